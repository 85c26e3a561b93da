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
import csv
import functools
import io
import json
import math
import os
import random
import shutil
import signal
import sys
import time
import warnings

import numpy as np
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


def finite(text):
    """float(text), refusing nan and inf as ValueError."""
    if not math.isfinite(v := float(text)):
        raise ValueError(text)
    return v


def read_csv(path):
    """bellm.py's --train: NLI triplets (sent0, sent1, hard_neg) or C-STS rows (sentence1,
    sentence2, condition, label); an empty or missing cell is a bad input naming its line."""
    text = common.read_text(path)  # UTF-8; a spreadsheet's byte-order mark is dropped
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))  # a field as long as the file
    reader = csv.DictReader(io.StringIO(text))
    cols = set(reader.fieldnames or [])
    if {"sent0", "sent1", "hard_neg"} <= cols:
        kind, need = "nli", ("sent0", "sent1", "hard_neg")
    elif {"sentence1", "sentence2", "condition", "label"} <= cols:
        kind, need = "csts", ("sentence1", "sentence2", "condition", "label")
    else:
        has = ",".join(sorted(cols)) or "no header"
        common.die(f"'{path}' needs the columns sent0,sent1,hard_neg (NLI triplets) or sentence1,"
                   f"sentence2,condition,label (C-STS); it has {has}")
    rows = []
    for r in reader:
        if missing := [c for c in need if not (r[c] or "").strip()]:  # short rows give None
            common.die(f"'{path}', line {reader.line_num}: no {', '.join(missing)}: fill in or "
                       "delete the row")
        try:
            rows.append(tuple(r[c] for c in need[:-1]) + (finite(r["label"]),)
                        if kind == "csts" else tuple(r[c] for c in need))
        except ValueError:
            common.die(f"'{path}', line {reader.line_num}: label {r['label']!r} is not a number; "
                       "C-STS labels are 1-5")
    if not rows:
        common.die(f"'{path}' has a header but no rows: pass a --train file with data")
    return kind, rows


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
# adapter_config.json: what bellm.py trains (plain LoRA on every Linear); any other value of these
# would run another model than the one trained
LORA_FIXED = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "bias": "none",
              "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
              "modules_to_save": None, "layers_to_transform": None, "layer_replication": None,
              "lora_bias": False, "trainable_token_indices": None, "target_parameters": None}


def check_run(run_dir, meta):
    """A run folder of this script is the model its files describe, or one line naming the file and
    the value: sentemb.json's keys of their types; the adapter's files whole; every value within
    the base model's limits; adapter_config.json as bellm.py trains (eval_sts.py and --resume
    call it). That the adapter's weights fit the base is checked when it loads (load_adapter)."""
    path, where = os.path.join(run_dir, common.META), f"cannot load the bellm.py run in '{run_dir}'"
    check_keys(path, meta, META_TYPES, META_OPTIONAL)
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
    lora_path = os.path.join(run_dir, "adapter_config.json")
    lora = common.read_json(lora_path, where, RECOPY)
    ok = {"r": lambda v: type(v) is int and v >= 1,
          "lora_alpha": lambda v: type(v) in (int, float) and v > 0,
          **{k: (lambda x, v=v: x == v or x is None and not v) for k, v in LORA_FIXED.items()}}
    for key, good in ok.items():
        if key in lora and not good(lora[key]):
            want = "an integer >= 1" if key == "r" else "a number > 0" if key == "lora_alpha" \
                else json.dumps(LORA_FIXED[key])
            common.die(f"{lora_path}: {key} {json.dumps(lora[key])} is not what bellm.py trains "
                       f"({key} {want}): set it so, or {RECOPY}")
    for key, ours in (("lora_r", "r"), ("lora_alpha", "lora_alpha")):
        if key in meta and lora.get(ours) != meta[key]:
            common.die(f"{lora_path}: {ours} {json.dumps(lora.get(ours))} disagrees with {path}'s "
                       f"{key} {meta[key]} (bellm.py --{key.replace('_', '-')}): set it to "
                       f"{meta[key]}, or {RECOPY}")


def described(state):
    """The sentemb.json values that a checkpoint's flags give (the harness's check_agree)."""
    a = state["args"]
    return {**{k: a[k] for k in ("bi_layers", "bi_mode", "bi_strategy", "prompt", "lora_r",
                                 "lora_alpha", "dtype")},
            **{k: state.get(k) for k in ("base_checksum", "base_fingerprint")}}


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


# ---------------------------------------------------------------- memory (the start-up line) ------
def memory_estimate(dec, n_lora, s, tokens, longest, r, grad_ckpt):
    """GiB of one training step, estimated from the config: (weights, LoRA + gradients + AdamW
    moments in fp32, activations kept for the backward). Activations, bytes a token a layer
    (counted with saved-tensor hooks on LLaMA configs; RMSNorm and the LoRA path keep fp32 copies,
    so bf16 does not halve them): A = α·H + β·I + 28·r + heads·L·(4 or 6), α = 68 / 62 and
    β = 20 / 14 for fp32 / bf16 (s = 4 / 2 bytes). With checkpointing: each layer keeps only its
    input (s·H) and one layer is recomputed at a time."""
    c, n = dec.config, len(dec.layers) + len(getattr(dec, "bellm_added", []))
    A = (68 if s == 4 else 62) * c.hidden_size + (20 if s == 4 else 14) * c.intermediate_size \
        + 28 * r + c.num_attention_heads * longest * (4 if s == 4 else 6)
    act = tokens * (n * s * c.hidden_size + A if grad_ckpt else n * A)
    weights = sum(q.numel() * q.element_size() for q in dec.parameters() if not q.requires_grad)
    return weights / 2**30, 16 * n_lora / 2**30, act / 2**30


def memory_line(dec, params, r, texts, longest, bf16, grad_ckpt):
    """The start-up line: a step's memory, estimated (docs/operations.md); bf16: bf16 weights or
    autocast (2 bytes a value, mostly)."""
    s, n = 2 if bf16 else 4, sum(q.numel() for q in params)
    est = [memory_estimate(dec, n, s, texts * longest, longest, r, c) for c in (0, 1)]
    per_tok = [e[2] * 2**20 / (texts * longest) for e in est]  # KiB a token
    w, o, act = est[grad_ckpt]
    return (f"memory (estimate): weights {w:.2f} GiB, LoRA + AdamW {o:.2f} GiB, activations "
            f"{per_tok[0]:,.0f} KiB a token ({per_tok[1]:,.0f} with --grad-ckpt): {act:.2f} GiB "
            f"for {texts} x {longest} tokens {'with' if grad_ckpt else 'without'} checkpointing; "
            f"{w + o + act:.2f} GiB in all")


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
    if a.csts and (not os.path.isfile(a.csts) or read_csv(a.csts)[0] != "csts"):
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
    rank, world, device, log = start()
    tasks = check_args(a, world)

    # data: NLI triplets (or C-STS pairs); every step's rows drawn from the seed
    kind, rows = read_csv(common.train_file(a.train, "nli_for_simcse.csv"))
    csts_dev = read_csv(a.csts)[1] if a.csts else None  # C-STS dev selects the checkpoint
    check_data(a, kind, csts_dev is not None)
    data = common.check_sts(common.senteval_dir(a.data_dir), tasks if a.final_eval else [])
    metric = "csts_dev" if csts_dev else "stsb_dev"
    per_step = a.batch_size * world * a.grad_accum  # rows a step, all ranks together
    steps = step_rows(len(rows), per_step, a.epochs, a.max_steps, a.seed)

    # the run folder, locked; --resume: its training state, trained as this command says
    out = a.output_dir
    new_run, lock = open_run(out, [a.model], a.resume, rank, world)  # lock: held till exit
    state = read_resume(out, a, device)  # None: a new run
    if state and state["step"] >= len(steps):  # nothing is wrong, nothing is left: exit 0
        return log(complete(state["step"], len(steps), out))
    curve = resumed_curve(out, state["step"]) if state and rank == 0 else []
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
    model = ddp(raw_model, world)  # DDP: the LoRA weights' gradients averaged over the ranks
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
    step, best = restore(state, raw_model, optimizer, scheduler, lr, log) if state else \
        (0, -math.inf)
    check_base(meta, state or {}, a.model, CKPT)
    log(f"{a.model}: {len(dec.layers)} layers, K={a.bi_layers} {a.bi_mode}/{a.bi_strategy}, "
        f"{sum(q.numel() for q in params):,} LoRA parameters, {len(rows)} {kind} rows, "
        f"{len(steps)} steps of {per_step} rows, lr {lr:g}, "
        f"{common.device_line(world, device, a.bf16)}")
    log(memory_line(dec, params, a.lora_r, a.batch_size * (3 if kind == "nli" else 2), longest,
                    dtype == torch.bfloat16 or bf16, grad_ckpt))

    handlers = catch_signals()  # SIGINT, SIGTERM: stop at the next step, saved
    raw_model.train()
    clock = common.new_clock(step)  # the step lines' speed
    for step in range(step + 1 if state else 0, len(steps) + 1):  # 0: the model as loaded
        if step > 0:  # optimisation step `step`: grad_accum micro-batches of B rows per rank
            optimizer.zero_grad(set_to_none=True)
            with common.metered(clock, forward):  # the step's FLOPs
                for ids, last in micro_batches(steps[step - 1], a.batch_size, a.grad_accum, rank,
                                               world):
                    with no_sync(model, last):
                        loss, n = train_step(forward, tokenizer, [rows[i] for i in ids], kind,
                                             a.prompt, device, a.temp, a.max_len, bf16, world,
                                             a.grad_accum, common.gather)
                    clock["tokens"] += n  # real ones
                    check_loss(loss, step, lr, out)
            gnorm = common.clip_gradients(params, a.max_grad_norm)  # before clipping: gnorm
            optimizer.step()
            scheduler.step()
            if step % a.log_steps == 0 or step == len(steps):
                log(f"step {step:>5}  loss {loss.item():.4f}  gnorm {gnorm:.3g}  lr "
                    f"{scheduler.get_last_lr()[0]:.2e}  "
                    f"{common.rates(clock, step, per_step, 'rows', world, device)}")
                clock = common.new_clock(step, clock)
        halt = stop_requested(world, device)  # a signal on any rank: every rank stops here
        evaluate = step % a.eval_steps == 0 and (step or a.eval_first) or step == len(steps)
        if (evaluate or halt) and rank == 0:  # the state; with a new best dev score, the model
            dev = dev_eval(raw_model, dev_score, encode, data, csts_dev) if evaluate else None
            state = training_state(raw_model, optimizer, scheduler, a, lr, step, **{
                k: meta[k] for k in ("base_checksum", "base_fingerprint")})
            curve, best = save_step(out, curve, step, metric, dev, best, state, meta,
                                    lora.save_pretrained, new_run, log)
            new_run = None
        if evaluate or halt:
            clock = saved(world, step, clock)
        if halt:
            break

    log(common.peak_memory(device, world))
    if STOP["signum"]:  # saved at this step: exit 128 + the signal's number
        sys.exit(stopped(step, out, log))
    STOP["now"] = True  # training has ended: a signal now exits at once
    if a.final_eval and rank == 0:  # the best checkpoint, loaded as eval_sts.py loads it
        final_table(out, data, tasks, device, a.bf16, best)
    restore_signals(handlers)


# ---------------------------------------------------------------- the harness ---------------------
# What a run needs to lose nothing, the same text in sscl.py, jtcse.py and bellm.py but for this
# table (test_all.py holds them equal); a reader who copies the method leaves it behind.
METHOD = "bellm"  # this script: the "method" of its sentemb.json and checkpoint.pt
RESUMABLE = {"resume", "lr", "epochs", "max_steps", "eval_steps", "log_steps", "final_eval",
             "data_dir", "output_dir", "bf16", "compile", "quiet", "length_grouping", "tasks",
             "eval_first", "grad_ckpt"}  # --resume may change
# ---- (the table ends here)
# A run folder holds the best model (its files + sentemb.json), checkpoint.pt (the training state,
# for --resume) and dev.jsonl (the dev curve). Every write is atomic: a kill, a full disk or a power
# cut at any instant leaves the old version or the new one. One process at a time writes a folder
# (flock on .lock).
CKPT, CURVE, STAGING, PENDING, LOCK = ("checkpoint.pt", "dev.jsonl", ".best.staging",
                                       ".best.pending", ".lock")
RECOPY = "copy the whole run folder again, or train again"
EARLIER = {"weight_decay": 0.01, "max_grad_norm": 0.0, "warmup_steps": 0}  # the update of runs
# saved before these flags: torch's AdamW defaults, unclipped, no warm-up
STOP = {"signum": 0, "now": False, "writes": 0}  # SIGINT/SIGTERM: stop at the next step, saved


def start():
    """One process, or one of torchrun's (NCCL on GPUs, gloo on CPUs). -> rank, world size, device,
    log (print on rank 0, flushed; nothing on the other ranks)."""
    STOP.update(signum=0, now=False, writes=0)
    rank, world, device = 0, 1, common.pick_device()
    if "RANK" in os.environ:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
    log = functools.partial(print, flush=True) if rank == 0 else lambda *_, **__: None
    return rank, world, device, log


def catch_signals():
    """SIGINT (Ctrl-C) and SIGTERM stop training at the next step, saved; a second one, or one
    after training, exits at once. -> the handlers replaced (restore_signals puts them back)."""
    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def on_signal(signum, frame):
    if STOP["signum"] or STOP["now"]:  # a second signal, or none is needed: out at once
        os.write(2, f"\n{signal.Signals(signum).name}: stopped\n".encode())
        os._exit(128 + signum)
    STOP["signum"] = signum
    os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step (again: at "
             "once)\n".encode())


def restore_signals(handlers):
    for s, h in handlers.items():
        signal.signal(s, h)


def stop_requested(world, device):
    """Whether a signal asked training to stop; with torchrun, a signal on any rank stops every rank
    at the same step."""
    if world > 1:
        t = torch.tensor(STOP["signum"], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        STOP["signum"] = int(t)
    return bool(STOP["signum"])


def ddp(model, world):
    """The model as training runs it: wrapped by DDP under torchrun (gradients averaged over the
    ranks), itself on one process."""
    return torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model


def micro_batches(rows, batch_size, grad_accum, rank, world):
    """One optimisation step's rows (every rank's micro-batches) -> this rank's grad_accum
    micro-batches, each as (rows, whether it is the step's last: DDP all-reduces after it)."""
    return [(rows[(k * world + rank) * batch_size:][:batch_size], k == grad_accum - 1)
            for k in range(grad_accum)]


def no_sync(model, last):
    """DDP all-reduces the gradients only after a step's last micro-batch."""
    return contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()


def check_loss(loss, step, lr, out_dir):
    """The NaN guard, before the optimiser step: the weights saved are still good."""
    if not torch.isfinite(loss):
        common.die(f"loss became {loss.item()} at step {step}: resume with a lower --lr (now "
                   f"{lr:g}; --resume --lr ...) or check the data; the run in {out_dir} is kept")


def dev_eval(model, score, *args):
    """score(*args) with the model in eval mode (no dropout), then back in training mode."""
    model.eval()
    try:
        return score(*args)
    finally:
        model.train()


def open_run(out_dir, inputs, resume, rank, world):
    """The run folder, on rank 0: never one of the input models; with --resume a run of this script
    with its checkpoint, else new, empty or left by a run that saved nothing; writable; locked for
    as long as the lock returned is open; a save that a kill cut short completed. -> (the folder's
    entries before this run and whether it made the folder: a first save that fails restores
    them; None with --resume), the lock"""
    new_run, lock = None, None
    if rank == 0:
        for name in inputs:
            if os.path.isdir(name) and os.path.isdir(out_dir) and os.path.samefile(name, out_dir):
                common.die(f"--output-dir '{out_dir}' is the input model '{name}': training would "
                           "overwrite its weights; pass another --output-dir")
        if not resume:  # before anything is written into it
            check_new_run(out_dir)
            new_run = (set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set(),
                       not os.path.isdir(out_dir))
        try:
            os.makedirs(out_dir, exist_ok=True)
            open(os.path.join(out_dir, ".write_test"), "w").close()
            os.remove(os.path.join(out_dir, ".write_test"))
        except OSError as e:
            common.die(f"cannot write to output folder '{out_dir}' ({e.strerror}): pass a writable "
                       "--output-dir")
        lock = take_lock(out_dir)
        finish_save(out_dir)
        if not resume:  # again, now that a save cut short is completed
            check_new_run(out_dir)
        elif not os.path.isfile(os.path.join(out_dir, CKPT)):
            common.die(f"--resume: no {os.path.join(out_dir, CKPT)}; drop --resume to start a new "
                       "run")
    if world > 1:
        torch.distributed.barrier()
    return new_run, lock


def take_lock(out_dir):
    """An exclusive lock on OUT_DIR/.lock (holding this process's pid), which the kernel drops when
    the file is closed or the process ends, however it ends. -> the open lock file"""
    try:
        lock = open(os.path.join(out_dir, LOCK), "a+")
    except OSError as e:  # e.g. a folder of that name
        common.die(f"cannot open {os.path.join(out_dir, LOCK)} ({e.strerror}): delete it (it only "
                   "holds the pid of the run that writes the folder) and run again")
    try:
        import fcntl
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # Windows: no lock
        pass
    except OSError:
        common.die(f"'{out_dir}' is in use by another training run (pid "
                   f"{open(os.path.join(out_dir, LOCK)).read().strip() or '?'}): wait for it to "
                   "end, or pass another --output-dir")
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def check_new_run(out_dir):
    """A new run writes into a folder that is new, empty, or left by a run that saved nothing (its
    .lock, dev.jsonl, a save cut short): never over a run, nor over any file it did not write."""
    if not os.path.isdir(out_dir):
        return
    found = sorted(set(os.listdir(out_dir)) - {LOCK, CURVE, STAGING, PENDING, CKPT + ".tmp",
                                                CURVE + ".tmp"})
    if common.META in found or CKPT in found:
        method = method_in(out_dir)
        what = f"a run of {method}.py" if method else "a run"
        common.die(f"'{out_dir}' already holds {what}: pass "
                   f"{'--resume to continue it, or ' * (method == METHOD)}another --output-dir")
    if found:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        common.die(f"'{out_dir}' holds {found[0]}{more}, which {METHOD}.py did not write: pass a "
                   "new or empty --output-dir")


def method_in(run_dir):
    """The script whose run a folder holds, as its sentemb.json says, else its checkpoint.pt (None:
    neither says)."""
    with contextlib.suppress(Exception):
        with open(os.path.join(run_dir, common.META)) as f:
            return json.load(f)["method"]
    with contextlib.suppress(Exception):
        return torch.load(os.path.join(run_dir, CKPT), map_location="cpu", weights_only=False,
                          mmap=True)["method"]


def read_resume(out_dir, a, device):
    """--resume: the checkpoint of a run of this script trained with this command's settings (a
    flag the run predates had its default; those in RESUMABLE may change), and, once it has saved
    a best model, that model whole and described as trained (check_run, check_agree). -> its
    training state; None for a new run"""
    if not a.resume:
        return None
    state = read_checkpoint(out_dir, "--resume", "start again without --resume in another "
                            "--output-dir", device)
    now = {k: os.path.abspath(v) if isinstance(v, str) and os.path.exists(v) else v
           for k, v in vars(a).items()}
    old = state["args"]  # with the defaults of flags the run predates
    kind = lambda v: "number" if type(v) in (int, float) else type(v)  # noqa: E731
    ok = {"opt": lambda v: isinstance(v, dict) and {"state", "param_groups"} <= set(v),
          "rng": lambda v: isinstance(v, (tuple, list)) and len(v) == 3 and torch.is_tensor(v[0])
          and isinstance(v[1], tuple) and isinstance(v[2], tuple),
          "sched": lambda v: isinstance(v, dict), "world": lambda v: type(v) is int and v >= 1,
          **{k: lambda v, k=k: None in (v, now[k]) or kind(v) == kind(now[k])
             for k in old if k in now}}  # each flag of the type this command's has
    fields = {**{k: state[k] for k in ("opt", "rng", "sched", "world") if k in state}, **old}
    if bad := [k for k, v in fields.items() if k in ok and not ok[k](v)]:
        common.die(f"--resume: {os.path.join(out_dir, CKPT)} is damaged ({bad[0]} of the wrong "
                   f"type; not the training state {METHOD}.py writes): {RECOPY}")
    if state.get("world", world := common.world_size()) != world:  # the global batch's rows
        common.die(f"--resume: the run was trained by {state['world']} process(es), this command "
                   f"runs {world}: resume it with torchrun --nproc_per_node {state['world']} (1: "
                   "without torchrun), so that its steps keep their global batch")
    if changed := [k for k in old if k not in RESUMABLE and old[k] != now.get(k)
                   and (k in now or old[k])]:  # a flag now gone: ignored where it was off
        flag = lambda k, v: f"--{k.replace('_', '-')} {v}" + (  # noqa: E731
            " (its default: the run predates the flag)" * (k in state["predates"]))
        common.die("--resume: the run was started with "
                   f"{', '.join(flag(k, old[k]) for k in changed)}, this command says "
                   f"{', '.join(flag(k, now.get(k)) for k in changed)}: resume with the run's own "
                   "settings")
    if state["best"] > -float("inf"):
        if (meta := read_meta(out_dir)) is None:
            common.die(f"--resume: {os.path.join(out_dir, common.META)} is missing, but the run "
                       f"has saved a best model: {RECOPY}")
        check_run(out_dir, meta)
        check_agree(out_dir, state, meta)
    return state


def read_checkpoint(run_dir, why, fix, device="cpu", mmap=False):
    """RUN_DIR/checkpoint.pt of a run of this script: the training state, its args completed with
    the defaults of the flags the run predates (their names: state["predates"]), its trained
    weights under "model" (older runs: "encoder", "trainable"); one line when it is damaged or
    another script's. why: who reads it (--resume, eval_sts.py); fix: the way out."""
    path = os.path.join(run_dir, CKPT)
    try:
        state = torch.load(path, map_location=device, weights_only=False, mmap=mmap)
    except Exception as e:  # truncated, empty, not a torch file: torch raises many types
        common.die(f"{why}: {path} cannot be read ({type(e).__name__}); it is damaged: {fix}")
    if not isinstance(state, dict) or state.get("method", METHOD) != METHOD:
        common.die(f"{why}: {path} was not written by {METHOD}.py: {fix}")
    for old in ("encoder", "trainable"):  # the key of the trained weights in older checkpoints
        if old in state and "model" not in state:
            state["model"] = state.pop(old)
    ok = {"model": lambda v: isinstance(v, (dict, list)),
          "args": lambda v: isinstance(v, dict) and isinstance(v.get("lr"), float),
          "step": lambda v: type(v) is int and v >= 0,
          "best": lambda v: isinstance(v, (int, float)) and type(v) is not bool}
    if bad := [k for k in ("model", "opt", "rng", "args", "step", "best")
               if k not in state or not ok.get(k, lambda v: True)(state[k])]:
        common.die(f"{why}: {path} is damaged ({', '.join(bad)} missing or of the wrong type; not "
                   f"the training state {METHOD}.py writes): {fix}")
    defaults = {x.dest: x.default for x in p._actions if x.dest != "help"}
    state["predates"] = [k for k in defaults if k not in state["args"]]
    state["args"] = {**defaults, **{k: v for k, v in EARLIER.items() if k in defaults},
                     **state["args"]}
    return state


def check_agree(run_dir, state, meta):
    """A run folder's training state (checkpoint.pt) and its best model's description (sentemb.json)
    are of one run: every setting both hold is the same (described: the values a checkpoint's
    flags give sentemb.json), or one line naming both files."""
    for key, want in described(state).items():
        if key in meta and want is not None and meta[key] != want:
            common.die(f"'{run_dir}': {CKPT} was trained with {key} {json.dumps(want)} and "
                       f"{common.META} describes {key} {json.dumps(meta[key])}: the two files "
                       f"are of different runs; {RECOPY}")


def resumed_curve(out_dir, step):
    """The dev curve up to the resumed step: a kill may have cut the save after a step's curve, so
    the entries after it go (they are evaluated again)."""
    entries = read_curve(out_dir)
    curve = [e for e in entries if e["step"] <= step]
    if len(curve) < len(entries):
        write_curve(out_dir, curve)
    return curve


def complete(step, steps, out_dir):
    """--resume of a run with nothing left to train (exit 0, the folder untouched): what to do."""
    return (f"the run is complete (step {step} of {steps}): nothing to train in '{out_dir}'; "
            f"evaluate it with eval_sts.py --model {out_dir}, or pass a larger --max-steps or "
            "--epochs with --resume to train on")


def training_state(model, optimizer, scheduler, a, lr, step, **extra):
    """What --resume needs to go on as the uninterrupted run would: the trained weights (not the
    frozen ones, which come from the model files), the optimiser and schedule, the flags, the
    random-number states, the step, and extra (the method's own: values, random-number generators);
    save_step adds the best dev score so far."""
    return {"model": {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()
                      if v.requires_grad},
            "opt": optimizer.state_dict(), "sched": scheduler.state_dict(), "method": METHOD,
            "args": {**{k: os.path.abspath(v) if isinstance(v, str) and os.path.exists(v) else v
                        for k, v in vars(a).items()}, "lr": lr},
            "step": step, "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()),
            "world": common.world_size(),
            **{k: v.get_state() if isinstance(v, torch.Generator) else v for k, v in extra.items()}}


def restore(state, model, optimizer, scheduler, lr, log, **generators):
    """--resume: the trained weights, optimiser, schedule and random-number states of the saved
    step (generators: the method's own, as training_state saved them); a new --lr applies from
    that step on (logged). -> (step, best dev score so far)"""
    trained = [k for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad]
    try:
        saved = state["model"]
        if isinstance(saved, list):  # bellm.py's older checkpoints: the trained tensors in order
            saved = dict(zip(trained, saved, strict=True))
        missing, unexpected = model.load_state_dict(saved, strict=False)
        if unexpected or set(missing) & set(trained):
            raise KeyError((unexpected or sorted(set(missing) & set(trained)))[0])
        optimizer.load_state_dict(state["opt"])
        if "sched" in state:  # (jtcse.py's older checkpoints: none, a constant rate)
            scheduler.load_state_dict(state["sched"])
    except (KeyError, RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
        common.die(f"--resume: the checkpoint does not fit the model and settings of this command "
                   f"({type(e).__name__}): pass the --output-dir of a run of this model and "
                   "settings")
    torch.set_rng_state(state["rng"][0].cpu())  # map_location put it on the device
    random.setstate(state["rng"][1])
    np.random.set_state(state["rng"][2])
    for k, g in generators.items():
        if not torch.is_tensor(state.get(k)):  # (the method's own, e.g. JTCSE's R)
            common.die(f"--resume: {CKPT} is damaged ({k} missing or of the wrong type): {RECOPY}")
        g.set_state(state[k].cpu())
    for g in optimizer.param_groups:  # the rate over this command's schedule: a larger
        g["initial_lr"], g["lr"] = lr, lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)  # --max-steps stretches it (HF's way)
    if lr != state["args"]["lr"]:  # a new --lr from the resumed step on
        log(f"--lr {lr:g} replaces the run's {state['args']['lr']:g} from step {state['step']} on")
    return state["step"], state["best"]


def save_step(out_dir, curve, step, metric, dev, best, state, meta, write, new_run, log):
    """Rank 0, after an evaluation (dev: its score) or at a stop between evaluations (dev None):
    dev.jsonl with the step's score; then the training state, with a new best dev score the model
    too (write(folder) saves it; meta: its sentemb.json, with the step and its score) as one save
    (save_best), else alone. Weights no longer finite are never saved. A save that fails is one
    line (a new run leaves its folder as it found it). -> (the dev curve, the best score so far)"""
    if dev is not None and not math.isfinite(dev):  # never a silent NaN: saved, then one line
        save_step(out_dir, curve, step, metric, None, best, state, meta, write, new_run, log)
        common.die(f"the {metric} at step {step} is {dev}: undefined for this model's embeddings "
                   f"(all alike?); the training state is saved in {out_dir}")
    new_best, best = dev is not None and dev > best, max(best, -math.inf if dev is None else dev)
    if dev is not None:
        curve = curve + [{"step": step, "metric": metric, "score": dev}]
        try:  # dev.jsonl, rewritten whole before the save of that step
            write_curve(out_dir, curve)
        except OSError as e:
            save_failed(os.path.join(out_dir, CURVE), e, out_dir, new_run)
    if not all(bool(torch.isfinite(v).all()) for v in state["model"].values()):
        common.die(f"the weights are no longer finite: not saved; {out_dir} holds the last good "
                   "step: resume from it with a lower --lr (--resume --lr ...)")
    state = {**state, "best": best}
    try:
        if new_best:
            save_best(out_dir, write, state, {**meta, "step": step, metric: dev})
        else:  # the training state alone, replaced whole
            common.write_whole(os.path.join(out_dir, CKPT), lambda f: torch.save(state, f), pause)
    except Exception as e:  # OSError; torch's and safetensors' writers on a full disk
        save_failed(f"the best model in {out_dir}" if new_best else os.path.join(out_dir, CKPT),
                    e, out_dir, new_run)
    if dev is not None:
        log(f"step {step:>5}  {metric} {dev:.2f}  (best {best:.2f})")
    return curve, best


def saved(world, step, clock):
    """Every rank waits for rank 0's save. -> the clock, restarted after it"""
    if world > 1:
        torch.distributed.barrier()
    return common.new_clock(step, clock)


def stopped(step, out_dir, log):
    """Training stopped by a signal, saved at this step: what to do. -> the exit code, 128 + the
    signal's number (130 for Ctrl-C, 143 for SIGTERM)"""
    log(f"stopped at step {step} ({signal.Signals(STOP['signum']).name}): the training state is "
        f"in {os.path.join(out_dir, CKPT)}; run the same command with --resume to continue")
    return 128 + STOP["signum"]


def save_best(out_dir, write, state, meta):
    """A new best model with its sentemb.json (meta) and training state, replaced as one: write()
    fills a staging folder, every file is synced, the folder is renamed to .best.pending (the
    commit point: before it a kill leaves the old save), then moved into place (finish_save)."""
    staging = os.path.join(out_dir, STAGING)
    try:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        write(staging)
        torch.save(state, os.path.join(staging, CKPT))
        with open(os.path.join(staging, common.META), "w") as f:
            json.dump(meta, f, indent=2)
        for root, _, files in os.walk(staging):
            for name in files:
                fsync(os.path.join(root, name))
                pause()
            fsync(root)
        os.replace(staging, os.path.join(out_dir, PENDING))  # the commit point
        pause()
        fsync(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finish_save(out_dir)


def finish_save(out_dir):
    """Complete a save that a kill cut short (holding the lock). Before its commit point: the
    staging folder goes, the old model stands. After it, .best.pending holds the files of the save
    not yet in place, sentemb.json the last to leave: while it holds sentemb.json, they are moved
    into place, sentemb.json last, once the others' moves are on disk; without it, the moves had
    finished, and the empty folder only goes (nothing in place is touched)."""
    shutil.rmtree(os.path.join(out_dir, STAGING), ignore_errors=True)
    for tmp in (CKPT, CURVE):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, tmp + ".tmp"))
    pending = os.path.join(out_dir, PENDING)
    if os.path.isfile(os.path.join(pending, common.META)):  # committed, not all moved
        with contextlib.suppress(FileNotFoundError):  # meanwhile the folder describes no run
            os.remove(os.path.join(out_dir, common.META))
        pause()
        files = sorted(os.path.relpath(os.path.join(root, n), pending)
                       for root, _, names in os.walk(pending) for n in names)
        for rel in [f for f in files if f != common.META] + [common.META]:
            os.makedirs(os.path.dirname(os.path.join(out_dir, rel)), exist_ok=True)
            if rel == common.META:  # the others' moves on disk first
                for root, _, _ in os.walk(out_dir):
                    fsync(root)
            os.replace(os.path.join(pending, rel), os.path.join(out_dir, rel))
            pause()
        fsync(out_dir)
    if os.path.isdir(pending):
        shutil.rmtree(pending)
        pause()


def save_failed(what, e, out_dir, new_run):
    """A save that failed (a full disk): one line; a new run leaves its folder as it found it."""
    full = getattr(e, "errno", None) == 28 or any(s in str(e) for s in (
        "unexpected pos", "file write failed", "os error 28", "No space left"))  # torch's, Rust's
    reason = "No space left on device" if full else getattr(e, "strerror", None) or str(e)
    if new_run:  # new_run: the folder's entries before the run, and whether the run made it
        for name in set(os.listdir(out_dir)) - new_run[0]:
            path = os.path.join(out_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        if new_run[1]:
            os.rmdir(out_dir)
    common.die(f"cannot save {what} ({reason}): free disk space or pass another --output-dir; "
               "what was saved before is kept, and --resume continues from it")


def pause():
    """Each instant between two writes of a save. Tests aim kills here: SENTEMB_SAVE_PAUSE=seconds
    sleeps; SENTEMB_KILL_AT=N sends SIGKILL to this process at its N-th such instant."""
    STOP["writes"] += 1
    if STOP["writes"] == int(os.environ.get("SENTEMB_KILL_AT", 0)):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("SENTEMB_SAVE_PAUSE", 0)))


def fsync(path):  # a file's data, or a folder's entries (renames), to the disk
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_curve(out_dir, curve):
    """RUN/dev.jsonl = the dev curve, one {"step", "metric", "score"} a line, replaced whole."""
    text = "".join(json.dumps(e) + "\n" for e in curve).encode()
    common.write_whole(os.path.join(out_dir, CURVE), lambda f: f.write(text), pause)


def read_curve(run_dir):
    """The entries of RUN_DIR/dev.jsonl ([] without one); a damaged line is one error line."""
    path = os.path.join(run_dir, CURVE)
    entries = []
    lines = common.read_text(path).splitlines() if os.path.isfile(path) else []
    for i, line in enumerate(lines, 1):
        try:
            e = json.loads(line)
        except ValueError:
            e = None
        if not (isinstance(e, dict) and type(e.get("step")) is int and e["step"] >= 0
                and isinstance(e.get("metric"), str) and type(e.get("score")) in (int, float)):
            common.die(f"{path} is damaged (line {i} is not "
                       '{"step": N, "metric": NAME, "score": X}): delete it to resume with the '
                       "curve restarting here, or copy the run folder again")
        entries.append(e)
    return entries


def check_keys(path, meta, required, optional):
    """sentemb.json's keys (required, and optional ones older runs lack), each of its type: one
    line naming those that are not."""
    if bad := [k for k, ok in required.items() if k not in meta or not ok(meta[k])] + [
            k for k, ok in optional.items() if k in meta and not ok(meta[k])]:
        common.die(f"{path} is not a run description of sscl.py, jtcse.py or bellm.py "
                   f"({', '.join(bad)} missing or of the wrong type): re-save the run, or delete "
                   "the file to load the folder as a plain model")


def read_meta(run_dir):
    """A run folder's sentemb.json as a dict (None: there is none), or one line saying it is not
    this script's."""
    path = os.path.join(run_dir, common.META)
    if not os.path.isfile(path):
        return None
    try:
        meta = json.loads(common.read_text(path))
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("method") != METHOD:
        said = f"method {meta.get('method')!r}" if isinstance(meta, dict) else "damaged or edited"
        common.die(f"{path} is not a run description of {METHOD}.py ({said}): re-save the run, or "
                   "delete the file to load the folder as a plain model")
    return meta


def final_table(out_dir, data, tasks, device, bf16, best):
    """The best checkpoint on the test sets, loaded as eval_sts.py loads it."""
    meta = read_meta(out_dir)
    check_run(out_dir, meta)
    encode = load_encoder(out_dir, meta, device)
    print(f"the best checkpoint (dev {best:.2f}) on the test sets:")
    with common.autocast(device, bf16):
        print(common.format_table(common.evaluate(encode, data, tasks)))


if __name__ == "__main__":
    main()
