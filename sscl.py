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
  eqs. 1-2, Figs. 1, 4, 5 (--analyze)        sscl_analysis.py
  Table 1: the first N layers (--num-layers); Table 3: --select-on transfer; Fig. 6: --convergence

  python sscl.py --layer 11     # the paper: BERT-base, wiki1m, 1 epoch (GPU); 10,11: Progressive
  python sscl.py --model sentence-transformers/all-MiniLM-L6-v2 --train wiki1m_head.txt \\
      --layer 5 --max-steps 100 --eval-steps 50 --output-dir runs/sscl_minilm   # CPU: minutes
"""
import functools
import os

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

import common
import runs

p = common.parser(__doc__)
# --- general: the paper's values as defaults (the shared flags: common.training_flags) ---
p.add_argument("--model", nargs="+", default=["bert-base-uncased"],
               help="hub name or local folder (paper: bert-base-uncased); --analyze takes several")
p.add_argument("--train", help="one sentence a line (default: SimCSE's wiki1m_for_simcse.txt)")
common.training_flags(p, output_dir="runs/sscl", lr=3e-5, lr_note=" (1e-5 for large models)",
                      max_len=32, batch_size=64, eval_steps=125)
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
p.add_argument("--analyze", action="store_true", help="no training: eqs. 1-2 per layer of each "
               "--model on STS-B test (sscl_analysis.py)")
p.add_argument("--plot", metavar="FILE.png", help="--analyze: draw Figs. 1, 4 (and 5)")
p.add_argument("--sentence", help="--analyze: this sentence's last-layer token cosines (Fig. 5)")
p.add_argument("--convergence", action="store_true", help="--analyze: Fig. 6, the runs' dev curves")
common.show_ranges(p)


# ---------------------------------------------------------------- the loss ----------------------
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


# ---------------------------------------------------------------- the model ---------------------
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


# ---------------------------------------------------------------- one training step -------------
def train_step(model, tokenizer, sentences, layers, a, world, device):
    """One micro-batch of B sentences on this rank: both dropout views in one forward pass, the loss
    over the global batch (world·B rows), its gradients accumulated. -> the loss."""
    batch = common.tokenize(tokenizer, sentences, a.max_len, device)  # (B, L)
    if not a.no_aug:  # two dropout views of every sentence: (2B, L)
        batch = {k: torch.cat([v, v]) for k, v in batch.items()}
    with common.autocast(device, a.bf16):  # (2B, D), or (B, D) with --no-aug; per M: the same
        z, z_layers = common.run_batch(functools.partial(model, layers=layers), batch,
                                       a.length_grouping)  # in length groups: the same outputs
    B = len(sentences)  # the loss in fp32, outside autocast
    h, h_pos = z[:B].float(), (z if a.no_aug else z[B:]).float()  # SSCL-BERT: the positive is h
    h, h_pos = common.gather(h), common.gather(h_pos)  # (world·B, D): the global batch
    # NOTE(authors' code): docs/sscl.md details 2, 3, 5, which --objective authors switches
    if a.objective == "paper":  # view 1's layer-M vectors (the anchor's pass), all ranks
        negs = [common.gather(zm[:B].float()) for zm in z_layers]  # per M: (world·B, D)
        loss = sscl_loss(h, h_pos, negs, a.temp)
    else:  # both views' layer-M vectors, this rank's only; averaged with SimCSE's loss
        negs = [v.float() for zm in z_layers for v in (zm[:B], zm[B:])]  # per M: 2 × (B, D)
        loss = sscl_loss_authors(h, h_pos, negs, a.temp)
    # DDP averages gradients over ranks, each holding the global loss: × world (the authors'
    # Trainer does not scale by world, which AdamW cancels up to its eps)
    (loss * world / a.grad_accum).backward()
    return loss


# ---------------------------------------------------------------- encode, save, load ------------
def make_encode(encoder, tokenizer, max_len, device):
    """encode(list[str]) -> (N, D): the one function behind dev evaluation and eval_sts.py."""
    return common.encoder(lambda batch: encoder(batch)[0], tokenizer, max_len, device)


def save_model(encoder, tokenizer, max_len, folder):
    """A plain HF model folder (+ proj.pt) and a sentence-transformers folder (CLS without MLP)."""
    encoder.bert.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if encoder.proj is not None:
        torch.save(encoder.proj.state_dict(), os.path.join(folder, "proj.pt"))
    pooling = "cls" if encoder.pooler == "cls" else "mean"  # sentence-transformers' names
    runs.save_sentence_transformers(folder, encoder.bert.config.hidden_size, pooling, max_len,
                                    encoder.proj)


def load_encoder(run_dir, meta, device):
    """eval_sts.py's entry point for a run folder of this script (runs.read_meta checked it)."""
    bert = common.load_pretrained(AutoModel, run_dir, strict=True)  # every weight from the file
    encoder = SentenceEncoder(bert, meta["pooler"], meta["proj_dim"])
    if meta["proj_dim"]:
        runs.load_weights(encoder.proj, os.path.join(run_dir, "proj.pt"))
    max_len = common.check_max_len(meta["max_len"], bert.config, run_dir, "sentemb.json's max_len")
    tokenizer = common.load_pretrained(AutoTokenizer, run_dir)
    return make_encode(encoder.to(device).eval(), tokenizer, max_len, device)


# ---------------------------------------------------------------- main --------------------------
def main():
    a = common.parse(p)
    if a.analyze:  # the paper's over-smoothing figures, no training
        import sscl_analysis
        return sscl_analysis.analyze(a, common.pick_device())
    run = runs.Run(a, "sscl", p)  # torchrun: this process's rank, the world size, its device
    layers = check_args(a, run.world)

    # data: every step's sentences drawn from the seed; the STS files read once, now
    data = common.check_sts(common.senteval_dir(a.data_dir), common.TASKS if a.final_eval else [])
    metric, dev_score = common.dev_score(a.select_on, data)  # the score that picks the checkpoint
    sentences = common.read_sentences(common.train_file(a.train, "wiki1m_for_simcse.txt"))
    per_step = a.batch_size * run.world * a.grad_accum  # sentences a step, all ranks together
    steps = common.step_rows(len(sentences), per_step, a.epochs, a.max_steps, a.seed)
    lr = run.open([a.model], len(steps))  # the run folder, locked; --resume: its state

    common.seed_everything(a.seed)  # the model; dropout from torch's RNG (the data order: its own)
    tokenizer = common.load_pretrained(AutoTokenizer, a.model)
    bert = common.load_pretrained(AutoModel, a.model, num_layers=a.num_layers)  # Table 1: cut
    encoder = SentenceEncoder(bert, a.pooler, a.proj_dim)
    model = run.wrap(encoder.to(run.device))  # DDP under torchrun
    eval_len = common.positions(encoder.bert.config)  # evaluation does not truncate (SimCSE)
    encode = make_encode(encoder, tokenizer, eval_len, run.device)

    # the optimiser: SimCSE's Trainer defaults, AdamW with linear decay to 0, no warm-up
    params = [q for q in encoder.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=True)  # fused: one kernel for all parameters
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / len(steps))
    run.resume(f"'{a.model}'", encoder=encoder, opt=opt, sched=sched)  # --resume; signals caught
    run.start(f"SSCL: {a.model}, layers {layers or 'none (SimCSE)'}, pooler {a.pooler}, "
              f"objective {a.objective}, {len(sentences)} sentences, {len(steps)} steps of "
              f"{per_step} sentences, lr {lr:g}")

    encoder.train()
    for step in run.steps(len(steps)):  # 0 (the model as loaded), 1, ..., len(steps)
        if step > 0:  # optimisation step `step`: grad_accum micro-batches of B sentences per rank
            opt.zero_grad(set_to_none=True)
            for k in range(a.grad_accum):
                sents = [sentences[i] for i in run.rows(steps[step - 1], k, a.batch_size)]
                with run.sync(model, k, a.grad_accum):
                    loss = train_step(model, tokenizer, sents, layers, a, run.world, run.device)
                run.check_finite(loss)  # NaN guard, before the weights change
            opt.step()
            sched.step()
            if step % a.log_steps == 0 or step == len(steps):
                run.log_step(f"loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}", per_step)
        halt = run.stopping()  # SIGINT/SIGTERM on any rank: save this step, then stop
        evaluate = step % a.eval_steps == 0 or step == len(steps)
        if evaluate or halt:  # the training state; with a new best dev score, the model too
            dev = run.evaluate(encoder, dev_score, encode, data) if evaluate else None
            state = {"encoder": encoder.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict()}
            write = functools.partial(save_model, encoder, tokenizer, eval_len)
            run.save(state, params, dev, write, metric, pooler=a.pooler, proj_dim=a.proj_dim,
                     max_len=eval_len, layers=layers, objective=a.objective, select_on=a.select_on,
                     num_layers=bert.config.num_hidden_layers, step=step, **{metric: dev})
        if halt:
            break
    run.end()  # the peak memory; after a signal: exit, saying how to resume
    run.final_eval(data)  # the best checkpoint, loaded as eval_sts.py loads it, on the test sets


# ---------------------------------------------------------------- argument checks ---------------
def check_args(a, world):
    """Every check that stops training (one error line, exit 2). -> the layers M."""
    if a.plot or a.sentence or a.convergence:
        common.die("--plot, --sentence and --convergence draw the analysis: add --analyze")
    if len(a.model) > 1:
        common.die(f"--model got {len(a.model)} models: training takes one (several: --analyze)")
    a.model = a.model[0]
    if a.batch_size * world < 2:
        common.die("--batch-size must be at least 2: in-batch negatives need other sentences")
    if a.objective == "authors" and a.no_aug:
        common.die("--no-aug has no counterpart in the authors' code (it always encodes two "
                   "dropout views): use it with --objective paper")
    config = common.check_encoder(a.model, a.max_len, num_layers=a.num_layers)  # BERT-like
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
