"""BeLLM: Backward Dependency Enhanced Large Language Model for Sentence Embeddings
(Xianming Li & Jing Li, NAACL 2024, arXiv 2311.05296).

A decoder LLM reads a prompt, `The representative word for {sentence} is:"`, and the final-norm hidden
state of the last token is the sentence embedding. BeLLM makes the last K decoder layers bidirectional
(eq. 4: the causal mask is removed; padding stays masked) and, in the wiring of eq. 5 that the authors
trained, runs them beside the causal stack on the token embeddings x and sums the two outputs:
h = LLM->(x) + BiLLM<->(x). Training is LoRA on NLI triplets with the contrastive loss of eq. 6.
`--bi-mode sequential` is the later BiLLM wiring (the last K layers bidirectional in place).
Note: with last-token pooling, K = 1 in sequential mode cannot change the embedding (README, item 1).

  python bellm.py --model HuggingFaceTB/SmolLM2-135M-Instruct --output-dir runs/bellm --bf16 \\
      --train snli_devtest.csv --batch-size 16 --max-len 32 --lr 5e-4 --max-steps 100 --eval-steps 50 \\
      --no-eval-first --no-final-eval          # README's CPU run: STS-B dev 83.11, 22 min on 2 cores
  torchrun --nproc_per_node 4 bellm.py --batch-size 16 --output-dir runs/bellm-7b   # paper: 4 GPUs x 16 (GPU)
  python bellm.py --model HuggingFaceTB/SmolLM2-135M-Instruct --degradation --tasks STS-B --plot fig4.png
  python bellm.py --dependency --model HuggingFaceTB/SmolLM2-135M-Instruct runs/bellm \
      sentence-transformers/all-MiniLM-L6-v2 --bi-layers 0 1 --plot fig5.png      # Fig. 2/5 (README, "Figures")
"""
import argparse
import contextlib
import copy
import csv
import io
import math
import os
import random
import resource
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from scipy.stats import spearmanr

import common
import figures
import runs

PROMPT = 'The representative word for {sentence} is:"'  # §3.3
warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft on transformers 5

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
# --- general ---
p.add_argument("--model", nargs="+", default=["meta-llama/Llama-2-7b-hf"], help="hub name or local folder of a "
               "decoder LLM (LLaMA, Mistral, Qwen2, ...; paper: LLaMA-2-7B); --dependency takes several, and also "
               "bellm.py run folders and BERT-like encoders")
p.add_argument("--train", default=None, help="csv with sent0,sent1,hard_neg (SimCSE's nli_for_simcse.csv, the "
               "default) or a C-STS csv with sentence1,sentence2,condition,label")
p.add_argument("--data-dir", default=None, help="STS data (else $SENTEMB_DATA)")
p.add_argument("--output-dir", default="runs/bellm", help="where the best adapter and sentemb.json go")
p.add_argument("--epochs", type=common.POS_INT, default=1, help="passes over --train")
p.add_argument("--max-steps", type=common.STEPS, default=-1,
               help="stop after N optimisation steps (-1: run the epochs)")
p.add_argument("--batch-size", type=common.POS_INT, default=64,
               help="triplets per step PER GPU (paper: one of 16, 32, 64, "
               "128); under torchrun the in-batch negatives come from all GPUs: world_size x batch-size triplets")
p.add_argument("--grad-accum", type=common.POS_INT, default=1,
               help="micro-batches of --batch-size per optimisation step; "
               "each micro-batch only sees its own in-batch negatives (accumulation does not enlarge the pool)")
p.add_argument("--length-grouping", action=argparse.BooleanOptionalAction, default=True,
               help="run a step's texts in length groups, each padded only to its own longest: the same loss and "
               "gradients for the cost of the real tokens (--no-length-grouping: one forward, padded to the longest)")
p.add_argument("--lr", type=common.POS_FLOAT, default=None, help="default 2e-4 (paper); with --resume: the "
               "run's own, unless given")
p.add_argument("--max-len", type=common.POS_INT, default=64,
               help="tokens per TRAINING sentence; longer ones are cut before "
               "they are put into the prompt, so the prompt's end is never cut (evaluation never cuts)")
p.add_argument("--eval-steps", type=common.POS_INT, default=100,
               help="STS-B dev every N steps (and at step 0 and the end)")
p.add_argument("--eval-first", action=argparse.BooleanOptionalAction, default=True,
               help="evaluate at step 0 (the zero-shot score); --no-eval-first saves one evaluation on a CPU")
p.add_argument("--seed", type=common.SEED, default=42, help="weights of added layers, LoRA, "
               "dropout and the data order")
p.add_argument("--quiet", action="store_true", help="no progress bars (shown only when stderr is a terminal)")
p.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint.pt")
p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too (always on CUDA), for training and the "
               "dev evaluations: faster on CPUs with bf16 instructions; dev scores move by ~0.1")
p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="the base LLM's weights (LoRA and "
               "AdamW stay float32): default bfloat16 on CUDA (the paper's setting), float32 on CPU")
p.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction, default=None, help="gradient checkpointing "
               "(each layer's activations are recomputed in the backward pass): default on with CUDA, off on CPU")
# --- bellm ---
p.add_argument("--bi-layers", type=common.NONNEG_INT, nargs="+", default=[1],
               help="K: how many last layers are bidirectional (paper: 1; "
               "0 = the plain causal LLM); --dependency takes several, e.g. 0 1")
p.add_argument("--bi-mode", default="parallel", choices=["parallel", "sequential"],
               help="parallel = eq. 5 (causal stack and bidirectional layers both read x, outputs summed; the "
                    "authors' code); sequential = BiLLM (the last K layers bidirectional in place)")
p.add_argument("--bi-strategy", default="convert", choices=["convert", "add"],
               help="convert: the last K layers become bidirectional; add: K new bidirectional layers, copies "
                    "of the last K, on top of all n causal layers (Table 4 'addition')")
p.add_argument("--prompt", default=PROMPT, help="must contain {sentence}; may contain {condition} (C-STS, §5.1: "
               "'Given the context {condition}, summarize the sentence {sentence} in one word:\"')")
p.add_argument("--temp", type=common.POS_FLOAT, default=0.05, help="tau of eq. 6 (paper: 0.05)")
p.add_argument("--lora-r", type=common.POS_INT, default=32, help="paper: 32")
p.add_argument("--lora-alpha", type=common.POS_INT, default=32, help="paper: 32")
p.add_argument("--lora-dropout", type=common.PROB, default=0.1, help="paper: 0.1")
p.add_argument("--csts", default=None, help="C-STS csv (sentence1,sentence2,condition,label) scored at every "
               "evaluation; when given it selects the checkpoint instead of STS-B dev")
p.add_argument("--log-steps", type=common.POS_INT, default=10, help="print loss and speed every N steps")
p.add_argument("--degradation", action="store_true", help="no training: STS score of the causal LLM cut after "
               "each layer k = 1..n (Fig. 4), from one pass with all hidden states")
p.add_argument("--dependency", action="store_true", help="no training: for each --model, the mean Spearman "
               "correlation between the pivot token's final hidden state (the pooled last token; CLS for a BERT) "
               "and each token of the sentence, over STS-B test sentences (Fig. 2, Fig. 5)")
p.add_argument("--plot", default=None, metavar="FILE.png", help="with --degradation or --dependency: draw Fig. 4 "
               "or Fig. 2/5 into this PNG; needs matplotlib")
p.add_argument("--tasks", default=",".join(common.TASKS), help="tasks of the final table and of --degradation")
p.add_argument("--final-eval", action=argparse.BooleanOptionalAction, default=True,
               help="7-task table of the best checkpoint at the end")
common.show_ranges(p)


def fill(prompt, sentence, condition=None):
    """The prompted text; str.replace, so braces inside a sentence are left alone. No condition: empty."""
    return prompt.replace("{sentence}", sentence).replace("{condition}", condition or "")


def check_prompt(prompt, conditional):
    if "{sentence}" not in prompt:
        common.die(f"--prompt '{prompt}' has no {{sentence}}: write where the sentence goes, e.g. '{PROMPT}'")
    if ("{condition}" in prompt) != conditional:
        common.die("--prompt has {condition} but the data has no condition column" if not conditional else
                   "C-STS data needs a --prompt with {condition}, e.g. 'Given the context {condition}, "
                   "summarize the sentence {sentence} in one word:\"'")


# ================================================================ model (patch) =================
def load_decoder(name, bi_layers, bi_strategy, device, dtype=None):
    """tokenizer, decoder (embed_tokens, layers, rotary_emb, norm) in `dtype` (default fp32 on CPU, bf16 on CUDA);
    for bi_strategy 'add', K copies of the last K layers are attached as `dec.bellm_added`."""
    from transformers import AutoModel, AutoTokenizer
    tok = common.load_pretrained(AutoTokenizer, name)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    dec = common.load_pretrained(AutoModel, name, dtype=dtype)
    if device.type == "cpu":  # same attention; PyTorch's CPU SDPA backward with a mask is slow (bench/length_groups.py)
        dec.set_attn_implementation("eager")
    if not all(hasattr(dec, m) for m in ("embed_tokens", "layers", "rotary_emb", "norm")):
        common.die(f"'{name}' ({type(dec).__name__}) is not a decoder LLM with embed_tokens, layers, rotary_emb "
                   "and norm: pass a LLaMA / Mistral / Qwen2-style model")
    n = len(dec.layers)
    if not 0 <= bi_layers <= n:
        common.die(f"--bi-layers {bi_layers} is outside 0..{n} ('{name}' has {n} layers)")
    if bi_strategy == "add":  # Table 4 "addition": new layers, initialised as copies of the last K layers
        dec.bellm_added = torch.nn.ModuleList(copy.deepcopy(layer) for layer in dec.layers[n - bi_layers:])
    if tok.pad_token is None:  # padding is masked everywhere, so any id will do
        tok.pad_token = tok.eos_token
    return tok, dec.to(device)


def cast_frozen_linears(dec, dtype=torch.bfloat16):
    """Under bf16 autocast with float32 base weights: store each frozen Linear in bf16 once. Autocast casts them at
    every forward pass (it caches the casts of trainable weights only), so the numbers are the same, and the time
    of the casts and half those weights' memory are saved. Norms and embeddings stay float32, as autocast runs them."""
    for m in dec.modules():
        if isinstance(m, torch.nn.Linear) and not any(q.requires_grad for q in m.parameters()):
            m.to(dtype)


def attn_mask(attention_mask, causal, dtype):
    """(b, L) 1 = real token -> (b, 1, L, L) additive mask, 0 where query i may read key j."""
    L = attention_mask.shape[1]
    keep = attention_mask[:, None, None, :].bool()  # keys: real tokens only, in every layer (eq. 4 too)
    if causal:  # eq. 3: j <= i
        keep = keep & torch.ones(L, L, dtype=torch.bool, device=keep.device).tril()
    keep = keep | torch.eye(L, dtype=torch.bool, device=keep.device)  # no empty row (padding queries)
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def forward(dec, input_ids, attention_mask, bi_layers, bi_mode, bi_strategy, all_hidden=False):
    """Final-norm hidden states (b, L, H); all_hidden=True: also the causal stack's per-layer outputs."""
    x = dec.embed_tokens(input_ids)  # (b, L, H)
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # positions count real tokens (left padding)
    kw = dict(position_embeddings=dec.rotary_emb(x, pos), position_ids=pos)
    n = len(dec.layers)
    if bi_strategy == "add":
        causal_layers, bi = dec.layers, (dec.bellm_added if bi_layers else [])
    else:
        causal_layers, bi = dec.layers[:n - bi_layers], dec.layers[n - bi_layers:]
    h, hs = x, [x]
    m = attn_mask(attention_mask, True, x.dtype)  # (b, 1, L, L)
    for layer in causal_layers:  # LLM->: causal
        h = layer(h, attention_mask=m, **kw)
        hs.append(h)
    if bi_layers:
        m = attn_mask(attention_mask, False, x.dtype)  # eq. 4: no causal mask, padding still masked
        g = x if bi_mode == "parallel" else h  # eq. 5 reads x; BiLLM continues from the causal stack
        for layer in bi:  # BiLLM<->: bidirectional
            g = layer(g, attention_mask=m, **kw)
        # eq. 5: h = LLM->(x) + BiLLM<->(x); NOTE(authors' code): with no causal layer left (K = n) h = BiLLM(x)
        h = g if bi_mode == "sequential" or len(causal_layers) == 0 else h + g
    return (dec.norm(h), hs) if all_hidden else dec.norm(h)


def memory_estimate(dec, n_lora, s, tokens, longest, r, grad_ckpt):
    """GiB of one training step, estimated from the config: (weights, LoRA + gradients + AdamW moments in fp32,
    activations kept for the backward). Activations, bytes a token a layer (counted with saved-tensor hooks on
    LLaMA configs; RMSNorm and the LoRA path keep fp32 copies, so bf16 does not halve them):
    A = α·H + β·I + 28·r + heads·L·(4 or 6), α = 68 / 62 and β = 20 / 14 for fp32 / bf16 (s = 4 / 2 bytes).
    With checkpointing: each layer keeps only its input (s·H) and one layer is recomputed at a time."""
    c, n = dec.config, len(dec.layers) + len(getattr(dec, "bellm_added", []))
    A = (68 if s == 4 else 62) * c.hidden_size + (20 if s == 4 else 14) * c.intermediate_size + 28 * r \
        + c.num_attention_heads * longest * (4 if s == 4 else 6)
    act = tokens * (n * s * c.hidden_size + A if grad_ckpt else n * A)
    weights = sum(q.numel() * q.element_size() for q in dec.parameters() if not q.requires_grad)
    return weights / 2**30, 16 * n_lora / 2**30, act / 2**30


def last_token(h, attention_mask):
    """h (b, L, H) -> (b, H) at the last real token, for left or right padding."""
    idx = (attention_mask * torch.arange(attention_mask.shape[1], device=h.device)).argmax(1)  # (b,)
    return h[torch.arange(h.shape[0], device=h.device), idx]


class BeLLM(torch.nn.Module):
    """The embedding model as one module (what DDP wraps): input_ids, attention_mask (b, L) -> (b, H)."""

    def __init__(self, dec, bi_layers, bi_mode, bi_strategy):
        super().__init__()
        self.dec, self.bi = dec, (bi_layers, bi_mode, bi_strategy)

    def forward(self, input_ids, attention_mask):
        return last_token(forward(self.dec, input_ids, attention_mask, *self.bi), attention_mask)


def prompted(tok, cfg, sentences, conditions=None):
    """Sentences -> prompted texts; --max-len applies to the sentence, cut before it enters the prompt, so
    the prompt's end (`is:"`, read by the pooled last token) is never cut. Returns texts, their token limit."""
    def cut(s):
        ids = tok(s, add_special_tokens=False)["input_ids"]
        return s if len(ids) <= cfg["max_len"] else tok.decode(ids[:cfg["max_len"]])
    texts = [fill(cfg["prompt"], cut(s), c) for s, c in zip(sentences, conditions or [None] * len(sentences))]
    return texts, cfg["max_len"] + len(tok(fill(cfg["prompt"], "", ""))["input_ids"]) + 8


def make_encoder(dec, tok, cfg, device, cpu_bf16=False):
    """encode(list[str], conditions=None) -> (N, H): the one encode function (training dev eval, eval_sts.py)."""
    net = BeLLM(dec, cfg["bi_layers"], cfg["bi_mode"], cfg["bi_strategy"])

    @torch.no_grad()
    def encode(sentences, conditions=None):
        texts, max_len = prompted(tok, cfg, sentences, conditions)
        with common.autocast(device, cpu_bf16):
            return common.encode_in_batches(lambda b: net(b["input_ids"], b["attention_mask"]), tok, texts, max_len,
                                            device, 64)

    return encode


def load_encoder(run_dir, meta, device):
    """For eval_sts.py. meta: base_model, bi_layers, bi_mode, prompt [, bi_strategy, max_len];
    run_dir None = zero-shot, no LoRA (a run folder without its adapter is refused by
    runs.read_meta, never run as the base model)."""
    return make_encoder(*load_run(run_dir, meta, device), device)


def load_run(run_dir, meta, device):
    """The decoder of a run (base + LoRA adapter, in eval mode), its tokenizer and its config dict."""
    cfg = {"bi_strategy": "convert", **meta}
    dtype = getattr(torch, cfg["dtype"]) if cfg.get("dtype") else None  # the base as trained (runs before: default)
    tok, dec = load_decoder(cfg["base_model"], cfg["bi_layers"], cfg["bi_strategy"], device, dtype)
    cfg.setdefault("max_len", dec.config.max_position_embeddings)  # evaluation does not cut sentences
    if run_dir:  # wraps the LoRA layers into dec in place; a damaged adapter file stops here
        runs.load_adapter(dec, run_dir)
    check_prompt(cfg["prompt"], "{condition}" in cfg["prompt"])
    if "{condition}" in cfg["prompt"]:  # a C-STS run: STS pairs come without a condition
        print("note: the prompt has {condition} (C-STS) and these sentences have none: it is left empty")
    return dec.eval(), tok, cfg


# ================================================================ data ==========================
def finite(text):
    """float(text), refusing nan and inf as ValueError."""
    if not math.isfinite(v := float(text)):
        raise ValueError(text)
    return v


def read_csv(path):
    """NLI triplets (sent0, sent1, hard_neg) or C-STS rows (sentence1, sentence2, condition, label); an empty
    or missing cell is a bad input naming its line."""
    text = common.read_text(path)  # UTF-8; a spreadsheet's byte-order mark is dropped
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))  # a field as long as the file
    reader = csv.DictReader(io.StringIO(text))
    cols = set(reader.fieldnames or [])
    if {"sent0", "sent1", "hard_neg"} <= cols:
        kind, need = "nli", ("sent0", "sent1", "hard_neg")
    elif {"sentence1", "sentence2", "condition", "label"} <= cols:
        kind, need = "csts", ("sentence1", "sentence2", "condition", "label")
    else:
        common.die(f"'{path}' needs the columns sent0,sent1,hard_neg (NLI triplets) or sentence1,sentence2,"
                   f"condition,label (C-STS); it has {','.join(sorted(cols)) or 'no header'}")
    rows = []
    for r in reader:
        if missing := [c for c in need if not (r[c] or "").strip()]:  # short rows give None
            common.die(f"'{path}', line {reader.line_num}: no {', '.join(missing)}: fill in or delete the row")
        try:
            rows.append(tuple(r[c] for c in need[:-1]) + (finite(r["label"]),)
                        if kind == "csts" else tuple(r[c] for c in need))
        except ValueError:
            common.die(f"'{path}', line {reader.line_num}: label {r['label']!r} is not a number; C-STS labels are 1-5")
    if not rows:
        common.die(f"'{path}' has a header but no rows: pass a --train file with data")
    return kind, rows


def csts_spearman(encode, rows):
    """C-STS (§5.1): each sentence is embedded with its condition; Spearman x 100 of cosine vs label."""
    a = encode([r[0] for r in rows], [r[2] for r in rows])
    b = encode([r[1] for r in rows], [r[2] for r in rows])
    return 100 * spearmanr(F.cosine_similarity(a, b).numpy(), [r[3] for r in rows]).statistic


# ================================================================ loss ==========================
def bellm_loss(h, h_pos, h_neg, temp):
    """eq. 6: -log e^{cos(h_i,h_i+)/t} / sum_j (e^{cos(h_i,h_j+)/t} + e^{cos(h_i,h_j-)/t}); h*: (B, H)."""
    h = F.normalize(h, dim=-1)
    sim = h @ F.normalize(torch.cat([h_pos, h_neg]), dim=-1).T / temp  # (B, 2B)
    return F.cross_entropy(sim, torch.arange(len(h), device=h.device))


def cosent_loss(a, b, labels, scale=20.0):
    """C-STS training (not in the paper's text; AnglE's cosine objective by the same authors):
    log(1 + sum_{y_i > y_j} e^{scale (cos_j - cos_i)}); a, b: (B, H), labels: (B,)."""
    cos = F.cosine_similarity(a, b) * scale  # (B,)
    diff = cos[None, :] - cos[:, None]  # [i, j] = cos_j - cos_i
    diff = diff[labels[:, None] > labels[None, :]]
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff]), 0)


# ================================================================ main ==========================
def main():
    a = p.parse_args()
    common.QUIET = a.quiet
    transformers.logging.disable_progress_bar()
    rank, world, device = common.init_distributed()  # under torchrun: one process per GPU
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if unknown := [t for t in tasks if t not in common.TASKS]:
        common.die(f"unknown task(s) {', '.join(unknown)}: --tasks takes {','.join(common.TASKS)}")
    if a.batch_size * world < 2:
        common.die(f"--batch-size {a.batch_size}: eq. 6 needs in-batch negatives, pass 2 or more")
    if a.degradation or a.dependency:
        figures.check(a.plot)  # a bad --plot path stops before the data is looked for
    elif a.plot:
        common.die("--plot draws an analysis: add --degradation or --dependency (no training)")
    data = common.senteval_dir(a.data_dir)

    # ---------------------------------------------------------------- seeding
    common.seed_everything(a.seed)  # the same initial weights (and LoRA dropout stream) on every rank

    if a.degradation or a.dependency:  # the analyses: no training
        import bellm_analysis  # the paper's figures, in their own file
        if a.dependency:
            return bellm_analysis.dependency(a, device, common.check_sts(data, ["STS-B"]))
        check_prompt(a.prompt, False)
        tok, dec = load_decoder(a.model[0], 0, "convert", device)
        bellm_analysis.degradation(a, tok, dec.eval(), device, data, tasks)
        return
    if len(a.model) > 1 or len(a.bi_layers) > 1:
        common.die("--model and --bi-layers take one value for training (several only with --dependency)")
    a.model, a.bi_layers = a.model[0], a.bi_layers[0]

    # ---------------------------------------------------------------- data
    kind, rows = read_csv(common.train_file(a.train, "nli_for_simcse.csv"))
    csts_dev = None
    if a.csts:
        if not os.path.isfile(a.csts) or (kind_dev := read_csv(a.csts))[0] != "csts":
            common.die(f"--csts '{a.csts}' is not a C-STS csv (sentence1,sentence2,condition,label)")
        csts_dev = kind_dev[1]
    check_prompt(a.prompt, kind == "csts" or csts_dev is not None)
    per_step = a.batch_size * world * a.grad_accum  # rows per optimisation step, all ranks together
    if len(rows) < per_step:
        common.die(f"'{a.train}' has {len(rows)} rows, fewer than the {per_step} of one step: lower --batch-size "
                   "or --grad-accum")
    data = common.check_sts(data, tasks if a.final_eval else [])
    ckpt = runs.open_run(a.output_dir, a.resume, [a.model], rank)  # locks it; refuses to overwrite a run
    state = runs.load_state(ckpt, "bellm", a, device) if a.resume else None
    lr = a.lr or (state["args"]["lr"] if state else 2e-4)
    g = torch.Generator().manual_seed(a.seed)  # the data order: fixed by the seed, the same on every rank
    order = [i for _ in range(a.epochs) for i in torch.randperm(len(rows), generator=g).tolist()]
    steps = [order[i:i + per_step] for i in range(0, len(order) - per_step + 1, per_step)]  # last partial dropped
    total = len(steps) if a.max_steps < 0 else min(a.max_steps, len(steps))
    runs.complete(state, total, a.output_dir)  # --resume of a finished run: says so, exit 0

    # ---------------------------------------------------------------- model (patch) + LoRA
    from peft import LoraConfig, get_peft_model
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    tok, dec = load_decoder(a.model, a.bi_layers, a.bi_strategy, device, dtype)
    prompt_len = len(tok(fill(a.prompt, "", ""))["input_ids"])
    common.check_max_len(a.max_len, dec.config, a.model, extra=prompt_len)
    grad_ckpt = device.type == "cuda" if a.grad_ckpt is None else a.grad_ckpt
    if grad_ckpt:  # with bf16 weights, LLaMA-2-7B fits one 80 GB GPU (README)
        dec.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # DDP-safe
    model = get_peft_model(dec, LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout,
                                           target_modules="all-linear"))  # every Linear; AutoModel has no head
    if a.bf16 or device.type == "cuda":  # autocast on: cast the frozen base Linears once, not at every pass
        cast_frozen_linears(dec)
    net = BeLLM(dec, a.bi_layers, a.bi_mode, a.bi_strategy)  # every LoRA parameter is used in every step,
    ddp = net if world == 1 else torch.nn.parallel.DistributedDataParallel(net)  # so DDP needs no unused-param scan
    meta = dict(method="bellm", base_model=a.model, bi_mode=a.bi_mode, bi_layers=a.bi_layers,
                bi_strategy=a.bi_strategy, prompt=a.prompt, dtype=str(dtype).removeprefix("torch."),
                max_len=dec.config.max_position_embeddings)  # for evaluation, which does not cut sentences
    encode = make_encoder(dec, tok, meta, device, a.bf16)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / total)  # linear decay (the authors' HF Trainer)
    log = print if rank == 0 else (lambda *_, **__: None)
    log(f"{a.model}: {len(dec.layers)} layers, K={a.bi_layers} {a.bi_mode}/{a.bi_strategy}, "
        f"{sum(q.numel() for q in params):,} LoRA parameters, {len(rows)} {kind} rows, {total} steps of {per_step} "
        f"rows ({world} process(es) x {a.batch_size} x {a.grad_accum} accumulated), lr {lr:g}, device {device}"
        + (f" ({common.bf16_note(device)})" if a.bf16 else ""))
    s = 2 if dtype == torch.bfloat16 or a.bf16 or device.type == "cuda" else 4  # bytes of most activations
    longest = a.max_len + len(tok(fill(a.prompt, "", ""))["input_ids"])  # a prompted training text, at most
    texts = a.batch_size * (3 if kind == "nli" else 2)  # a micro-batch
    est = [memory_estimate(dec, sum(q.numel() for q in params), s, texts * longest, longest, a.lora_r,
                           c) for c in (False, True)]
    per_tok = [e[2] * 2**20 / (texts * longest) for e in est]  # KiB a token
    w, o, act = est[grad_ckpt]
    log(f"memory (estimate, README): weights {w:.2f} GiB, LoRA + AdamW {o:.2f} GiB, activations {per_tok[0]:,.0f} "
        f"KiB a token ({per_tok[1]:,.0f} with --grad-ckpt): {act:.2f} GiB for {texts} x {longest} tokens "
        f"{'with' if grad_ckpt else 'without'} checkpointing; {w + o + act:.2f} GiB in all")

    def dev_score():
        model.eval()
        score = (csts_spearman(encode, csts_dev) if csts_dev else
                 common.evaluate(encode, data, ["STS-B"], "dev")["STS-B"])
        model.train()
        return score

    step, best = 0, -float("inf")
    if state:
        def restore():  # copy_ refuses other shapes; the count is checked here
            if len(params) != len(state["trainable"]):
                raise ValueError("other LoRA layers")
            for q, v in zip(params, state["trainable"]):
                q.data.copy_(v)
            opt.load_state_dict(state["opt"]), sched.load_state_dict(state["sched"])
        runs.fit(restore, f"'{a.model}' with these LoRA settings")
        step, best = state["step"], state["best"]
        torch.set_rng_state(state["rng"][0]), random.setstate(state["rng"][1]), np.random.set_state(state["rng"][2])
        runs.resume_lr(opt, lr, state, log, sched)

    def training_state():
        return {"method": "bellm", "args": {**runs.run_args(a), "lr": lr},
                "trainable": [q.detach().clone() for q in params], "opt": opt.state_dict(),
                "sched": sched.state_dict(), "step": step, "best": best,
                "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state())}

    def save(score=None):  # rank 0 writes (the training state; with a new best dev score, the adapter too)
        nonlocal best
        if rank == 0 and score is not None and score > best:
            best = score  # the peft adapter (added layers' LoRA included), sentemb.json and the state, as one
            runs.save_best(a.output_dir, model.save_pretrained, training_state(), params, **meta)
        elif rank == 0:
            runs.save_state(training_state(), a.output_dir, params)
        if world > 1:
            torch.distributed.barrier()

    def evaluate_and_save():
        d = dev_score() if rank == 0 else None
        save(d)
        if rank == 0:
            log(f"step {step:>5}  {'csts_dev' if csts_dev else 'stsb_dev'} {d:.2f}  (best {best:.2f})", flush=True)

    def micro_step(batch):
        """One micro-batch of B rows on this rank -> (loss over the global batch of world·B rows, real tokens)."""
        conditions = None if kind == "nli" else [r[2] for r in batch for _ in range(2)]
        texts = [s for r in batch for s in (r if kind == "nli" else r[:2])]  # NLI: 3 texts a row, C-STS: 2
        b = common.tokenize(tok, *prompted(tok, {**meta, "max_len": a.max_len}, texts, conditions), device)
        with common.autocast(device, a.bf16):
            run = lambda x: ddp(x["input_ids"], x["attention_mask"])  # noqa: E731
            h = (common.by_length(run, b) if a.length_grouping else run(b)).float()  # (B·3, H) or (B·2, H)
        h = h.view(len(batch), -1, h.shape[-1])  # (B, 3, H): anchor, entailment, contradiction
        cols = [common.gather(h[:, i]) for i in range(h.shape[1])]  # each (world·B, H), ranks in order
        if kind == "nli":
            loss = bellm_loss(*cols, a.temp)  # eq. 6 over the global batch
        else:  # C-STS pairs, each sentence under its condition
            labels = common.gather(torch.tensor([r[3] for r in batch], device=device))
            loss = cosent_loss(*cols, labels)
        # every rank holds the same global loss; DDP averages gradients over ranks, hence × world
        (loss * world / a.grad_accum).backward()
        return loss, int(b["attention_mask"].sum())

    # ---------------------------------------------------------------- training loop
    model.train()
    with runs.StopOnSignal() as stop:  # Ctrl-C / SIGTERM: stop at the next step boundary, saved
        if step == 0 and a.eval_first:
            evaluate_and_save()
        t0, toks, seen = time.perf_counter(), 0, 0
        while step < total:
            opt.zero_grad(set_to_none=True)
            for k in range(a.grad_accum):  # micro-batch k: rank r takes its slice of B rows
                start = (k * world + rank) * a.batch_size
                sync = contextlib.nullcontext if world == 1 or k == a.grad_accum - 1 else ddp.no_sync
                with sync():  # gradients are all-reduced once, after the last micro-batch
                    loss, n_tok = micro_step([rows[i] for i in steps[step][start:start + a.batch_size]])
                if not torch.isfinite(loss):  # before opt.step(): the weights are still the last good ones
                    common.die(f"loss became {loss.item()} at step {step}: resume with a lower --lr (now {lr:g}; "
                               f"--resume --lr ...); the run in {a.output_dir} is kept")
                toks += n_tok
            opt.step()
            sched.step()
            step, seen = step + 1, seen + per_step
            if step % a.log_steps == 0 or step == total:
                dt, n = time.perf_counter() - t0, torch.tensor(float(toks), device=device)
                if world > 1:
                    torch.distributed.all_reduce(n)  # real tokens of all ranks
                log(f"step {step:>5}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                    f"rows/s {seen / dt:.2f}  "
                    f"tok/s {n.item() / dt:.0f}", flush=True)
                t0, toks, seen = time.perf_counter(), 0, 0
            halt = stop(device, world)  # the same answer on every rank
            if step % a.eval_steps == 0 or step == total:
                evaluate_and_save()
                t0, toks, seen = time.perf_counter(), 0, 0
            elif halt:
                save()
            if halt:
                stop.exit(step, a.output_dir)

        peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else  # Linux ru_maxrss: KiB
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
        log(f"peak memory {peak:.2f} GiB ({'torch.cuda.max_memory_allocated' if device.type == 'cuda' else 'ru_maxrss'}"
            f"{', rank 0' if world > 1 else ''})")

        # ------------------------------------------------------------ evaluation of the best checkpoint
        stop.now = True  # nothing left to save: a signal ends the process at once
        if a.final_eval and rank == 0:
            best_encode = load_encoder(a.output_dir, meta, device)  # what eval_sts.py runs (--bf16: its --bf16)
            with common.autocast(device, a.bf16):
                print(common.format_table(common.evaluate(best_encode, data, tasks)))

if __name__ == "__main__":
    main()
