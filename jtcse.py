"""JTCSE: "Joint Tensor-Modulus Constraints and Cross-Attention for Unsupervised Contrastive Learning of
Sentence Embeddings". Zong, Yi, Shi, Wang, Xu. 2025. arXiv:2505.02366.

Two BERT towers (I and II, each already trained with unsupervised SimCSE) are trained together. Each
tower keeps SimCSE's InfoNCE (eq. 11); the towers also serve as each other's positives (ICNCE, eq. 12),
both with their plain outputs and with a cross stream in which, at every k-th layer (a "CAEL", eqs.
7-10), a tower's attention weights are applied to the OTHER tower's values. This raises the attention
paid to CLS (eq. 6). A modulus term (eqs. 13-14) asks the two towers' pooler outputs of a positive pair
to have equal length, weighted by -log cos of their CLS vectors. The embedding is CLS(I) + CLS(II) with
no cross-attention; `--distill` compresses the twin into one tower ("JTCSE D", §IV-C).

  python jtcse.py --model-a runs/simcse_1 --model-b runs/simcse_2 --train wiki1m_for_simcse.txt  # paper (GPU)
  OMP_NUM_THREADS=1 python jtcse.py --model-a sentence-transformers/all-MiniLM-L6-v2 --model-b runs/sscl_minilm \\
      --train wiki1m_head.txt --no-add-sick --max-len 32 --lr 2e-5 --max-steps 40 --eval-steps 10 \\
      --output-dir runs/jtcse_minilm                  # README's CPU run: 23 min on 2 cores shared with other jobs
  OMP_NUM_THREADS=1 python jtcse.py --distill runs/jtcse_minilm --model-a sentence-transformers/all-MiniLM-L6-v2 \\
      --train wiki1m_head.txt --no-add-sick --max-len 32 --max-steps 30 --eval-steps 10 \\
      --output-dir runs/jtcse_d_minilm                # JTCSE D: 7 min
  python jtcse.py --analyze runs/jtcse_minilm --model-a sentence-transformers/all-MiniLM-L6-v2 \
      --plot fig.png                                  # E_CLS (eq. 6) and Fig. 5 (README, "Figures")
"""
import argparse
import contextlib
import os
import time

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoTokenizer, BertModel

import common
import runs

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
# --- general ---
p.add_argument("--model-a", default="bert-base-uncased", help="tower I: hub name or local BERT folder (paper: "
               "bert-base-uncased already trained with unsupervised SimCSE on round-trip-translated data)")
p.add_argument("--model-b", default="bert-base-uncased", help="tower II, same tokenizer as tower I (paper: "
               "a second SimCSE-trained bert-base-uncased, other round-trip-translated data)")
p.add_argument("--train", default=None, help="one sentence a line (default: SimCSE's wiki1m_for_simcse.txt)")
p.add_argument("--data-dir", default=None, help="STS data: DIR/downstream/{STS,SICK} (else $SENTEMB_DATA)")
p.add_argument("--output-dir", default="runs/jtcse", help="the best checkpoint (STS-B dev) is saved here")
p.add_argument("--epochs", type=common.POS_INT, default=1, help="paper: 1")
p.add_argument("--max-steps", type=common.STEPS, default=-1,
               help="stop after N optimisation steps (-1: run the epochs)")
p.add_argument("--batch-size", type=common.POS_INT, default=64,
               help="sentences per step PER GPU (paper: 64); under torchrun "
               "the in-batch negatives come from all GPUs: world_size x batch-size")
p.add_argument("--grad-accum", type=common.POS_INT, default=1,
               help="micro-batches of --batch-size per optimisation step; "
               "each micro-batch only sees its own in-batch negatives (accumulation does not enlarge the pool)")
p.add_argument("--length-grouping", action=argparse.BooleanOptionalAction, default=True,
               help="run a step's texts in length groups, each padded only to its own longest: the same loss and "
               "gradients for the cost of the real tokens (--no-length-grouping: one forward, padded to the longest)")
p.add_argument("--lr", type=common.POS_FLOAT, default=None, help="default 1.3e-6 (authors' value: small, because "
               "the towers are ALREADY fine-tuned sentence encoders); with --distill 1e-5 (authors' supplementary); "
               "with --resume: the run's own, unless given")
p.add_argument("--max-len", type=common.POS_INT, default=64, help="paper: 64 tokens")
p.add_argument("--eval-steps", type=common.POS_INT, default=100,
               help="STS-B dev every N steps, also at step 0 and at the end")
p.add_argument("--seed", type=common.SEED, default=42)
p.add_argument("--log-steps", type=common.POS_INT, default=10, help="print the loss every N steps")
p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too (always on CUDA): faster training on "
               "CPUs with bf16 instructions; evaluation stays fp32")
p.add_argument("--quiet", action="store_true", help="no progress bars (shown only when stderr is a terminal)")
p.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint.pt")
p.add_argument("--final-eval", action=argparse.BooleanOptionalAction, default=True,
               help="print the 7-task table of the best checkpoint at the end")
# --- JTCSE ---
p.add_argument("--num-cael", type=common.NONNEG_INT, default=None,
               help="number of cross-attention encoder layers: layer j "
               "(1-based) is a CAEL when j mod (layers/num_cael) = 0, so it must divide the layer count (eq. 7, "
               "Table IX); default layers/2 (every 2nd layer: 6 for BERT-base, the paper's best; 3 for a 6-layer "
               "MiniLM), 1 for an odd layer count; 0 = no cross stream (ICNCE on plain outputs only)")
p.add_argument("--temp", type=common.POS_FLOAT, default=0.05, help="temperature tau of every InfoNCE (paper: 0.05)")
p.add_argument("--add-sick", action=argparse.BooleanOptionalAction, default=True, help="add the unlabeled "
               "sentences of SICK train (from --data-dir) to --train, as the paper's footnote 7 adds SICK-R's")
p.add_argument("--no-nce", action="store_true", help="drop L_NCE, eq. 11 (Table X ablation)")
p.add_argument("--no-icnce", action="store_true", help="drop L_ICNCE, eq. 12 (Table X ablation)")
p.add_argument("--no-ictm", action="store_true", help="drop L_ICTM, eqs. 13-14 (Table X ablation)")
p.add_argument("--tmc-half", action="store_true", help="authors' code: divide the modulus ratio of eq. 13 by 2")
p.add_argument("--distill", default=None, metavar="TEACHER_DIR", help="JTCSE D: train one fresh tower "
               "(initialised from --model-a) to match a trained twin's embeddings with MSE, then save it alone")
p.add_argument("--analyze", nargs="?", const="", default=None, metavar="TWIN_DIR", help="print E_CLS (eq. 6) "
               "per layer on STS-B test for --model-a alone and the twin (TWIN_DIR's towers, else --model-a/-b) "
               "with and without cross-attention, and the cosines of STS-B test pairs by gold score (Fig. 5) "
               "for each tower and the twin; no training")
p.add_argument("--plot", default=None, metavar="FILE.png", help="with --analyze: draw E_CLS per layer and Fig. 5 "
               "into this PNG; needs matplotlib")
common.show_ranges(p)


# ---------------------------------------------------------------- model -------------------------
def load_towers(names):
    """[BertModel] + their shared tokenizer. Towers must be BERTs of one shape with one vocabulary."""
    for n in names:
        if (kind := common.load_pretrained(AutoConfig, n).model_type) != "bert":
            common.die(f"'{n}' is a {kind} model: JTCSE's towers must be BERT models (BertModel)")
    toks = [common.load_pretrained(AutoTokenizer, n) for n in names]
    if any(t.get_vocab() != toks[0].get_vocab() for t in toks):
        common.die(f"'{names[0]}' and '{names[-1]}' have different tokenizers: both towers read one tokenised "
                   "batch, so pass two models that share a vocabulary")
    towers = [common.load_pretrained(BertModel, n, strict=True) for n in names]  # pooler: eq. 13
    shape = lambda c: (c.num_hidden_layers, c.hidden_size, c.num_attention_heads)  # noqa: E731
    if any(shape(t.config) != shape(towers[0].config) for t in towers):
        common.die(f"towers differ in (layers, hidden, heads): {[shape(t.config) for t in towers]}; "
                   "eq. 10 swaps values between equal layers, so pass towers of one architecture")
    return towers, toks[0]


def cael_period(num_cael, num_layers):
    """eq. 7: layer j is a CAEL when j mod k = 0, k = num_layers / num_cael. 0 = no cross stream."""
    if num_cael is None:
        num_cael = num_layers // 2 if num_layers % 2 == 0 else 1
    if num_cael == 0:
        return 0
    if num_cael < 0 or num_layers % num_cael:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        common.die(f"--num-cael {num_cael} does not divide the {num_layers} layers: choose one of {divisors} "
                   "(or 0 for no cross-attention)")
    return num_layers // num_cael


def additive_mask(attention_mask, dtype):
    """(N, L) 1/0 -> (N, 1, 1, L) 0 / most negative float: the padding mask added before the softmax."""
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def layer_forward(layers, xs, mask, cael, cls_only=False, ctxs=None):
    """Encoder layer j of each tower, run from the towers' own BertLayer submodules.
    xs: one (N, L, H) input per tower. cael=False: ordinary self-attention, CT = SA·V (eq. 9);
    cael=True (two towers): CACT_I = SA_I·V_II and CACT_II = SA_II·V_I (eq. 10). The context then goes
    through the rest of the tower's OWN layer: output projection, dropout, residual + LayerNorm, FFN.
    cls_only: queries (and the output) for position 0 only, when only CLS is needed (last layer).
    ctxs: list that receives each tower's context tensor (N, L, H), for eq. 6."""
    SA, V = [], []
    for layer, x in zip(layers, xs):
        att = layer.attention.self
        shape = lambda t: t.view(*t.shape[:-1], -1, att.attention_head_size).transpose(1, 2)  # (N, heads, L, d)
        q = shape(att.query(x[:, :1] if cls_only else x))
        k, v = shape(att.key(x)), shape(att.value(x))
        sa = torch.softmax(q @ k.transpose(-1, -2) * att.scaling + mask, dim=-1)  # eq. 8: SA = softmax(QKᵀ/√d + M)
        SA.append(F.dropout(sa, att.dropout.p, att.training)), V.append(v)
    if cael:
        V = V[::-1]  # eq. 10: each tower's attention weights take the OTHER tower's values
    out = []
    for layer, x, sa, v in zip(layers, xs, SA, V):
        x = x[:, :1] if cls_only else x
        ctx = (sa @ v).transpose(1, 2).reshape(x.shape)  # CT or CACT, heads merged: (N, L, H)
        if ctxs is not None:
            ctxs.append(ctx)
        out.append(layer.feed_forward_chunk(layer.attention.output(ctx, x)))  # W_O, residual, LN, FFN
    return out


class Twin(torch.nn.Module):
    """Towers I and II. forward -> h: [(N, H)] CLS of each tower's last hidden state (primitive stream =
    stock BertModel), hP: [(N, H)] pooler outputs, c: [(N, H)] CLS of each cross stream after the last
    CAEL (None without CAELs)."""

    def __init__(self, towers, num_cael):
        super().__init__()
        self.towers = torch.nn.ModuleList(towers)
        self.n = towers[0].config.num_hidden_layers
        self.k = cael_period(num_cael, self.n)

    def forward(self, batch):
        cross = self.k > 0
        outs = [t(**batch, output_hidden_states=cross) for t in self.towers]  # primitive streams
        h = [o.last_hidden_state[:, 0] for o in outs]
        hP = [o.pooler_output for o in outs]
        if not cross:
            return h, hP, None
        # cross stream: equal to the primitive stream before the first CAEL (layer k), so it starts from
        # hidden_states[k-1], the input of layer k; ordinary layers as usual, CAELs with eq. 10.
        mask = additive_mask(batch["attention_mask"], outs[0].last_hidden_state.dtype)
        xs = [o.hidden_states[self.k - 1] for o in outs]
        for j in range(self.k, self.n + 1):
            layers = [t.encoder.layer[j - 1] for t in self.towers]
            xs = layer_forward(layers, xs, mask, cael=j % self.k == 0, cls_only=j == self.n)
        return h, hP, [x[:, 0] for x in xs]  # c^O: (N, H) per tower


def make_encode(towers, tokenizer, max_len, device):
    """encode(list[str]) -> (N, H) = Σ_towers CLS of the last hidden state: the twin's CLS(I) + CLS(II),
    no pooler, no cross-attention (authors' evaluation), or one tower's CLS (distilled). The one function
    behind dev evaluation and eval_sts.py."""
    def embed(batch):
        with common.autocast(device):
            return sum(t(**batch).last_hidden_state[:, 0] for t in towers)
    return lambda sentences: common.encode_in_batches(embed, tokenizer, sentences, max_len, device)


def load_encoder(run_dir, meta, device):
    """eval_sts.py's entry point for a run folder of this script (twin or distilled tower;
    runs.read_meta checked its files)."""
    towers = [common.load_pretrained(BertModel, os.path.join(run_dir, t), strict=True)
              .to(device).eval() for t in meta["towers"]]
    tokenizer = common.load_pretrained(AutoTokenizer, os.path.join(run_dir, meta["towers"][0]))
    max_len = common.check_max_len(meta["max_len"], towers[0].config, run_dir,
                                   "sentemb.json's max_len")
    return make_encode(towers, tokenizer, max_len, device)


# ---------------------------------------------------------------- loss --------------------------
def nce(z, z_pos, temp):
    """eq. 11: z, z_pos: (B, H). -log e^{cos(z_i, z_i⁺)/τ} / Σ_j e^{cos(z_i, z_j⁺)/τ}, mean over i.
    Cross-tower (eq. 12): z from one tower's view 1, z_pos from the OTHER tower's view 2."""
    sim = F.normalize(z, dim=-1) @ F.normalize(z_pos, dim=-1).T / temp  # (B, B) cosines / τ
    return F.cross_entropy(sim, torch.arange(len(z), device=z.device))


def modulus_ratio(a, b):
    """‖a − b‖ / (‖a‖ + ‖b‖) per row; = √(1+k²−2kt)/(1+k), k = ‖b‖/‖a‖, t = cos(a, b) (eq. 5 form)."""
    return (a - b).norm(dim=-1) / (a.norm(dim=-1) + b.norm(dim=-1))


def tmc(h, h_pos, hP, hP_pos, half=False, eps=1e-4):
    """eq. 13, towers i ≠ j: -log(cos(h_i, h_j⁺)) · ‖h_i^P − h_j^{P+}‖ / (‖h_i^P‖ + ‖h_j^{P+}‖), mean over
    the batch. h: (B, H) CLS, hP: (B, H) pooler. The cosine is clamped at eps before the log.
    NOTE(authors' code): the cosine of a negative pair is replaced by the constant 1e-4, and the ratio is
    further divided by 2 (half=True)."""
    cos = F.cosine_similarity(h, h_pos, dim=-1).clamp(min=eps)
    return (-cos.log() * modulus_ratio(hP, hP_pos) / (2 if half else 1)).mean()


def jtcse_loss(h, hP, c, R, a):
    """h, hP, c: per tower (2B, H), rows [view 1; view 2] (two dropout passes); c None without CAELs.
    R ∈ {0, 1}. -> (eq. 15 total, {term: value})."""
    B = len(h[0]) // 2
    terms = {}
    if not a.no_nce:  # eq. 11, per tower: view 1 against view 2
        terms["nce"] = nce(h[0][:B], h[0][B:], a.temp) + nce(h[1][:B], h[1][B:], a.temp)
    if not a.no_icnce:  # eq. 12: R·(L(h_I,h_II) + L(c_I,c_II)) + (1−R)·(L(h_II,h_I) + L(c_II,c_I))
        i, j = (0, 1) if R == 1 else (1, 0)
        terms["icnce"] = nce(h[i][:B], h[j][B:], a.temp)
        if c is not None:
            terms["icnce"] = terms["icnce"] + nce(c[i][:B], c[j][B:], a.temp)
    if not a.no_ictm:  # eq. 14: L_TMC(h_I, h_II⁺) + L_TMC(h_II, h_I⁺)
        terms["ictm"] = (tmc(h[0][:B], h[1][B:], hP[0][:B], hP[1][B:], a.tmc_half)
                         + tmc(h[1][:B], h[0][B:], hP[1][:B], hP[0][B:], a.tmc_half))
    return sum(terms.values()), terms  # eq. 15


# ---------------------------------------------------------------- training ----------------------
def main():
    a = p.parse_args()
    common.QUIET = a.quiet
    transformers.logging.disable_progress_bar()
    rank, world, device = common.init_distributed()  # under torchrun: one process per GPU
    if a.analyze is not None:
        import jtcse_analysis  # the paper's E_CLS and Fig. 5, in their own file
        return jtcse_analysis.analyze(a, device)
    if a.plot:
        common.die("--plot draws the analysis: add --analyze (no training)")
    distill = a.distill is not None
    if a.batch_size * world < 2 and not distill:
        common.die("--batch-size must be at least 2: in-batch negatives need other sentences in the batch")
    if a.no_nce and a.no_icnce and a.no_ictm:
        common.die("--no-nce, --no-icnce and --no-ictm together leave no loss: drop at least one of them")
    if distill and (teacher_meta := runs.read_meta(a.distill)) is None:
        common.die(f"--distill '{a.distill}' holds no {common.META}: pass the --output-dir of a jtcse.py twin run")
    if distill:
        if teacher_meta["method"] != "jtcse" or len(teacher_meta["towers"]) != 2:
            common.die(f"--distill '{a.distill}' is not a jtcse.py twin run: pass the --output-dir of one")
    data = common.check_sts(common.senteval_dir(a.data_dir), common.TASKS if a.final_eval else [])
    sentences = common.read_sentences(common.train_file(a.train, "wiki1m_for_simcse.txt"))
    if a.add_sick:  # paper footnote 7: unlabeled SICK sentences join the training text (we take SICK train)
        sick = common.load_sts(data, "SICK-R", "train")["train"]
        sentences += sorted({s for r in sick for s in r[:2]} - set(sentences))
    per_step = a.batch_size * world * a.grad_accum  # sentences per optimisation step, all ranks together
    if len(sentences) < per_step:
        common.die(f"{len(sentences)} training sentences < {per_step} per step: lower --batch-size or --grad-accum")
    ckpt_path = runs.open_run(a.output_dir, a.resume, [a.model_a, a.model_b, a.distill], rank)  # locks it
    state = runs.load_state(ckpt_path, "jtcse", a, device) if a.resume else None
    lr = a.lr or (state["args"]["lr"] if state else 1e-5 if distill else 1.3e-6)

    # seeding: one generator for the data order, one for R (eq. 12), both the same on every rank (so R is
    # the same on all ranks in a step); torch's global RNG drives dropout
    common.seed_everything(a.seed)
    r_gen = torch.Generator().manual_seed(a.seed)
    if distill:  # JTCSE D: the student is one fresh tower, the teacher the frozen twin (CLS(I) + CLS(II))
        teacher_towers, tokenizer = load_towers([os.path.join(a.distill, t) for t in teacher_meta["towers"]])
        (student,), student_tok = load_towers([a.model_a])
        if student_tok.get_vocab() != tokenizer.get_vocab():
            common.die(f"student '{a.model_a}' and the teacher in '{a.distill}' have different tokenizers: "
                       "pass a --model-a with the teacher's vocabulary")
        model = torch.nn.ModuleList([student]).to(device)
        teacher = make_encode([t.to(device).eval() for t in teacher_towers], tokenizer, a.max_len, device)
        names = ["."]
    else:
        towers, tokenizer = load_towers([a.model_a, a.model_b])
        model = Twin(towers, a.num_cael).to(device)
        names = ["tower_a", "tower_b"]
    for tower in (model if distill else model.towers):  # BERT's pooler feeds only eq. 13: frozen when unused
        if (distill or a.no_ictm) and tower.pooler is not None:  # (DDP needs every trainable parameter used)
            tower.pooler.requires_grad_(False)
    common.check_max_len(a.max_len, (model[0] if distill else model.towers[0]).config, a.model_a)
    net = model[0] if distill else model  # what one forward pass runs: the student, or the twin
    ddp = net if world == 1 else torch.nn.parallel.DistributedDataParallel(net)
    steps_per_epoch = len(sentences) // per_step  # the last incomplete step is dropped
    total = a.epochs * steps_per_epoch if a.max_steps < 0 else a.max_steps
    runs.complete(state, total, a.output_dir)  # --resume of a finished run: says so, exit 0
    # NOTE(authors' code): plain AdamW at a constant learning rate, no schedule and no warm-up
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=lr, fused=True)  # one kernel
    save_towers = [model[0]] if distill else list(model.towers)
    eval_len = save_towers[0].config.max_position_embeddings  # evaluation does not truncate (SimCSE, SentEval)
    encode = make_encode(save_towers, tokenizer, eval_len, device)
    step, best = 0, -float("inf")
    log = print if rank == 0 else (lambda *_, **__: None)
    if state:
        runs.fit(lambda: (model.load_state_dict(state["model"]), opt.load_state_dict(state["opt"])),
                   "these towers")
        step, best = state["step"], state["best"]
        torch.set_rng_state(state["rng"]), r_gen.set_state(state["r_gen"])
        runs.resume_lr(opt, lr, state, log)
    what = f"distil {a.distill} into {a.model_a}" if distill else \
        f"towers {a.model_a} + {a.model_b}, CAEL every {model.k or '-'} of {model.n} layers"
    log(f"JTCSE: {what}, {len(sentences)} sentences, {total} steps of {per_step} sentences ({world} process(es) "
        f"x {a.batch_size} x {a.grad_accum} accumulated), lr {lr:g}, device {device}"
        + (f" ({common.bf16_note(device)})" if a.bf16 else ""))

    def training_state():
        return {"method": "jtcse", "args": {**runs.run_args(a), "lr": lr}, "model": model.state_dict(),
                "opt": opt.state_dict(), "step": step, "best": best, "rng": torch.get_rng_state(),
                "r_gen": r_gen.get_state()}

    def save_model(folder):  # plain BertModel folders, loadable without this project
        for name, tower in zip(names, save_towers):
            tower.save_pretrained(os.path.join(folder, name))
            tokenizer.save_pretrained(os.path.join(folder, name))
        if distill:  # one tower, CLS: also a sentence-transformers folder (a twin's sum of two towers is not)
            runs.save_sentence_transformers(folder, save_towers[0].config.hidden_size, "cls", eval_len)

    def save(dev=None):  # rank 0 writes (the training state; with a new best dev score, the model too), all wait
        nonlocal best
        if rank == 0 and dev is not None and dev > best:
            best = dev  # both towers (or the student), sentemb.json and the training state: replaced as one
            runs.save_best(a.output_dir, save_model, training_state(), list(model.parameters()), method="jtcse",
                             towers=names, max_len=eval_len, stsb_dev=dev, step=step, teacher=a.distill,
                             num_cael=None if distill else model.n // model.k if model.k else 0)
        elif rank == 0:
            runs.save_state(training_state(), a.output_dir, list(model.parameters()))
        if world > 1:
            torch.distributed.barrier()

    def evaluate_and_save():
        dev = None
        if rank == 0:
            model.eval()
            dev = common.evaluate(encode, data, ["STS-B"], split="dev")["STS-B"]
            model.train()
        save(dev)
        if rank == 0:
            log(f"step {step:>5}  stsb_dev {dev:.2f}  (best {best:.2f})", flush=True)

    group = common.by_length if a.length_grouping else lambda run, batch: run(batch)

    def micro_step(sents, R):
        """One micro-batch of B sentences on this rank -> (loss over the global batch of world·B, its terms)."""
        batch = common.tokenize(tokenizer, sents, a.max_len, device)  # (B, L)
        B = len(sents)
        with common.autocast(device, a.bf16):
            if distill:  # MSE between the student's CLS and the teacher twin's embedding, same text
                with torch.no_grad():
                    target = teacher(sents).to(device)  # (B, H)
                cls = group(lambda b: ddp(**b).last_hidden_state[:, 0], batch)  # (B, H)
                loss = F.mse_loss(common.gather(cls.float()), common.gather(target))
                terms = {}
            else:  # two dropout views of every sentence in one forward pass: (2B, L)
                h, hP, c = group(ddp, {k: torch.cat([v, v]) for k, v in batch.items()})  # per tower (2B, H)
                # global batch: per tower, [view 1 of all ranks; view 2 of all ranks], (2·world·B, H)
                glob = lambda zs: [torch.cat([common.gather(z[:B]), common.gather(z[B:])]) for z in zs]  # noqa: E731
                loss, terms = jtcse_loss(glob(h), glob(hP), None if c is None else glob(c), R, a)
        # every rank holds the same global loss; DDP averages gradients over ranks, hence × world
        (loss * world / a.grad_accum).backward()
        return loss, terms

    model.train()
    with runs.StopOnSignal() as stop:  # Ctrl-C / SIGTERM: stop at the next step boundary, saved
        if step == 0:
            evaluate_and_save()
        t0, seen = time.perf_counter(), 0
        while step < total and not stop(device, world):
            epoch = step // steps_per_epoch
            order = torch.randperm(len(sentences), generator=torch.Generator().manual_seed(a.seed + epoch)).tolist()
            for b in range(step % steps_per_epoch, steps_per_epoch):
                step_sents = order[b * per_step:(b + 1) * per_step]  # this step's sentences, all ranks
                R = int(torch.randint(0, 2, (1,), generator=r_gen))  # eq. 12: direction of ICNCE, drawn each step
                opt.zero_grad(set_to_none=True)
                for k in range(a.grad_accum):  # micro-batch k: rank r takes its slice of B
                    start = (k * world + rank) * a.batch_size
                    sync = contextlib.nullcontext if world == 1 or k == a.grad_accum - 1 else ddp.no_sync
                    with sync():  # gradients are all-reduced once, after the last micro-batch
                        loss, terms = micro_step([sentences[i] for i in step_sents[start:start + a.batch_size]], R)
                    if not torch.isfinite(loss):  # before opt.step(): the weights are still the last good ones
                        common.die(f"loss became {loss.item()} at step {step}: resume with a lower --lr "
                                   f"(--resume --lr ...) or check the data; the run in {a.output_dir} is kept")
                opt.step()
                step, seen = step + 1, seen + per_step
                if step % a.log_steps == 0 or step == total:
                    parts = "".join(f"  {n} {v.item():.4f}" for n, v in terms.items())
                    log(f"step {step:>5}  loss {loss.item():.4f}{parts}{'' if distill else f'  R {R}'}  "
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
