"""JTCSE: "Joint Tensor-Modulus Constraints and Cross-Attention for Unsupervised Contrastive
Learning of Sentence Embeddings". Zong, Yi, Shi, Wang, Xu. 2025. arXiv:2505.02366.

Two BERT towers (I and II, each already trained with unsupervised SimCSE) are trained together. Each
keeps SimCSE's InfoNCE (eq. 11); the towers are each other's positives (ICNCE, eq. 12), on their
plain outputs and on a cross stream in which, at every k-th layer (a CAEL, eqs. 7-10), a tower's
attention weights take the OTHER tower's values. A modulus term (eqs. 13-14) asks the towers'
pooler outputs of a positive pair for equal length. The embedding is CLS(I) + CLS(II);
`--distill` compresses the twin into one tower (JTCSE D, §IV-C).

  eqs. 7-10, CAEL: SA_I·V_II, SA_II·V_I       layer_forward, Twin
  eq. 11 / 12, InfoNCE / ICNCE               nce, jtcse_loss (nce_authors: --objective authors)
  eqs. 13-14, tensor-modulus constraint      tmc, modulus_ratio (tmc_authors)
  eq. 15, the total; one step                jtcse_loss, train_step
  eq. 6, Fig. 5 (--analyze)                  jtcse_analysis.py

  python jtcse.py --model-a runs/simcse_1 --model-b runs/simcse_2 --train wiki1m_for_simcse.txt
  python jtcse.py --model-a sentence-transformers/all-MiniLM-L6-v2 --model-b runs/sscl_minilm \\
      --train wiki1m_head.txt --no-add-sick --max-len 32 --lr 2e-5 --max-steps 40 --eval-steps 10 \\
      --output-dir runs/jtcse_minilm                           # CPU (docs/jtcse.md)
  python jtcse.py --distill runs/jtcse_minilm --model-a sentence-transformers/all-MiniLM-L6-v2 \\
      --train wiki1m_head.txt --no-add-sick --max-len 32 --max-steps 30 --output-dir runs/jtcse_d
"""
import argparse
import functools
import os

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoTokenizer, BertModel

import common
import runs

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
# --- general: the paper's values as defaults (the shared flags: common.training_flags) ---
p.add_argument("--model-a", default="bert-base-uncased", help="tower I, a BERT (paper: "
               "bert-base-uncased trained with unsupervised SimCSE on round-trip-translated data)")
p.add_argument("--model-b", default="bert-base-uncased", help="tower II: the same shape and "
               "vocabulary (paper: a second such SimCSE model)")
p.add_argument("--train", help="one sentence a line (default: SimCSE's wiki1m_for_simcse.txt)")
common.training_flags(p, output_dir="runs/jtcse", lr=1.3e-6, max_len=64, batch_size=64,
                      eval_steps=100, lr_note=" (the towers are trained already); --distill: 1e-5")
# --- JTCSE ---
p.add_argument("--num-cael", type=common.NONNEG_INT, help="cross-attention layers (eq. 7, Table "
               "IX): layer j is a CAEL when j mod (layers/num_cael) = 0; default layers/2 "
               "(1 if odd); 0 = no cross stream")
p.add_argument("--temp", type=common.POS_FLOAT, default=0.05, help="tau (paper: 0.05)")
p.add_argument("--add-sick", action=argparse.BooleanOptionalAction, default=True,
               help="add SICK train's sentences to --train (footnote 7)")
p.add_argument("--no-nce", action="store_true", help="drop L_NCE, eq. 11 (Table X)")
p.add_argument("--no-icnce", action="store_true", help="drop L_ICNCE, eq. 12 (Table X)")
p.add_argument("--no-ictm", action="store_true", help="drop L_ICTM, eqs. 13-14 (Table X)")
p.add_argument("--objective", default="paper", choices=["paper", "authors"], help="paper: eqs. "
               "11-13; authors: the authors' code (docs/jtcse.md, details 4-8)")
p.add_argument("--distill", metavar="TEACHER_DIR", help="JTCSE D: a fresh --model-a tower learns a "
               "trained twin's embeddings (MSE) and is saved alone")
p.add_argument("--analyze", nargs="?", const="", metavar="TWIN_DIR", help="no training: E_CLS "
               "(eq. 6) per layer and Fig. 5 for --model-a and the twin (jtcse_analysis.py)")
p.add_argument("--plot", metavar="FILE.png", help="--analyze: draw them into this PNG")


class Analysis(argparse.Action):
    """A flag of the analyses: stores its value and implies --analyze (never a training run)."""
    def __call__(self, parser, ns, values, option_string=None):
        setattr(ns, self.dest, values)
        ns.analyze = "" if ns.analyze is None else ns.analyze


p.add_argument("--compare", nargs="+", metavar="MODEL", action=Analysis, help="no training: "
               "BERTs, sscl.py or jtcse.py runs (a twin = its two towers); E_CLS of the last "
               "layer against the 7-STS average (Fig. 10)")
p.add_argument("--cost", nargs="?", const=64, type=common.POS_INT, metavar="TOKENS",
               action=Analysis, help="--compare: parameters, GMACs of one sentence of TOKENS "
               "tokens (default 64), 7-STS average, Avg./GMACs (Table VII)")
p.add_argument("--attention", metavar="SENTENCE", action=Analysis, help="--compare: each "
               "layer's head-averaged attention map of this sentence (Fig. 9)")
common.show_ranges(p)


# ---------------------------------------------------------------- the model: CAEL ---------------
def cael_period(num_cael, num_layers):
    """eq. 7: layer j is a CAEL when j mod k = 0, k = num_layers / num_cael (default: every 2nd
    layer, 6 CAELs for BERT-base, the paper's best; every layer k = n for an odd count). 0: none."""
    if num_cael is None:
        num_cael = num_layers // 2 if num_layers % 2 == 0 else 1
    return num_layers // num_cael if num_cael else 0


def additive_mask(attention_mask, dtype):
    """(N, L) 1/0 -> (N, 1, 1, L): 0 / the most negative float, added before the softmax."""
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def layer_forward(layers, xs, mask, cael, cls_only=False, ctxs=None):
    """Encoder layer j of each tower, from the towers' own BertLayer submodules. xs: one (N, L, H)
    input per tower. cael=False: self-attention, CT = SA·V (eq. 9); cael=True: CACT_I = SA_I·V_II,
    CACT_II = SA_II·V_I (eq. 10). The context then goes through the rest of the tower's OWN layer
    (W_O, dropout, residual + LayerNorm, FFN). cls_only: queries and output for position 0 only
    (the last layer). ctxs: receives each tower's context (N, L, H), for eq. 6."""
    SA, V = [], []
    for layer, x in zip(layers, xs):
        att = layer.attention.self
        d = att.attention_head_size
        heads = lambda t: t.view(*t.shape[:-1], -1, d).transpose(1, 2)  # noqa: E731
        q = heads(att.query(x[:, :1] if cls_only else x))  # (N, heads, L, d)
        k, v = heads(att.key(x)), heads(att.value(x))
        sa = torch.softmax(q @ k.transpose(-1, -2) * att.scaling + mask, dim=-1)  # eq. 8
        SA.append(F.dropout(sa, att.dropout.p, att.training))
        V.append(v)
    if cael:
        V = V[::-1]  # eq. 10: each tower's attention weights take the OTHER tower's values
    out = []
    for layer, x, sa, v in zip(layers, xs, SA, V):
        x = x[:, :1] if cls_only else x
        ctx = (sa @ v).transpose(1, 2).reshape(x.shape)  # CT or CACT, heads merged: (N, L, H)
        if ctxs is not None:
            ctxs.append(ctx)
        out.append(layer.feed_forward_chunk(layer.attention.output(ctx, x)))  # W_O .. FFN
    return out


class Twin(torch.nn.Module):
    """Towers I and II. forward(batch) -> h: [(N, H)] CLS of each tower's last hidden state (the
    primitive stream = stock BertModel), hP: [(N, H)] pooler outputs, c: [(N, H)] CLS of each cross
    stream after the last CAEL (None without CAELs)."""

    def __init__(self, towers, num_cael):
        super().__init__()
        self.towers = torch.nn.ModuleList(towers)
        self.n = towers[0].config.num_hidden_layers
        self.k = cael_period(num_cael, self.n)

    def forward(self, batch):
        cross = self.k > 0
        outs = [t(**batch, output_hidden_states=cross) for t in self.towers]  # primitive streams
        h, hP = [o.last_hidden_state[:, 0] for o in outs], [o.pooler_output for o in outs]
        if not cross:
            return h, hP, None
        # the cross stream equals the primitive one before the first CAEL (layer k): it starts from
        # hidden_states[k-1], the input of layer k; ordinary layers as usual, CAELs with eq. 10
        mask = additive_mask(batch["attention_mask"], outs[0].last_hidden_state.dtype)
        xs = [o.hidden_states[self.k - 1] for o in outs]
        for j in range(self.k, self.n + 1):
            layers = [t.encoder.layer[j - 1] for t in self.towers]
            xs = layer_forward(layers, xs, mask, cael=j % self.k == 0, cls_only=j == self.n)
        return h, hP, [x[:, 0] for x in xs]  # c^O: (N, H) per tower


# ---------------------------------------------------------------- the loss ----------------------
def nce(z, z_pos, temp):
    """eq. 11: z, z_pos: (B, H). -log e^{cos(z_i, z_i⁺)/τ} / Σ_j e^{cos(z_i, z_j⁺)/τ}, mean over i.
    Cross-tower (eq. 12): z from one tower's view 1, z_pos from the OTHER tower's view 2."""
    sim = F.normalize(z, dim=-1) @ F.normalize(z_pos, dim=-1).T / temp  # (B, B) cosines / τ
    return F.cross_entropy(sim, torch.arange(len(z), device=z.device))


def nce_authors(z, z_other, temp):
    """NOTE(authors' code), model_dual.py `unsup_infonce_loss` (z_other = z, eq. 11) and `icnce`
    (eq. 12); docs/jtcse.md, details 4-5. z, z_other: (2B, H), rows [view 1; view 2] (theirs
    interleaved: the same loss). Every row is an anchor; its positive is the other view of its
    sentence in z_other, its negatives every other row of z_other but the same one (masked):
    2B − 2 negatives where eqs. 11-12 as we read them have B − 1."""
    n = len(z)
    sim = F.normalize(z, dim=-1) @ F.normalize(z_other, dim=-1).T / temp  # (2B, 2B) cosines / τ
    same = torch.eye(n, dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(same, float("-inf"))  # the same row of z_other is no candidate
    return F.cross_entropy(sim, (torch.arange(n, device=z.device) + n // 2) % n)  # the other view


def modulus_ratio(a, b):
    """‖a − b‖ / (‖a‖ + ‖b‖) per row; = √(1+k²−2kt)/(1+k), k = ‖b‖/‖a‖, t = cos(a, b) (eq. 5)."""
    return (a - b).norm(dim=-1) / (a.norm(dim=-1) + b.norm(dim=-1))


def tmc(h, h_pos, hP, hP_pos, eps=1e-4):
    """eq. 13, towers i ≠ j: -log(cos(h_i, h_j⁺)) · ‖h_i^P − h_j^{P+}‖ / (‖h_i^P‖ + ‖h_j^{P+}‖),
    mean over the batch. h: (B, H) CLS, hP: (B, H) pooler. The cosine is clamped at eps before the
    log: a non-positive cosine gives a finite loss and no gradient (docs/jtcse.md, detail 8)."""
    cos = F.cosine_similarity(h, h_pos, dim=-1).clamp(min=eps)
    return (-cos.log() * modulus_ratio(hP, hP_pos)).mean()


def tmc_authors(h, h_pos, hP, hP_pos):
    """NOTE(authors' code), model_dual.py `LTN_loss` (docs/jtcse.md, details 7-8): a negative
    cosine is replaced by the constant 1e-4 (no gradient), any other goes into the log as it is,
    and the modulus ratio is divided by a further 2. Shapes as tmc."""
    cos = F.cosine_similarity(h, h_pos, dim=-1)
    cos = torch.where(cos < 0, torch.full_like(cos, 1e-4), cos)
    return (-cos.log() * modulus_ratio(hP, hP_pos) / 2).mean()


def jtcse_loss(h, hP, c, R, a):
    """h, hP, c: per tower (2B, H), rows [view 1; view 2] (two dropout passes); c None without
    CAELs. R ∈ {0, 1}. a.objective: 'paper' (nce, tmc) or 'authors' (nce_authors, tmc_authors).
    -> (eq. 15 total, {term: value})."""
    B = len(h[0]) // 2
    authors = a.objective == "authors"

    def L(x, y):  # InfoNCE, anchors from x, candidates from y: (2B, H) each
        return nce_authors(x, y, a.temp) if authors else nce(x[:B], y[B:], a.temp)

    def TMC(i, j):  # eq. 13: tower i's view 1 against tower j's view 2
        return (tmc_authors if authors else tmc)(h[i][:B], h[j][B:], hP[i][:B], hP[j][B:])

    terms = {}
    if not a.no_nce:  # eq. 11, per tower: its views against each other
        terms["nce"] = L(h[0], h[0]) + L(h[1], h[1])
    if not a.no_icnce:  # eq. 12: R·(L(h_I,h_II) + L(c_I,c_II)) + (1−R)·(L(h_II,h_I) + L(c_II,c_I))
        i, j = (0, 1) if R == 1 else (1, 0)  # NOTE(authors' code): their random_data = 1 − R
        terms["icnce"] = L(h[i], h[j])
        if c is not None:
            terms["icnce"] = terms["icnce"] + L(c[i], c[j])
    if not a.no_ictm:  # eq. 14: L_TMC(h_I, h_II⁺) + L_TMC(h_II, h_I⁺)
        terms["ictm"] = TMC(0, 1) + TMC(1, 0)
    return sum(terms.values()), terms  # eq. 15


# ---------------------------------------------------------------- one training step -------------
def cls(bert, batch):
    """CLS of the last hidden state: (N, H)."""
    return bert(**batch).last_hidden_state[:, 0]


def global_views(zs, B):
    """Per tower (2B, H) rows [view 1; view 2] of this rank -> (2·world·B, H) rows [view 1 of all
    ranks; view 2 of all ranks]. NOTE(authors' code): one GPU only; both objectives gather here
    (docs/jtcse.md, detail 13)."""
    return None if zs is None else [torch.cat([common.gather(z[:B]), common.gather(z[B:])])
                                    for z in zs]


def train_step(model, tokenizer, sentences, R, a, world, device, teacher=None):
    """One micro-batch of B sentences on this rank -> (the loss over the global batch of world·B,
    its terms); gradients accumulated. The twin: both dropout views in one pass, eq. 15. JTCSE D
    (teacher: the frozen twin's encode): MSE of the student's CLS to the twin's embedding."""
    batch = common.tokenize(tokenizer, sentences, a.max_len, device)  # (B, L)
    B, terms = len(sentences), {}
    with common.autocast(device, a.bf16):
        if teacher is not None:
            with torch.no_grad():
                target = teacher(sentences).to(device)  # (B, H), the same text
            z = common.run_batch(functools.partial(cls, model), batch, a.length_grouping)  # (B, H)
            loss = F.mse_loss(common.gather(z.float()), common.gather(target))
        else:  # two dropout views of every sentence in one forward pass: (2B, L)
            two = {k: torch.cat([v, v]) for k, v in batch.items()}
            outs = common.run_batch(model, two, a.length_grouping)  # h, hP, c: per tower (2B, H)
            h, hP, c = (global_views(zs, B) for zs in outs)
            loss, terms = jtcse_loss(h, hP, c, R, a)
    # every rank holds the same global loss; DDP averages gradients over ranks, hence × world
    (loss * world / a.grad_accum).backward()
    return loss, terms


# ---------------------------------------------------------------- encode, save, load ------------
def load_towers(names):
    """[BertModel] (every weight from its file: the pooler feeds eq. 13) and their shared
    tokenizer; check_towers has checked them."""
    towers = [common.load_pretrained(BertModel, n, strict=True) for n in names]
    return towers, common.load_pretrained(AutoTokenizer, names[0])


def make_encode(towers, tokenizer, max_len, device):
    """encode(list[str]) -> (N, H) = Σ_towers CLS of the last hidden state: the twin's CLS(I) +
    CLS(II), no pooler, no cross-attention (authors' evaluation), or one tower's CLS (distilled).
    The one function behind dev evaluation and eval_sts.py."""
    def embed(batch):
        with common.autocast(device):
            return sum(cls(t, batch) for t in towers)
    return lambda sentences: common.encode_in_batches(embed, tokenizer, sentences, max_len, device)


def save_model(towers, names, tokenizer, max_len, folder):
    """Plain BertModel folders, loadable without this project; a distilled tower (one, at the
    root, CLS) is also a sentence-transformers folder (a twin's sum of two is not)."""
    for name, tower in zip(names, towers):
        tower.save_pretrained(os.path.join(folder, name))
        tokenizer.save_pretrained(os.path.join(folder, name))
    if names == ["."]:
        runs.save_sentence_transformers(folder, towers[0].config.hidden_size, "cls", max_len)


def load_encoder(run_dir, meta, device):
    """eval_sts.py's entry point for a run folder of this script (twin or distilled tower)."""
    towers, tokenizer = load_towers([os.path.join(run_dir, t) for t in meta["towers"]])
    max_len = common.check_max_len(meta["max_len"], towers[0].config, run_dir,
                                   "sentemb.json's max_len")
    return make_encode([t.to(device).eval() for t in towers], tokenizer, max_len, device)


# ---------------------------------------------------------------- main --------------------------
def main():
    a = common.parse(p)
    if a.analyze is not None:  # E_CLS (eq. 6) and Fig. 5, no training
        import jtcse_analysis
        return jtcse_analysis.analyze(a, common.pick_device())
    run = runs.Run(a, "jtcse")  # torchrun: this process's rank, the world size, its device
    teacher_towers = check_args(a, run.world)  # --distill: the teacher twin's folders

    # data: wiki1m (+ SICK train's sentences, footnote 7); every step's rows drawn from the seed
    data = common.check_sts(common.senteval_dir(a.data_dir), common.TASKS if a.final_eval else [])
    sentences = common.read_sentences(common.train_file(a.train, "wiki1m_for_simcse.txt"))
    if a.add_sick:  # unlabeled; the paper says SICK-R, we take its train split (docs/jtcse.md)
        sick = common.load_sts(data, "SICK-R", "train")["train"]
        sentences += sorted({s for r in sick for s in r[:2]} - set(sentences))
    per_step = a.batch_size * run.world * a.grad_accum  # sentences a step, all ranks together
    steps = common.step_rows(len(sentences), per_step, a.epochs, a.max_steps, a.seed)
    lr = run.open([a.model_a, a.model_b, a.distill], len(steps))  # the run folder, locked

    # the model: the twin; JTCSE D: one fresh tower (the student) and the frozen twin (the teacher)
    common.seed_everything(a.seed)  # dropout from torch's RNG; R (eq. 12) from its own generator:
    r_gen = torch.Generator().manual_seed(a.seed)  # NOTE(authors' code): Python's random (detail 6)
    teacher = None
    if a.distill:
        twin, tokenizer = load_towers(teacher_towers)
        twin = [t.to(run.device).eval() for t in twin]
        teacher = make_encode(twin, tokenizer, a.max_len, run.device)
        towers, names = load_towers([a.model_a])[0], ["."]
        net = towers[0]
    else:
        towers, tokenizer = load_towers([a.model_a, a.model_b])
        net, names = Twin(towers, a.num_cael), ["tower_a", "tower_b"]
    for tower in towers:  # BERT's pooler feeds only eq. 13: frozen when unused (DDP: all are used)
        if (a.distill or a.no_ictm) and tower.pooler is not None:
            tower.pooler.requires_grad_(False)
    model = run.wrap(net.to(run.device))  # DDP under torchrun
    # no truncation at evaluation (SimCSE, SentEval); NOTE(authors' code): 64 tokens (detail 12)
    eval_len = towers[0].config.max_position_embeddings
    encode = make_encode(towers, tokenizer, eval_len, run.device)

    # the optimiser; NOTE(authors' code): AdamW at a constant learning rate, no warm-up
    params = [q for q in net.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=True)  # fused: one kernel for all parameters
    run.resume("these towers", model=net, opt=opt, r_gen=r_gen)  # --resume; signals caught
    what = f"distil {a.distill} into {a.model_a}" if a.distill else \
        f"towers {a.model_a} + {a.model_b}, CAEL every {net.k or '-'} of {net.n} layers"
    run.log(f"JTCSE: {what}, objective {a.objective}, {len(sentences)} sentences, {len(steps)} "
            f"steps of {per_step} sentences ({run.world} process(es) x {a.batch_size} x "
            f"{a.grad_accum} accumulated), lr {lr:g}, device {run.device}"
            + (f" ({common.bf16_note(run.device)})" if a.bf16 else ""))

    net.train()
    for step in run.steps(len(steps)):  # 0 (the towers as loaded), 1, ..., len(steps)
        if step > 0:  # optimisation step `step`: grad_accum micro-batches of B sentences per rank
            R = int(torch.randint(0, 2, (1,), generator=r_gen))  # eq. 12: ICNCE's direction
            opt.zero_grad(set_to_none=True)
            for k in range(a.grad_accum):
                sents = [sentences[i] for i in run.rows(steps[step - 1], k, a.batch_size)]
                with run.sync(model, k, a.grad_accum):
                    loss, terms = train_step(model, tokenizer, sents, R, a, run.world, run.device,
                                             teacher)
                run.check_finite(loss)  # NaN guard, before the weights change
            opt.step()
            if step % a.log_steps == 0 or step == len(steps):
                parts = "".join(f"  {n} {v.item():.4f}" for n, v in terms.items())
                run.log_step(f"loss {loss.item():.4f}{parts}" + ("" if a.distill else f"  R {R}"),
                             per_step)
        halt = run.stopping()  # SIGINT/SIGTERM on any rank: save this step, then stop
        evaluate = step % a.eval_steps == 0 or step == len(steps)
        if evaluate or halt:  # the training state; with a new best STS-B dev, the towers too
            dev = run.evaluate(net, common.stsb_dev, encode, data) if evaluate else None
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "r_gen": r_gen.get_state()}
            write = functools.partial(save_model, towers, names, tokenizer, eval_len)
            run.save(state, params, dev, write,
                     towers=names, max_len=eval_len, stsb_dev=dev, step=step, teacher=a.distill,
                     objective=None if a.distill else a.objective,
                     num_cael=None if a.distill else net.n // net.k if net.k else 0)
        if halt:
            break
    run.end()  # after a signal: exit, saying how to resume

    if a.final_eval and run.rank == 0:  # the best checkpoint, loaded as eval_sts.py loads it
        from eval_sts import load_encoder as load_run
        print(f"best checkpoint (STS-B dev {run.best:.2f}) on the test sets:")
        print(common.format_table(common.evaluate(load_run(a.output_dir, device=run.device), data)))


# ---------------------------------------------------------------- argument checks ---------------
def check_towers(names, num_cael=None, max_len=None):
    """BERTs of one shape and one vocabulary (both towers read one batch; eq. 10 swaps values
    between equal layers), and a --num-cael that divides their layer count."""
    configs = [common.load_pretrained(AutoConfig, n) for n in names]
    for name, c in zip(names, configs):
        if c.model_type != "bert":
            common.die(f"'{name}' is a {c.model_type} model: JTCSE's towers must be BERT models")
    vocabs = [common.load_pretrained(AutoTokenizer, n).get_vocab() for n in names]
    if any(v != vocabs[0] for v in vocabs):
        common.die(f"'{names[0]}' and '{names[-1]}' have different tokenizers: the towers read one "
                   "tokenised batch, so pass models that share a vocabulary")
    shapes = [(c.num_hidden_layers, c.hidden_size, c.num_attention_heads) for c in configs]
    if any(s != shapes[0] for s in shapes):
        common.die(f"towers differ in (layers, hidden, heads): {shapes}; eq. 10 swaps values "
                   "between equal layers, so pass towers of one architecture")
    n = shapes[0][0]
    if max_len:
        common.check_max_len(max_len, configs[0], names[0])
    if num_cael and n % num_cael:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        common.die(f"--num-cael {num_cael} does not divide the {n} layers: choose one of "
                   f"{divisors} (or 0 for no cross-attention)")


def check_args(a, world):
    """Every check of the command line that stops training (one error line, exit 2). --distill:
    -> the teacher twin's tower folders."""
    if a.plot:
        common.die("--plot draws the analysis: add --analyze (no training)")
    if a.batch_size * world < 2 and not a.distill:
        common.die("--batch-size must be at least 2: in-batch negatives need other sentences")
    if a.distill and a.objective != "paper":
        common.die("--objective chooses the twin's loss; --distill trains with MSE: "
                   "drop --objective")
    if a.no_nce and a.no_icnce and a.no_ictm:
        common.die("--no-nce, --no-icnce and --no-ictm together leave no loss: drop one of them")
    if not a.distill:
        return check_towers([a.model_a, a.model_b], a.num_cael, a.max_len)
    meta = runs.read_meta(a.distill)
    if meta is None:
        common.die(f"--distill '{a.distill}' holds no {common.META}: pass the --output-dir of a "
                   "jtcse.py twin run")
    if meta["method"] != "jtcse" or len(meta["towers"]) != 2:
        common.die(f"--distill '{a.distill}' is not a jtcse.py twin run: pass the --output-dir "
                   "of one")
    teacher = [os.path.join(a.distill, t) for t in meta["towers"]]
    check_towers(teacher)
    check_towers([a.model_a], max_len=a.max_len)
    student, twin = (common.load_pretrained(AutoTokenizer, m) for m in (a.model_a, teacher[0]))
    if student.get_vocab() != twin.get_vocab():
        common.die(f"student '{a.model_a}' and the teacher in '{a.distill}' have different "
                   "tokenizers: pass a --model-a with the teacher's vocabulary")
    if not runs.given("--lr"):
        a.lr = 1e-5  # the authors' supplementary, for JTCSE D
    return teacher


if __name__ == "__main__":
    main()
