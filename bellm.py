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
  eq. 5, h = LLM->(x) + BiLLM<->(x)           decoder_forward, BeLLM (last_token pooling)
  eq. 6, the contrastive loss; one step       bellm_loss, train_step (C-STS: cosent_loss)
  Figs. 2, 4, 5, App. A (no training)         bellm_analysis.py

  torchrun --nproc_per_node 4 bellm.py --batch-size 16 --output-dir runs/bellm_7b  # paper: 4 GPUs
  python bellm.py --model HuggingFaceTB/SmolLM2-135M-Instruct --train snli_devtest.csv --bf16 \\
      --batch-size 16 --max-len 32 --lr 5e-4 --max-steps 100 --eval-steps 50 --no-eval-first \\
      --no-final-eval --output-dir runs/bellm                      # CPU (docs/bellm.md)
"""
import argparse
import copy
import csv
import functools
import io
import json
import math
import os
import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

import common
import harness

PROMPT = 'The representative word for {sentence} is:"'  # §3.3; C-STS, §5.1:
CSTS_PROMPT = 'Given the context {condition}, summarize the sentence {sentence} in one word:"'

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
harness.add_run_flags(p, compiled="each layer")  # --seed, --log-steps, --precision, ...
p.add_argument("--eval-first", action=argparse.BooleanOptionalAction, default=True,
               help="evaluate step 0 (zero-shot); --no-eval-first saves one evaluation")
p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="the base LLM's weights "
               "(LoRA and AdamW stay float32): default on CUDA --precision's (bf16: the paper's), "
               "float32 on CPU")
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
METHOD = "bellm"  # the "method" of its sentemb.json and checkpoint.pt
RESUMABLE = harness.RESUMABLE | {"lr", "epochs", "max_steps", "eval_steps", "data_dir",
                                 "output_dir", "length_grouping", "tasks", "eval_first",
                                 "grad_ckpt"}  # --resume may change these


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


def decoder_forward(dec, input_ids, attention_mask, bi_layers, bi_mode, bi_strategy,
                    all_hidden=False):
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
        h = decoder_forward(self.dec, input_ids, attention_mask, *self.bi)  # (b, L, H)
        return last_token(h, attention_mask)


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


def train_step(model, batch, device, temp=0.05, labels=None, autocast=None, world=1, accum=1,
               gather=lambda z: z, scale=lambda loss: loss):
    """One micro-batch of B rows -> (the loss over the global batch, its real tokens); gradients
    accumulated. batch: prompted_batch's texts tokenised, on the host, 3 a row (anchor, entailment,
    contradiction: eq. 6), or with C-STS's labels (B,) 2 a row (cosent_loss). model(batch): each
    text's last-token state (N, H) (BeLLM through embed), through common.in_length_groups; autocast:
    the forward's dtype (None: fp32). torchrun: gather(z) = every rank's rows; the gradients ×
    world / accum (DDP averages them over the ranks), of scale(loss) (fp16: the GradScaler's)."""
    tokens = int(batch["attention_mask"].numpy().sum())  # real ones, on the host (numpy's)
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        h = model(batch).float()  # (B·3, H) or (B·2, H)
    h = h.view(-1, 3 if labels is None else 2, h.shape[-1])  # (B, 3 or 2, H): a row's texts
    cols = [gather(h[:, i]) for i in range(h.shape[1])]  # each (world·B, H), ranks in order
    if labels is None:
        loss = bellm_loss(*cols, temp)  # eq. 6 over the global batch
    else:
        loss = cosent_loss(*cols, gather(labels.to(device, non_blocking=True)))  # labels: (B,)
    # every rank holds the same global loss; DDP averages gradients over ranks, hence × world
    scale(loss * world / accum).backward()
    return loss, tokens


# ---------------------------------------------------------------- the data loader -----------------
COLUMNS = {"nli": ("sent0", "sent1", "hard_neg"),  # a training file's kinds, by their columns
           "csts": ("sentence1", "sentence2", "condition", "label")}


def read_csv(path):
    """--train, --csts (and eval_sts.py --csts) files: NLI triplets (sent0, sent1, hard_neg) or
    C-STS rows (sentence1, sentence2, condition, label). -> kind ("nli" or "csts"), rows; an empty
    or missing cell, or a label that is not a finite number, is a bad input naming its line."""
    text = common.read_text(path)  # UTF-8; a spreadsheet's byte-order mark is dropped
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))  # a field as long as the file
    reader = csv.DictReader(io.StringIO(text))
    cols = set(reader.fieldnames or [])
    kinds = [kind for kind, need in COLUMNS.items() if set(need) <= cols]
    if not kinds:
        has = ",".join(sorted(cols)) or "no header"
        common.die(f"'{path}' needs the columns sent0,sent1,hard_neg (NLI triplets) or sentence1,"
                   f"sentence2,condition,label (C-STS); it has {has}")
    kind = kinds[0]
    rows = [csv_row(path, reader.line_num, r, kind) for r in reader]
    if not rows:
        common.die(f"'{path}' has a header but no rows: pass a --train file with data")
    return kind, rows


def csv_row(path, line, r, kind):
    """One row of a kind's csv (a dict of its cells) -> a tuple of its columns, C-STS's label a
    float; or one line naming the line."""
    need = COLUMNS[kind]
    missing = [c for c in need if not (r[c] or "").strip()]  # short rows give None
    if missing:
        common.die(f"'{path}', line {line}: no {', '.join(missing)}: fill in or delete the row")
    if kind == "nli":
        return tuple(r[c] for c in need)
    try:
        label = float(r["label"])
    except ValueError:
        label = math.nan
    if not math.isfinite(label):
        common.die(f"'{path}', line {line}: label {r['label']!r} is not a number; C-STS labels "
                   "are 1-5")
    return tuple(r[c] for c in need[:-1]) + (label,)


def prompted_batch(tokenizer, rows, kind, prompt, max_len):
    """A micro-batch's rows, kind "nli" (anchor, entailment, contradiction) or "csts" (sentence1,
    sentence2, condition, label: each sentence under its condition) -> (their prompted texts, 3
    or 2 a row, tokenised on the host; C-STS's labels (B,), else None). max_len: a sentence's."""
    conditions = None if kind == "nli" else [r[2] for r in rows for _ in range(2)]
    texts = [s for r in rows for s in (r if kind == "nli" else r[:2])]  # 3 texts a row, or 2
    texts, limit = prompted(tokenizer, {"prompt": prompt, "max_len": max_len}, texts, conditions)
    return (tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt"),
            None if kind == "nli" else torch.tensor([r[3] for r in rows]))


def micro_batches(tokenizer, rows, kind, prompt, steps, rank, world, batch_size, max_len):
    """Each step's micro-batches on this rank, tokenised on the host (a step or two ahead of the
    loop: common.ahead) -> per step [prompted_batch]; rank r's k-th: rows [(k·world + r)·B, +B)."""
    tokenizer = copy.deepcopy(tokenizer)  # not the evaluation's: a fast tokenizer is not shared
    for ids in steps:
        yield [prompted_batch(tokenizer, [rows[i] for i in ids[j:j + batch_size]], kind, prompt,
                              max_len)
               for j in range(rank * batch_size, len(ids), world * batch_size)]


# ---------------------------------------------------------------- building the model ------------
def base_dtype(name, device, autocast):
    """--dtype, the base's weights; by default autocast's 16 bits on CUDA, else float32."""
    if name:
        return getattr(torch, name)
    if device.type == "cuda" and autocast is not None:
        return autocast
    return torch.float32


def load_decoder(name, bi_layers, bi_strategy, device, dtype=None):
    """tokenizer, decoder (embed_tokens, layers, rotary_emb, norm) in `dtype` (default fp32 on CPU,
    bf16 on CUDA); for bi_strategy 'add', copies of the last K layers as `dec.bellm_added`."""
    tok = common.load_pretrained(AutoTokenizer, name)
    dtype = dtype or base_dtype(None, device, torch.bfloat16)  # as a bf16 run has it
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


def add_lora(dec, r, alpha, dropout):
    """LoRA on every Linear of the decoder (peft; AutoModel has no LM head), in place: only the
    adapters train. -> the peft model (save_pretrained: the adapter)"""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules="all-linear")
    with warnings.catch_warnings():  # peft reads transformers 5's deprecated name
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                FutureWarning)
        return get_peft_model(dec, config)


def cast_frozen_linears(dec, dtype=torch.bfloat16):
    """Under bf16 autocast with float32 base weights: each frozen Linear stored in bf16 once, not
    cast at every pass (autocast caches only trained weights' casts): the same numbers, without
    the casts' time, in half the memory. Norms and embeddings stay float32, as autocast has them."""
    for m in dec.modules():
        if isinstance(m, torch.nn.Linear) and not any(q.requires_grad for q in m.parameters()):
            m.to(dtype)


# ---------------------------------------------------------------- main ----------------------------
def main():
    a = common.parse(p)
    rank, world, device, log = harness.start()  # torchrun: one process a GPU
    tasks = check_args(a, world)

    # data: NLI triplets (or C-STS pairs); every step's rows drawn from the seed
    kind, rows = read_csv(common.train_file(a.train, "nli_for_simcse.csv"))
    csts_dev = read_csv(a.csts)[1] if a.csts else None  # C-STS dev selects the checkpoint
    check_data(a, kind, csts_dev is not None)
    data = common.sts_data(a.data_dir, tasks if a.final_eval else [])
    metric = "csts_dev" if csts_dev else "stsb_dev"
    per_step = a.batch_size * world * a.grad_accum  # rows a step, all ranks together
    steps = common.step_rows(len(rows), per_step, a.epochs, a.max_steps, a.seed)

    # the run folder (harness.py), locked; --resume: its state, trained as this command says
    run = harness.Run(a, METHOD, RESUMABLE, check_run, [a.model], device, custom_module=True)
    if run.complete(len(steps)):  # nothing is wrong, nothing is left: exit 0
        return
    lr = run.rate(a.lr, 2e-4)  # --lr, the resumed run's, or the paper's

    # the model: the decoder, patched (decoder_forward), with LoRA on every Linear (peft)
    torch.manual_seed(a.seed)  # the same added layers, LoRA and dropout stream on every rank
    autocast = common.PRECISIONS[a.precision]  # the step's dtype (None: fp32)
    dtype = base_dtype(a.dtype, device, autocast)  # the base's weights
    tokenizer, dec = load_decoder(a.model, a.bi_layers, a.bi_strategy, device, dtype)
    prompt = len(tokenizer(fill(a.prompt, "", ""))["input_ids"])  # its tokens around a sentence
    longest = common.check_max_len(a.max_len, dec.config, a.model, extra=prompt) + prompt
    grad_ckpt = device.type == "cuda" if a.grad_ckpt is None else a.grad_ckpt
    if grad_ckpt:  # each layer recomputed in the backward: bf16 LLaMA-2-7B fits one 80 GB GPU
        dec.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    lora = add_lora(dec, a.lora_r, a.lora_alpha, a.lora_dropout)  # the peft model: the adapter
    if autocast:  # the frozen Linears stored in autocast's dtype once, not cast at every pass
        cast_frozen_linears(dec, autocast)
    raw_model = BeLLM(dec, a.bi_layers, a.bi_mode, a.bi_strategy)
    model = DDP(raw_model) if world > 1 else raw_model  # torchrun: LoRA gradients averaged
    step_model = common.in_length_groups(  # the model as a step runs it: the host's batch
        functools.partial(embed, common.compiled_layers(model, a.compile)),  # copied in length
        a.length_grouping, device=device)  # groups; --compile: each decoder layer, in place
    meta = dict(method=METHOD, base_model=a.model, bi_mode=a.bi_mode, bi_layers=a.bi_layers,
                bi_strategy=a.bi_strategy, prompt=a.prompt, dtype=str(dtype).removeprefix("torch."),
                max_len=dec.config.max_position_embeddings,  # evaluation does not cut sentences
                lora_r=a.lora_r, lora_alpha=a.lora_alpha, **base_checksums(dec))  # sentemb.json
    encode = make_encode(dec, tokenizer, meta, device, a.precision)

    params = [q for q in raw_model.parameters() if q.requires_grad]  # the update (authors' code)
    optimizer = torch.optim.AdamW(common.decay_groups(raw_model, a.weight_decay), lr=lr, fused=True)
    scheduler = get_linear_schedule_with_warmup(optimizer, a.warmup_steps, len(steps))
    scaler = torch.amp.GradScaler(device.type, enabled=a.precision == "fp16")  # fp16: loss × s
    run.start_training(model=raw_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                       lr=lr, meta=meta)  # what every save holds; signals stop at a step
    first = run.load_resumed_state()  # --resume: each part as saved (a new run: step 0)
    check_base(meta, run.state["meta"] if run.state else {}, a.model, harness.CKPT)
    log(f"{a.model}: {len(dec.layers)} layers, K={a.bi_layers} {a.bi_mode}/{a.bi_strategy}, "
        f"{sum(q.numel() for q in params):,} LoRA parameters, {len(rows)} {kind} rows, "
        f"{len(steps)} steps of {per_step} rows, lr {lr:g}, "
        f"{world} process(es), device {device}, {a.precision}")
    log(memory_line(dec, params, a.lora_r, a.batch_size * (3 if kind == "nli" else 2), longest,
                    dtype != torch.float32 or autocast is not None, grad_ckpt))

    batches = common.ahead(micro_batches(  # the steps from `first` on, tokenised ahead
        tokenizer, rows, kind, a.prompt, steps[max(first - 1, 0):], rank, world, a.batch_size,
        a.max_len))
    meter = harness.Meter(device, per_step, "rows", a.precision)  # the step lines' speed
    raw_model.train()
    for step in range(first, len(steps) + 1):  # step 0: the model as loaded
        if step > 0:  # optimisation step `step`: grad_accum micro-batches of B rows a rank
            with meter.step(step_model):
                for k, (batch, labels) in enumerate(next(batches)):  # DDP syncs after the last
                    with model.no_sync() if world > 1 and k < a.grad_accum - 1 else nullcontext():
                        loss, n = train_step(
                            step_model, batch, device, temp=a.temp, labels=labels,
                            autocast=autocast, world=world, accum=a.grad_accum,
                            gather=harness.gather, scale=scaler.scale)
                    meter.tokens += n  # real ones
                    run.watch(step, loss)  # not finite: noted on the device, read below
                scaler.unscale_(optimizer)  # fp16: the gradients / s, clipped as they are
                gnorm = torch.nn.utils.clip_grad_norm_(  # the norm before clipping; 0: no clip
                    params, a.max_grad_norm or math.inf)
                scaler.step(optimizer)  # fp16: skipped where a gradient is inf or NaN
                scaler.update()  # fp16: s halved after a skip, doubled after 2000 steps without
                scheduler.step()  # every step, skipped or not
                optimizer.zero_grad(set_to_none=True)
        evaluate = (step % a.eval_steps == 0 and (step > 0 or a.eval_first)) or step == len(steps)
        read = evaluate or step % a.log_steps == 0  # the host reads the device here
        if read and step > 0:
            run.check_loss()  # one not finite since the last read: one line, the last save good
            if step % a.log_steps == 0 or step == len(steps):
                run.log(step, meter, loss=loss, gnorm=gnorm, lr=scheduler.get_last_lr()[0])
        halt = run.stop_requested(read)  # a signal on any rank: every rank stops at a read
        dev = dev_score(encode, data, csts_dev) if evaluate and rank == 0 else None  # no dropout
        if evaluate or halt:  # checkpoint.pt; with a new best dev score, best/ (rank 0; all wait)
            run.save(step, metric, dev, functools.partial(save_model, lora))
        if halt:
            break

    with run.finish(step):  # a signal stopped it: saved, exit 128 + its number
        if a.final_eval:  # the best checkpoint, loaded as eval_sts.py loads it (rank 0)
            run.final_table(load_encoder, data, tasks, a.precision)


# ======== a reader of the paper may stop at main(): below, how a run of BeLLM is saved and checked
# ---------------------------------------------------------------- the run folder ------------------
def base_checksums(dec):
    """The base model's fingerprints, so that an adapter is applied only to the base it was trained
    on, never to another of its shape: base_fingerprint, every base weight (LoRA's left out)
    reduced to Σ|w| in bf16 (the precision a base may be stored in), weighted by its position;
    base_checksum, the token embeddings' and final norm's Σ|w| (all that older runs record)."""
    w = [q.detach() for n, q in dec.named_parameters() if "lora_" not in n]
    def reduce(x):  # Σ|x| in bf16
        return x.to(torch.bfloat16).float().abs().sum(dtype=torch.float64)
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


def memory_estimate(dec, n_lora, s, tokens, longest, r, grad_ckpt):
    """GiB of one training step, from the config: (weights, LoRA + gradients + AdamW moments in
    fp32, activations kept for the backward). Activations, bytes a token a layer (counted with
    saved-tensor hooks on LLaMA configs; RMSNorm and LoRA keep fp32 copies, so bf16 does not halve
    them): A = α·H + β·I + 28·r + heads·L·(4 or 6), α = 68 / 62, β = 20 / 14 for fp32 / bf16
    (s = 4 / 2 bytes). Checkpointing: each layer keeps its input (s·H), one recomputed at a time."""
    c, n = dec.config, len(dec.layers) + len(getattr(dec, "bellm_added", []))
    A = (68 if s == 4 else 62) * c.hidden_size + (20 if s == 4 else 14) * c.intermediate_size \
        + 28 * r + c.num_attention_heads * longest * (4 if s == 4 else 6)
    act = tokens * (n * s * c.hidden_size + A if grad_ckpt else n * A)
    weights = sum(q.numel() * q.element_size() for q in dec.parameters() if not q.requires_grad)
    return weights / 2**30, 16 * n_lora / 2**30, act / 2**30


def memory_line(dec, params, r, texts, longest, bf16, grad_ckpt):
    """The start-up line: a step's memory, estimated (docs/operations.md); bf16: 2 bytes a value."""
    s, n = 2 if bf16 else 4, sum(q.numel() for q in params)
    est = [memory_estimate(dec, n, s, texts * longest, longest, r, c) for c in (0, 1)]
    per_tok = [e[2] * 2**20 / (texts * longest) for e in est]  # KiB a token
    w, o, act = est[grad_ckpt]
    return (f"memory (estimate): weights {w:.2f} GiB, LoRA + AdamW {o:.2f} GiB, activations "
            f"{per_tok[0]:,.0f} KiB a token ({per_tok[1]:,.0f} with --grad-ckpt): {act:.2f} GiB "
            f"for {texts} x {longest} tokens {'with' if grad_ckpt else 'without'} checkpointing; "
            f"{w + o + act:.2f} GiB in all")


def make_encode(dec, tok, cfg, device, precision=None):
    """encode(list[str], conditions=None) -> (N, H) without dropout: dev scores', eval_sts.py's."""
    net = BeLLM(dec, cfg["bi_layers"], cfg["bi_mode"], cfg["bi_strategy"])

    @torch.no_grad()
    def encode(sentences, conditions=None):
        texts, max_len = prompted(tok, cfg, sentences, conditions)
        with common.autocast(device, precision), common.evaluating(dec):
            return common.encode_in_batches(encode.embed, tok, texts, max_len, device, 64)
    encode.tokenizer, encode.max_len = tok, cfg["max_len"]  # what it reads (eval_sts.py --ensemble)
    encode.embed, encode.layers = functools.partial(embed, net), net  # common.compiled_encode
    return encode


def save_model(lora, folder):
    """The LoRA adapter (peft: adapter_config.json, adapter_model.safetensors), also a
    sentence-transformers folder of st_module.BeLLM (trust_remote_code=True)."""
    lora.save_pretrained(folder)
    common.write_st_files(folder, pooler="BeLLM")


def load_adapter(dec, run_dir):
    """The LoRA adapter of a bellm.py run folder wrapped into dec (in place), or one line naming the
    file: it loads, holding exactly the adapter weights this base model and adapter_config.json
    ask for (peft would only warn about missing ones and leave them as initialised)."""
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
                   f"{harness.RECOPY}")
    want = set(get_peft_model_state_dict(model))
    have = common.safetensors_keys(os.path.join(run_dir, "adapter_model.safetensors"), where,
                                   harness.RECOPY)
    if want != have:
        odd = sorted(want - have) or sorted(have - want)
        said = "lacks" if want - have else "holds"
        common.die(f"{where}: adapter_model.safetensors {said} {len(odd)} adapter weights ({odd[0]}"
                   f"{', ...' if len(odd) > 1 else ''}) "
                   f"{'that' if want - have else 'beyond what'} "
                   f"adapter_config.json and the base model ask for: {harness.RECOPY}")
    return model


META_TYPES = {  # sentemb.json: the keys, and their types
    "base_model": lambda v: isinstance(v, str) and v != "",
    "bi_layers": lambda v: type(v) is int and v >= 0,
    "bi_mode": ("parallel", "sequential").__contains__,
    "prompt": lambda v: isinstance(v, str) and "{sentence}" in v}
META_OPTIONAL = {  # keys that older runs may lack
    "bi_strategy": ("convert", "add").__contains__,
    "dtype": ("float32", "bfloat16", "float16").__contains__,
    "max_len": lambda v: type(v) is int and v >= 1, "lora_r": lambda v: type(v) is int and v >= 1,
    "lora_alpha": lambda v: type(v) in (int, float) and v > 0,
    **{k: lambda v: type(v) in (int, float) for k in ("base_checksum", "base_fingerprint")},
    "step": lambda v: type(v) is int and v >= 0,
    **{k: lambda v: v is None or type(v) in (int, float) for k in ("stsb_dev", "csts_dev")}}
def check_run(run_dir, meta):
    """A run folder of this script is the model its files describe, or one line naming the file and
    the value: sentemb.json's keys of their types; the adapter's files whole; every value within
    the base's limits; adapter_config.json as bellm.py trains (for eval_sts.py and --resume)."""
    path, where = os.path.join(run_dir, common.META), f"cannot load the bellm.py run in '{run_dir}'"
    common.check_keys(path, meta, META_TYPES, META_OPTIONAL)
    for rel in ("adapter_config.json", "adapter_model.safetensors"):
        common.check_file(run_dir, rel, where, harness.RECOPY)
    base = meta["base_model"]
    config = common.load_pretrained(AutoConfig, base)
    n = config.num_hidden_layers
    if meta["bi_layers"] > n:  # the words of --bi-layers
        common.die(f"{path}: bi_layers {meta['bi_layers']} is outside 0..{n} ('{base}' has {n} "
                   f"layers): set it to 0..{n}, or {harness.RECOPY}")
    if "max_len" in meta:
        common.check_max_len(meta["max_len"], config, base, f"{path}: max_len")
    check_lora_config(os.path.join(run_dir, "adapter_config.json"), meta, path, where)


# adapter_config.json: what bellm.py trains (plain LoRA on every Linear); any other value of these
# would run another model than the one trained (null for an empty one: peft's older default)
LORA_FIXED = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "bias": "none",
              "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
              "modules_to_save": None, "layers_to_transform": None, "layer_replication": None,
              "lora_bias": False, "trainable_token_indices": None, "target_parameters": None}
LORA_TYPES = {"r": ("an integer >= 1", lambda v: type(v) is int and v >= 1),  # (as said, test)
              "lora_alpha": ("a number > 0", lambda v: type(v) in (int, float) and v > 0)}


def check_lora_config(lora_path, meta, path, where):
    """A run's adapter_config.json: plain LoRA as bellm.py trains it, its r and alpha those of
    sentemb.json (meta, at path), or one line naming the key."""
    lora = common.read_json(lora_path, where, harness.RECOPY)
    fix = harness.RECOPY
    for key in [k for k in (*LORA_TYPES, *LORA_FIXED) if k in lora]:
        value = lora[key]
        if key in LORA_TYPES:
            want, test = LORA_TYPES[key]
            good = test(value)
        else:
            want = json.dumps(LORA_FIXED[key])
            good = value == LORA_FIXED[key] or (value is None and not LORA_FIXED[key])
        if not good:
            common.die(f"{lora_path}: {key} {json.dumps(value)} is not what bellm.py trains "
                       f"({key} {want}): set it so, or {fix}")
    for key, ours in (("lora_r", "r"), ("lora_alpha", "lora_alpha")):
        if key in meta and lora.get(ours) != meta[key]:
            common.die(f"{lora_path}: {ours} {json.dumps(lora.get(ours))} disagrees with {path}'s "
                       f"{key} {meta[key]} (bellm.py --{key.replace('_', '-')}): set it to "
                       f"{meta[key]}, or {fix}")


def load_encoder(run_dir, meta, device):
    """For eval_sts.py. meta: base_model, bi_layers, bi_mode, prompt [, bi_strategy, max_len];
    run_dir None: zero-shot, no LoRA (check_run refuses a run folder without its adapter)."""
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
    """The score that picks the checkpoint: STS-B dev, or C-STS dev with --csts (§5.1; Spearman)."""
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
    unknown = [t for t in tasks if t not in common.TASKS]
    if unknown:
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
    # flags that only shape the bidirectional layers, changed from their defaults
    odd = [f"--{k.replace('_', '-')} {getattr(a, k)}" for k in ("bi_mode", "bi_strategy")
           if getattr(a, k) != p.get_default(k)]
    if not a.bi_layers and odd:
        common.die(f"--bi-layers 0 makes no layer bidirectional, so {' and '.join(odd)} would do "
                   "nothing: drop them, or pass --bi-layers 1 or more")
    if not a.final_eval and a.tasks != p.get_default("tasks"):
        common.die("--tasks picks the final table's tasks, and --no-final-eval prints none: drop "
                   "one of them")
    return tasks


def check_data(a, kind, csts_dev):
    """The flags the data asks for: {condition} in --prompt just for C-STS (data or --csts dev);
    --temp only where eq. 6 reads it (NLI)."""
    check_prompt(a.prompt, kind == "csts" or csts_dev)
    if kind == "csts" and a.temp != p.get_default("temp"):
        common.die("--temp is eq. 6's temperature, and C-STS rows train with cosent_loss, which "
                   "has none: drop --temp")


if __name__ == "__main__":
    main()
