"""SSCL: "Alleviating Over-smoothing for Unsupervised Sentence Representation"
Chen, Shou, Gong, Pei, Cao, Chang, Jiang, Li. Findings of ACL 2023. arXiv:2305.06154.

Unsupervised SimCSE encodes every sentence twice with dropout and contrasts the two views against the
other sentences of the batch. SSCL observes that the last layers of a PLM over-smooth (adjacent layers
and the tokens of a sentence become near-identical) and adds one negative per sentence taken from the
model itself: the same sentence's representation at an intermediate layer M. The last layer is pushed
away from what layer M already says. Several layers at once = Progressive SSCL (Fig. 3b).

  python sscl.py --layer 11                  # the paper's setting: bert-base-uncased, wiki1m, 1 epoch (GPU)
  python sscl.py --layer 10,11               # Progressive SSCL, the paper's best (77.90) (GPU)
  python sscl.py --model sentence-transformers/all-MiniLM-L6-v2 --train wiki1m_head.txt \\
      --layer 5 --max-steps 100 --eval-steps 50 --output-dir runs/sscl_minilm  # README's quick run: 6 min, 2 cores
  python sscl.py --analyze --model sentence-transformers/all-MiniLM-L6-v2 runs/simcse_s1 runs/sscl_s1 \
      --sentence "A man is playing a guitar." --plot fig.png   # eqs. 1-2, Fig. 1/4/5 (README, "Figures")
"""
import argparse
import contextlib
import os
import time

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModel, AutoTokenizer

import common
import figures
import runs

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
# --- general ---
p.add_argument("--model", nargs="+", default=["bert-base-uncased"], help="hub name or local folder (paper: "
               "bert-base-uncased); --analyze takes several, to compare them")
p.add_argument("--train", default=None, help="one sentence a line (default: SimCSE's wiki1m_for_simcse.txt)")
p.add_argument("--data-dir", default=None, help="STS data: DIR/downstream/{STS,SICK} (else $SENTEMB_DATA)")
p.add_argument("--output-dir", default="runs/sscl", help="the best checkpoint (STS-B dev) is saved here")
p.add_argument("--epochs", type=common.POS_INT, default=1, help="paper: 1")
p.add_argument("--max-steps", type=common.STEPS, default=-1,
               help="stop after N optimisation steps (-1: run the epochs)")
p.add_argument("--batch-size", type=common.POS_INT, default=64,
               help="sentences per GPU and step (paper: 64 on one GPU); "
               "under torchrun the in-batch negatives come from all GPUs: world_size x batch-size")
p.add_argument("--grad-accum", type=common.POS_INT, default=1,
               help="micro-batches of --batch-size per optimisation step; "
               "each micro-batch only sees its own in-batch negatives (accumulation does not enlarge the pool)")
p.add_argument("--length-grouping", action=argparse.BooleanOptionalAction, default=True,
               help="run a step's texts in length groups, each padded only to its own longest: the same loss and "
               "gradients for the cost of the real tokens (--no-length-grouping: one forward, padded to the longest)")
p.add_argument("--lr", type=common.POS_FLOAT, default=None, help="default 3e-5 (paper; 1e-5 for large models); "
               "with --resume: the run's own, unless given")
p.add_argument("--max-len", type=common.POS_INT, default=32, help="paper: 32 tokens")
p.add_argument("--eval-steps", type=common.POS_INT, default=125,
               help="STS-B dev every N steps, also at step 0 and at the end")
p.add_argument("--seed", type=common.SEED, default=42)
p.add_argument("--log-steps", type=common.POS_INT, default=10, help="print the loss every N steps")
p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too (always on CUDA): ~1.7x faster "
               "training on CPUs with bf16 instructions; evaluation stays fp32")
p.add_argument("--quiet", action="store_true", help="no progress bars (shown only when stderr is a terminal)")
p.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint.pt")
p.add_argument("--final-eval", action=argparse.BooleanOptionalAction, default=True,
               help="print the 7-task table of the best checkpoint at the end")
# --- SSCL ---
p.add_argument("--layer", default="11", help="intermediate layer(s) M whose representation is a negative: "
               "hidden_states[M], 1..num_layers-1; 0 = plain SimCSE; '10,11' = Progressive SSCL (paper: 11)")
p.add_argument("--pooler", default="cls", choices=["cls", "avg"],
               help="cls: CLS + MLP head in training, raw CLS at evaluation (SimCSE); avg: masked mean")
p.add_argument("--no-aug", action="store_true", help="SSCL-BERT (Table 2): the positive is the sentence's own "
               "representation, no dropout view; only the negatives shape the space")
p.add_argument("--proj-dim", type=common.NONNEG_INT, default=0,
               help="linear projection of the sentence vector to this size, "
               "kept at evaluation (Table 5: 128/256); 0 = none")
p.add_argument("--temp", type=common.POS_FLOAT, default=0.05, help="temperature tau (Table 6; paper: 0.05)")
p.add_argument("--loss-mix", action="store_true", help="authors' code: mean of the SSCL loss and the plain "
               "SimCSE loss (the paper describes the SSCL loss alone)")
p.add_argument("--analyze", action="store_true", help="no training: the over-smoothing diagnostics of each --model "
               "on STS-B test (eq. 1 token-wise and eq. 2 inter-layer similarity, per layer)")
p.add_argument("--plot", default=None, metavar="FILE.png", help="with --analyze: draw Fig. 1 and Fig. 4 (and Fig. 5 "
               "with --sentence) into this PNG; needs matplotlib")
p.add_argument("--sentence", default=None, help="with --analyze: also the token-by-token cosine matrix of this "
               "sentence at the last layer (Fig. 5)")
common.show_ranges(p)


def parse_layers(spec, num_layers):
    """'11' -> [11]; '10,11' -> [10, 11]; '0' -> [] (SimCSE). Bad values stop with one line."""
    try:
        layers = sorted({int(x) for x in spec.split(",")})
    except ValueError:
        common.die(f"--layer '{spec}' is not a comma-separated list of integers: e.g. --layer 11 or --layer 10,11")
    if layers == [0]:
        return []
    if any(not 1 <= m <= num_layers - 1 for m in layers):
        common.die(f"--layer {spec}: this model has {num_layers} layers, so M must be in 1..{num_layers - 1} "
                   f"(or --layer 0 for plain SimCSE)")
    return layers


# ---------------------------------------------------------------- model -------------------------
class SentenceEncoder(torch.nn.Module):
    """BERT + pooling. The MLP head (SimCSE's `MLPLayer`, cls pooling) is used in training only;
    the projection (--proj-dim) is part of the embedding and kept at evaluation."""

    def __init__(self, bert, pooler, proj_dim=0):
        super().__init__()
        hidden = bert.config.hidden_size
        self.bert, self.pooler = bert, pooler
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh()) if pooler == "cls" else None
        self.proj = torch.nn.Linear(hidden, proj_dim) if proj_dim else None

    def pool(self, hidden, mask):
        """hidden: (N, L, H), mask: (N, L) -> (N, H or proj_dim). Same pooling for every layer."""
        if self.pooler == "cls":
            z = hidden[:, 0]
            if self.training:
                z = self.mlp(z)
        else:
            m = mask.unsqueeze(-1).to(hidden.dtype)
            z = (hidden * m).sum(1) / m.sum(1)
        return self.proj(z) if self.proj is not None else z

    def forward(self, batch, layers=()):
        """-> (last-layer pooled (N, D), [pooled hidden_states[M] (N, D) for M in layers])"""
        out = self.bert(**batch, output_hidden_states=bool(layers))
        mask = batch["attention_mask"]
        return self.pool(out.last_hidden_state, mask), [self.pool(out.hidden_states[m], mask) for m in layers]


def make_encode(encoder, tokenizer, max_len, device):
    """encode(list[str]) -> (N, D): the one function behind dev evaluation and eval_sts.py."""
    def embed(batch):
        with common.autocast(device):
            return encoder(batch)[0]
    return lambda sentences: common.encode_in_batches(embed, tokenizer, sentences, max_len, device)


def load_encoder(run_dir, meta, device):
    """eval_sts.py's entry point for a run folder of this script (runs.read_meta checked its
    files)."""
    bert = common.load_pretrained(AutoModel, run_dir, strict=True)  # every weight from the file
    encoder = SentenceEncoder(bert, meta["pooler"], meta["proj_dim"])
    if meta["proj_dim"]:
        runs.load_weights(encoder.proj, os.path.join(run_dir, "proj.pt"))
    max_len = common.check_max_len(meta["max_len"], bert.config, run_dir, "sentemb.json's max_len")
    tokenizer = common.load_pretrained(AutoTokenizer, run_dir)
    return make_encode(encoder.to(device).eval(), tokenizer, max_len, device)


# ---------------------------------------------------------------- loss --------------------------
def sscl_loss(h, h_pos, h_negs, temp):
    """h, h_pos: (B, D) last layer, two views; h_negs: list of (B, D), layer-M representations.
    SimCSE eq. 4 with SSCL's extra negatives (§3.2): row i's logits are
    [cos(h_i, h_j⁺)/τ]_j ⊕ [cos(h_i, h_j^M)/τ]_j for every M, and the target is column i."""
    h = F.normalize(h, dim=-1)
    logits = torch.cat([h @ F.normalize(z, dim=-1).T for z in [h_pos, *h_negs]], dim=1) / temp  # (B, B·(1+|M|))
    return F.cross_entropy(logits, torch.arange(len(h), device=h.device))


# ---------------------------------------------------------------- analysis ----------------------
@torch.no_grad()
def over_smoothing(name, a, sents, device):
    """Per layer l = 0 (embeddings) .. n, means over the sentences:
    eq. 1 token-wise similarity: the mean cos(h_i^l, h_j^l) over real tokens i ≠ j of a sentence;
    eq. 2 inter-layer similarity: cos(s^l, s^(l+1)), s^l the pooled sentence vector (--pooler).
    With --sentence: also that sentence's last-layer token-by-token cosine matrix (Fig. 5) and its tokens."""
    tokenizer = common.load_pretrained(AutoTokenizer, name)
    bert = common.load_pretrained(AutoModel, name).to(device).eval()
    common.check_max_len(a.max_len, bert.config, name)
    n = bert.config.num_hidden_layers
    tok_sim, layer_sim = torch.zeros(n + 1), torch.zeros(n)
    for i in common.progress(range(0, len(sents), 128), "analyze", unit="batch"):
        batch = common.tokenize(tokenizer, sents[i:i + 128], a.max_len, device)
        with common.autocast(device):
            hs = bert(**batch, output_hidden_states=True).hidden_states  # n+1 × (b, L, H)
        mask = batch["attention_mask"].float()  # (b, L)
        pair = mask.unsqueeze(1) * mask.unsqueeze(2) * (1 - torch.eye(mask.shape[1], device=device))  # (b, L, L) i≠j
        pooled = []
        for l, h in enumerate(hs):
            h = F.normalize(h.float(), dim=-1)
            cos = h @ h.transpose(1, 2)  # (b, L, L)
            tok_sim[l] += ((cos * pair).sum((1, 2)) / pair.sum((1, 2)).clamp(min=1)).sum().cpu()
            pooled.append(h[:, 0] if a.pooler == "cls" else (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True))
        for l in range(n):
            layer_sim[l] += F.cosine_similarity(pooled[l], pooled[l + 1], dim=-1).sum().cpu()
    heat = None
    if a.sentence:  # Fig. 5: (L, L) cosines of the last layer's tokens, special tokens included
        batch = common.tokenize(tokenizer, [a.sentence], a.max_len, device)
        h = F.normalize(bert(**batch).last_hidden_state[0].float(), dim=-1)  # (L, H)
        heat = ((h @ h.T).cpu().numpy(), tokenizer.convert_ids_to_tokens(batch["input_ids"][0]))
    return (tok_sim / len(sents)).tolist(), (layer_sim / len(sents)).tolist(), heat


def analyze(a, device):
    """Prints eqs. 1-2 per layer for each --model; --plot draws Fig. 1 (eq. 2) and Fig. 4 (eq. 1) with one line
    per model, and with --sentence a Fig. 5 heat map per model."""
    figures.check(a.plot)
    rows = common.load_sts(common.senteval_dir(a.data_dir), "STS-B")["test"]
    sents = sorted({s for r in rows for s in r[:2]})
    res = {name: over_smoothing(name, a, sents, device) for name in a.model}
    for name, (tok_sim, layer_sim, heat) in res.items():
        print(f"over-smoothing of {name} on {len(sents)} STS-B test sentences ({a.pooler} pooling)")
        print(f"{'layer':>5} {'token-wise sim (eq. 1)':>23} {'sim to next layer (eq. 2)':>26}")
        for l, t in enumerate(tok_sim):
            print(f"{l:5d} {t:23.4f} " + (f"{layer_sim[l]:26.4f}" if l < len(layer_sim) else ""))
        if heat:
            print(f"Fig. 5, last-layer token cosines of {a.sentence!r}: mean off-diagonal "
                  f"{(heat[0].sum() - heat[0].trace()) / (len(heat[1]) ** 2 - len(heat[1])):.4f}")
    if a.plot:
        short = [os.path.basename(os.path.normpath(m)) for m in a.model]
        label = dict(zip(a.model, short if len(set(short)) == len(short) else a.model))
        panels = [dict(kind="lines", title="Fig. 1: similarity of adjacent layers (eq. 2)", xlabel="layer l",
                       ylabel=f"cos(s^l, s^(l+1)), {a.pooler} pooling", series={
                           label[m]: (range(len(r[1])), r[1]) for m, r in res.items()}),
                  dict(kind="lines", title="Fig. 4: token-wise similarity (eq. 1)", xlabel="layer l (0 = embeddings)",
                       ylabel="mean cos(h_i, h_j), i ≠ j", series={
                           label[m]: (range(len(r[0])), r[0]) for m, r in res.items()})]
        panels += [dict(kind="heat", title=f"Fig. 5: {label[m]}, last layer", matrix=r[2][0], labels=r[2][1],
                        vmin=-1, vmax=1, cbar="cosine", xlabel="token", ylabel="token")
                   for m, r in res.items() if r[2]]
        figures.draw(a.plot, panels, f"Over-smoothing on STS-B test ({len(sents)} sentences)")


# ---------------------------------------------------------------- training ----------------------
def main():
    a = p.parse_args()
    common.QUIET = a.quiet
    transformers.logging.disable_progress_bar()
    rank, world, device = common.init_distributed()
    if a.analyze:
        return analyze(a, device)
    if a.plot or a.sentence:
        common.die("--plot and --sentence draw the analysis: add --analyze (no training)")
    if len(a.model) > 1:
        common.die(f"--model got {len(a.model)} models: training takes one (several only with --analyze)")
    a.model = a.model[0]
    if a.batch_size * world < 2:
        common.die("--batch-size must be at least 2: in-batch negatives need other sentences in the batch")
    config = common.load_pretrained(AutoConfig, a.model)
    if config.model_type not in transformers.models.auto.modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        common.die(f"'{a.model}' is a {config.model_type} model, not a bidirectional encoder: SSCL trains BERT-like "
                   "models (bert, roberta, ...); pass one as --model")
    layers = parse_layers(a.layer, config.num_hidden_layers)
    common.check_max_len(a.max_len, config, a.model)
    data = common.check_sts(common.senteval_dir(a.data_dir), common.TASKS if a.final_eval else [])
    sentences = common.read_sentences(common.train_file(a.train, "wiki1m_for_simcse.txt"))
    per_step = a.batch_size * world * a.grad_accum  # sentences per optimisation step, all ranks together
    if len(sentences) < per_step:
        common.die(f"{len(sentences)} training sentences < {per_step} per step: lower --batch-size or --grad-accum")
    ckpt_path = runs.open_run(a.output_dir, a.resume, [a.model], rank)  # locks it; refuses to overwrite a run
    state = runs.load_state(ckpt_path, "sscl", a, device) if a.resume else None
    lr = a.lr or (state["args"]["lr"] if state else 3e-5)

    # seeding: the data order comes from its own generator (the same on every rank), dropout from torch's RNG
    common.seed_everything(a.seed)
    tokenizer = common.load_pretrained(AutoTokenizer, a.model)
    encoder = SentenceEncoder(common.load_pretrained(AutoModel, a.model), a.pooler, a.proj_dim).to(device)
    if getattr(encoder.bert, "pooler", None) is not None:  # BERT's own pooler is used by neither pooling: frozen
        encoder.bert.pooler.requires_grad_(False)
    model = encoder if world == 1 else torch.nn.parallel.DistributedDataParallel(encoder)
    steps_per_epoch = len(sentences) // per_step  # the last incomplete step is dropped
    total = a.epochs * steps_per_epoch if a.max_steps < 0 else a.max_steps
    runs.complete(state, total, a.output_dir)  # --resume of a finished run: says so, exit 0
    params = [q for q in encoder.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=True)  # fused: one kernel for all parameters
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / total)  # linear decay, as SimCSE's Trainer
    eval_len = encoder.bert.config.max_position_embeddings  # evaluation does not truncate (SimCSE, SentEval)
    encode = make_encode(encoder, tokenizer, eval_len, device)
    step, best = 0, -float("inf")
    log = print if rank == 0 else (lambda *_, **__: None)
    if state:
        runs.fit(lambda: (encoder.load_state_dict(state["encoder"]), opt.load_state_dict(state["opt"]),
                            sched.load_state_dict(state["sched"])), f"'{a.model}'")
        step, best = state["step"], state["best"]
        torch.set_rng_state(state["rng"])
        runs.resume_lr(opt, lr, state, log, sched)
    log(f"SSCL: {a.model}, layers {layers or 'none (SimCSE)'}, pooler {a.pooler}, {len(sentences)} sentences, "
        f"{total} steps of {per_step} sentences, lr {lr:g}, {world} process(es), device {device}"
        + (f" ({common.bf16_note(device)})" if a.bf16 else ""))

    def training_state():
        return {"method": "sscl", "args": {**runs.run_args(a), "lr": lr}, "encoder": encoder.state_dict(),
                "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step, "best": best,
                "rng": torch.get_rng_state()}

    def save_model(folder):  # a plain HF model folder (+ proj.pt), also a sentence-transformers folder
        encoder.bert.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if encoder.proj is not None:
            torch.save(encoder.proj.state_dict(), os.path.join(folder, "proj.pt"))
        pooling = "cls" if a.pooler == "cls" else "mean"  # raw CLS at evaluation: the MLP is training-only
        runs.save_sentence_transformers(folder, encoder.bert.config.hidden_size, pooling, eval_len, encoder.proj)

    def save(dev=None):  # rank 0 writes (the training state; with a new best dev score, the model too), all wait
        nonlocal best
        if rank == 0 and dev is not None and dev > best:
            best = dev
            runs.save_best(a.output_dir, save_model, training_state(), params, method="sscl", pooler=a.pooler,
                             proj_dim=a.proj_dim, max_len=eval_len, layers=layers, stsb_dev=dev, step=step)
        elif rank == 0:
            runs.save_state(training_state(), a.output_dir, params)
        if world > 1:
            torch.distributed.barrier()

    def evaluate_and_save():
        dev = None
        if rank == 0:
            encoder.eval()
            dev = common.evaluate(encode, data, ["STS-B"], split="dev")["STS-B"]
            encoder.train()
        save(dev)
        if rank == 0:
            log(f"step {step:>5}  stsb_dev {dev:.2f}  (best {best:.2f})", flush=True)

    def micro_step(sents):
        """One micro-batch of B sentences on this rank -> loss over the global batch (world·B rows)."""
        batch = common.tokenize(tokenizer, sents, a.max_len, device)  # (B, L)
        if not a.no_aug:  # two dropout views of every sentence in one forward pass: (2B, L)
            batch = {k: torch.cat([v, v]) for k, v in batch.items()}
        run = lambda b: model(b, layers)  # noqa: E731
        with common.autocast(device, a.bf16):  # (2B, D), or (B, D) with --no-aug; per M: the same
            z, z_layers = common.by_length(run, batch) if a.length_grouping else run(batch)
        B = len(sents)  # the loss in fp32, outside autocast
        h, h_pos = z[:B].float(), (z if a.no_aug else z[B:]).float()  # SSCL-BERT: the positive is h itself
        h_negs = [zm[:B].float() for zm in z_layers]  # layer-M representations of view 1, the anchor's own pass
        h, h_pos, h_negs = common.gather(h), common.gather(h_pos), [common.gather(n) for n in h_negs]
        loss = sscl_loss(h, h_pos, h_negs, a.temp)
        if a.loss_mix and h_negs:  # NOTE(authors' code): averaged with the plain SimCSE loss
            loss = (loss + sscl_loss(h, h_pos, [], a.temp)) / 2
        # every rank holds the same global loss; DDP averages gradients over ranks, hence × world
        (loss * world / a.grad_accum).backward()
        return loss

    encoder.train()
    with runs.StopOnSignal() as stop:  # Ctrl-C / SIGTERM: stop at the next step boundary, saved
        if step == 0:
            evaluate_and_save()
        t0, seen = time.perf_counter(), 0
        while step < total and not stop(device, world):
            epoch = step // steps_per_epoch
            order = torch.randperm(len(sentences), generator=torch.Generator().manual_seed(a.seed + epoch)).tolist()
            for b in range(step % steps_per_epoch, steps_per_epoch):
                step_sents = order[b * per_step:(b + 1) * per_step]  # this step's sentences, all ranks
                opt.zero_grad(set_to_none=True)
                for k in range(a.grad_accum):  # micro-batch k: rank r takes its slice of B
                    start = (k * world + rank) * a.batch_size
                    sync = contextlib.nullcontext if world == 1 or k == a.grad_accum - 1 else model.no_sync
                    with sync():  # gradients are all-reduced once, after the last micro-batch
                        loss = micro_step([sentences[i] for i in step_sents[start:start + a.batch_size]])
                    if not torch.isfinite(loss):  # before opt.step(): the weights are still the last good ones
                        common.die(f"loss became {loss.item()} at step {step}: resume with a lower --lr "
                                   f"(--resume --lr ...) or check the data; the run in {a.output_dir} is kept")
                opt.step()
                sched.step()
                step, seen = step + 1, seen + per_step
                if step % a.log_steps == 0 or step == total:
                    log(f"step {step:>5}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                        f"sent/s {seen / (time.perf_counter() - t0):.1f}", flush=True)
                halt = stop(device, world)  # the same answer on every rank
                if step == total or step % a.eval_steps == 0:
                    evaluate_and_save()
                    t0, seen = time.perf_counter(), 0
                elif halt:
                    save()
                if step == total or halt:
                    break
        if stop.signum:
            stop.exit(step, a.output_dir)

        # ------------------------------------------------------------ final table ---------------
        stop.now = True  # nothing left to save: a signal ends the process at once
        if a.final_eval and rank == 0:
            from eval_sts import load_encoder as load_any
            print(f"best checkpoint (STS-B dev {best:.2f}) on the test sets:")
            print(common.format_table(common.evaluate(load_any(a.output_dir, device=device), data)))


if __name__ == "__main__":
    main()
