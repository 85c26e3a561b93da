"""SSCL: "Alleviating Over-smoothing for Unsupervised Sentence Representation"
Chen, Shou, Pei, Gong, Cao, Chang, Li, Jiang. ACL 2023 (2023.acl-long.197). arXiv:2305.06154.

Unsupervised SimCSE encodes every sentence twice with dropout and contrasts the two views against
the other sentences of the batch. SSCL sees that the last layers of a PLM over-smooth (adjacent
layers, and the tokens of a sentence, become near-identical) and adds negatives taken from the
model itself: each sentence's representation at an intermediate layer M. The last layer is pushed
away from what layer M already says. Several layers at once = Progressive SSCL (Fig. 3b).

  eq. 4, InfoNCE with layer-M negatives      sscl_loss
  the authors' objective (--objective)       sscl_loss_authors
  h^M = hidden_states[M], pooled as h        SentenceEncoder
  one step: two dropout views, the loss      train_step
  Table 1: the first N layers (--num-layers); Table 3: --select-on transfer
  eqs. 1-2, Figs. 1, 4, 5, 6: python sscl_analysis.py (no training)

  python sscl.py --layer 11     # the paper: BERT-base, wiki1m, 1 epoch (GPU); 10,11: Progressive
  python sscl.py --model sentence-transformers/all-MiniLM-L6-v2 --train wiki1m_head.txt \\
      --layer 5 --max-steps 100 --eval-steps 50 --output-dir runs/sscl_minilm   # CPU: minutes
"""
import argparse
import contextlib
import functools
import json
import math
import os
import random
import shutil
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

import common

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
# --- general: the paper's values as defaults ---
p.add_argument("--model", default="bert-base-uncased",
               help="hub name or local folder (paper: bert-base-uncased)")
p.add_argument("--train", help="one sentence a line (default: SimCSE's wiki1m_for_simcse.txt)")
p.add_argument("--data-dir", help="STS data: DIR/downstream/{STS,SICK} (else $SENTEMB_DATA)")
p.add_argument("--output-dir", default="runs/sscl", help="the run folder: best model, state")
p.add_argument("--epochs", type=common.POS_INT, default=1, help="paper: 1")
p.add_argument("--max-steps", type=common.STEPS, default=-1, help="N steps (-1: the epochs)")
p.add_argument("--batch-size", type=common.POS_INT, default=64, help="sentences a step and GPU "
               "(paper: 64); torchrun: in-batch negatives from all GPUs")
p.add_argument("--grad-accum", type=common.POS_INT, default=1, help="micro-batches a step, each "
               "with only its own in-batch negatives")
p.add_argument("--length-grouping", action=argparse.BooleanOptionalAction, default=True,
               help="a step's texts in length groups: the same loss, the real tokens' cost")
p.add_argument("--lr", type=common.POS_FLOAT, help="paper: 3e-5 (1e-5 for large models); "
               "--resume: the run's own unless given")
# NOTE(authors' code): the update of their Trainer, transformers 4.2.1 (training_args.py L289,
# L293, L304: weight decay 0.0, clipping at 1.0, no warm-up; run_unsup_example.sh keeps them)
p.add_argument("--weight-decay", type=common.NONNEG_FLOAT, default=0.0, help="AdamW's, biases and "
               "LayerNorm excluded (authors' code: 0.0)")
p.add_argument("--max-grad-norm", type=common.NONNEG_FLOAT, default=1.0, help="clip the gradients' "
               "global norm to this before each update (authors' code: 1.0); 0: no clipping")
p.add_argument("--warmup-steps", type=common.NONNEG_INT, default=0, help="the rate's linear "
               "warm-up before its linear decay to 0 (authors' code: 0)")
p.add_argument("--max-len", type=common.POS_INT, default=32, help="training tokens a sentence "
               "(paper: 32)")
p.add_argument("--eval-steps", type=common.POS_INT, default=125, help="dev every N steps")
p.add_argument("--seed", type=common.SEED, default=42)
p.add_argument("--log-steps", type=common.POS_INT, default=10, help="the loss every N steps")
p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too (always on CUDA)")
p.add_argument("--compile", action="store_true", help="torch.compile the model (training, eval)")
p.add_argument("--quiet", action="store_true", help="no progress bars")
p.add_argument("--resume", action="store_true", help="continue OUTPUT_DIR/checkpoint.pt")
p.add_argument("--final-eval", action=argparse.BooleanOptionalAction, default=True,
               help="the 7 STS tasks of the best checkpoint at the end")
# --- SSCL ---
p.add_argument("--layer", default="11", help="layer(s) M whose representation is a negative: "
               "hidden_states[M]; 0 = SimCSE; '10,11' = Progressive SSCL (paper: 11)")
# NOTE(authors' code): their example script trains with avg pooling (docs/sscl.md, detail 6)
p.add_argument("--pooler", default="cls", choices=["cls", "avg"], help="cls: CLS + MLP in "
               "training, raw CLS at evaluation (SimCSE); avg: masked mean")
p.add_argument("--no-aug", action="store_true", help="SSCL-BERT (Table 2): no dropout view, "
               "the positive is the sentence's own representation")
p.add_argument("--proj-dim", type=common.NONNEG_INT, default=0,
               help="a linear projection to this size, kept at evaluation (Table 5); 0 = none")
p.add_argument("--temp", type=common.POS_FLOAT, default=0.05, help="tau (paper: 0.05)")
p.add_argument("--num-layers", type=common.POS_INT, help="the encoder cut to its first N "
               "layers, trained and saved so (Table 1: 10 of BERT-base's 12); default: all")
p.add_argument("--select-on", default="stsb", choices=["stsb", "transfer"], help="the dev score "
               "that picks the checkpoint: STS-B (paper); transfer: the 7 transfer tasks' mean dev "
               "accuracy, SentEval fasttest (the authors' script, Table 3; docs/sscl.md, detail 8)")
p.add_argument("--objective", default="paper", choices=["paper", "authors"],
               help="paper: eq. 4; authors: the authors' code (docs/sscl.md, details 2, 3, 5)")
common.show_ranges(p)


# ---------------------------------------------------------------- the loss ------------------------
def sscl_loss(h, h_pos, h_negs, temp):
    """eq. 4, SimCSE's InfoNCE with SSCL's extra negatives (§3.2). h, h_pos: (B, D) last layer, two
    views; h_negs: list of (B, D), the layer-M representations. Row i's logits are
    [cos(h_i, h_j⁺)/τ]_j ⊕ [cos(h_i, h_j^M)/τ]_j for every M; the target is column i."""
    h = F.normalize(h, dim=-1)
    logits = torch.cat([h @ F.normalize(z, dim=-1).T for z in [h_pos, *h_negs]], dim=1) / temp
    return F.cross_entropy(logits, torch.arange(len(h), device=h.device))  # logits: (B, B·(1+|M|))


def sscl_loss_authors(h, h_pos, h_negs, temp):
    """NOTE(authors' code), sscl/models.py `cl_forward` + `construct_negtives` (docs/sscl.md, 2-3):
    h_negs holds BOTH views' layer-M vectors (2B negatives per M), averaged with SimCSE's loss."""
    return (sscl_loss(h, h_pos, h_negs, temp) + sscl_loss(h, h_pos, [], temp)) / 2


# ---------------------------------------------------------------- the model -----------------------
class SentenceEncoder(torch.nn.Module):
    """BERT + pooling. The MLP head (SimCSE's `MLPLayer`, cls pooling) is used in training only; the
    projection (--proj-dim) is kept at evaluation. BERT's own pooler is unused: frozen."""

    def __init__(self, bert, pooler, proj_dim=0):
        super().__init__()
        hidden = bert.config.hidden_size
        self.bert, self.pooler = bert, pooler
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh()) \
            if pooler == "cls" else None
        self.proj = torch.nn.Linear(hidden, proj_dim) if proj_dim else None
        if getattr(bert, "pooler", None) is not None:
            bert.pooler.requires_grad_(False)

    def pool(self, hidden, mask):
        """hidden: (N, L, H), mask: (N, L) -> (N, H or proj_dim). Same pooling for every layer."""
        if self.pooler == "cls":
            z = self.mlp(hidden[:, 0]) if self.training else hidden[:, 0]
        else:
            m = mask.unsqueeze(-1).to(hidden.dtype)
            z = (hidden * m).sum(1) / m.sum(1)
        return self.proj(z) if self.proj is not None else z

    def forward(self, batch, layers=()):
        """-> (last layer pooled (N, D), [hidden_states[M] pooled (N, D) for M in layers])"""
        out, mask = self.bert(**batch, output_hidden_states=bool(layers)), batch["attention_mask"]
        return self.pool(out.last_hidden_state, mask), [self.pool(out.hidden_states[m], mask)
                                                         for m in layers]


# ---------------------------------------------------------------- one training step ---------------
def train_step(model, tokenizer, sentences, layers, device, temp=0.05, max_len=32,
               objective="paper", no_aug=False, bf16=False, world=1, accum=1, gather=lambda z: z):
    """One micro-batch of B sentences: both dropout views in one forward pass, the loss over the
    global batch, its gradients accumulated. -> the loss.
    model(batch, layers) -> (the last layer pooled, [hidden_states[M] pooled for M in layers]): a
    SentenceEncoder, or one run in length groups (the same outputs); layers: the M of eq. 4 ([]:
    SimCSE); objective "authors": their code's loss (docs/sscl.md, details 2, 3, 5); no_aug:
    SSCL-BERT, Table 2; bf16: autocast. torchrun: gather(z) = every rank's rows (B, D) ->
    (world·B, D); the gradients × world / accum (DDP averages them over the ranks; accum
    micro-batches a step)."""
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=max_len,
                      return_tensors="pt").to(device)  # (B, L)
    if not no_aug:  # two dropout views of every sentence: (2B, L)
        batch = {k: torch.cat([v, v]) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        z, z_layers = model(batch, layers)  # (2B, D), or (B, D) with no_aug; per M: the same
    B = len(sentences)  # the loss in fp32, outside autocast
    h, h_pos = z[:B].float(), (z if no_aug else z[B:]).float()  # SSCL-BERT: the positive is h
    h, h_pos = gather(h), gather(h_pos)  # (world·B, D): the global batch
    # NOTE(authors' code): docs/sscl.md details 2, 3, 5, which objective "authors" switches
    if objective == "paper":  # view 1's layer-M vectors (the anchor's pass), all ranks
        negs = [gather(zm[:B].float()) for zm in z_layers]  # per M: (world·B, D)
        loss = sscl_loss(h, h_pos, negs, temp)
    else:  # both views' layer-M vectors, this rank's only; averaged with SimCSE's loss
        negs = [v.float() for zm in z_layers for v in (zm[:B], zm[B:])]  # per M: 2 × (B, D)
        loss = sscl_loss_authors(h, h_pos, negs, temp)
    # DDP averages gradients over ranks, each holding the global loss: × world (the authors'
    # Trainer does not scale by world, which AdamW cancels up to its eps)
    (loss * world / accum).backward()
    return loss


# ---------------------------------------------------------------- the authors' update -------------
class AdamW421(torch.optim.AdamW):
    """NOTE(authors' code): the AdamW of their Trainer, transformers 4.2.1's (optimization.py
    L347-355): ε is added to √v before the bias correction, torch's AdamW adds it after. With
    b1 = 1 - β1^t, b2 = 1 - β2^t at step t, theirs is lr·√b2/b1 · m / (√v + ε) = lr/b1 · m /
    (√(v/b2) + ε/√b2): torch's update with ε/√b2 (docs/sscl.md, detail 11), in torch's fused
    kernel. Weight decay (theirs: 0.0) acts before torch's step and after 4.2.1's (L366)."""

    def step(self, closure=None):
        for g in self.param_groups:  # the step t about to run and its ε, saved with the state
            g["t"] = g.get("t", 0) + 1
            g["eps"] = g.setdefault("eps_421", g["eps"]) / (1 - g["betas"][1] ** g["t"]) ** 0.5
        return super().step(closure)


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


# ---------------------------------------------------------------- the run folder ------------------
def make_encode(encoder, tokenizer, max_len, device):
    """encode(list[str]) -> (N, D): the one function behind dev evaluation and eval_sts.py."""
    return common.encoder(lambda batch: encoder(batch)[0], tokenizer, max_len, device)


def save_model(encoder, tokenizer, max_len, folder):
    """A plain HF model folder (+ proj.pt), also a sentence-transformers folder, so that
    SentenceTransformer(folder) encodes as we evaluate (CLS without the training MLP, or the masked
    mean; then the projection)."""
    encoder.bert.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if encoder.proj is not None:
        torch.save(encoder.proj.state_dict(), os.path.join(folder, "proj.pt"))
    common.write_st_files(folder, encoder.bert.config.hidden_size, max_len, encoder.pooler,
                          encoder.proj)


META_TYPES = {  # sentemb.json: the keys (those of older runs may lack are optional) and their types
    "pooler": ("cls", "avg").__contains__, "proj_dim": lambda v: type(v) is int and v >= 0,
    "max_len": lambda v: type(v) is int and v >= 1}
META_OPTIONAL = {
    "layers": lambda v: isinstance(v, list) and all(type(m) is int and m >= 1 for m in v),
    "objective": ("paper", "authors").__contains__, "select_on": ("stsb", "transfer").__contains__,
    "num_layers": lambda v: type(v) is int and v >= 1, "step": lambda v: type(v) is int and v >= 0,
    **{k: lambda v: v is None or type(v) in (int, float) for k in ("stsb_dev", "transfer_dev")}}
RUN_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
def check_run(run_dir, meta):
    """A run folder of this script is the model its files describe, or one line naming the file and
    the value: sentemb.json's keys of their types; the model files whole, the weights those of
    config.json; every value against the weights (eval_sts.py and --resume call it)."""
    path, where = os.path.join(run_dir, common.META), f"cannot load the sscl.py run in '{run_dir}'"
    check_keys(path, meta, META_TYPES, META_OPTIONAL)
    for rel in RUN_FILES + ("proj.pt",) * bool(meta["proj_dim"]):
        common.check_file(run_dir, rel, where, RECOPY)
    common.check_weights(run_dir, where, RECOPY)
    from transformers import AutoConfig
    config = common.load_pretrained(AutoConfig, run_dir)
    n, hidden = config.num_hidden_layers, config.hidden_size

    def bad(key, why, fix):
        common.die(f"{path}: {key} {json.dumps(meta[key])} {why}: {fix}, or {RECOPY}")
    common.check_max_len(meta["max_len"], config, run_dir, f"{path}: max_len")
    if meta.get("num_layers", n) != n:
        bad("num_layers", f"disagrees with the {n} layers of config.json (num_hidden_layers; "
            "sscl.py --num-layers saves the cut model)", f"set it to {n}")
    if any(m > n - 1 for m in meta.get("layers", [])):
        bad("layers", f"is outside 1..{n - 1}: this model has {n} layers, so M (sscl.py --layer) "
            f"must be in 1..{n - 1}", "set the layers the run was trained with")
    proj = os.path.join(run_dir, "proj.pt")
    if not meta["proj_dim"] and os.path.exists(proj):
        bad("proj_dim", "leaves out the projection that proj.pt holds (sscl.py --proj-dim)",
            "set it to proj.pt's output size")
    if meta["proj_dim"]:
        try:
            w = torch.load(proj, map_location="cpu", weights_only=True)["weight"]
        except Exception as e:  # truncated, not a torch file, not a Linear's state
            common.die(f"cannot load {proj} ({type(e).__name__}: {common.first_line(e)}): it is "
                       f"damaged or another model's; {RECOPY}")
        if tuple(w.shape) != (meta["proj_dim"], hidden):
            bad("proj_dim", f"disagrees with proj.pt, a projection from {w.shape[-1]} to "
                f"{w.shape[0]} dimensions (the model's hidden size is {hidden}): proj.pt is "
                "damaged or another model's", f"set it to {w.shape[0]}")


def described(state):
    """The sentemb.json values that a checkpoint's flags give (the harness's check_agree)."""
    a = state["args"]
    try:
        layers = sorted({int(m) for m in str(a["layer"]).split(",")} - {0})
    except ValueError:  # not a --layer sscl.py takes: --resume names the flag
        layers = None
    return {"pooler": a["pooler"], "proj_dim": a["proj_dim"], "objective": a["objective"],
            "select_on": a["select_on"], "num_layers": a["num_layers"], "layers": layers}


def load_encoder(run_dir, meta, device):
    """eval_sts.py's entry point for a run folder of this script (check_run has checked it)."""
    bert = common.load_pretrained(AutoModel, run_dir, strict=True)  # every weight from the file
    encoder = SentenceEncoder(bert, meta["pooler"], meta["proj_dim"])
    if meta["proj_dim"]:
        encoder.proj.load_state_dict(torch.load(os.path.join(run_dir, "proj.pt"),
                                                map_location="cpu", weights_only=True))
    tokenizer = common.load_pretrained(AutoTokenizer, run_dir)
    return make_encode(encoder.to(device).eval(), tokenizer, meta["max_len"], device)


# ---------------------------------------------------------------- argument checks -----------------
def select_on(name, data):
    """--select-on -> (its name, score(encode, data)): the dev score that selects the checkpoint.
    stsb: STS-B dev (the paper's); transfer: the mean dev accuracy x 100 of SentEval's 7 transfer
    tasks in fasttest mode (the authors' script, `eval_avg_transfer`), whose files are read now,
    once for the run."""
    if name == "stsb":
        return "stsb_dev", common.stsb_dev
    try:  # the one file beside this script that a flag needs: SentEval's classifiers
        import transfer
    except ImportError:
        common.die("--select-on transfer needs transfer.py (SentEval's transfer tasks) beside "
                   "sscl.py: copy it from the repository, or pass --select-on stsb")
    loaded = {task: transfer.load_transfer(data, task) for task in transfer.TRANSFER}
    return "transfer_dev", functools.partial(transfer.transfer_dev, loaded=loaded)


def check_encoder(name, max_len, flag="--model", num_layers=None):
    """A BERT-like bidirectional encoder (a masked-LM architecture: bert, roberta, ...) whose
    position embeddings hold max_len tokens, and that has num_layers layers to keep. -> its config
    (num_hidden_layers: the kept layers)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MLM
    config = common.load_pretrained(AutoConfig, name)
    if config.model_type not in MLM:
        common.die(f"'{name}' is a {config.model_type} model, not a bidirectional encoder: pass a "
                   f"BERT-like model (bert, roberta, ...) as {flag}")
    common.check_max_len(max_len, config, name)
    common.check_num_layers(num_layers, config, name)
    config.num_hidden_layers = num_layers or config.num_hidden_layers
    return config


def check_args(a, world):
    """Every check that stops training (one error line, exit 2). -> the layers M."""
    if a.batch_size * world < 2:
        common.die("--batch-size must be at least 2: in-batch negatives need other sentences")
    if a.objective == "authors" and a.no_aug:
        common.die("--no-aug has no counterpart in the authors' code (it always encodes two "
                   "dropout views): use it with --objective paper")
    config = check_encoder(a.model, a.max_len, num_layers=a.num_layers)  # BERT-like
    return parse_layers(a.layer, config.num_hidden_layers)


def parse_layers(spec, n):
    """'11' -> [11]; '10,11' -> [10, 11]; '0' -> [] (SimCSE); n: the model's layers. NOTE(authors'
    code): their `--hard_negative_layers N` = the top N ('10,11' for 2); docs/sscl.md, detail 4."""
    try:
        layers = sorted({int(x) for x in spec.split(",")})
    except ValueError:
        common.die(f"--layer '{spec}' is not a comma-separated list of integers: e.g. --layer 11 "
                   "or --layer 10,11")
    if layers != [0] and any(not 1 <= m <= n - 1 for m in layers):
        common.die(f"--layer {spec}: this model has {n} layers, so M must be in 1..{n - 1} "
                   "(or --layer 0 for plain SimCSE)")
    return [m for m in layers if m]


# ---------------------------------------------------------------- main ----------------------------
def main():
    a = common.parse(p)
    rank, world, device, log = start()
    layers = check_args(a, world)

    # data: every step's sentences drawn from the seed; the STS files read once, now
    data = common.check_sts(common.senteval_dir(a.data_dir), common.TASKS if a.final_eval else [])
    metric, dev_score = select_on(a.select_on, data)  # the score that picks the checkpoint
    sentences = common.read_sentences(common.train_file(a.train, "wiki1m_for_simcse.txt"))
    per_step = a.batch_size * world * a.grad_accum  # sentences a step, all ranks together
    steps = step_rows(len(sentences), per_step, a.epochs, a.max_steps, a.seed)

    # the run folder, locked; --resume: its training state, trained as this command says
    out = a.output_dir
    new_run, lock = open_run(out, [a.model], a.resume, rank, world)  # lock: held till exit
    state = read_resume(out, a, device)  # None: a new run
    if state and state["step"] >= len(steps):  # nothing is wrong, nothing is left: exit 0
        return log(complete(state["step"], len(steps), out))
    curve = resumed_curve(out, state["step"]) if state and rank == 0 else []
    lr = a.lr or (state["args"]["lr"] if state else 3e-5)  # the paper's, or the resumed run's

    # the model: BERT (its first --num-layers, Table 1) and SimCSE's pooling
    common.seed_everything(a.seed)  # the model; dropout from torch's RNG (the data order: its own)
    tokenizer = common.load_pretrained(AutoTokenizer, a.model)
    bert = common.load_pretrained(AutoModel, a.model, num_layers=a.num_layers)
    raw_model = SentenceEncoder(bert, a.pooler, a.proj_dim).to(device)
    model = ddp(raw_model, world)
    forward = common.in_length_groups(common.compiled(model, a.compile), a.length_grouping,
                                      raw_model)
    eval_len = common.positions(bert.config)  # evaluation does not truncate (SimCSE)
    encode = common.compiled_encode(make_encode(raw_model, tokenizer, eval_len, device), a.compile)
    meta = dict(method=METHOD, pooler=a.pooler, proj_dim=a.proj_dim, max_len=eval_len,
                layers=layers, objective=a.objective, select_on=a.select_on,
                num_layers=bert.config.num_hidden_layers)  # sentemb.json: how it encodes

    # the update: the authors' Trainer (transformers 4.2.1): AdamW (trainer.py L553-583, betas
    # 0.9/0.999, ε 1e-8), the global norm clipped (sscl/trainers.py L472-488), linear decay (L585)
    groups = common.decay_groups(raw_model, a.weight_decay)  # no decay: biases, LayerNorm
    optimizer = AdamW421(groups, lr=lr, eps=1e-8, fused=True)  # one kernel for all parameters
    scheduler = get_linear_schedule_with_warmup(optimizer, a.warmup_steps, len(steps))
    step, best = restore(state, raw_model, optimizer, scheduler, lr, log) if state else \
        (0, -math.inf)
    log(f"SSCL: {a.model}, layers {layers or 'none (SimCSE)'}, pooler {a.pooler}, objective "
        f"{a.objective}, {len(sentences)} sentences, {len(steps)} steps of {per_step} sentences, "
        f"lr {lr:g}, {common.device_line(world, device, a.bf16)}")

    handlers = catch_signals()  # SIGINT, SIGTERM: stop at the next step, saved
    raw_model.train()
    clock = common.new_clock(step)  # the step lines' speed
    for step in range(step + 1 if state else 0, len(steps) + 1):  # 0: the model as loaded
        if step > 0:  # optimisation step `step`: grad_accum micro-batches of B sentences per rank
            optimizer.zero_grad(set_to_none=True)
            with common.metered(clock, forward):  # the step's FLOPs
                for rows, last in micro_batches(steps[step - 1], a.batch_size, a.grad_accum, rank,
                                                world):
                    with no_sync(model, last):
                        loss = train_step(forward, tokenizer, [sentences[i] for i in rows],
                                          layers, device, a.temp, a.max_len, a.objective,
                                          a.no_aug, a.bf16 or device.type == "cuda", world,
                                          a.grad_accum, common.gather)
                    check_loss(loss, step, lr, out)
            gnorm = common.clip_gradients(raw_model.parameters(), a.max_grad_norm)  # before: gnorm
            optimizer.step()
            scheduler.step()
            if step % a.log_steps == 0 or step == len(steps):
                log(f"step {step:>5}  loss {loss.item():.4f}  gnorm {gnorm:.3g}  lr "
                    f"{scheduler.get_last_lr()[0]:.2e}  "
                    f"{common.rates(clock, step, per_step, 'sent', world, device)}")
                clock = common.new_clock(step, clock)
        halt = stop_requested(world, device)  # a signal on any rank: every rank stops here
        evaluate = step % a.eval_steps == 0 or step == len(steps)
        if (evaluate or halt) and rank == 0:  # the state; with a new best dev score, the model
            dev = dev_eval(raw_model, dev_score, encode, data) if evaluate else None
            state = training_state(raw_model, optimizer, scheduler, a, lr, step)
            curve, best = save_step(out, curve, step, metric, dev, best, state, meta,
                                    functools.partial(save_model, raw_model, tokenizer, eval_len),
                                    new_run, log)
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
        final_table(out, data, common.TASKS, device, a.bf16, best)
    restore_signals(handlers)


# ---------------------------------------------------------------- the harness ---------------------
# What a run needs to lose nothing, the same text in sscl.py, jtcse.py and bellm.py but for this
# table (test_all.py holds them equal); a reader who copies the method leaves it behind.
METHOD = "sscl"  # this script: the "method" of its sentemb.json and checkpoint.pt
RESUMABLE = {"resume", "lr", "epochs", "max_steps", "eval_steps", "log_steps", "final_eval",
             "data_dir", "output_dir", "bf16", "compile", "quiet",
             "length_grouping"}  # --resume may change
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
