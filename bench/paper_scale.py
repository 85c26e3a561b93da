"""The three papers' main runs, priced before they are run: for each, the steps of one epoch, the
FLOPs of one training step and of the epoch, the time and memory of measured steps on this
machine, the GPU-hours of the epoch on one A100 and one H100, and the memory per GPU.

Every model is built from its config.json alone (BERT_BASE, LLAMA2_7B below, copied from the
Hugging Face hub), with random weights, and the text is a word-level stand-in tokeniser's: nothing
is downloaded. What each column is:

- steps: training rows // global batch (the scripts drop the last, incomplete step).
- FLOPs: torch.utils.flop_counter.FlopCounterMode around one call of the script's own train_step
  (forward, loss, backward), at the paper's per-GPU shapes, on fake tensors
  (torch._subclasses.FakeTensorMode: shapes and dtypes, no storage), so BeLLM's count covers all
  32 layers of LLaMA-2-7B. Every sentence is as long as --max-len allows: an upper bound for our
  scripts, which pad each length group to its own longest (64 wiki1m sentences at 32 tokens fill
  2,984 of 4,096 slots; docs/operations.md, "Length groups"), and what the authors' JTCSE computes
  (it pads every sentence to 64 tokens). Counted: matrix products (the Linear layers, attention's
  Q·K^T and A·V, with eager attention: the CPU SDPA kernel has no FLOP formula); not counted: the
  AdamW update, element-wise work, the dev evaluations. --lengths real: each sentence instead has
  the token count of a real one (a seeded sample of wiki1m's under BERT's tokenizer; of the NLI
  triplets' under LLaMA-2's), and the step runs in length groups as the scripts run it; the
  FLOPs and the measured steps alike.
- GPU-hours: FLOPs of an epoch / (peak × --mfu), with NVIDIA's dense BF16 Tensor Core peaks: A100
  312 TFLOPS (A100 datasheet), H100 SXM 989 TFLOPS (H100 datasheet: 1,979 "with sparsity", half
  without). An assumed utilisation, not a measurement: BERT-base steps of 64 sentences are small
  for these GPUs, so read the SSCL and JTCSE figures as lower bounds. A run on G GPUs takes 1/G of
  the GPU-hours in wall time (communication left out).
- GiB per GPU: the scripts' CUDA configuration (bf16 autocast; BeLLM also bf16 base weights and
  gradient checkpointing). SSCL, JTCSE: measured (torch.cuda.max_memory_allocated) when this
  machine has CUDA and the measured step is the paper's; otherwise an estimate: weights, fp32
  gradients and AdamW moments (12 bytes a trained parameter) and the tensors autograd keeps for the
  backward, counted under bf16 autocast on the fake step (CPU autocast: CUDA's keeps a few more ops
  in fp32); the CUDA context and the backward's short-lived tensors are left out. BeLLM:
  bellm.py's start-up estimate (bellm.memory_estimate, docs/operations.md).
- measured here: 1 + --steps training steps (train_step and the scripts' AdamW; the batch tokenised
  before, as the scripts tokenise ahead) on this machine's device, in the scripts' configuration for
  it (a CPU: fp32, BeLLM without checkpointing), each run in a fresh process; the median of the last
  --steps, and the peak memory above the loaded model (CPU: peak resident memory, VmHWM; CUDA:
  max_memory_allocated) next to the same estimate for that step. On a CPU, --fraction 0.125 of the
  paper's rows a step by default (the JTCSE twin's whole step needs about 25 GiB in fp32, and
  minutes), and BeLLM runs a slice of --bellm-layers layers of LLaMA-2-7B (the real sizes; the last
  one the bidirectional layer). On a GPU that common.GPU_PEAKS knows, the step's share of its dense
  bf16 peak (MFU) follows its TFLOP/s; --compile measures the steps as the scripts' --compile runs
  them (the first step, which compiles, is left out of the median).

The papers' settings, and where they come from (each script's flag help gives the paper's value):
- SSCL (Chen et al., ACL 2023): bert-base-uncased, --layer 11, SimCSE's wiki1m (1,000,000
  sentences), 1 epoch, batch 64, 32 tokens, lr 3e-5: sscl.py's defaults, docs/sscl.md, and the
  authors' run_unsup_example.sh (one GPU; the same epoch, batch, length and rate).
- JTCSE (Zong et al., 2025): two bert-base towers, a CAEL every 2nd layer (6 of 12), wiki1m plus
  SICK-R's sentences (footnote 7; jtcse.py adds the 4,802 distinct sentences of SICK_train.txt),
  1 epoch, batch 64, 64 tokens, lr 1.3e-6; JTCSE D: one tower learns the twin's embedding, lr
  1e-5, batch 64, the same data: jtcse.py's defaults, docs/jtcse.md (details 10, 11, 14), the
  authors' train_jtcse_bert.py (one GPU; 1 epoch, batch 64, max_len 64, lr 1.3e-6, 6 CAELs).
- BeLLM (Li & Li, NAACL 2024): LLaMA-2-7B, K = 1 (eq. 5's parallel wiring), LoRA r 32 / alpha 32 /
  dropout 0.1 on every Linear, SimCSE's NLI triplets (nli_for_simcse.csv: 275,601 rows), 1 epoch,
  batch 64 triplets over 4 GPUs (16 each), 64 tokens a sentence plus the prompt's 11 (LLaMA-2's
  tokenizer, <s> included; bench/bellm_memory.py), bf16, gradient checkpointing, lr 2e-4:
  bellm.py's defaults and docs/bellm.md.

  python bench/paper_scale.py                       # the three papers: 4 min on an idle 2-core CPU
  python bench/paper_scale.py --paper bellm --no-time          # counts and estimates only: seconds
  python bench/paper_scale.py --fraction 1 --steps 5           # a GPU: the papers' own steps
  python bench/paper_scale.py --fraction 1 --steps 5 --compile --lengths real    # as they train
"""
import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import bellm
import common
import jtcse
import sscl

# huggingface.co/bert-base-uncased, config.json: the fields BertConfig reads
BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1, max_position_embeddings=512,
                 type_vocab_size=2, initializer_range=0.02, layer_norm_eps=1e-12, pad_token_id=0)
# huggingface.co/meta-llama/Llama-2-7b-hf, config.json: the fields LlamaConfig reads
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
                 initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False)
PEAK = {g: common.GPU_PEAKS[g] for g in ("A100", "H100")}  # dense BF16 (H100: SXM), datasheets
# the runs: training rows, rows a step and GPU, GPUs (the docstring's sources)
RUNS = {"SSCL": dict(rows=1_000_000, batch=64, gpus=1),
        "JTCSE twin": dict(rows=1_000_000 + 4_802, batch=64, gpus=1),
        "JTCSE D": dict(rows=1_000_000 + 4_802, batch=64, gpus=1),
        "BeLLM": dict(rows=275_601, batch=16, gpus=4)}
# each paper: its setting, in words, and its runs
PAPERS = {"sscl": ("SSCL: bert-base-uncased's config, --layer 11; wiki1m, 1,000,000 sentences; "
                   "batch 64, 32 tokens; 1 epoch on one GPU", ["SSCL"]),
          "jtcse": ("JTCSE: two bert-base-uncased towers, 6 CAELs; wiki1m + SICK train's 4,802 "
                    "sentences; batch 64, 64 tokens; 1 epoch on one GPU; JTCSE D into one tower",
                    ["JTCSE twin", "JTCSE D"]),
          "bellm": ("BeLLM: LLaMA-2-7B's config, K = 1, LoRA r 32; NLI, 275,601 triplets; batch 64 "
                    "= 4 GPUs x 16, 64 + 11 prompt tokens, bf16, gradient checkpointing; 1 epoch",
                    ["BeLLM"])}
# transformers 5 renames it (is_activation_checkpointing); peft reads the old name
warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
PROMPT = "w1 w2 w3 w4 {sentence} w5 w6 w7 w8 w9 w10"  # with <s>: as long as LLaMA-2's bellm.PROMPT


def tokenizer(decoder):
    """A word-level stand-in for the models' tokenisers (a count needs token ids, not words): words
    w0..w999; <s> sentence [SEP] for BERT (its [CLS] .. [SEP]), <s> sentence for a decoder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {"[PAD]": 0, "[UNK]": 1, "<s>": 2, "[SEP]": 3, **{f"w{i}": 4 + i for i in range(1000)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.post_processor = processors.TemplateProcessing(
        single="<s> $A" if decoder else "<s> $A [SEP]", special_tokens=[("<s>", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="<s>", bos_token="<s>", sep_token="[SEP]",
                                   eos_token="[SEP]")


LENGTHS = {}  # --lengths real: "bert", "llama" -> the token lengths of real sentences, in turn


def texts(n, offset=0, kind="bert"):
    """n distinct sentences of 100 words: longer than any --max-len here, so each is cut to it;
    with --lengths real, as many words as the real sentences have tokens (LENGTHS[kind])."""
    real = LENGTHS.get(kind)
    return [" ".join(f"w{(7 * i + j) % 1000}" for j in range(real[i % len(real)] if real else 100))
            for i in range(offset, offset + n)]


def real_lengths(a):
    """--lengths real: the tokens (no special ones) of a seeded sample of real training sentences:
    wiki1m's by BERT's tokenizer, the NLI triplets' by LLaMA-2's (--wiki, --nli, --*tokenizer)."""
    import random
    from transformers import AutoTokenizer
    for flag, path in (("--wiki", a.wiki), ("--nli", a.nli)):
        if path and not os.path.isfile(path):
            common.die(f"{flag} '{path}' is not a file: pass the training file, or leave {flag} "
                       "out to download SimCSE's")
    wiki = common.read_sentences(a.wiki)
    nli = [s for r in bellm.read_csv(common.train_file(a.nli, "nli_for_simcse.csv"))[1] for s in r]
    for kind, rows, name in (("bert", wiki, a.tokenizer), ("llama", nli, a.bellm_tokenizer)):
        pick = random.Random(0).sample(rows, min(a.sample, len(rows)))
        ids = common.load_pretrained(AutoTokenizer, name)(pick, add_special_tokens=False)
        LENGTHS[kind] = [max(1, len(x)) for x in ids["input_ids"]]


def build(name, device, gpu, bert=BERT_BASE, llama=LLAMA2_7B, layers=None, compiled=False):
    """The run's model with random weights on `device` ("meta": to be made fake), as its script
    builds it, -> (a module holding every model of the run, step(n): the script's train_step on n
    rows, its forward and backward). gpu: the scripts' CUDA configuration (bf16 autocast; BeLLM:
    bf16 base weights, gradient checkpointing), else their CPU one (fp32). compiled: as the
    scripts' --compile (the whole model; BeLLM: each decoder layer)."""
    run = torch.device("cpu" if device == "meta" else device)  # where the batch is copied
    bf16 = ["--bf16"] if gpu else []  # the scripts' flags
    autocast = torch.bfloat16 if gpu else None  # their train_step's
    with torch.device(device):
        if name == "SSCL":
            return build_sscl(bert, run, bf16, autocast, compiled)
        if name == "JTCSE twin":
            return build_twin(bert, run, bf16, autocast, compiled)
        if name == "JTCSE D":
            return build_distilled(bert, run, bf16, autocast, compiled)
        return build_bellm(llama, device, run, gpu, bf16, autocast, layers, compiled)


def as_compiled(module, compiled):
    """The module as the scripts' --compile runs it (torch.compile, dynamic shapes), or itself."""
    if compiled:
        return torch.compile(module, dynamic=True)
    return module


def bert_batches(max_len):
    """batch(n): n stand-in sentences tokenised for BERT, cut at max_len; each n tokenised once,
    before the steps."""
    @functools.cache
    def batch(n):
        return tokenizer(False)(texts(n), padding=True, truncation=True, max_length=max_len,
                                return_tensors="pt")
    return batch


def build_sscl(bert, run, bf16, autocast, compiled):
    """SSCL: sscl.py's defaults (--layer 11, --max-len 32, cls pooler + MLP). -> (model, step)"""
    from transformers import BertConfig, BertModel
    a = sscl.p.parse_args(bf16)
    batch = bert_batches(sscl.p.get_default("max_len"))
    enc = sscl.SentenceEncoder(BertModel(BertConfig(**bert)), a.pooler, a.proj_dim)
    m = sscl.parse_layers(a.layer, enc.bert.config.num_hidden_layers)
    enc_net = as_compiled(enc, compiled)

    def step(n):
        return sscl.train_step(common.in_length_groups(enc_net, device=run), batch(n), m, run,
                               a.temp, autocast=autocast)
    return enc, step


def build_twin(bert, run, bf16, autocast, compiled):
    """JTCSE's twin: jtcse.py's defaults (--max-len 64, a CAEL every 2nd layer). -> (model,
    step)"""
    from transformers import BertConfig, BertModel
    a = jtcse.p.parse_args(bf16)
    batch = bert_batches(jtcse.p.get_default("max_len"))
    twin = jtcse.Twin([BertModel(BertConfig(**bert)) for _ in "ab"], a.num_cael)
    twin_net = as_compiled(twin, compiled)

    def step(n):
        return jtcse.train_step(common.in_length_groups(twin_net, device=run), batch(n), 1, run,
                                a.temp, autocast=autocast)
    return twin, step


def build_distilled(bert, run, bf16, autocast, compiled):
    """JTCSE D: a fresh tower learns the frozen twin's CLS(I) + CLS(II) (jtcse.py --distill).
    -> (the student and the twin's towers, step)"""
    from transformers import BertConfig, BertModel
    a = jtcse.p.parse_args(["--distill", "TWIN", *bf16])
    batch = bert_batches(jtcse.p.get_default("max_len"))
    student, *twin = [BertModel(BertConfig(**bert)) for _ in "sab"]
    student.pooler.requires_grad_(False)  # as jtcse.py with --distill
    teacher = jtcse.make_encode([t.requires_grad_(False).eval() for t in twin],
                                tokenizer(False), a.max_len, run)
    cls = as_compiled(functools.partial(jtcse.cls_vector, student), compiled)

    def step(n):
        return jtcse.distill_step(common.in_length_groups(cls, device=run), batch(n), texts(n),
                                  teacher, run, autocast=autocast)[0]
    return torch.nn.ModuleList([student, *twin]), step


def build_bellm(llama, device, run, gpu, bf16, autocast, layers, compiled):
    """BeLLM: bellm.py's defaults (K = 1 parallel, LoRA r 32 on every Linear, --max-len 64),
    `layers` of the decoder (None: all); gpu: bf16 base weights, gradient checkpointing, the
    frozen Linears cast. -> (the peft model, step)"""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel, LlamaConfig
    a = bellm.p.parse_args(["--prompt", PROMPT, *bf16])
    cfg = LlamaConfig(**{**llama, "num_hidden_layers": layers or llama["num_hidden_layers"]})
    dec = AutoModel.from_config(cfg, dtype=torch.bfloat16 if gpu else torch.float32)
    if device == "cpu":  # as bellm.load_decoder: CPU SDPA's backward with a mask is slow
        dec.set_attn_implementation("eager")
    if gpu:
        dec.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    lora = get_peft_model(dec, LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha,
                                          lora_dropout=a.lora_dropout,
                                          target_modules="all-linear"))
    if gpu:
        bellm.cast_frozen_linears(dec)
    model = bellm.BeLLM(dec, a.bi_layers, a.bi_mode, a.bi_strategy)
    common.compiled_layers(model, compiled)
    tok = tokenizer(True)
    embed = functools.partial(bellm.embed, model)

    @functools.cache
    def batch(n):  # n triplets tokenised once, before the steps
        rows = list(zip(*(texts(n, k * n, "llama") for k in range(3))))
        return bellm.prompted_batch(tok, rows, "nli", a.prompt, a.max_len)[0]

    def step(n):
        return bellm.train_step(common.in_length_groups(embed, device=run), batch(n), run, a.temp,
                                autocast=autocast)[0]
    return lora, step


def fake(module):
    """Every parameter and buffer of a meta-device module replaced by a fake CPU tensor of its
    shape and dtype (FakeTensorMode): the module runs, and FlopCounterMode counts it, without
    computing or holding anything. (Built on meta first: a fake module cannot be moved with .to.)"""
    with FakeTensorMode(allow_non_fake_inputs=True):  # the batches stay real; the weights fake
        for m in module.modules():
            fake_tensors(m)
            if hasattr(m, "set_attn_implementation"):  # eager: every attention matmul counted
                m.set_attn_implementation("eager")
    return module


def fake_tensors(m):
    """The module's own parameters and buffers (not its children's) replaced by empty tensors of
    their shapes and dtypes: fake ones, under FakeTensorMode."""
    for k, t in m._parameters.items():
        if t is not None:
            m._parameters[k] = torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype),
                                                  t.requires_grad)
    for k, t in m._buffers.items():
        if t is not None:
            m._buffers[k] = torch.empty(t.shape, dtype=t.dtype)


def count(module, step, n):
    """step(n) under FlopCounterMode, -> (FLOPs, bytes of the tensors autograd keeps for the
    backward: each storage once, the parameters' own excluded)."""
    params = {q.untyped_storage()._cdata for q in module.parameters()}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            kept[s._cdata] = s.nbytes()
        return t
    with FlopCounterMode(display=False) as flops, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(n)
    return flops.get_total_flops(), sum(kept.values())


def estimate(name, n, gpu, layers=None):
    """The count of one step of n rows, and its memory in GiB: (weights, gradients + AdamW, kept
    activations); BeLLM: bellm.py's start-up estimate (bellm.memory_estimate)."""
    module, step = build(name, "meta", gpu, layers=layers)
    flops, kept = count(fake(module), step, n)
    trained = sum(q.numel() for q in module.parameters() if q.requires_grad)
    if name == "BeLLM":
        dec = module.base_model.model
        longest = bellm.p.get_default("max_len") + len(
            tokenizer(True)(bellm.fill(PROMPT, "", ""))["input_ids"])
        mem = bellm.memory_estimate(dec, trained, 2 if gpu else 4, 3 * n * longest, longest,
                                     bellm.p.get_default("lora_r"), gpu)
    else:
        weights = sum(q.numel() * q.element_size() for q in module.parameters())
        mem = (weights / 2**30, 12 * trained / 2**30, kept / 2**30)
    return flops, mem


def rss(field):  # GiB, from /proc/self/status (VmRSS: now; VmHWM: the peak)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 2**20


def measure(name, n, steps, layers, compiled=False):
    """In this (fresh) process: the run's model with random weights on this machine's device, 1 +
    steps training steps of n rows (train_step, then AdamW as the script makes it; compiled: as
    --compile, the first step compiling). Prints one JSON line: the seconds of each step, the peak
    memory above the loaded model (GiB)."""
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    module, step = build(name, "cuda" if cuda else "cpu", cuda, layers=layers, compiled=compiled)
    params = [q for q in module.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-9, fused=name != "BeLLM")  # as each script
    if cuda:
        loaded = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    else:
        loaded = rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:  # Linux: VmHWM starts again from VmRSS
            f.write("5")
    times = []
    for _ in range(1 + steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        step(n)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else rss("VmHWM")
    print(json.dumps({"times": times, "delta": peak - loaded, "peak": peak}))


def device_name():
    """This machine's device, and for a CPU whether it has bf16 instructions."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA)"
    name = "CPU"
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            info = dict(map(str.strip, line.split(":", 1))
                        for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        name = info.get("model name", name)
        flags = set(info.get("flags", "").split())
    bf16 = [x for x in ("avx512_bf16", "amx_bf16") if x in flags]
    return (f"{name}, {torch.get_num_threads()} threads, "
            + (f"bf16 instructions ({', '.join(bf16)})" if bf16
               else "no bf16 instructions (neither avx512_bf16 nor amx_bf16 in /proc/cpuinfo)"))


def si(x):  # 2.10 T, 32.9 P
    for unit, v in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9)):
        if x >= v:
            return f"{x / v:.3g} {unit}"
    return f"{x:.3g}"


def arguments():
    """The command line: the papers, the measured steps' settings; --measure and --rows (hidden)
    are the child process's of one measurement."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", nargs="+", choices=list(PAPERS), default=list(PAPERS))
    p.add_argument("--no-time", action="store_true", help="count and estimate only; no real step")
    p.add_argument("--steps", type=common.POS_INT, default=2,
                   help="timed steps after a first one (default 2)")
    p.add_argument("--fraction", type=common.FRACTION, help="of the paper's rows a step and GPU, "
                   "for the measured steps (default: 1 on CUDA, 0.125 on a CPU)")
    p.add_argument("--bellm-layers", type=common.POS_INT, default=2,
                   help="layers of LLaMA-2-7B in BeLLM's measured slice (default 2: one causal, "
                   "the bidirectional one)")
    p.add_argument("--mfu", type=common.FRACTION, default=0.4,
                   help="assumed fraction of the GPUs' dense BF16 peak (default 0.4)")
    p.add_argument("--compile", action="store_true", help="the measured steps as the scripts' "
                   "--compile run them (the first step compiles, and is left out)")
    p.add_argument("--lengths", choices=["max", "real"], default="max", help="max: every sentence "
                   "cut at --max-len (an upper bound); real: the token lengths of real training "
                   "sentences, a sample (--sample) of --wiki's by --tokenizer (SSCL, JTCSE) and "
                   "--nli's by --bellm-tokenizer (BeLLM), in length groups as the scripts run them")
    p.add_argument("--wiki", help="--lengths real: wiki1m (default: SimCSE's, downloaded)")
    p.add_argument("--nli", help="--lengths real: NLI triplets (default: SimCSE's, downloaded)")
    p.add_argument("--tokenizer", default="bert-base-uncased", help="--lengths real: SSCL's and "
                   "JTCSE's (default: bert-base-uncased)")
    p.add_argument("--bellm-tokenizer", default="meta-llama/Llama-2-7b-hf", help="--lengths real: "
                   "BeLLM's (default: meta-llama/Llama-2-7b-hf, a gated model: log in first)")
    p.add_argument("--sample", type=common.POS_INT, default=4096,
                   help="--lengths real: sentences sampled, seeded (default 4096)")
    common.show_ranges(p)
    # the child process of one measurement; added after show_ranges, which would append a range
    # to --rows's hidden help (argparse.SUPPRESS) and so show it in --help
    p.add_argument("--measure", choices=list(RUNS), help=argparse.SUPPRESS)
    p.add_argument("--rows", type=common.POS_INT, help=argparse.SUPPRESS)
    return p


def main():
    a = arguments().parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    if a.lengths == "real":
        real_lengths(a)
    if a.measure:
        return measure(a.measure, a.rows, a.steps, a.bellm_layers, a.compile)
    cuda = torch.cuda.is_available()
    if a.fraction is not None:
        fraction = a.fraction
    elif cuda:
        fraction = 1.0
    else:
        fraction = 0.125
    print_setting(a)
    for paper in a.paper:
        title, runs = PAPERS[paper]
        print(f"\n{title}\n\n| run | steps | FLOPs a step | FLOPs an epoch | s/step here | "
              "GPU-hours A100 / H100 | GiB per GPU |\n|---|---|---|---|---|---|---|")
        notes = []
        for name in runs:
            row, run_notes = price(a, name, fraction, cuda)
            print(row)
            notes += run_notes
        print("".join("\n" + line for line in notes), flush=True)


def print_setting(a):
    """The lines above the tables: torch, the device of the measured steps, the sentences'
    lengths, the GPU-hours' assumption."""
    compiled = ", compiled (--compile)" if a.compile else ""
    print(f"torch {torch.__version__}; measured steps on: {device_name()}" + compiled)
    if a.lengths == "max":
        lengths = "every one cut at --max-len"
    else:
        lengths = (f"those of {a.sample} real ones (--lengths real), in length groups, FLOPs and "
                   "times alike")
    print("sentence lengths: " + lengths)
    print(f"GPU-hours = FLOPs of the epoch / (peak x {a.mfu:.0%}); dense BF16 peaks: A100 312, "
          "H100 SXM 989 TFLOPS (NVIDIA's datasheets)")


def price(a, name, fraction, cuda):
    """One run of RUNS priced: its table row (steps, FLOPs, the measured step, GPU-hours, GiB per
    GPU), and its notes (the estimate's parts; the measured step's). -> (row, [note, ...])"""
    r = RUNS[name]
    steps = r["rows"] // (r["batch"] * r["gpus"])  # the global batch: batch x GPUs
    flops, (w, o, act) = estimate(name, r["batch"], True)  # a step on one GPU
    epoch = steps * r["gpus"] * flops
    hours = [epoch / (PEAK[g] * a.mfu) / 3600 for g in PEAK]
    opt = "LoRA and AdamW" if name == "BeLLM" else "gradients and AdamW"
    gib = f"{w + o + act:.1f} (estimate)"
    note = (f"{name}: GiB per GPU, estimated: weights {w:.2f} + {opt} {o:.2f} + "
            f"activations {act:.2f}")
    if name == "BeLLM":
        note += f"; FLOPs of the global step: 4 GPUs x {si(flops)}, all 32 layers counted"
    notes = [note]
    here = "not measured"
    if not a.no_time:  # a fresh process: its peak memory is this run's alone
        here, measured_gib, note = measured(a, name, fraction, cuda, opt)
        if measured_gib:
            gib = measured_gib
        notes.append(note)
    row = (f"| {name} | {steps:,} | {si(flops * r['gpus'])} | {si(epoch)} | {here} | "
           f"{hours[0]:.3g} / {hours[1]:.3g} | {gib} |")
    return row, notes


def measured(a, name, fraction, cuda, opt):
    """The run's steps measured in a fresh process (--measure), beside the same step counted.
    -> (the table's "s/step here" cell, its "GiB per GPU" cell when the step measured is the
    paper's on CUDA (SSCL, JTCSE) else None, the note)"""
    r = RUNS[name]
    n = max(1, round(fraction * r["batch"]))
    layers = a.bellm_layers if name == "BeLLM" else None
    got = measure_in_child(a, name, n)
    s = statistics.median(got["times"][1:])
    f_n, (_, o_n, act_n) = estimate(name, n, cuda, layers)  # the same step, counted
    what = f"{n} of {r['batch']} " + ("triplets" if name == "BeLLM" else "sentences")
    if layers:
        what += f", {layers} of 32 layers"
    peak = gpu_peak(cuda)
    mfu = f", {f_n / s / peak:.0%} of its dense bf16 peak" if peak else ""
    here = f"{s:.2f} ({what}; {f_n / s / 1e12:.3f} TFLOP/s{mfu})"
    gib = None
    if cuda and n == r["batch"] and name != "BeLLM":
        gib = f"{got['peak']:.1f} (measured)"
    note = (f"{name}, measured here ({what}, {'bf16' if cuda else 'fp32'}): "
            f"peak +{got['delta']:.2f} GiB above the loaded model "
            f"({'max_memory_allocated' if cuda else 'VmHWM'}), estimated "
            f"+{o_n + act_n:.2f} ({opt} {o_n:.2f}, activations {act_n:.2f}); "
            f"first step {got['times'][0]:.2f} s")
    return here, gib, note


def measure_in_child(a, name, n):
    """`--measure name --rows n` in a child process (this script, the same --steps, lengths and
    --compile), -> its JSON line; a failed child stops this run, with its error."""
    same = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in (
        "lengths", "wiki", "nli", "tokenizer", "bellm_tokenizer", "sample") and v]
    compile_flag = ["--compile"] if a.compile else []
    child = subprocess.run([sys.executable, __file__, "--measure", name, "--rows", str(n),
                            "--steps", str(a.steps), "--bellm-layers", str(a.bellm_layers),
                            *same, *compile_flag],
                           capture_output=True, text=True)
    if child.returncode:
        sys.exit(f"measuring {name} failed:\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def gpu_peak(cuda):
    """This GPU's dense bf16 peak in FLOP/s (common.GPU_PEAKS), None on a CPU or a GPU it does not
    know."""
    if not cuda:
        return None
    for gpu, peak in common.GPU_PEAKS.items():
        if gpu in torch.cuda.get_device_name():
            return peak
    return None


if __name__ == "__main__":
    main()
