"""BeLLM: "Backward Dependency Enhanced Large Language Model for Sentence Embeddings".
Xianming Li & Jing Li. NAACL 2024. arXiv:2311.05296.

A decoder LLM reads a prompt, `The representative word for {sentence} is:"`, and the final-norm
hidden state of the last token is the sentence embedding. BeLLM makes the last K decoder layers
bidirectional (eq. 4: the causal mask goes; padding stays masked) and, in the wiring of eq. 5 that
the authors trained, runs them beside the causal stack on the token embeddings x and sums the two:
h = LLM->(x) + BiLLM<->(x). Training: LoRA on NLI triplets with the contrastive loss of eq. 6.
`--bi-mode sequential` is the later BiLLM wiring (the last K layers bidirectional in place); with
last-token pooling its K = 1 cannot change the embedding (docs/bellm.md, detail 1).

  §3.3, the prompt                            PROMPT, fill, prompted
  eqs. 3-4, causal / bidirectional masks      attn_mask
  eq. 5, h = LLM->(x) + BiLLM<->(x)           forward, BeLLM (last_token pooling)
  eq. 6, the contrastive loss; one step       bellm_loss, train_step (C-STS: cosent_loss)
  Figs. 2, 4, 5, App. A (no training)         bellm_analysis.py

  torchrun --nproc_per_node 4 bellm.py --batch-size 16 --output-dir runs/bellm_7b  # paper: 4 GPUs
  python bellm.py --model HuggingFaceTB/SmolLM2-135M-Instruct --train snli_devtest.csv --bf16 \\
      --batch-size 16 --max-len 32 --lr 5e-4 --max-steps 100 --eval-steps 50 --no-eval-first \\
      --no-final-eval --output-dir runs/bellm                      # CPU (docs/bellm.md)
"""
import argparse
import contextlib
import copy
import functools
import json
import math
import os
import shutil
import sys
import warnings

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from transformers import get_linear_schedule_with_warmup

import common

PROMPT = 'The representative word for {sentence} is:"'  # §3.3; C-STS, §5.1:
CSTS_PROMPT = 'Given the context {condition}, summarize the sentence {sentence} in one word:"'
# peft on transformers 5
warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
# --- general: the paper's values as defaults ---
p.add_argument("--model", default="meta-llama/Llama-2-7b-hf", help="a decoder LLM (LLaMA, "
               "Mistral, Qwen2, ...; paper: LLaMA-2-7B)")
p.add_argument("--train", help="csv with sent0,sent1,hard_neg (default: SimCSE's "
               "nli_for_simcse.csv) or C-STS's sentence1,sentence2,condition,label")
p.add_argument("--data-dir", help="STS data: DIR/downstream/{STS,SICK} (else $SENTEMB_DATA)")
p.add_argument("--output-dir", default="runs/bellm", help="the run folder: best model, state")
p.add_argument("--epochs", type=common.POS_INT, default=1, help="paper: 1")
p.add_argument("--max-steps", type=common.STEPS, default=-1, help="N steps (-1: the epochs)")
p.add_argument("--batch-size", type=common.POS_INT, default=64, help="rows a step and GPU "
               "(paper: 64); torchrun: in-batch negatives from all GPUs")
p.add_argument("--grad-accum", type=common.POS_INT, default=1, help="micro-batches a step, each "
               "with only its own in-batch negatives")
p.add_argument("--length-grouping", action=argparse.BooleanOptionalAction, default=True,
               help="a step's texts in length groups: the same loss, the real tokens' cost")
p.add_argument("--lr", type=common.POS_FLOAT, help="paper: 2e-4 (batch: one of 16, 32, 64, "
               "128); --resume: the run's own unless given")
# NOTE(authors' code): 4AI/BeLLM's AnglE.fit (model.py L417-430) sets only warm-up and lr of HF
# TrainingArguments (transformers >= 4.38.2, which billm 0.1.3 needs; training_args.py L769,
# L773, L781, L1142): torch's AdamW, weight decay 0.0, clipping at 1.0 (trainer.py L1998), linear
# decay; warm-up: train.py L70's default, 100 steps
p.add_argument("--weight-decay", type=common.NONNEG_FLOAT, default=0.0, help="AdamW's, biases and "
               "norms excluded (authors' code: 0.0)")
p.add_argument("--max-grad-norm", type=common.NONNEG_FLOAT, default=1.0, help="clip the gradients' "
               "global norm to this before each update (authors' code: 1.0); 0: no clipping")
p.add_argument("--warmup-steps", type=common.NONNEG_INT, default=100, help="the rate's linear "
               "warm-up before its linear decay to 0 (authors' code: 100)")
p.add_argument("--max-len", type=common.POS_INT, default=64, help="training tokens a sentence "
               "(paper: 64)")
p.add_argument("--eval-steps", type=common.POS_INT, default=100, help="dev every N steps")
p.add_argument("--seed", type=common.SEED, default=42)
p.add_argument("--log-steps", type=common.POS_INT, default=10, help="the loss every N steps")
p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too (always on CUDA)")
p.add_argument("--compile", action="store_true", help="torch.compile each layer (training, eval)")
p.add_argument("--quiet", action="store_true", help="no progress bars")
p.add_argument("--resume", action="store_true", help="continue OUTPUT_DIR/checkpoint.pt")
p.add_argument("--final-eval", action=argparse.BooleanOptionalAction, default=True,
               help="the 7 STS tasks of the best checkpoint at the end")
p.add_argument("--eval-first", action=argparse.BooleanOptionalAction, default=True,
               help="evaluate step 0 (zero-shot); --no-eval-first saves one evaluation")
p.add_argument("--dtype", choices=["float32", "bfloat16"], help="the base LLM's weights (LoRA and "
               "AdamW stay float32): default bfloat16 on CUDA (the paper's), float32 on CPU")
p.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction,
               help="gradient checkpointing: default on with CUDA, off on CPU")
p.add_argument("--tasks", default=",".join(common.TASKS), help="the final table's tasks")
# --- BeLLM ---
p.add_argument("--bi-layers", type=common.NONNEG_INT, default=1, help="K, the last layers made "
               "bidirectional (paper: 1; 0 = the causal LLM)")
p.add_argument("--bi-mode", default="parallel", choices=["parallel", "sequential"],
               help="parallel = eq. 5 (the authors' code); sequential = BiLLM")
p.add_argument("--bi-strategy", default="convert", choices=["convert", "add"], help="convert the "
               "last K layers, or add K bidirectional copies of them on top (Table 4)")
p.add_argument("--prompt", default=PROMPT, help="with {sentence}; may contain {condition} (C-STS, "
               f"§5.1: '{CSTS_PROMPT}')")
p.add_argument("--temp", type=common.POS_FLOAT, default=0.05, help="tau of eq. 6 (paper: 0.05)")
p.add_argument("--lora-r", type=common.POS_INT, default=32, help="paper: 32")
p.add_argument("--lora-alpha", type=common.POS_INT, default=32, help="paper: 32")
p.add_argument("--lora-dropout", type=common.PROB, default=0.1, help="paper: 0.1")
p.add_argument("--csts", help="a C-STS dev csv, scored at every evaluation: selects the checkpoint")
common.show_ranges(p)


# ---------------------------------------------------------------- the loss ------------------------
def bellm_loss(h, h_pos, h_neg, temp):
    """eq. 6: -log e^{cos(h_i,h_i+)/t} / Σ_j (e^{cos(h_i,h_j+)/t} + e^{cos(h_i,h_j-)/t});
    h, h_pos, h_neg: (B, H)."""
    h = F.normalize(h, dim=-1)
    sim = h @ F.normalize(torch.cat([h_pos, h_neg]), dim=-1).T / temp  # (B, 2B)
    return F.cross_entropy(sim, torch.arange(len(h), device=h.device))


def cosent_loss(u, v, labels, scale=20.0):
    """C-STS training (not in the paper's text; AnglE's cosine objective, by the same authors):
    log(1 + Σ_{y_i > y_j} e^{scale (cos_j - cos_i)}), cos_i = cos(u_i, v_i); u, v: (B, H),
    labels: (B,)."""
    cos = F.cosine_similarity(u, v) * scale  # (B,)
    diff = cos[None, :] - cos[:, None]  # [i, j] = cos_j - cos_i
    diff = diff[labels[:, None] > labels[None, :]]
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff]), 0)


# ---------------------------------------------------------------- the model patch -----------------
def attn_mask(attention_mask, causal, dtype):
    """(b, L) 1 = real token -> (b, 1, L, L) additive mask, 0 where query i may read key j."""
    L = attention_mask.shape[1]
    keep = attention_mask[:, None, None, :].bool()  # keys: real tokens only (eq. 4 too)
    if causal:  # eq. 3: j <= i
        keep = keep & torch.ones(L, L, dtype=torch.bool, device=keep.device).tril()
    keep = keep | torch.eye(L, dtype=torch.bool, device=keep.device)  # no empty row (padding)
    zeros = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return zeros.masked_fill(~keep, torch.finfo(dtype).min)


def forward(dec, input_ids, attention_mask, bi_layers, bi_mode, bi_strategy, all_hidden=False):
    """Final-norm hidden states (b, L, H); all_hidden: also the causal stack's per-layer outputs."""
    x = dec.embed_tokens(input_ids)  # (b, L, H)
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # real tokens only (left padding)
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
        m = attn_mask(attention_mask, False, x.dtype)  # eq. 4: no causal mask, padding masked
        g = x if bi_mode == "parallel" else h  # eq. 5 reads x; BiLLM continues the causal stack
        for layer in bi:  # BiLLM<->: bidirectional
            g = layer(g, attention_mask=m, **kw)
        # eq. 5: h = LLM->(x) + BiLLM<->(x)
        # NOTE(authors' code): with no causal layer left (K = n), h = BiLLM(x)
        h = g if bi_mode == "sequential" or len(causal_layers) == 0 else h + g
    return (dec.norm(h), hs) if all_hidden else dec.norm(h)


def last_token(h, attention_mask):
    """h (b, L, H) -> (b, H) at the last real token, for left or right padding."""
    idx = (attention_mask * torch.arange(attention_mask.shape[1], device=h.device)).argmax(1)
    return h[torch.arange(h.shape[0], device=h.device), idx]


class BeLLM(torch.nn.Module):
    """The embedding model as one module (what DDP wraps): input_ids, attention_mask -> (b, H)."""

    def __init__(self, dec, bi_layers, bi_mode, bi_strategy):
        super().__init__()
        self.dec, self.bi = dec, (bi_layers, bi_mode, bi_strategy)

    def forward(self, input_ids, attention_mask):
        return last_token(forward(self.dec, input_ids, attention_mask, *self.bi), attention_mask)


# ---------------------------------------------------------------- the prompt (§3.3) ---------------
def fill(prompt, sentence, condition=None):
    """The prompted text (§3.3); str.replace leaves braces inside a sentence alone."""
    return prompt.replace("{sentence}", sentence).replace("{condition}", condition or "")


def prompted(tok, cfg, sentences, conditions=None):
    """Sentences -> prompted texts; max_len applies to the sentence, cut before it enters the
    prompt, so the prompt's end (`is:"`, read by the pooled last token) is never cut.
    -> texts, their token limit."""
    def cut(s):
        ids = tok(s, add_special_tokens=False)["input_ids"]
        return s if len(ids) <= cfg["max_len"] else tok.decode(ids[:cfg["max_len"]])
    conditions = conditions or [None] * len(sentences)
    texts = [fill(cfg["prompt"], cut(s), c) for s, c in zip(sentences, conditions)]
    return texts, cfg["max_len"] + len(tok(fill(cfg["prompt"], "", ""))["input_ids"]) + 8


# ---------------------------------------------------------------- one training step ---------------
def embed(model, batch):
    """The model on a tokenised batch: (b, H)."""
    return model(batch["input_ids"], batch["attention_mask"])


def train_step(model, tokenizer, rows, kind, prompt, device, temp=0.05, max_len=64, bf16=False,
               world=1, accum=1, gather=lambda z: z):
    """One micro-batch of B rows -> (the loss over the global batch, its real tokens); gradients
    accumulated. kind "nli": rows (anchor, entailment, contradiction), eq. 6; "csts": rows
    (sentence1, sentence2, condition, label), cosent_loss over the pairs, each sentence under its
    condition. model(batch) -> (N, H): the last token's hidden state of each prompted text (BeLLM
    through embed), or that run in length groups (the same outputs); prompt: with {sentence} (and
    {condition}); max_len: the tokens of a sentence; bf16: autocast. torchrun: gather(z) = every
    rank's rows (B, H) -> (world·B, H); the gradients × world / accum (DDP averages them over the
    ranks; accum micro-batches a step)."""
    conditions = None if kind == "nli" else [r[2] for r in rows for _ in range(2)]
    texts = [s for r in rows for s in (r if kind == "nli" else r[:2])]  # 3 texts a row, or 2
    texts, limit = prompted(tokenizer, {"prompt": prompt, "max_len": max_len}, texts, conditions)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=limit,
                      return_tensors="pt").to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        h = model(batch).float()  # (B·3, H) or (B·2, H)
    h = h.view(len(rows), -1, h.shape[-1])  # (B, 3, H): anchor, entailment, contradiction
    cols = [gather(h[:, i]) for i in range(h.shape[1])]  # each (world·B, H), ranks in order
    if kind == "nli":
        loss = bellm_loss(*cols, temp)  # eq. 6 over the global batch
    else:
        loss = cosent_loss(*cols, gather(torch.tensor([r[3] for r in rows], device=device)))
    # every rank holds the same global loss; DDP averages gradients over ranks, hence × world
    (loss * world / accum).backward()
    return loss, int(batch["attention_mask"].sum())


# ---------------------------------------------------------------- the data loader -----------------
def step_rows(n, per_step, epochs, max_steps, seed):
    """The row indices of every optimisation step, the same on every rank: epoch e is a permutation
    of range(n) drawn from seed + e, cut into steps of per_step rows (all ranks' micro-batches), the
    last incomplete step dropped. max_steps N (not -1): N steps, over as many epochs as that
    takes."""
    if n < per_step:
        common.die(f"{n} training rows < {per_step} per step: lower --batch-size or --grad-accum")
    per_epoch = n // per_step
    total = epochs * per_epoch if max_steps < 0 else max_steps
    steps = []
    for e in range(math.ceil(total / per_epoch)):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist()
        steps += [order[i * per_step:(i + 1) * per_step] for i in range(per_epoch)]
    return steps[:total]


# ---------------------------------------------------------------- the model, its run folder -------
def load_decoder(name, bi_layers, bi_strategy, device, dtype=None):
    """tokenizer, decoder (embed_tokens, layers, rotary_emb, norm) in `dtype` (default fp32 on CPU,
    bf16 on CUDA); for bi_strategy 'add', copies of the last K layers as `dec.bellm_added`."""
    from transformers import AutoModel, AutoTokenizer
    tok = common.load_pretrained(AutoTokenizer, name)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    dec = common.load_pretrained(AutoModel, name, dtype=dtype)
    if device.type == "cpu":  # PyTorch's CPU SDPA backward with a mask is slow (docs/operations.md)
        dec.set_attn_implementation("eager")
    if not all(hasattr(dec, m) for m in ("embed_tokens", "layers", "rotary_emb", "norm")):
        common.die(f"'{name}' ({type(dec).__name__}) is not a decoder LLM with embed_tokens, "
                   "layers, rotary_emb and norm: pass a LLaMA / Mistral / Qwen2-style model")
    n = len(dec.layers)
    if not 0 <= bi_layers <= n:
        common.die(f"--bi-layers {bi_layers} is outside 0..{n} ('{name}' has {n} layers)")
    if bi_strategy == "add":  # Table 4 "addition": new layers, copies of the last K
        dec.bellm_added = torch.nn.ModuleList(copy.deepcopy(m) for m in dec.layers[n - bi_layers:])
    if tok.pad_token is None:  # padding is masked everywhere, so any id will do
        tok.pad_token = tok.eos_token
    return tok, dec.to(device)


def base_checksums(dec):
    """The base model's fingerprints, so that an adapter is applied only to the base it was trained
    on, never to another of its shape: base_fingerprint, every base weight (LoRA's left out)
    reduced to Σ|w| in bf16 (the precision a base may be stored in), weighted by its position;
    base_checksum, the token embeddings' and final norm's Σ|w| (all that older runs record)."""
    w = [q.detach() for n, q in dec.named_parameters() if "lora_" not in n]
    reduce = lambda x: x.to(torch.bfloat16).float().abs().sum(dtype=torch.float64)  # noqa: E731
    return {"base_checksum": float(sum(x.double().abs().sum() for x in (
                dec.embed_tokens.weight.detach(), dec.norm.weight.detach()))),
            "base_fingerprint": float(sum(i * reduce(x) for i, x in enumerate(w, 1)))}


def check_base(given, recorded, name, where):
    """The base_checksums of the base given against those a run recorded (dicts holding them)."""
    for key in ("base_checksum", "base_fingerprint"):
        if recorded.get(key) is not None and not math.isclose(given[key], recorded[key],
                                                              rel_tol=1e-6):
            common.die(f"'{name}' is not the base model the adapter was trained on (its weights' "
                       f"{key} is {given[key]:.6g}, {where} records {recorded[key]:.6g}): name the "
                       "model bellm.py --model trained it on")


def cast_frozen_linears(dec, dtype=torch.bfloat16):
    """Under bf16 autocast with float32 base weights: each frozen Linear stored in bf16 once.
    Autocast would cast them at every pass (it caches only trainable weights' casts): the same
    numbers, without the casts' time, and half those weights' memory. Norms and embeddings stay
    float32, as autocast runs them."""
    for m in dec.modules():
        if isinstance(m, torch.nn.Linear) and not any(q.requires_grad for q in m.parameters()):
            m.to(dtype)


def add_lora(dec, r, alpha, dropout, grad_ckpt=False, autocast=False):
    """LoRA on every Linear of the decoder (peft; AutoModel has no LM head), in place. grad_ckpt:
    gradient checkpointing (with bf16 weights, LLaMA-2-7B fits one 80 GB GPU); autocast: bf16
    autocast will run, so the frozen Linears are cast once (cast_frozen_linears). -> the peft
    model (its save_pretrained writes the adapter)"""
    from peft import LoraConfig, get_peft_model
    if grad_ckpt:
        dec.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = get_peft_model(dec, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                          target_modules="all-linear"))
    if autocast:
        cast_frozen_linears(dec)
    return lora


def prompt_tokens(tokenizer, dec, prompt, max_len, name):
    """The tokens of the prompt around a sentence, once --max-len is known to fit the model's
    positions with them."""
    n = len(tokenizer(fill(prompt, "", ""))["input_ids"])
    common.check_max_len(max_len, dec.config, name, extra=n)
    return n


def make_encode(dec, tok, cfg, device, cpu_bf16=False):
    """encode(list[str], conditions=None) -> (N, H): the one encode function (dev evaluation in
    training, eval_sts.py)."""
    net = BeLLM(dec, cfg["bi_layers"], cfg["bi_mode"], cfg["bi_strategy"])

    @torch.no_grad()
    def encode(sentences, conditions=None):
        texts, max_len = prompted(tok, cfg, sentences, conditions)
        with common.autocast(device, cpu_bf16):
            return common.encode_in_batches(encode.embed, tok, texts, max_len, device, 64)
    encode.tokenizer, encode.max_len = tok, cfg["max_len"]  # what it reads (eval_sts.py --ensemble)
    encode.embed, encode.layers = functools.partial(embed, net), net  # common.compiled_encode
    return encode


def load_adapter(dec, run_dir):
    """The LoRA adapter of a bellm.py run folder wrapped into dec (in place), or one line naming the
    file: it must load, and hold exactly the adapter weights that this base model and
    adapter_config.json ask for (peft would only warn about missing ones and leave them as
    initialised)."""
    import warnings

    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    where = f"cannot load the bellm.py run in '{run_dir}'"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # missing keys are checked below, with the file named
            model = PeftModel.from_pretrained(dec, run_dir)
    except Exception as e:  # a damaged config or weights, or another base model's adapter (shapes)
        common.die(f"{where} ({type(e).__name__}: {common.first_line(e)}): adapter_config.json or "
                   "adapter_model.safetensors is damaged, or made for another base model; "
                   f"{RECOPY}")
    want = set(get_peft_model_state_dict(model))
    have = common.safetensors_keys(os.path.join(run_dir, "adapter_model.safetensors"), where,
                                   RECOPY)
    if want != have:
        odd = sorted(want - have) or sorted(have - want)
        said = "lacks" if want - have else "holds"
        common.die(f"{where}: adapter_model.safetensors {said} {len(odd)} adapter weights ({odd[0]}"
                   f"{', ...' * (len(odd) > 1)}) {'that' if want - have else 'beyond what'} "
                   f"adapter_config.json and the base model ask for: {RECOPY}")
    return model


META_TYPES = {  # sentemb.json: the keys, and their types
    "base_model": lambda v: isinstance(v, str) and v != "",
    "bi_layers": lambda v: type(v) is int and v >= 0,
    "bi_mode": ("parallel", "sequential").__contains__,
    "prompt": lambda v: isinstance(v, str) and "{sentence}" in v}
META_OPTIONAL = {  # keys that older runs may lack
    "bi_strategy": ("convert", "add").__contains__, "dtype": ("float32", "bfloat16").__contains__,
    "max_len": lambda v: type(v) is int and v >= 1, "lora_r": lambda v: type(v) is int and v >= 1,
    "lora_alpha": lambda v: type(v) in (int, float) and v > 0,
    **{k: lambda v: type(v) in (int, float) for k in ("base_checksum", "base_fingerprint")},
    "step": lambda v: type(v) is int and v >= 0,
    **{k: lambda v: v is None or type(v) in (int, float) for k in ("stsb_dev", "csts_dev")}}
def check_run(run_dir, meta):
    """A run folder of this script is the model its files describe, or one line naming the file and
    the value: sentemb.json's keys of their types; the adapter's files whole; every value within
    the base model's limits; adapter_config.json as bellm.py trains (eval_sts.py and --resume
    call it). That the adapter's weights fit the base is checked when it loads (load_adapter)."""
    path, where = os.path.join(run_dir, common.META), f"cannot load the bellm.py run in '{run_dir}'"
    common.check_keys(path, meta, META_TYPES, META_OPTIONAL)
    for rel in ("adapter_config.json", "adapter_model.safetensors"):
        common.check_file(run_dir, rel, where, RECOPY)
    from transformers import AutoConfig
    base = meta["base_model"]
    n = common.load_pretrained(AutoConfig, base).num_hidden_layers
    if meta["bi_layers"] > n:  # the words of --bi-layers
        common.die(f"{path}: bi_layers {meta['bi_layers']} is outside 0..{n} ('{base}' has {n} "
                   f"layers): set it to 0..{n}, or {RECOPY}")
    if "max_len" in meta:
        common.check_max_len(meta["max_len"], common.load_pretrained(AutoConfig, base), base,
                             f"{path}: max_len")
    common.check_lora_config(os.path.join(run_dir, "adapter_config.json"), meta, path, where,
                             RECOPY)


def load_encoder(run_dir, meta, device):
    """For eval_sts.py. meta: base_model, bi_layers, bi_mode, prompt [, bi_strategy, max_len];
    run_dir None = zero-shot, no LoRA (a run folder without its adapter is refused by
    check_run, never run as the base model)."""
    return make_encode(*load_adapted(run_dir, meta, device), device)


def load_adapted(run_dir, meta, device):
    """The decoder of a run (base + LoRA adapter, in eval mode), its tokenizer and config dict."""
    cfg = {"bi_strategy": "convert", **meta}
    dtype = getattr(torch, cfg["dtype"]) if cfg.get("dtype") else None  # the base as trained
    tok, dec = load_decoder(cfg["base_model"], cfg["bi_layers"], cfg["bi_strategy"], device, dtype)
    cfg.setdefault("max_len", dec.config.max_position_embeddings)  # evaluation does not cut
    check_base(base_checksums(dec), cfg, cfg["base_model"], f"{run_dir}/sentemb.json")
    if run_dir:  # wraps the LoRA layers into dec in place; a damaged adapter file stops here
        load_adapter(dec, run_dir)
    check_prompt(cfg["prompt"], "{condition}" in cfg["prompt"])
    if "{condition}" in cfg["prompt"]:  # a C-STS run: STS pairs come without a condition
        print("note: the prompt has {condition} (C-STS): left empty for sentences without one")
    return dec.eval(), tok, cfg


def dev_score(encode, data, csts_dev=None):
    """The score that selects the checkpoint: STS-B dev, or with --csts C-STS (§5.1; each sentence
    embedded with its condition; Spearman x 100 of cosine vs label)."""
    if not csts_dev:
        return common.stsb_dev(encode, data)
    u = encode([r[0] for r in csts_dev], [r[2] for r in csts_dev])
    v = encode([r[1] for r in csts_dev], [r[2] for r in csts_dev])
    return 100 * spearmanr(F.cosine_similarity(u, v).numpy(), [r[3] for r in csts_dev]).statistic


# ---------------------------------------------------------------- argument checks -----------------
def check_prompt(prompt, conditional):
    if "{sentence}" not in prompt:
        common.die(f"--prompt '{prompt}' has no {{sentence}}: write where the sentence goes, e.g. "
                   f"'{PROMPT}'")
    if ("{condition}" in prompt) != conditional:
        common.die("--prompt has {condition} but the data has no condition column"
                   if not conditional else "C-STS data needs a --prompt with {condition}, e.g. "
                   f"'{CSTS_PROMPT}'")


def check_tasks(spec):
    """--tasks 'STS12,STS-B' -> ['STS12', 'STS-B']; an unknown name stops with one line."""
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    if unknown := [t for t in tasks if t not in common.TASKS]:
        common.die(f"unknown task(s) {', '.join(unknown)}: --tasks takes {','.join(common.TASKS)}")
    return tasks


def check_args(a, world):
    """Every check of the command line that stops training (one error line, exit 2), flags that
    would do nothing included. -> the tasks of the final table"""
    tasks = check_tasks(a.tasks)
    if a.batch_size * world < 2:
        common.die(f"--batch-size {a.batch_size}: eq. 6 needs in-batch negatives, pass 2 or more")
    if a.csts and (not os.path.isfile(a.csts) or common.read_csv(a.csts)[0] != "csts"):
        common.die(f"--csts '{a.csts}' is not a C-STS csv (sentence1,sentence2,condition,label)")
    if not a.bi_layers and (odd := [f"--{k.replace('_', '-')} {getattr(a, k)}" for k in
                                    ("bi_mode", "bi_strategy")
                                    if getattr(a, k) != p.get_default(k)]):
        common.die(f"--bi-layers 0 makes no layer bidirectional, so {' and '.join(odd)} would do "
                   "nothing: drop them, or pass --bi-layers 1 or more")
    if not a.final_eval and a.tasks != p.get_default("tasks"):
        common.die("--tasks picks the final table's tasks, and --no-final-eval prints none: drop "
                   "one of them")
    return tasks


def check_data(a, kind, csts_dev):
    """What the training data asks of the flags: a --prompt with {condition} exactly for C-STS
    data or a --csts dev file; --temp only where eq. 6 reads it (NLI)."""
    check_prompt(a.prompt, kind == "csts" or csts_dev)
    if kind == "csts" and a.temp != p.get_default("temp"):
        common.die("--temp is eq. 6's temperature, and C-STS rows train with cosent_loss, which "
                   "has none: drop --temp")


# ---------------------------------------------------------------- main ----------------------------
def main():
    a = common.parse(p)
    rank, world, device, log = common.start()
    tasks = check_args(a, world)

    # data: NLI triplets (or C-STS pairs); every step's rows drawn from the seed
    kind, rows = common.read_csv(common.train_file(a.train, "nli_for_simcse.csv"))
    csts_dev = common.read_csv(a.csts)[1] if a.csts else None  # C-STS dev selects the checkpoint
    check_data(a, kind, csts_dev is not None)
    data = common.check_sts(common.senteval_dir(a.data_dir), tasks if a.final_eval else [])
    metric = "csts_dev" if csts_dev else "stsb_dev"
    per_step = a.batch_size * world * a.grad_accum  # rows a step, all ranks together
    steps = step_rows(len(rows), per_step, a.epochs, a.max_steps, a.seed)

    # the run folder, locked; --resume: its training state, trained as this command says
    out = a.output_dir
    state, lock = open_run(out, [a.model], a, rank, world, device)  # lock: held till exit
    if state and state["step"] >= len(steps):  # nothing is wrong, nothing is left: exit 0
        return log(common.complete(state["step"], len(steps), out))
    lr = a.lr or (state["args"]["lr"] if state else 2e-4)  # the paper's, or the resumed run's

    # the model: the decoder, patched (forward), with LoRA on every Linear (peft)
    common.seed_everything(a.seed)  # the same added layers, LoRA and dropout stream on every rank
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    tokenizer, dec = load_decoder(a.model, a.bi_layers, a.bi_strategy, device, dtype)
    longest = a.max_len + prompt_tokens(tokenizer, dec, a.prompt, a.max_len, a.model)
    grad_ckpt = device.type == "cuda" if a.grad_ckpt is None else a.grad_ckpt
    bf16 = a.bf16 or device.type == "cuda"  # autocast: --bf16, always on CUDA
    lora = add_lora(dec, a.lora_r, a.lora_alpha, a.lora_dropout, grad_ckpt, bf16)
    raw_model = BeLLM(dec, a.bi_layers, a.bi_mode, a.bi_strategy)
    model = common.ddp(raw_model, world)  # DDP: the LoRA weights' gradients averaged over the ranks
    forward = common.in_length_groups(  # --compile: each decoder layer, in place (training, eval)
        functools.partial(embed, common.compiled_layers(model, a.compile)), a.length_grouping)
    meta = dict(method=METHOD, base_model=a.model, bi_mode=a.bi_mode, bi_layers=a.bi_layers,
                bi_strategy=a.bi_strategy, prompt=a.prompt, dtype=str(dtype).removeprefix("torch."),
                max_len=dec.config.max_position_embeddings,  # evaluation does not cut sentences
                lora_r=a.lora_r, lora_alpha=a.lora_alpha, **base_checksums(dec))  # sentemb.json
    encode = make_encode(dec, tokenizer, meta, device, a.bf16)

    params = [q for q in raw_model.parameters() if q.requires_grad]  # the update (authors' code)
    optimizer = torch.optim.AdamW(common.decay_groups(raw_model, a.weight_decay), lr=lr, fused=True)
    scheduler = get_linear_schedule_with_warmup(optimizer, a.warmup_steps, len(steps))
    step, run = restore(state, raw_model, optimizer, scheduler, lr, log)  # run: dev curve, best
    check_base(meta, state["meta"] if state else {}, a.model, CKPT)
    log(f"{a.model}: {len(dec.layers)} layers, K={a.bi_layers} {a.bi_mode}/{a.bi_strategy}, "
        f"{sum(q.numel() for q in params):,} LoRA parameters, {len(rows)} {kind} rows, "
        f"{len(steps)} steps of {per_step} rows, lr {lr:g}, "
        f"{common.device_line(world, device, a.bf16)}")
    log(common.memory_line(dec, params, a.lora_r, a.batch_size * (3 if kind == "nli" else 2),
                           longest, dtype == torch.bfloat16 or bf16, grad_ckpt))

    handlers = common.catch_signals()  # SIGINT, SIGTERM: stop at the next step, saved
    raw_model.train()
    clock = common.new_clock(step)  # the step lines' speed
    for step in range(step + 1 if state else 0, len(steps) + 1):  # 0: the model as loaded
        if step > 0:  # optimisation step `step`: grad_accum micro-batches of B rows per rank
            optimizer.zero_grad(set_to_none=True)
            with common.metered(clock, forward):  # the step's FLOPs
                for ids, last in common.micro_batches(steps[step - 1], a.batch_size,
                                                      a.grad_accum, rank, world):
                    with common.no_sync(model, last):
                        loss, n = train_step(forward, tokenizer, [rows[i] for i in ids], kind,
                                             a.prompt, device, a.temp, a.max_len, bf16, world,
                                             a.grad_accum, common.gather)
                    clock["tokens"] += n  # real ones
                    common.check_loss(loss, step, lr, out)
            gnorm = common.clip_gradients(params, a.max_grad_norm)  # before clipping: gnorm
            optimizer.step()
            scheduler.step()
            if step % a.log_steps == 0 or step == len(steps):
                log(f"step {step:>5}  loss {loss.item():.4f}  gnorm {gnorm:.3g}  lr "
                    f"{scheduler.get_last_lr()[0]:.2e}  "
                    f"{common.rates(clock, step, per_step, 'rows', world, device)}")
                clock = common.new_clock(step, clock)
        halt = common.stop_requested(world, device)  # a signal on any rank: every rank stops here
        evaluate = step % a.eval_steps == 0 and (step or a.eval_first) or step == len(steps)
        if (evaluate or halt) and rank == 0:  # the state; with a new best dev score, the model
            dev = common.dev_eval(raw_model, dev_score, encode, data, csts_dev) if evaluate \
                else None
            state = training_state(raw_model, optimizer, scheduler, a, lr, step, meta)
            run = save_step(out, run, step, metric, dev, state, lora.save_pretrained, log)
        if evaluate or halt:
            clock = common.saved(world, step, clock)
        if halt:
            break

    log(common.peak_memory(device, world))
    if common.STOP["signum"]:  # saved at this step: exit 128 + the signal's number
        sys.exit(common.stopped(step, out, log))
    common.STOP["now"] = True  # training has ended: a signal now exits at once
    if a.final_eval and rank == 0:  # the best checkpoint, loaded as eval_sts.py loads it
        final_table(out, data, tasks, device, a.bf16, run["best"])
    common.restore_signals(handlers)


# ---------------------------------------------------------------- the harness ---------------------
# What a run needs to lose nothing, the same text in sscl.py, jtcse.py and bellm.py but for this
# table (test_all.py holds them equal); a reader who copies the method leaves it behind.
METHOD = "bellm"  # this script: the "method" of its sentemb.json and checkpoint.pt
RESUMABLE = {"resume", "lr", "epochs", "max_steps", "eval_steps", "log_steps", "final_eval",
             "data_dir", "output_dir", "bf16", "compile", "quiet", "length_grouping", "tasks",
             "eval_first", "grad_ckpt"}  # --resume may change
# ---- (the table ends here)
# A run folder: checkpoint.pt, all the run knows (flags, model description, weights, optimiser,
# schedule, RNG, step, dev curve, best score, its save's id), replaced whole: the one commit point;
# best/, the best model (its sentemb.json names its save); dev.jsonl, a view of the curve. A new
# best is written into .best.new, committed by checkpoint.pt, then renamed into best/ (settle).
CKPT, BEST, NEW, OLD, CURVE = common.CKPT, common.BEST, ".best.new", ".best.old", "dev.jsonl"
OURS = {common.LOCK, NEW, OLD, CKPT + ".tmp", CURVE + ".tmp"}  # the names of a save under way
RECOPY = "copy the whole run folder again, or train again"


def open_run(out_dir, inputs, a, rank, world, device):
    """The run folder, locked for this run (on rank 0, while the lock returned is open) and settled:
    never an input model; with --resume a run of this script, else new, empty or holding only the
    names of a save under way. -> the state --resume continues (None: a new run), the lock"""
    lock = None
    if rank == 0:
        for name in inputs:
            if os.path.isdir(name) and os.path.isdir(out_dir) and os.path.samefile(name, out_dir):
                common.die(f"--output-dir '{out_dir}' is the input model '{name}': training would "
                           "overwrite its weights; pass another --output-dir")
        found = sorted(set(os.listdir(out_dir)) - OURS) if os.path.isdir(out_dir) else []
        if not a.resume and found:  # before .lock is made: a folder of the user's stays as it is
            method = (common.run_of(out_dir) or [None])[0]
            common.die(f"'{out_dir}' holds {', '.join(found[:3])}, which {METHOD}.py did not "
                       "write: pass a new or empty --output-dir" if not method else
                       f"'{out_dir}' already holds a run of {method}.py: pass "
                       f"{'--resume to continue it, or ' * (method == METHOD)}another --output-dir")
        lock = common.lock_run(out_dir)
        if settle(out_dir) is None and a.resume:
            common.die(f"--resume: no {os.path.join(out_dir, CKPT)}; drop --resume to start a new "
                       "run")
    if world > 1:
        torch.distributed.barrier()
    return read_resume(out_dir, a, device) if a.resume else None, lock


def settle(run_dir, state=None):
    """What a kill left, decided by the save ids (holding the lock): a .best.new that checkpoint.pt
    names was committed: checked, it takes best/'s place; any other goes, as do .best.old and the
    .tmp files; dev.jsonl is rewritten from the checkpoint; a best/ that is not the save it names
    is one line. state: checkpoint.pt's, when the caller has it. -> it (None: no checkpoint)"""
    at, ours = functools.partial(os.path.join, run_dir), state is not None  # ours: just written
    for name in OURS - {common.LOCK}:  # our names, of the kind we write
        if os.path.lexists(at(name)) and os.path.isdir(at(name)) != (name in (NEW, OLD)):
            common.die(f"'{at(name)}' is not the {'folder' if name in (NEW, OLD) else 'file'} "
                       f"{METHOD}.py writes there: delete it, then run again")
    if state is None and os.path.lexists(at(CKPT)):
        state = read_checkpoint(run_dir)
    save = state and state["save"]
    try:
        if save and common.save_id(at(NEW)) == save:  # committed, not yet in place: roll forward
            if not ours:  # a leftover: checked before it is used
                check_run(at(NEW), read_meta(at(NEW)))
            with common.folder_lock(run_dir, "EX"):  # a reader of best/ is never inside a swap
                common.pause()
                if os.path.isdir(at(BEST)):
                    os.replace(at(BEST), at(OLD))
                    common.pause()
                os.replace(at(NEW), at(BEST))
                common.fsync(run_dir)
                common.pause()
        for name in (NEW, OLD):  # a save never committed; the best model replaced
            if os.path.isdir(at(name)):
                shutil.rmtree(at(name))
        for name in (CKPT + ".tmp", CURVE + ".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(at(name))
        view = "".join(json.dumps(e) + "\n" for e in state["curve"]).encode() if state else b""
        if state and (not os.path.isfile(at(CURVE)) or open(at(CURVE), "rb").read() != view):
            common.write_whole(at(CURVE), lambda f: f.write(view), common.pause)
    except OSError as e:
        common.die(f"cannot settle the run folder '{run_dir}' ({e.strerror}: {e.filename}): free "
                   "disk space or make it writable, then run again")
    if save and common.save_id(at(BEST)) != save:
        common.die(f"{os.path.join(at(BEST), common.META)} does not name the save {save} that "
                   f"{at(CKPT)} names (missing, damaged or another save's): {RECOPY}")
    return state


@contextlib.contextmanager
def reading(run_dir):
    """A reader of a run folder (eval_sts.py, the analyses, --distill): settled if no run holds it
    (a run settles its own saves); best/ never swapped while the reader is inside. -> best/"""
    with contextlib.suppress(OSError), open(os.path.join(run_dir, common.LOCK), "a+") as lock:
        if common.flock(lock, "EX", "NB"):
            settle(run_dir)
    with common.folder_lock(run_dir, "SH"):
        yield os.path.join(run_dir, BEST)


def read_checkpoint(run_dir, device="cpu"):
    """RUN_DIR/checkpoint.pt of a run of this script, every field of its type, or one line naming
    the field. -> the state"""
    path = os.path.join(run_dir, CKPT)
    try:
        state = torch.load(path, map_location=device, weights_only=False, mmap=True)
    except Exception as e:  # truncated, empty, not a torch file: torch raises many types
        common.die(f"{path} cannot be read ({type(e).__name__}); it is damaged: {RECOPY}")
    if not isinstance(state, dict) or state.get("method") != METHOD:
        common.die(f"{path} was not written by {METHOD}.py: pass a run folder of {METHOD}.py")
    if "save" not in state and "step" in state:
        common.die(f"{path} predates best/ (an earlier {METHOD}.py's run): eval_sts.py reads it, "
                   f"the {METHOD}.py that wrote it resumes it")
    number = lambda v: isinstance(v, (int, float))  # noqa: E731
    ok = {"model": lambda v: isinstance(v, dict) and all(map(torch.is_tensor, v.values())),
          "opt": lambda v: isinstance(v, dict) and {"state", "param_groups"} <= set(v),
          "sched": lambda v: isinstance(v, dict), "meta": lambda v: isinstance(v, dict),
          "rng": lambda v: isinstance(v, (tuple, list)) and len(v) == 3 and torch.is_tensor(v[0])
          and isinstance(v[1], tuple) and isinstance(v[2], tuple),
          "args": lambda v: isinstance(v, dict) and isinstance(v.get("lr"), float),
          "step": lambda v: type(v) is int and v >= 0, "world": lambda v: type(v) is int and v > 0,
          "best": number, "save": lambda v: v is None or isinstance(v, str),
          "curve": lambda v: isinstance(v, list) and all(isinstance(e, dict) and number(
              e.get("score")) and type(e.get("step")) is int for e in v)}
    if bad := [k for k, good in ok.items() if k not in state or not good(state[k])]:
        common.die(f"{path} is damaged ({bad[0]} missing or of the wrong type): {RECOPY}")
    return state


def read_resume(out_dir, a, device):
    """--resume: checkpoint.pt, trained with this command's flags but those of RESUMABLE (each of
    its type) by as many processes (the global batch), or one line naming what differs."""
    state, now = read_checkpoint(out_dir, device), common.flags(a)
    old, world = state["args"], common.world_size()
    kind = lambda v: "number" if type(v) in (int, float) else type(v)  # noqa: E731
    if bad := [k for k in old if k in now and None not in (old[k], now[k])
               and kind(old[k]) != kind(now[k])]:
        common.die(f"--resume: {os.path.join(out_dir, CKPT)} is damaged ({bad[0]} of the wrong "
                   f"type): {RECOPY}")
    if state["world"] != world:
        common.die(f"--resume: the run was trained by {state['world']} process(es), this command "
                   f"runs {world}: resume it with torchrun --nproc_per_node {state['world']} (1: "
                   "without torchrun), so that its steps keep their global batch")
    if changed := [k for k in old if k not in RESUMABLE and old[k] != now.get(k)
                   and (k in now or old[k])]:  # a flag now gone: ignored where it was off
        said = lambda v: ", ".join(f"--{k.replace('_', '-')} {v(k)}" for k in changed)  # noqa
        common.die(f"--resume: the run was started with {said(old.get)}, this command says "
                   f"{said(now.get)}: resume with the run's own settings")
    return state


def training_state(model, optimizer, scheduler, a, lr, step, meta, **extra):
    """What --resume needs to go on as the uninterrupted run would: the trained weights (not the
    frozen ones: the model files'), optimiser, schedule, flags, RNG states, step, extra (the
    method's own generators), and the model's description (meta); save_step adds the record."""
    return {"model": {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()
                      if v.requires_grad},
            "opt": optimizer.state_dict(), "sched": scheduler.state_dict(), "method": METHOD,
            "meta": meta, "args": {**common.flags(a), "lr": lr}, "step": step,
            "world": common.world_size(), "rng": common.rng_states(),
            **{k: v.get_state() for k, v in extra.items()}}


def restore(state, model, optimizer, scheduler, lr, log, **generators):
    """--resume: the trained weights, optimiser, schedule, RNG states (generators: the method's)
    of the saved step; the rate over this command's schedule (a larger --max-steps stretches it,
    as HF Trainer does), a new --lr from that step on. -> (step, the run's record: 0, none new)"""
    if state is None:
        return 0, {"best": -math.inf, "save": None, "curve": []}
    if bad := [k for k in generators if not torch.is_tensor(state.get(k))]:
        common.die(f"--resume: {CKPT} is damaged ({bad[0]} missing or of the wrong type): {RECOPY}")
    trained = {k for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad}
    try:
        if set(state["model"]) != trained:  # the trained weights, no more, no fewer
            raise KeyError(sorted(set(state["model"]) ^ trained)[0])
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["opt"])
        scheduler.load_state_dict(state["sched"])
        for k, g in generators.items():  # (the method's own, e.g. JTCSE's R)
            g.set_state(state[k].cpu())
    except (KeyError, RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
        common.die(f"--resume: the checkpoint does not fit the model and settings of this command "
                   f"({type(e).__name__}: {common.first_line(e)}): pass the --output-dir of a run "
                   "of this model and settings")
    common.set_rng_states(state["rng"])
    for g in optimizer.param_groups:  # the rate over this command's schedule
        g["initial_lr"], g["lr"] = lr, lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    if lr != state["args"]["lr"]:  # a new --lr from the resumed step on
        log(f"--lr {lr:g} replaces the run's {state['args']['lr']:g} from step {state['step']} on")
    return state["step"], {k: state[k] for k in ("best", "save", "curve")}


def save_step(out_dir, run, step, metric, dev, state, write, log):
    """Rank 0, after an evaluation (dev: its score) or at a stop (dev None): the training state and
    the run's record (best score, its save's id, dev curve) replace checkpoint.pt, the commit; a
    new best is first written whole into .best.new (write(folder), its sentemb.json: state["meta"],
    step, score, save id), put in place after (settle). -> the run's record; a failure: one line"""
    if dev is not None and not math.isfinite(dev):  # never a silent NaN: saved, then one line
        save_step(out_dir, run, step, metric, None, state, write, log)
        common.die(f"the {metric} at step {step} is {dev}: undefined for this model's embeddings "
                   f"(all alike?); the training state is saved in {out_dir}")
    if not all(bool(torch.isfinite(v).all()) for v in state["model"].values()):
        common.die(f"the weights are no longer finite: not saved; {out_dir} holds the last good "
                   "step: resume from it with a lower --lr (--resume --lr ...)")
    new, new_best = os.path.join(out_dir, NEW), dev is not None and dev > run["best"]
    if dev is not None:
        run = {**run, "curve": run["curve"] + [{"step": step, "metric": metric, "score": dev}]}
    if new_best:
        run = {**run, "best": dev, "save": f"{step}-{os.urandom(4).hex()}"}
    state = {**state, **run}
    try:
        if new_best:
            os.makedirs(new)
            write(new)
            with open(os.path.join(new, common.META), "w") as f:
                json.dump({**state["meta"], "save": run["save"], "step": step, metric: dev}, f,
                          indent=2)
            common.sync_tree(new)  # on disk before the commit names it
        common.write_whole(os.path.join(out_dir, CKPT), lambda f: torch.save(state, f),
                           common.pause)  # the commit point
    except Exception as e:  # OSError; torch's and safetensors' writers on a full disk
        shutil.rmtree(new, ignore_errors=True)
        common.save_failed(e, out_dir)
    settle(out_dir, state)
    if dev is not None:
        log(f"step {step:>5}  {metric} {dev:.2f}  (best {run['best']:.2f})")
    return run


def read_meta(folder):
    """A model folder's sentemb.json, a run description of this script, or one line."""
    path = os.path.join(folder, common.META)
    meta = common.read_json(path, f"cannot load '{folder}'", RECOPY)
    if meta.get("method") != METHOD:
        common.die(f"{path} is not a run description of {METHOD}.py (method "
                   f"{meta.get('method')!r}): {RECOPY}")
    return meta


def final_table(out_dir, data, tasks, device, bf16, best):
    """The best model on the test sets, loaded as eval_sts.py loads it."""
    folder = os.path.join(out_dir, BEST)
    meta = read_meta(folder)
    check_run(folder, meta)
    encode = load_encoder(folder, meta, device)
    print(f"the best checkpoint (dev {best:.2f}) on the test sets:")
    with common.autocast(device, bf16):
        print(common.format_table(common.evaluate(encode, data, tasks)))


if __name__ == "__main__":
    main()
