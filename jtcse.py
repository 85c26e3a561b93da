"""JTCSE: "Joint Tensor-Modulus Constraints and Cross-Attention for Unsupervised Contrastive
Learning of Sentence Embeddings". Zong, Yi, Shi, Wang, Xu. 2025. arXiv:2505.02366.

Two BERT towers (I and II, each trained with unsupervised SimCSE) are trained together. Each keeps
SimCSE's InfoNCE (eq. 11); the towers are each other's positives (ICNCE, eq. 12), on their plain
outputs and on a cross stream in which, at every k-th layer (a CAEL, eqs. 7-10), a tower's attention
weights take the OTHER tower's values. A modulus term (eqs. 13-14) asks the towers' pooler outputs
of a positive pair for equal length. The embedding is CLS(I) + CLS(II), untruncated (SimCSE,
SentEval); `--distill` compresses the twin (or any ensemble) into one tower (JTCSE D, §IV-C).

  eqs. 7-10, CAEL: SA_I·V_II, SA_II·V_I       layer_forward, Twin
  eq. 11 / 12, InfoNCE / ICNCE               nce, jtcse_loss (nce_authors: --objective authors)
  eqs. 13-14, tensor-modulus constraint      tmc, modulus_ratio (tmc_authors)
  eq. 15, the total; one step                jtcse_loss, train_step
  Fig. 8, LayerNorm removed                  drop_layernorm (--drop-layernorm N)
  eq. 6, Figs. 5, 8-10, Table VII            jtcse_analysis.py (--analyze, --compare)

  python jtcse.py --model-a runs/simcse_1 --model-b runs/simcse_2       # the paper (GPU)
  python jtcse.py --model-a sentence-transformers/all-MiniLM-L6-v2 --model-b runs/sscl_minilm \\
      --train wiki1m_head.txt --no-add-sick --max-len 32 --lr 2e-5 --max-steps 40 \\
      --eval-steps 10 --output-dir runs/jtcse_minilm              # CPU (docs/jtcse.md)
  python jtcse.py --distill runs/jtcse_minilm --model-a runs/simcse_1 --output-dir runs/jtcse_d
"""
import functools
import os

import torch
import torch.nn.functional as F

import common
import eval_sts
import runs

p = common.parser(__doc__)
# --- general: the paper's values as defaults (the shared flags: common.training_flags) ---
p.add_argument("--model-a", default="bert-base-uncased", help="tower I, BERT or RoBERTa (paper: "
               "bert-base-uncased trained with unsupervised SimCSE on round-trip-translated data)")
p.add_argument("--model-b", default="bert-base-uncased", help="tower II: the same shape and "
               "vocabulary (paper: a second such SimCSE model)")
p.add_argument("--train", help="one sentence a line (default: SimCSE's wiki1m_for_simcse.txt)")
common.training_flags(p, output_dir="runs/jtcse", lr=1.3e-6, max_len=64, batch_size=64,
                      eval_steps=100, lr_note=" (the towers are trained already); --distill: 1e-5")
# --- JTCSE ---
p.add_argument("--num-cael", type=common.NONNEG_INT, help="cross-attention layers (eq. 7, Table "
               "IX), evenly spaced: default layers/2 (1 if odd); 0 = no cross stream")
p.add_argument("--temp", type=common.POS_FLOAT, default=0.05, help="tau (paper: 0.05)")
p.add_argument("--no-add-sick", dest="add_sick", action="store_false",
               help="train on --train alone (paper: SICK train's sentences added, footnote 7)")
p.add_argument("--no-nce", action="store_true", help="drop L_NCE, eq. 11 (Table X)")
p.add_argument("--no-icnce", action="store_true", help="drop L_ICNCE, eq. 12 (Table X)")
p.add_argument("--no-ictm", action="store_true", help="drop L_ICTM, eqs. 13-14 (Table X)")
p.add_argument("--drop-layernorm", type=common.NONNEG_INT, default=0, metavar="N", help="Fig. 8: "
               "no output LayerNorm in each tower's last N layers; L_TMC then reads h, not h^P")
p.add_argument("--objective", default="paper", choices=["paper", "authors"], help="paper: eqs. "
               "11-13; authors: the authors' code (docs/jtcse.md, details 4-8)")
p.add_argument("--distill", nargs="+", metavar="TEACHER", help="JTCSE D: a fresh --model-a tower "
               "learns the sum of these encoders' embeddings (MSE): a twin run, + others = +UC D")
p.add_argument("--analyze", nargs="?", const="", metavar="TWIN_DIR", help="no training: E_CLS "
               "(eq. 6) per layer and Fig. 5, --model-a and the twin (jtcse_analysis.py)")
p.add_argument("--compare", nargs="+", metavar="MODEL", help="no training: last-layer E_CLS "
               "against the 7-STS average (Fig. 10); a twin run = its two towers")
p.add_argument("--cost", nargs="?", const=64, type=common.POS_INT, metavar="TOKENS", help="with "
               "--compare: parameters, GMACs of a TOKENS-token sentence, Avg./GMACs (Table VII)")
p.add_argument("--attention", metavar="SENTENCE", help="with --compare: attention maps (Fig. 9)")
p.add_argument("--modulus", action="store_true", help="with --compare: STS and |h| by N (Fig. 8)")
p.add_argument("--plot", metavar="FILE.png", help="--analyze, --compare: draw into this PNG")
common.show_ranges(p)


# ---------------------------------------------------------------- the model patch: CAEL ---------
def layer_forward(layers, xs, mask, cael, cls_only=False, ctxs=None):
    """Encoder layer j of each tower, from the towers' own BertLayer submodules; xs: one (N, L, H)
    input per tower. cael=False: CT = SA·V (eq. 9); cael=True: CACT_I = SA_I·V_II, CACT_II =
    SA_II·V_I (eq. 10); then the rest of the tower's OWN layer (W_O, residual + LayerNorm, FFN).
    cls_only: position 0 only (the last layer). ctxs: receives each context (N, L, H), for eq. 6."""
    SA, V = [], []
    for layer, x in zip(layers, xs):
        att, d = layer.attention.self, layer.attention.self.attention_head_size
        heads = lambda t: t.view(*t.shape[:-1], -1, d).transpose(1, 2)  # noqa: E731
        q = heads(att.query(x[:, :1] if cls_only else x))  # (N, heads, L, d)
        k, v = heads(att.key(x)), heads(att.value(x))
        sa = torch.softmax(q @ k.transpose(-1, -2) * att.scaling + mask, dim=-1)  # eq. 8
        SA.append(F.dropout(sa, att.dropout.p, att.training))
        V.append(v)
    V = V[::-1] if cael else V  # eq. 10: each tower's attention weights take the OTHER's values
    out = []
    for layer, x, sa, v in zip(layers, xs, SA, V):
        x = x[:, :1] if cls_only else x
        ctx = (sa @ v).transpose(1, 2).reshape(x.shape)  # CT or CACT, heads merged: (N, L, H)
        if ctxs is not None:
            ctxs.append(ctx)
        out.append(layer.feed_forward_chunk(layer.attention.output(ctx, x)))  # W_O .. FFN
    return out


def drop_layernorm(tower, n):
    """Fig. 8: the output LayerNorm of the tower's last n layers passes the residual sum through,
    unnormalised (its weights stay in the checkpoint, frozen and unused). -> the tower"""
    for layer in tower.encoder.layer[-n:] if n else []:
        layer.output.LayerNorm.requires_grad_(False).forward = torch.nn.Identity().forward
    return tower


# ---------------------------------------------------------------- the loss ----------------------
def nce(z, z_pos, temp):
    """eq. 11: z, z_pos: (B, H). -log e^{cos(z_i, z_i⁺)/τ} / Σ_j e^{cos(z_i, z_j⁺)/τ}, mean over i.
    Cross-tower (eq. 12): z from one tower's view 1, z_pos from the OTHER tower's view 2."""
    sim = F.normalize(z, dim=-1) @ F.normalize(z_pos, dim=-1).T / temp  # (B, B) cosines / τ
    return F.cross_entropy(sim, torch.arange(len(z), device=z.device))


def nce_authors(z, z_other, temp):
    """NOTE(authors' code), model_dual.py `unsup_infonce_loss` (eq. 11, z_other = z) and `icnce`
    (eq. 12); docs/jtcse.md, details 4-5. z, z_other: (2B, H), rows [view 1; view 2]. Every row is
    an anchor against all rows of z_other but its own: 2B − 2 negatives (eqs. 11-12: B − 1)."""
    n = len(z)
    sim = F.normalize(z, dim=-1) @ F.normalize(z_other, dim=-1).T / temp  # (2B, 2B) cosines / τ
    sim = sim.masked_fill(torch.eye(n, dtype=torch.bool, device=z.device), float("-inf"))  # itself
    return F.cross_entropy(sim, (torch.arange(n, device=z.device) + n // 2) % n)  # the other view


def modulus_ratio(a, b):
    """‖a − b‖ / (‖a‖ + ‖b‖) per row; = √(1+k²−2kt)/(1+k), k = ‖b‖/‖a‖, t = cos(a, b) (eq. 5)."""
    return (a - b).norm(dim=-1) / (a.norm(dim=-1) + b.norm(dim=-1))


def tmc(h, h_pos, hP, hP_pos, eps=1e-4):
    """eq. 13, towers i ≠ j: -log(cos(h_i, h_j⁺)) · ‖h_i^P − h_j^{P+}‖ / (‖h_i^P‖ + ‖h_j^{P+}‖),
    mean over the batch; h: (B, H) CLS, hP: (B, H) pooler. cos is clamped at eps (detail 8)."""
    cos = F.cosine_similarity(h, h_pos, dim=-1).clamp(min=eps)
    return (-cos.log() * modulus_ratio(hP, hP_pos)).mean()


def tmc_authors(h, h_pos, hP, hP_pos):
    """NOTE(authors' code), model_dual.py `LTN_loss` (docs/jtcse.md, details 7-8): a negative
    cosine becomes the constant 1e-4, any other enters the log as it is; the ratio is halved."""
    cos = F.cosine_similarity(h, h_pos, dim=-1)
    cos = torch.where(cos < 0, torch.full_like(cos, 1e-4), cos)
    return (-cos.log() * modulus_ratio(hP, hP_pos) / 2).mean()


def jtcse_loss(h, hP, c, R, a):
    """h, hP, c: per tower (2B, H), rows [view 1; view 2]; c None without CAELs; R ∈ {0, 1};
    a.objective: paper (nce, tmc) or authors (nce_authors, tmc_authors). -> eq. 15, {term: value}"""
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
        terms["icnce"] = L(h[i], h[j]) + (L(c[i], c[j]) if c is not None else 0)
    if not a.no_ictm:  # eq. 14: L_TMC(h_I, h_II⁺) + L_TMC(h_II, h_I⁺)
        terms["ictm"] = TMC(0, 1) + TMC(1, 0)
    return sum(terms.values()), terms  # eq. 15


# ---------------------------------------------------------------- the model: the twin ---------
class Twin(torch.nn.Module):
    """Towers I and II. forward(batch) -> h: [(N, H)] CLS of each tower's last hidden state (stock
    BertModel), hP: [(N, H)] pooler outputs, c: [(N, H)] CLS of each cross stream (or None)."""
    def __init__(self, towers, num_cael=None):
        super().__init__()
        self.towers = torch.nn.ModuleList(towers)
        self.n = n = towers[0].config.num_hidden_layers
        if num_cael is None:  # every 2nd layer (BERT-base: 6 CAELs, the paper's best); odd: 1
            num_cael = n // 2 if n % 2 == 0 else 1
        self.k = n // num_cael if num_cael else 0  # eq. 7: layer j is a CAEL when j mod k = 0

    def forward(self, batch):
        outs = [t(**batch, output_hidden_states=self.k > 0) for t in self.towers]  # primitive
        h, hP = [o.last_hidden_state[:, 0] for o in outs], [o.pooler_output for o in outs]
        if not self.k:
            return h, hP, None
        # the cross stream: as the primitive one up to layer k (the first CAEL), then eq. 10
        mask = common.additive_mask(batch["attention_mask"], outs[0].last_hidden_state.dtype)
        xs = [o.hidden_states[self.k - 1] for o in outs]
        for j in range(self.k, self.n + 1):
            layers = [t.encoder.layer[j - 1] for t in self.towers]
            xs = layer_forward(layers, xs, mask, cael=j % self.k == 0, cls_only=j == self.n)
        return h, hP, [x[:, 0] for x in xs]  # c^O: (N, H) per tower


# ---------------------------------------------------------------- one training step -------------
def train_step(model, tokenizer, sentences, R, a, world, device, teacher=None):
    """One micro-batch of B sentences on this rank -> (the loss over the global batch of world·B,
    its terms); gradients accumulated. Twin: eq. 15; JTCSE D: MSE to the teacher's embedding."""
    batch = common.tokenize(tokenizer, sentences, a.max_len, device)  # (B, L)
    B, terms = len(sentences), {}
    with common.autocast(device, a.bf16):
        if teacher is not None:
            target = teacher(sentences).to(device)  # (B, H), the same text; no gradients
            z = common.run_batch(functools.partial(common.cls, model), batch, a.length_grouping)
            loss = F.mse_loss(common.gather(z.float()), common.gather(target))
        else:  # two dropout views of every sentence in one forward pass: (2B, L)
            two = {k: torch.cat([v, v]) for k, v in batch.items()}
            outs = common.run_batch(model, two, a.length_grouping)  # h, hP, c: per tower (2B, H)
            # (2·world·B, H) per tower; NOTE(authors' code): one GPU only (detail 13)
            h, hP, c = ([common.gather_views(z, B) for z in zs] if zs else None for zs in outs)
            loss, terms = jtcse_loss(h, h if a.drop_layernorm else hP, c, R, a)  # Fig. 8: h
    # every rank holds the same global loss; DDP averages gradients over ranks, hence × world
    (loss * world / a.grad_accum).backward()
    return loss, terms


# ---------------------------------------------------------------- encode, save, load ------------
def make_encode(towers, tokenizer, max_len, device):
    """encode(list[str]) -> (N, H) = Σ_towers CLS, no pooler or cross-attention (the authors'): the
    twin's CLS(I) + CLS(II), or a distilled tower's CLS. Dev evaluation and eval_sts.py use it."""
    return common.encoder(lambda batch: sum(common.cls(t, batch) for t in towers), tokenizer,
                          max_len, device)


def save_model(towers, names, tokenizer, max_len, folder):
    """Plain BertModel folders; a distilled tower (".") is also a sentence-transformers folder."""
    for name, tower in zip(names, towers):
        tower.save_pretrained(os.path.join(folder, name))
        tokenizer.save_pretrained(os.path.join(folder, name))
    if names == ["."]:
        runs.save_sentence_transformers(folder, towers[0].config.hidden_size, "cls", max_len)


def load_encoder(run_dir, meta, device):
    """eval_sts.py's entry point for a run folder of this script (twin or distilled tower)."""
    towers, tokenizer = common.load_towers([os.path.join(run_dir, t) for t in meta["towers"]])
    towers = [drop_layernorm(t, meta.get("drop_layernorm", 0)) for t in towers]  # Fig. 8
    max_len = common.check_max_len(meta["max_len"], towers[0].config, run_dir,
                                   "sentemb.json's max_len")
    return make_encode([t.to(device).eval() for t in towers], tokenizer, max_len, device)


# ---------------------------------------------------------------- main --------------------------
def main():
    a = common.parse(p)
    if a.analyze is not None or a.compare:  # eq. 6, Figs. 5, 9, 10, Table VII: no training
        import jtcse_analysis
        return jtcse_analysis.analyze(a, common.pick_device())
    run = runs.Run(a, "jtcse", p)  # torchrun: this process's rank, the world size, its device
    check_args(a, run.world)

    # data: wiki1m (+ SICK train's sentences, footnote 7); every step's rows drawn from the seed
    data = common.check_sts(common.senteval_dir(a.data_dir), common.TASKS if a.final_eval else [])
    sentences = common.read_sentences(common.train_file(a.train, "wiki1m_for_simcse.txt"))
    if a.add_sick:  # unlabeled; the paper says SICK-R, we take its train split (docs/jtcse.md)
        sentences += sorted(common.sts_sentences(data, "SICK-R", "train") - set(sentences))
    per_step = a.batch_size * run.world * a.grad_accum  # sentences a step, all ranks together
    steps = common.step_rows(len(sentences), per_step, a.epochs, a.max_steps, a.seed)
    lr = run.open([a.model_a, a.model_b, *(a.distill or [])], len(steps))  # the run folder, locked

    # the model: the twin; JTCSE D: one fresh tower (the student) and a frozen teacher (the twin)
    common.seed_everything(a.seed)  # dropout from torch's RNG; R (eq. 12) from its own generator:
    r_gen = torch.Generator().manual_seed(a.seed)  # NOTE(authors' code): Python's random (detail 6)
    names = ["."] if a.distill else ["tower_a", "tower_b"]  # their folders in the run folder
    towers, tokenizer = common.load_towers([a.model_a] if a.distill else [a.model_a, a.model_b])
    towers = [drop_layernorm(t, a.drop_layernorm) for t in towers]  # Fig. 8; 0: the stock towers
    net, teacher = towers[0] if a.distill else Twin(towers, a.num_cael), None
    if a.distill:  # the teacher encodes the text the student reads (cut to --max-len)
        teacher = eval_sts.load_ensemble(a.distill, cut=a.max_len, device=run.device,
                                         size=(towers[0].config.hidden_size, "the student's"))
    for tower in towers:  # BERT's pooler feeds only eq. 13: frozen when unused (DDP: all are used)
        tower.pooler.requires_grad_(not (a.distill or a.no_ictm or a.drop_layernorm))
    model = run.wrap(net.to(run.device))  # DDP under torchrun
    eval_len = common.positions(towers[0].config)  # NOTE(authors' code): 64 (detail 12)
    encode = make_encode(towers, tokenizer, eval_len, run.device)

    # the optimiser; NOTE(authors' code): AdamW at a constant learning rate, no warm-up
    params = [q for q in net.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=True)  # fused: one kernel for all parameters
    run.resume("these towers", model=net, opt=opt, r_gen=r_gen)  # --resume; signals caught
    what = f"distil {' + '.join(a.distill)} into {a.model_a}" if a.distill else \
        f"towers {a.model_a} + {a.model_b}, CAEL every {net.k or '-'} of {net.n} layers"
    run.start(f"JTCSE: {what}, objective {a.objective}, {len(sentences)} sentences, "
              f"{len(steps)} steps of {per_step} sentences, lr {lr:g}")

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
            run.save(state, params, dev, write, towers=names, max_len=eval_len, stsb_dev=dev,
                     step=step, teacher=a.distill, objective=None if a.distill else a.objective,
                     num_cael=None if a.distill else net.n // net.k if net.k else 0,
                     drop_layernorm=a.drop_layernorm)
        if halt:
            break
    run.end()  # the peak memory; after a signal: exit, saying how to resume
    run.final_eval(data)  # the best checkpoint, loaded as eval_sts.py loads it, on the test sets


# ---------------------------------------------------------------- argument checks ---------------
def check_args(a, world):
    """Every check that stops training (one error line, exit 2)."""
    if a.plot or a.cost is not None or a.attention is not None or a.modulus:  # the analyses'
        common.die("--plot, --cost, --attention and --modulus belong to the analyses (no "
                   "training): add --compare MODEL ... (or --analyze, for --plot)")
    if a.batch_size * world < 2 and not a.distill:
        common.die("--batch-size must be at least 2: in-batch negatives need other sentences")
    if a.distill and (a.objective != "paper" or a.drop_layernorm):
        common.die("--distill trains one plain tower with MSE: drop --objective and "
                   "--drop-layernorm (they set up the twin)")
    if a.no_nce and a.no_icnce and a.no_ictm:
        common.die("--no-nce, --no-icnce and --no-ictm together leave no loss: drop one of them")
    for t in a.distill or []:  # each as eval_sts.py loads it: a missing or damaged one stops here
        runs.check_model(t)
    if a.distill and not runs.given("--lr"):
        a.lr = 1e-5  # the authors' supplementary, for JTCSE D
    towers = [a.model_a] if a.distill else [a.model_a, a.model_b]
    common.check_towers(towers, a.max_len, None if a.distill else a.num_cael, a.drop_layernorm)


if __name__ == "__main__":
    main()
