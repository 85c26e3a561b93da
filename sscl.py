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
import copy
import functools
import json
import math
import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

import common
import harness

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
harness.add_run_flags(p)  # --seed, --log-steps, --precision, --compile, --resume, ...
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
METHOD = "sscl"  # the "method" of its sentemb.json and checkpoint.pt
RESUMABLE = harness.RESUMABLE | {"lr", "epochs", "max_steps", "eval_steps", "data_dir",
                                 "output_dir", "length_grouping"}  # --resume may change these


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
        mask, dtype = batch["attention_mask"], self.bert.dtype  # (N, L), 1 = real token
        # transformers' masking_utils reads a 2-D mask's padding_mask.all() back to the host (on a
        # GPU: a wait in every step); a 4-D mask it takes as it is: 0 / the most negative float,
        # added to the attention scores (the same outputs)
        bias = (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min  # (N, 1, 1, L)
        out = self.bert(**{**batch, "attention_mask": bias}, output_hidden_states=bool(layers))
        return self.pool(out.last_hidden_state, mask), [self.pool(out.hidden_states[m], mask)
                                                         for m in layers]


# ---------------------------------------------------------------- one training step ---------------
def train_step(model, batch, layers, device, temp=0.05, objective="paper", no_aug=False,
               autocast=None, world=1, accum=1, gather=lambda z: z, scale=lambda loss: loss):
    """One micro-batch of B sentences, both dropout views in one forward pass -> the loss over the
    global batch; gradients accumulated. batch: the tokenizer's (B, L), on the host; model(batch,
    layers): SentenceEncoder's outputs, through common.in_length_groups; layers: eq. 4's M ([]:
    SimCSE); objective "authors": their code's loss (docs/sscl.md, details 2, 3, 5); no_aug:
    SSCL-BERT (Table 2); autocast: the forward's dtype (None: fp32). torchrun: gather(z) = every
    rank's rows; the gradients × world / accum (DDP averages them over the ranks), of scale(loss)
    (fp16: the gradient scaler's)."""
    B = len(batch["input_ids"])
    if not no_aug:  # two dropout views of every sentence: (2B, L)
        batch = {k: torch.cat([v, v]) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        z, z_layers = model(batch, layers)  # (2B, D), or (B, D) with no_aug; per M: the same
    h, h_pos = z[:B].float(), (z if no_aug else z[B:]).float()  # fp32; SSCL-BERT: h_pos = h
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
    scale(loss * world / accum).backward()
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
def micro_batches(tokenizer, sentences, steps, rank, world, batch_size, max_len):
    """Each step's micro-batches on this rank, tokenised on the host (a step or two ahead of the
    loop: common.ahead) -> per step [(B, L) batch]; rank r's k-th: rows [(k·world + r)·B, +B)."""
    tokenizer = copy.deepcopy(tokenizer)  # not the evaluation's: a fast tokenizer is not shared
    for rows in steps:
        yield [tokenizer([sentences[i] for i in rows[j:j + batch_size]], padding=True,
                         truncation=True, max_length=max_len, return_tensors="pt")
               for j in range(rank * batch_size, len(rows), world * batch_size)]


# ---------------------------------------------------------------- main ----------------------------
def main():
    a = common.parse(p)
    rank, world, device, log = harness.start()  # torchrun: one process a GPU
    layers = check_args(a, world)

    # data: every step's sentences drawn from the seed; the STS files read once, now
    data = common.sts_data(a.data_dir, common.TASKS if a.final_eval else [])
    metric, dev_score = select_on(a.select_on, data)  # the score that picks the checkpoint
    sentences = common.read_sentences(a.train)  # no --train: SimCSE's wiki1m_for_simcse.txt
    per_step = a.batch_size * world * a.grad_accum  # sentences a step, all ranks together
    steps = common.step_rows(len(sentences), per_step, a.epochs, a.max_steps, a.seed)

    # the run folder (harness.py), locked; --resume: its state, trained as this command says
    run = harness.Run(a, METHOD, RESUMABLE, check_run, [a.model], device)
    if run.complete(len(steps)):  # nothing is wrong, nothing is left: exit 0
        return
    lr = run.rate(a.lr, 3e-5)  # --lr, the resumed run's, or the paper's

    # the model: BERT (its first --num-layers, Table 1) and SimCSE's pooling
    torch.manual_seed(a.seed)  # the model; dropout from torch's RNG (the data order: its own)
    tokenizer = common.load_pretrained(AutoTokenizer, a.model)
    bert = common.load_pretrained(AutoModel, a.model, num_layers=a.num_layers)
    raw_model = SentenceEncoder(bert, a.pooler, a.proj_dim).to(device)
    model = DDP(raw_model) if world > 1 else raw_model  # torchrun: gradients averaged over ranks
    step_model = common.in_length_groups(  # the model as a step runs it: the host's batch
        torch.compile(model, dynamic=True) if a.compile else model,  # copied to the device in
        a.length_grouping, device)  # length groups (the same outputs, cheaper)
    eval_len = common.positions(bert.config)  # evaluation does not truncate (SimCSE)
    encode = make_encode(raw_model, tokenizer, eval_len, device, a.compile, a.precision)
    meta = dict(method=METHOD, pooler=a.pooler, proj_dim=a.proj_dim, max_len=eval_len,
                layers=layers, objective=a.objective, select_on=a.select_on,
                num_layers=bert.config.num_hidden_layers)  # best/sentemb.json: how it encodes

    # the update: the authors' Trainer (transformers 4.2.1): AdamW (trainer.py L553-583, betas
    # 0.9/0.999, ε 1e-8), the global norm clipped (sscl/trainers.py L472-488), linear decay (L585)
    groups = common.decay_groups(raw_model, a.weight_decay)  # no decay: biases, LayerNorm
    optimizer = AdamW421(groups, lr=lr, eps=1e-8, fused=True)  # one kernel for all parameters
    scheduler = get_linear_schedule_with_warmup(optimizer, a.warmup_steps, len(steps))
    autocast = common.PRECISIONS[a.precision]  # the step's dtype (None: fp32)
    scaler = torch.amp.GradScaler(device.type, enabled=a.precision == "fp16")  # fp16: loss × s
    run.start_training(model=raw_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                       lr=lr, meta=meta)  # what every save holds; signals stop at a step
    first = run.load_resumed_state()  # --resume: each part as saved (a new run: step 0)
    log(f"SSCL: {a.model}, layers {layers or 'none (SimCSE)'}, pooler {a.pooler}, objective "
        f"{a.objective}, {len(sentences)} sentences, {len(steps)} steps of {per_step} sentences, "
        f"lr {lr:g}, {world} process(es), device {device}, {a.precision}")

    batches = common.ahead(micro_batches(  # the steps from `first` on, tokenised ahead
        tokenizer, sentences, steps[max(first - 1, 0):], rank, world, a.batch_size, a.max_len))
    meter = harness.Meter(device, per_step, "sent", a.precision)  # the step lines' speed
    raw_model.train()
    for step in range(first, len(steps) + 1):  # step 0: the model as loaded, evaluated
        if step > 0:  # optimisation step `step`: grad_accum micro-batches of B sentences a rank
            with meter.step(step_model):
                for k, batch in enumerate(next(batches)):  # micro-batch k; DDP syncs after the last
                    with model.no_sync() if world > 1 and k < a.grad_accum - 1 else nullcontext():
                        loss = train_step(
                            step_model, batch, layers, device, temp=a.temp, objective=a.objective,
                            no_aug=a.no_aug, autocast=autocast, world=world, accum=a.grad_accum,
                            gather=harness.gather, scale=scaler.scale)
                    run.watch(step, loss)  # not finite: noted on the device, read below
                scaler.unscale_(optimizer)  # fp16: the gradients / s, clipped as they are
                gnorm = torch.nn.utils.clip_grad_norm_(  # the norm before clipping; 0: no clip
                    raw_model.parameters(), a.max_grad_norm or math.inf)
                scaler.step(optimizer)  # fp16: skipped where a gradient is inf or NaN
                scaler.update()  # fp16: s halved after a skip, doubled after 2000 steps without
                scheduler.step()  # every step, skipped or not
                optimizer.zero_grad(set_to_none=True)
        evaluate = step % a.eval_steps == 0 or step == len(steps)
        read = evaluate or step % a.log_steps == 0  # the host reads the device here
        if read and step > 0:
            run.check_loss()  # one not finite since the last read: one line, the last save good
            if step % a.log_steps == 0 or step == len(steps):
                run.log(step, meter, loss=loss, gnorm=gnorm, lr=scheduler.get_last_lr()[0])
        halt = run.stop_requested(read)  # a signal on any rank: every rank stops at a read
        dev = dev_score(encode, data) if evaluate and rank == 0 else None  # no dropout
        if evaluate or halt:  # checkpoint.pt; with a new best dev score, best/ (rank 0; all wait)
            run.save(step, metric, dev,
                     functools.partial(save_model, raw_model, tokenizer, eval_len))
        if halt:
            break

    with run.finish(step):  # a signal stopped it: saved, exit 128 + its number
        if a.final_eval:  # the best checkpoint, loaded as eval_sts.py loads it (rank 0)
            run.final_table(load_encoder, data, common.TASKS, a.precision)


# ======== a reader of the paper may stop at main(): below, how a run of SSCL is saved and checked
# ---------------------------------------------------------------- the run folder ------------------
def make_encode(encoder, tokenizer, max_len, device, compiled=False, precision=None):
    """encode(list[str]) -> (N, D) without dropout: the one encoder of dev scores, eval_sts.py."""
    return common.compiled_encode(common.encoder(lambda batch: encoder(batch)[0], tokenizer,
                                                 max_len, device, precision, encoder), compiled)


def save_model(encoder, tokenizer, max_len, folder):
    """A plain HF model folder (+ proj.pt), also a sentence-transformers folder (Transformer ->
    Pooling [-> Dense: the projection]) that encodes as we evaluate (CLS without the training MLP,
    or the masked mean)."""
    encoder.bert.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    proj = None
    if encoder.proj is not None:  # ours, and sentence-transformers' Dense
        proj = encoder.proj.state_dict()
        torch.save(proj, os.path.join(folder, "proj.pt"))
    common.write_st_files(folder, encoder.bert.config.hidden_size, max_len, encoder.pooler, proj)


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
    common.check_keys(path, meta, META_TYPES, META_OPTIONAL)
    for rel in RUN_FILES + (("proj.pt",) if meta["proj_dim"] else ()):
        common.check_file(run_dir, rel, where, harness.RECOPY)
    common.check_weights(run_dir, where, harness.RECOPY)
    config = common.load_pretrained(AutoConfig, run_dir)
    n, hidden = config.num_hidden_layers, config.hidden_size

    def bad(key, why, fix):
        common.die(f"{path}: {key} {json.dumps(meta[key])} {why}: {fix}, or {harness.RECOPY}")
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
                       f"damaged or another model's; {harness.RECOPY}")
        if tuple(w.shape) != (meta["proj_dim"], hidden):
            bad("proj_dim", f"disagrees with proj.pt, a projection from {w.shape[-1]} to "
                f"{w.shape[0]} dimensions (the model's hidden size is {hidden}): proj.pt is "
                "damaged or another model's", f"set it to {w.shape[0]}")


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
    """--select-on -> (its name, score(encode, data)), the dev score that picks the checkpoint:
    stsb, STS-B dev (the paper's); transfer, the mean dev accuracy x 100 of SentEval's 7 transfer
    tasks in fasttest mode (the authors' `eval_avg_transfer`), their files read now, once."""
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


if __name__ == "__main__":
    main()
