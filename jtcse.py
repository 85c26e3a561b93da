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
  eq. 15, the total; one step                jtcse_loss, train_step (JTCSE D: distill_step)
  Fig. 8, LayerNorm removed                  drop_layernorm (--drop-layernorm N)
  eq. 6, Figs. 5, 8-10, Table VII            python jtcse_analysis.py (no training)

  python jtcse.py --model-a runs/simcse_1 --model-b runs/simcse_2       # the paper (GPU)
  python jtcse.py --model-a sentence-transformers/all-MiniLM-L6-v2 --model-b runs/sscl_minilm \\
      --train wiki1m_head.txt --no-add-sick --max-len 32 --lr 2e-5 --max-steps 40 \\
      --eval-steps 10 --output-dir runs/jtcse_minilm              # CPU (docs/jtcse.md)
  python jtcse.py --distill runs/jtcse_minilm --model-a runs/simcse_1 --output-dir runs/jtcse_d
"""
import argparse
import copy
import functools
import json
import math
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModel, AutoTokenizer

import common
import harness

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
# --- general: the paper's values as defaults ---
p.add_argument("--model-a", default="bert-base-uncased", help="tower I, BERT or RoBERTa (paper: "
               "bert-base-uncased trained with unsupervised SimCSE on round-trip-translated data)")
p.add_argument("--model-b", default="bert-base-uncased", help="tower II: the same shape and "
               "vocabulary (paper: a second such SimCSE model)")
p.add_argument("--train", help="one sentence a line (default: SimCSE's wiki1m_for_simcse.txt)")
p.add_argument("--data-dir", help="STS data: DIR/downstream/{STS,SICK} (else $SENTEMB_DATA)")
p.add_argument("--output-dir", default="runs/jtcse", help="the run folder: best model, state")
p.add_argument("--epochs", type=common.POS_INT, default=1, help="paper: 1")
p.add_argument("--max-steps", type=common.STEPS, default=-1, help="N steps (-1: the epochs)")
p.add_argument("--batch-size", type=common.POS_INT, default=64, help="sentences a step and GPU "
               "(paper: 64); torchrun: in-batch negatives from all GPUs")
p.add_argument("--grad-accum", type=common.POS_INT, default=1, help="micro-batches a step, each "
               "with only its own in-batch negatives")
p.add_argument("--length-grouping", action=argparse.BooleanOptionalAction, default=True,
               help="a step's texts in length groups: the same loss, the real tokens' cost")
p.add_argument("--lr", type=common.POS_FLOAT, help="paper: 1.3e-6 (the towers are trained "
               "already); --distill: 1e-5; --resume: the run's own unless given")
# NOTE(authors' code): train_jtcse_bert.py L245, torch's AdamW(model.parameters()): decay 0.01
p.add_argument("--weight-decay", type=common.NONNEG_FLOAT, default=0.01, help="on every weight")
p.add_argument("--max-grad-norm", type=common.NONNEG_FLOAT, default=0.0, help="clip the gradients' "
               "global norm to this before each update; 0: off (authors' code, L77-79)")
p.add_argument("--max-len", type=common.POS_INT, default=64, help="training tokens a sentence "
               "(paper: 64)")
p.add_argument("--eval-steps", type=common.POS_INT, default=100, help="dev every N steps")
harness.add_run_flags(p)  # --seed, --log-steps, --precision, --compile, --resume, ...
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
               "learns the sum of these encoders' embeddings (MSE): a twin run; + an SSCL/SimCSE "
               "run or a plain encoder (its CLS) = +UC D")
common.show_ranges(p)
METHOD = "jtcse"  # the "method" of its sentemb.json and checkpoint.pt
RESUMABLE = harness.RESUMABLE | {"lr", "epochs", "max_steps", "eval_steps", "data_dir",
                                 "output_dir", "length_grouping"}  # --resume may change these


# ---------------------------------------------------------------- the model patch: CAEL -----------
def layer_forward(layers, xs, mask, cael, cls_only=False):
    """Encoder layer j of each tower, from the towers' own BertLayer submodules; xs: one (N, L, H)
    input per tower. cael=False: CT = SA·V (eq. 9); cael=True: CACT_I = SA_I·V_II, CACT_II =
    SA_II·V_I (eq. 10); then the rest of the tower's OWN layer (W_O, residual + LayerNorm, FFN).
    cls_only: position 0 only (the last layer). -> the outputs, the contexts (N, L, H) (eq. 6)"""
    SA, V = [], []
    for layer, x in zip(layers, xs):
        att, d = layer.attention.self, layer.attention.self.attention_head_size
        q = att.query(x[:, :1] if cls_only else x).unflatten(-1, (-1, d)).transpose(1, 2)
        k = att.key(x).unflatten(-1, (-1, d)).transpose(1, 2)  # (N, heads, L, d)
        v = att.value(x).unflatten(-1, (-1, d)).transpose(1, 2)
        sa = torch.softmax(q @ k.transpose(-1, -2) * att.scaling + mask, dim=-1)  # eq. 8
        SA.append(F.dropout(sa, att.dropout.p, att.training))
        V.append(v)
    V = V[::-1] if cael else V  # eq. 10: each tower's attention weights take the OTHER's values
    out, ctxs = [], []
    for layer, x, sa, v in zip(layers, xs, SA, V):
        x = x[:, :1] if cls_only else x
        ctxs.append((sa @ v).transpose(1, 2).reshape(x.shape))  # CT or CACT, heads merged
        out.append(layer.feed_forward_chunk(layer.attention.output(ctxs[-1], x)))  # W_O .. FFN
    return out, ctxs


def drop_layernorm(tower, n):
    """Fig. 8: the output LayerNorm of the tower's last n layers passes the residual sum through,
    unnormalised (its weights stay in the checkpoint, frozen and unused). -> the tower"""
    for layer in tower.encoder.layer[-n:] if n else []:
        layer.output.LayerNorm.requires_grad_(False).forward = torch.nn.Identity().forward
    return tower


def cls_vector(encoder, batch):
    """The [CLS] vector of an encoder's last hidden state: (N, H); its mask 4-D (Twin.forward)."""
    mask = additive_mask(batch["attention_mask"], next(encoder.parameters()).dtype)
    return encoder(**{**batch, "attention_mask": mask}).last_hidden_state[:, 0]


def additive_mask(attention_mask, dtype):
    """(N, L) 1/0 -> (N, 1, 1, L), added to attention scores: 4-D, never read on the host."""
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


# ---------------------------------------------------------------- the loss ------------------------
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


def jtcse_loss(h, hP, c, R, temp, objective="paper", skip=()):
    """h, hP, c: per tower (2B, H), rows [view 1; view 2]; c None without CAELs; R ∈ {0, 1};
    objective: paper (nce, tmc) or authors (nce_authors, tmc_authors); skip: terms left out
    (nce, icnce, ictm: the ablations of Table X). -> eq. 15, {term: value}"""
    B = len(h[0]) // 2
    tmc_loss = tmc_authors if objective == "authors" else tmc  # eq. 13

    def L(x, y):  # InfoNCE, anchors from x, candidates from y: (2B, H) each
        return nce_authors(x, y, temp) if objective == "authors" else nce(x[:B], y[B:], temp)
    terms = {}
    if "nce" not in skip:  # eq. 11, per tower: its views against each other
        terms["nce"] = L(h[0], h[0]) + L(h[1], h[1])
    if "icnce" not in skip:  # eq. 12: R·(L(h_I,h_II)+L(c_I,c_II)) + (1−R)·(L(h_II,h_I)+L(c_II,c_I))
        i, j = (0, 1) if R == 1 else (1, 0)  # NOTE(authors' code): their random_data = 1 − R
        terms["icnce"] = L(h[i], h[j]) + (L(c[i], c[j]) if c is not None else 0)
    if "ictm" not in skip:  # eq. 14: L_TMC(h_I, h_II⁺) + L_TMC(h_II, h_I⁺), views 1 and 2
        terms["ictm"] = (tmc_loss(h[0][:B], h[1][B:], hP[0][:B], hP[1][B:])
                         + tmc_loss(h[1][:B], h[0][B:], hP[1][:B], hP[0][B:]))
    return sum(terms.values()), terms  # eq. 15


# ---------------------------------------------------------------- the model: the twin -------------
class Twin(torch.nn.Module):
    """Towers I and II. forward(batch) -> h: [(N, H)] CLS of each tower's last hidden state (stock
    BertModel), hP: [(N, H)] pooler outputs, c: [(N, H)] CLS of each cross stream (or None)."""
    def __init__(self, towers, num_cael=None):
        super().__init__()
        self.towers = torch.nn.ModuleList(towers)
        self.n = n = towers[0].config.num_hidden_layers
        if num_cael is None:  # every 2nd layer (BERT-base: 6 CAELs, the paper's best); odd: 1
            num_cael = n // 2 if n % 2 == 0 else 1
        self.num_cael = num_cael  # CAELs: eq. 7's layer j is one when j mod k = 0
        self.k = n // num_cael if num_cael else 0

    def forward(self, batch):
        mask = additive_mask(batch["attention_mask"], self.towers[0].dtype)  # (N, 1, 1, L)
        outs = [t(**{**batch, "attention_mask": mask}, output_hidden_states=self.k > 0)
                for t in self.towers]  # primitive
        h, hP = [o.last_hidden_state[:, 0] for o in outs], [o.pooler_output for o in outs]
        if not self.k:
            return h, hP, None
        # the cross stream from layer k's input: layer j = k..n (eq. 7's j = encoder.layer[j - 1])
        xs = [o.hidden_states[self.k - 1] for o in outs]  # a CAEL (eq. 10) where j mod k = 0
        for j in range(self.k, self.n + 1):
            layers = [t.encoder.layer[j - 1] for t in self.towers]
            xs, _ = layer_forward(layers, xs, mask, cael=j % self.k == 0, cls_only=j == self.n)
        return h, hP, [x[:, 0] for x in xs]  # c^O: (N, H) per tower


# ---------------------------------------------------------------- one training step ---------------
def train_step(model, batch, R, device, temp=0.05, objective="paper", skip=(), tmc_on_h=False,
               autocast=None, world=1, accum=1, gather=lambda z: z, scale=lambda loss: loss):
    """One micro-batch of B sentences -> (eq. 15 over the global batch, its terms); gradients
    accumulated. batch: the tokenizer's (B, L), on the host; model(batch): the twin's (h, hP, c)
    through common.in_length_groups. R: eq. 12's direction; objective, skip: jtcse_loss's;
    tmc_on_h: eq. 13 reads h, not h^P (Fig. 8); autocast: the forward's dtype (None: fp32).
    torchrun: gather(z) = every rank's rows; the gradients × world / accum (DDP averages them over
    the ranks), of scale(loss) (fp16: the gradient scaler's)."""
    B = len(batch["input_ids"])
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        # two dropout views of every sentence in one forward pass: (2B, L)
        h, hP, c = model({k: torch.cat([v, v]) for k, v in batch.items()})  # per tower (2B, H)
        h = global_views(h, B, gather)  # NOTE(authors' code): 1 GPU
        hP = global_views(hP, B, gather)
        c = global_views(c, B, gather) if c is not None else None
        loss, terms = jtcse_loss(h, h if tmc_on_h else hP, c, R, temp, objective, skip)
    # every rank holds the same global loss; DDP averages gradients over ranks, hence × world
    scale(loss * world / accum).backward()
    return loss, terms


def global_views(zs, B, gather):
    """Per tower (2B, H), rows [view 1; view 2] -> (2·world·B, H): [view 1, view 2 of all ranks]."""
    return [torch.cat([gather(z[:B]), gather(z[B:])]) for z in zs]


def distill_step(model, batch, sentences, teacher, device, autocast=None, world=1, accum=1,
                 gather=lambda z: z, scale=lambda loss: loss):
    """JTCSE D (§IV-C): one micro-batch -> (the MSE of the student's CLS, model(batch), to
    teacher(sentences), (B, H) over the global batch; no terms); the rest as train_step's."""
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        target = teacher(sentences).to(device)  # (B, H), the same text; no gradients
        loss = F.mse_loss(gather(model(batch).float()), gather(target))
    scale(loss * world / accum).backward()
    return loss, {}


# ---------------------------------------------------------------- the data loader -----------------
def sick_sentences(data, sentences):
    """Footnote 7: SICK train's distinct sentences (unlabeled) not yet among sentences, sorted."""
    sick = {s for r in common.load_sts(data, "SICK-R", "train")["train"] for s in r[:2]}
    return sorted(sick - set(sentences))


def micro_batches(tokenizer, sentences, steps, rank, world, batch_size, max_len):
    """Each step's micro-batches on this rank, tokenised on the host (a step or two ahead of the
    loop: common.ahead) -> per step [((B, L) batch, its sentences)]; rank r's k-th: rows
    [(k·world + r)·B, +B)."""
    tokenizer = copy.deepcopy(tokenizer)  # not the evaluation's: a fast tokenizer is not shared
    for rows in steps:
        texts = [[sentences[i] for i in rows[j:j + batch_size]]
                 for j in range(rank * batch_size, len(rows), world * batch_size)]
        yield [(tokenizer(t, padding=True, truncation=True, max_length=max_len,
                          return_tensors="pt"), t) for t in texts]


# ---------------------------------------------------------------- building the model ------------
def load_towers(names, drop=0, pooler=True):
    """JTCSE's towers, [AutoModel] with every weight from its file (roberta-base's fresh pooler for
    eq. 13 is said on stderr), their tokenizer; drop: Fig. 8 (pooler frozen); pooler: trained."""
    towers = [drop_layernorm(common.load_pretrained(AutoModel, n, strict=True, fresh="pooler."),
                             drop) for n in names]
    for tower in towers:
        tower.pooler.requires_grad_(pooler and not drop)  # it feeds only eq. 13
    return towers, common.load_pretrained(AutoTokenizer, names[0])


# ---------------------------------------------------------------- main ----------------------------
def main():
    a = common.parse(p)
    rank, world, device, log = harness.start()  # torchrun: one process a GPU
    skip = check_args(a, world)  # eq. 15's terms left out (Table X)

    # data: wiki1m (+ SICK train's sentences, footnote 7); every step's rows drawn from the seed
    data = common.sts_data(a.data_dir, common.TASKS if a.final_eval else [])
    sentences = common.read_sentences(a.train)  # no --train: SimCSE's wiki1m_for_simcse.txt
    if a.add_sick:  # unlabeled; the paper says SICK-R, we take its train split (docs/jtcse.md)
        sentences += sick_sentences(data, sentences)
    per_step = a.batch_size * world * a.grad_accum  # sentences a step, all ranks together
    steps = common.step_rows(len(sentences), per_step, a.epochs, a.max_steps, a.seed)

    # the run folder (harness.py), locked; --resume: its state, trained as this command says
    run = harness.Run(a, METHOD, RESUMABLE, check_run, [a.model_a, a.model_b, *(a.distill or [])],
                      device, custom_module=not a.distill)  # a twin's: st_module.JTCSETwin
    if run.complete(len(steps)):  # nothing is wrong, nothing is left: exit 0
        return
    lr = run.rate(a.lr, 1e-5 if a.distill else 1.3e-6)  # --lr, the resumed run's, or the paper's

    # the model: the twin; JTCSE D: one fresh tower (the student) and a frozen teacher (the twin)
    torch.manual_seed(a.seed)  # dropout from torch's RNG; R (eq. 12) from its own generator:
    r_gen = torch.Generator().manual_seed(a.seed)  # NOTE(authors' code): Python's random (detail 6)
    if a.distill:  # the student's pooler is not trained (eq. 13 alone reads it)
        towers, tokenizer = load_towers([a.model_a], pooler=False)
        raw_model = towers[0].to(device)
        teacher = load_teacher(a.distill, a.max_len, towers[0].config.hidden_size, device)
        what = f"distil {' + '.join(a.distill)} into {a.model_a}"
    else:  # --no-icnce: no CAEL (only L_ICNCE reads the cross stream); --no-ictm: no pooler
        towers, tokenizer = load_towers([a.model_a, a.model_b], a.drop_layernorm, not a.no_ictm)
        raw_model = Twin(towers, 0 if "icnce" in skip else a.num_cael).to(device)
        what = f"towers {a.model_a} + {a.model_b}, CAEL every {raw_model.k or '-'} of " \
            f"{raw_model.n} layers"
    model = DDP(raw_model) if world > 1 else raw_model  # torchrun: gradients averaged over ranks
    student = functools.partial(cls_vector, model) if a.distill else model
    step_model = common.in_length_groups(  # the model as a step runs it: the host's batch
        torch.compile(student, dynamic=True) if a.compile else student,  # copied to the device
        a.length_grouping, device)  # in length groups (the same outputs, cheaper)
    eval_len = common.positions(towers[0].config)  # NOTE(authors' code): 64 (detail 12)
    encode = make_encode(towers, tokenizer, eval_len, device, a.compile, a.precision)
    meta = dict(method=METHOD, towers=FOLDERS[len(towers)], max_len=eval_len, teacher=a.distill,
                objective=None if a.distill else a.objective, drop_layernorm=a.drop_layernorm,
                num_cael=None if a.distill else raw_model.num_cael)  # sentemb.json: how it encodes

    # the update; NOTE(authors' code): AdamW (train_jtcse_bert.py L245) at a constant rate
    params = [q for q in raw_model.parameters() if q.requires_grad]  # theirs skip no-grad ones
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=a.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)  # constant
    autocast = common.PRECISIONS[a.precision]  # the step's dtype (None: fp32)
    scaler = torch.amp.GradScaler(device.type, enabled=a.precision == "fp16")  # fp16: loss × s
    run.start_training(model=raw_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                       lr=lr, meta=meta, generators={"r_gen": r_gen})  # what every save holds
    first = run.load_resumed_state()  # --resume: each part as saved (a new run: step 0)
    log(f"JTCSE: {what}, objective {a.objective}, {len(sentences)} sentences, {len(steps)} steps "
        f"of {per_step} sentences, lr {lr:g}, {world} process(es), device {device}, {a.precision}")

    batches = common.ahead(micro_batches(  # the steps from `first` on, tokenised ahead
        tokenizer, sentences, steps[max(first - 1, 0):], rank, world, a.batch_size, a.max_len))
    meter = harness.Meter(device, per_step, "sent", a.precision)  # the step lines' speed
    raw_model.train()
    for step in range(first, len(steps) + 1):  # step 0: the model as loaded, evaluated
        if step > 0:  # optimisation step `step`: grad_accum micro-batches of B sentences a rank
            R = int(torch.randint(0, 2, (1,), generator=r_gen))  # eq. 12: ICNCE's direction
            with meter.step(step_model):
                for k, (batch, texts) in enumerate(next(batches)):  # DDP syncs after the last
                    with model.no_sync() if world > 1 and k < a.grad_accum - 1 else nullcontext():
                        if a.distill:  # JTCSE D: the student's CLS against the teacher's
                            loss, terms = distill_step(step_model, batch, texts, teacher, device,
                                autocast=autocast, world=world, accum=a.grad_accum,
                                gather=harness.gather, scale=scaler.scale)
                        else:  # the twin: eq. 15
                            loss, terms = train_step(step_model, batch, R, device, temp=a.temp,
                                objective=a.objective, skip=skip, tmc_on_h=a.drop_layernorm > 0,
                                autocast=autocast, world=world, accum=a.grad_accum,
                                gather=harness.gather, scale=scaler.scale)
                    run.watch(step, loss)  # not finite: noted on the device, read below
                scaler.unscale_(optimizer)  # fp16: the gradients / s, clipped as they are
                terms["gnorm"] = torch.nn.utils.clip_grad_norm_(  # before clipping; 0: no clip
                    params, a.max_grad_norm or math.inf)
                scaler.step(optimizer)  # fp16: skipped where a gradient is inf or NaN
                scaler.update()  # fp16: s halved after a skip, doubled after 2000 steps without
                scheduler.step()  # every step, skipped or not
                optimizer.zero_grad(set_to_none=True)
        evaluate = step % a.eval_steps == 0 or step == len(steps)
        read = evaluate or step % a.log_steps == 0  # the host reads the device here
        if read and step > 0:
            run.check_loss()  # one not finite since the last read: one line, the last save good
            if step % a.log_steps == 0 or step == len(steps):
                run.log(step, meter, loss=loss, **terms, **({} if a.distill else {"R": R}))
        halt = run.stop_requested(read)  # a signal on any rank: every rank stops at a read
        dev = common.stsb_dev(encode, data) if evaluate and rank == 0 else None  # no dropout
        if evaluate or halt:  # checkpoint.pt; with a new best dev score, best/ (rank 0; all wait)
            run.save(step, "stsb_dev", dev,
                     functools.partial(save_model, towers, tokenizer, eval_len))
        if halt:
            break

    with run.finish(step):  # a signal stopped it: saved, exit 128 + its number
        if a.final_eval:  # the best checkpoint, loaded as eval_sts.py loads it (rank 0)
            run.final_table(load_encoder, data, common.TASKS, a.precision)


# ======== a reader of the paper may stop at main(): below, how a run of JTCSE is saved and checked
# ---------------------------------------------------------------- the run folder ------------------
def make_encode(towers, tokenizer, max_len, device, compiled=False, precision=None):
    """encode(list[str]) -> (N, H) = Σ_towers CLS without dropout, pooler or cross-attention (the
    authors'): the twin's CLS(I) + CLS(II), or a distilled tower's; dev scores', eval_sts.py's."""
    return common.compiled_encode(common.encoder(
        lambda b: sum(cls_vector(t, b) for t in towers), tokenizer, max_len, device, precision,
        torch.nn.ModuleList(towers)), compiled)


FOLDERS = {1: ["."], 2: ["tower_a", "tower_b"]}  # a run folder's towers: distilled, twin


def save_model(towers, tokenizer, max_len, folder):
    """Plain BertModel folders (FOLDERS), each a sentence-transformers folder too (CLS); a twin's
    folder is one of st_module.JTCSETwin (CLS(I) + CLS(II), trust_remote_code=True):
    SentenceTransformer(folder) encodes as we evaluate."""
    for name, tower in zip(FOLDERS[len(towers)], towers):
        tower.save_pretrained(os.path.join(folder, name))
        tokenizer.save_pretrained(os.path.join(folder, name))
        common.write_st_files(os.path.join(folder, name), tower.config.hidden_size, max_len, "cls")
    if len(towers) == 2:
        common.write_st_files(folder, pooler="JTCSETwin")


META_TYPES = {  # sentemb.json: the keys, and their types; a tower: "." (distilled) or a folder
    "towers": lambda v: isinstance(v, list) and 1 <= len(v) <= 2 and all(
        isinstance(t, str) and (t == "." or t not in ("", "..") and os.path.basename(t) == t)
        for t in v),
    "max_len": lambda v: type(v) is int and v >= 1}
META_OPTIONAL = {  # keys that older runs may lack
    "drop_layernorm": lambda v: type(v) is int and v >= 0,
    "objective": (None, "paper", "authors").__contains__,
    "num_cael": lambda v: v is None or type(v) is int and v >= 0,
    "step": lambda v: type(v) is int and v >= 0,
    "stsb_dev": lambda v: v is None or type(v) in (int, float),
    "teacher": lambda v: v is None or isinstance(v, str) or isinstance(v, list) and all(
        isinstance(x, str) for x in v)}
RUN_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def check_run(run_dir, meta):
    """A run folder of this script is the model its files describe, or one line naming the file and
    value: sentemb.json's keys of their types; each tower's files whole, its weights its config's;
    the towers listed = the tower folders, of one shape and vocabulary; values within limits."""
    path, where = os.path.join(run_dir, common.META), f"cannot load the jtcse.py run in '{run_dir}'"
    common.check_keys(path, meta, META_TYPES, META_OPTIONAL)
    for t in meta["towers"]:
        for rel in RUN_FILES:
            common.check_file(run_dir, os.path.normpath(os.path.join(t, rel)), where,
                              harness.RECOPY)
    present = [t for t in ("tower_a", "tower_b") if os.path.isdir(os.path.join(run_dir, t))]
    if meta["towers"] != ["."] and sorted(meta["towers"]) != present:  # a twin, evaluated whole
        common.die(f"{path}: towers {json.dumps(meta['towers'])} disagrees with the tower folders "
                   f"of the run folder ({present}): set it to {json.dumps(present)}, or "
                   f"{harness.RECOPY}")
    towers = [os.path.normpath(os.path.join(run_dir, t)) for t in meta["towers"]]
    for t in towers:
        common.check_weights(t, f"{where} ({t})", harness.RECOPY)
    check_towers(towers, meta["max_len"], meta.get("num_cael"),
                        meta.get("drop_layernorm", 0), meta=path)


def load_encoder(run_dir, meta, device):
    """eval_sts.py's entry point for a run folder of this script (twin or distilled tower)."""
    towers, tokenizer = load_towers([os.path.join(run_dir, t) for t in meta["towers"]],
                                    meta.get("drop_layernorm", 0))  # Fig. 8
    return make_encode([t.to(device).eval() for t in towers], tokenizer, meta["max_len"], device)


# ---------------------------------------------------------------- the towers ----------------------
# transformers' classes whose layers and pooler are BERT's code verbatim (transformers 5.23); the
# embeddings may differ (RoBERTa's position ids), the layers are what eq. 10 patches
JTCSE_TOWERS = ("bert", "roberta", "xlm-roberta", "camembert")


def check_towers(names, max_len=None, num_cael=None, drop=0, meta=None):
    """JTCSE's towers (and the models its analysis compares): BERT-like encoders with a pooler, of
    one shape and vocabulary (eq. 10 swaps values between equal layers of one batch); a --num-cael
    that divides their layers; a --drop-layernorm within them. meta: a run's sentemb.json, whose
    keys the messages name."""
    configs = [common.load_pretrained(AutoConfig, n) for n in names]
    check_alike(names, configs)
    if max_len:
        flag = f"{meta}: max_len" if meta else "--max-len"
        common.check_max_len(max_len, configs[0], names[0], flag)
    n = configs[0].num_hidden_layers
    if drop > n:
        flag = f"{meta}: drop_layernorm" if meta else "--drop-layernorm"
        fix = f"set it to 0 to {n}" if meta else f"pass 0 to {n}"
        common.die(f"{flag} {drop} is more than the {n} layers of '{names[0]}': {fix}")
    if num_cael and n % num_cael:
        flag = f"{meta}: num_cael" if meta else "--num-cael"
        common.die(f"{flag} {num_cael} does not divide the {n} layers: "
                   f"{'choose' if not meta else 'set it to'} one of "
                   f"{[d for d in range(1, n + 1) if n % d == 0]} (or 0 for no cross-attention)")


def check_alike(names, configs):
    """The towers are BERT-like encoders with a pooler, of one vocabulary and shape, or one line."""
    for name, c in zip(names, configs):
        if c.model_type not in JTCSE_TOWERS:
            common.die(f"'{name}' is a {c.model_type} model: JTCSE's towers must be BERT-like "
                       f"encoders with a pooler ({', '.join(JTCSE_TOWERS)})")
    vocabs = [common.load_pretrained(AutoTokenizer, n).get_vocab() for n in names]
    if any(v != vocabs[0] for v in vocabs):
        common.die(f"'{names[0]}' and '{names[-1]}' have different tokenizers: the towers read one "
                   "tokenised batch, so pass models that share a vocabulary")
    shapes = [(c.num_hidden_layers, c.hidden_size, c.num_attention_heads) for c in configs]
    if any(s != shapes[0] for s in shapes):
        common.die(f"towers differ in (layers, hidden, heads): {shapes}; eq. 10 swaps values "
                   "between equal layers, so pass towers of one architecture")


# ---------------------------------------------------------------- JTCSE D: the teacher ------------
def teacher_run(name, load):
    """A --distill teacher that is a run of ours (a run folder, its best/, a copy of it), checked
    by the script that wrote it (JTCSE: this one; SSCL or SimCSE: sscl.py) and read as eval_sts.py
    reads it. -> load(script, its model folder, its sentemb.json); None: a plain encoder"""
    found = harness.run_of(name)
    if not found:
        return None
    method, run_dir, folder = found
    if method not in ("jtcse", "sscl"):
        common.die(f"'{name}' is not a run of jtcse.py or sscl.py (method {method!r}): --distill "
                   "takes JTCSE and SSCL runs and plain encoders")
    script = sys.modules[__name__]
    if method == "sscl":
        try:  # the one file beside this script that --distill may need: an SSCL teacher's loader
            import sscl as script
        except ImportError:
            common.die(f"--distill '{name}' is a run of sscl.py: put sscl.py beside jtcse.py")
    with harness.reading(run_dir, method, script.check_run, folder) as (folder, meta):
        loaded = load(script, folder, meta)
        harness.check_prints(folder, meta)  # once its files have loaded (a damaged one named)
        return loaded


def load_teacher(names, max_len, hidden, device):
    """JTCSE D's teacher: encode(list[str]) -> (N, hidden), the sum of its members' embeddings
    (+UC D: the twin plus another encoder, Table I), each reading the student's text up to
    max_len tokens: a run of ours with its own pooling, a plain encoder by its CLS."""
    members = []
    for name in names:
        run = teacher_run(name, lambda script, folder, meta: script.load_encoder(
            folder, {**meta, "max_len": max_len}, device))  # a run's encoder, max_len tokens
        if run:
            members.append(run)
            continue
        model = common.load_pretrained(AutoModel, name).to(device).eval()
        members.append(common.encoder(functools.partial(cls_vector, model),
                                      common.load_pretrained(AutoTokenizer, name),
                                      min(max_len, common.positions(model.config) or max_len),
                                      device))
    for n, m in zip(names[1:], members[1:]):  # a sum over one text: one vocabulary, one limit
        if m.tokenizer.get_vocab() != members[0].tokenizer.get_vocab():
            common.die(f"'{names[0]}' and '{n}' have different tokenizers: the teacher sums the "
                       "embeddings of one tokenised sentence: pass models of one vocabulary")
        if m.max_len != members[0].max_len:
            common.die(f"'{names[0]}' reads up to {members[0].max_len} tokens and '{n}' up to "
                       f"{m.max_len}: pass teachers of one maximum length")
    sizes = [m(["a probe sentence"]).shape[-1] for m in members]
    if set(sizes) != {hidden}:
        common.die(f"the embeddings of {' + '.join(names)} have {', '.join(map(str, sizes))} "
                   f"dimensions; the student's is {hidden}: pass teachers of the student's size")
    return lambda sentences: sum(m(sentences).float() for m in members)  # (N, H)


def check_teacher(name):
    """A --distill teacher, before any work: its run's files and values, or a model folder."""
    if not os.path.isdir(name):
        common.load_pretrained(AutoConfig, name)
    elif teacher_run(name, lambda *_: True) is None:
        common.check_hf_folder(name, "model", f"cannot load '{name}'")
        common.check_hf_folder(name, "tokenizer", f"cannot load '{name}'")


# ---------------------------------------------------------------- argument checks -----------------
def check_args(a, world):
    """Every check that stops training (one error line, exit 2), flags that would do nothing
    included. -> eq. 15's terms left out (Table X: --no-nce, --no-icnce, --no-ictm)"""
    skip = [t for t in ("nce", "icnce", "ictm") if getattr(a, "no_" + t)]
    if a.batch_size * world < 2 and not a.distill:
        common.die("--batch-size must be at least 2: in-batch negatives need other sentences")
    twin = twin_flags(a, skip)
    if a.distill and twin:
        common.die(f"--distill trains one plain tower (--model-a) with MSE: drop {', '.join(twin)} "
                   "(they set up the twin)")
    if len(skip) == 3:
        common.die("--no-nce, --no-icnce and --no-ictm together leave no loss: drop one of them")
    if a.num_cael is not None and "icnce" in skip:
        common.die("--num-cael sets the cross stream, which only L_ICNCE reads: drop --num-cael or "
                   "--no-icnce")
    if a.temp != p.get_default("temp") and {"nce", "icnce"} <= set(skip):
        common.die("--temp is the InfoNCE temperature, and --no-nce --no-icnce leave no InfoNCE: "
                   "drop --temp")
    for t in a.distill or []:  # a missing or damaged teacher stops here
        check_teacher(t)
    towers = [a.model_a] if a.distill else [a.model_a, a.model_b]
    check_towers(towers, a.max_len, None if a.distill else a.num_cael, a.drop_layernorm)
    return skip


def twin_flags(a, skip):
    """The flags given that set up the twin (which --distill does not train)."""
    given = {"--model-b": a.model_b != p.get_default("model_b"),
             "--num-cael": a.num_cael is not None,
             "--temp": a.temp != p.get_default("temp"),
             "--objective": a.objective != p.get_default("objective"),
             "--drop-layernorm": a.drop_layernorm > 0}
    return [flag for flag, on in given.items() if on] + [f"--no-{t}" for t in skip]


if __name__ == "__main__":
    main()
