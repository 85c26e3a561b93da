"""Evaluate any checkpoint on the papers' benchmarks and print their tables:
the 7 STS tasks (STS12-16 in SentEval's "all" setting, STS-B test, SICK-R test; Spearman x 100),
SentEval's 7 transfer tasks (MR, CR, SUBJ, MPQA, SST-2, TREC, MRPC; accuracy x 100, SentEval's own
protocol), SentEval's probing tasks SentLen, TreeDepth, CoordInv (SSCL Table 4; same protocol), and
the alignment and uniformity of Wang & Isola (2020) on STS-B.

  # a plain Hugging Face model, 7 STS tasks
  python eval_sts.py --model bert-base-uncased --pooler cls
  # a run of sscl.py / jtcse.py / bellm.py
  python eval_sts.py --model runs/sscl
  # MR CR SUBJ MPQA SST TREC MRPC (SentEval test mode)
  python eval_sts.py --model runs/sscl --tasks transfer
  # SentLen TreeDepth CoordInv (SentEval's files in DIR/downstream/probing, see --tasks)
  python eval_sts.py --model runs/sscl --tasks probing
  python eval_sts.py --model runs/sscl --tasks all --align-uniform --json out.json
  # several models in turn; alignment against uniformity in one figure (JTCSE Fig. 7)
  python eval_sts.py --model runs/sscl runs/jtcse --tasks STS-B --align-uniform --plot fig7.png
  # an ensemble: the sum of the embeddings (JTCSE's +UC: a twin plus another encoder)
  python eval_sts.py --model runs/jtcse princeton-nlp/unsup-simcse-bert-base-uncased --ensemble
  # MTEB tasks, zero-shot (JTCSE Tables II-VI; pip install -r requirements-mteb.txt; the data
  # downloads from the Hugging Face hub)
  python eval_sts.py --model runs/jtcse --mteb Banking77Classification,SciFact,STSBenchmark
  # BeLLM's Table 5 (caption retrieval; docs/evaluation.md) and Table 2 (C-STS), without STS
  python eval_sts.py --model runs/bellm --retrieval flickr30k_test.tsv --show 4
  python eval_sts.py --model runs/bellm_csts --csts csts_validation.csv

A run folder written by our scripts holds `sentemb.json`, which names the method; that script's own
`load_encoder` builds the encode function, the same one used for its dev evaluation while training.
"""
import argparse
import errno
import importlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers

import common
import figures
import runs

# ---------------------------------------------------------------- transfer tasks (SentEval) -----
# SentEval (Conneau & Kiela 2018) as SimCSE's evaluation.py runs it: a logistic regression on frozen
# sentence embeddings, trained with SentEval's own protocol (folds, L2 grid, early stopping),
# accuracy x 100.
TRANSFER = ["MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC"]
TRANSFER_MODES = {  # SimCSE's evaluation.py: --mode test (the papers' tables) and --mode fasttest
    "test": dict(kfold=10, optim="adam", batch_size=64, tenacity=5, epoch_size=4),
    "fasttest": dict(kfold=5, optim="rmsprop", batch_size=128, tenacity=3, epoch_size=2),
}
# SentEval's defaults (engine.py, tools/classifier.py)
SEED, MAX_EPOCH, VALIDATION_SPLIT = 1111, 200, 0.05
# SentEval's L2 grid for its PyTorch classifier: 1e-5 ... 1e-2
REGS = [10**t for t in range(-5, -1)]
TREC_CLASSES = {"ABBR": 0, "DESC": 1, "ENTY": 2, "HUM": 3, "LOC": 4, "NUM": 5}


def _read(path, encoding):
    """The text of one SentEval file, decoded as SentEval decodes it."""
    if not os.path.isfile(path):
        common.die(f"missing {path}: the SentEval data folder is incomplete; unpack senteval.tar "
                   "again or fix --data-dir")
    try:
        with open(path, encoding=encoding) as f:
            return f.read()
    except UnicodeDecodeError as e:
        common.die(f"{path}: not {encoding} text ({e.reason} at byte {e.start}); "
                   "re-download senteval.tar")
    except OSError as e:
        common.die(f"cannot read {path} ({e.strerror}): make it readable, or unpack senteval.tar "
                   "again")


def _file_lines(text):
    """The lines `for line in open(path)` yields (SentEval's loop for SST, TREC, MRPC); the binary
    tasks use str.splitlines(), which also splits at a few other characters, as SentEval does."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def _sorted(*columns):
    """SentEval sorts each split "to reduce padding": by word counts, then label. The fold splits
    are drawn on this order, so it is part of the protocol. columns: lists of word lists, then the
    labels."""
    rows = sorted(zip(*columns), key=lambda r: tuple(len(c) for c in r[:-1]) + (r[-1],))
    return ([[" ".join(w) for w in col] for col in list(zip(*rows))[:-1]],
            np.array([r[-1] for r in rows]))


def load_transfer(data, task):
    """{split: (texts, labels)} read as SentEval reads them (senteval/binary.py, sst.py, trec.py,
    mrpc.py); texts = [sentences], or [sentences A, sentences B] for MRPC; each split in SentEval's
    sample order."""
    d = lambda *p: os.path.join(data, task if task != "SST2" else "SST", *p)  # noqa: E731
    if task in ("MR", "CR", "SUBJ", "MPQA"):  # label 1 = the first file (SUBJ: objective)
        files = {"MR": ("rt-polarity.pos", "rt-polarity.neg"),
                 "CR": ("custrev.pos", "custrev.neg"),
                 "SUBJ": ("subj.objective", "subj.subjective"),
                 "MPQA": ("mpqa.pos", "mpqa.neg")}[task]
        pos, neg = ([line.split() for line in _read(d(f), "latin-1").splitlines()] for f in files)
        return {"all": _sorted(pos + neg, [1] * len(pos) + [0] * len(neg))}
    if task == "SST2":
        out = {}
        for split in ("train", "dev", "test"):
            path, rows = d("binary", f"sentiment-{split}"), []
            for i, line in enumerate(_file_lines(_read(path, "utf-8")), 1):
                t = line.strip().split("\t")
                if len(t) < 2 or t[1] not in ("0", "1"):
                    common.die(f"{path}, line {i}: malformed line "
                               "(expected 'sentence<TAB>0 or 1'); re-download senteval.tar")
                rows.append((t[0].split(), int(t[1])))
            out[split] = _sorted(*zip(*rows))
        return out
    if task == "TREC":
        out = {}
        for split, name in (("train", "train_5500.label"), ("test", "TREC_10.label")):
            path, rows = d(name), []
            for i, line in enumerate(_file_lines(_read(path, "latin-1")), 1):
                target, _, rest = line.strip().partition(":")  # 'COARSE:fine question words'
                if target not in TREC_CLASSES or " " not in rest:
                    common.die(f"{path}, line {i}: malformed line (expected 'COARSE:fine question' "
                               f"with COARSE one of {', '.join(TREC_CLASSES)}); "
                               "re-download senteval.tar")
                rows.append((rest.split(" ", 1)[1].split(), TREC_CLASSES[target]))
            out[split] = _sorted(*zip(*rows))
        return out
    if task == "MRPC":  # header line; 'label<TAB>id1<TAB>id2<TAB>sentence 1<TAB>sentence 2'
        out = {}
        for split in ("train", "test"):
            path, rows = d(f"msr_paraphrase_{split}.txt"), []
            for i, line in enumerate(_file_lines(_read(path, "utf-8"))[1:], 2):
                t = line.strip().split("\t")
                if len(t) < 5 or t[0] not in ("0", "1"):
                    common.die(f"{path}, line {i}: malformed line (expected "
                               "'label<TAB>id1<TAB>id2<TAB>sentence 1<TAB>sentence 2'); "
                               "re-download senteval.tar")
                rows.append((t[3].split(), t[4].split(), int(t[0])))
            out[split] = _sorted(*zip(*rows))
        return out
    common.die(f"unknown transfer task '{task}': choose from {', '.join(TRANSFER)}")


def stratified_kfold(y, k, seed=SEED):
    """[(train_idx, test_idx)] x k, equal to scikit-learn's StratifiedKFold(k, shuffle=True,
    random_state=seed).split(X, y), which SentEval uses (scikit-learn >= 0.22: each class's fold
    labels are dealt round-robin over the sorted labels, then shuffled; classes numbered by first
    appearance)."""
    rng = np.random.RandomState(seed)
    _, first, inverse = np.unique(y, return_index=True, return_inverse=True)
    # class ids in order of first appearance
    y_enc = np.unique(first, return_inverse=True)[1][inverse]
    allocation = np.asarray([np.bincount(np.sort(y_enc)[i::k], minlength=len(first))
                             for i in range(k)])
    fold = np.empty(len(y), dtype=int)
    for c in range(len(first)):
        folds_for_class = np.arange(k).repeat(allocation[:, c])
        rng.shuffle(folds_for_class)
        fold[y_enc == c] = folds_for_class
    return [(np.flatnonzero(fold != i), np.flatnonzero(fold == i)) for i in range(k)]


def accuracy(W, b, X, y):
    """Fraction of rows whose arg-max logit is the label. W: (C, D), b: (C,), X: (N, D), y: (N,)."""
    return (X @ W.T + b).argmax(1).eq(y).sum().item() / len(y)


@torch.enable_grad()
def fit_logreg(X, y, runs, nclasses, cfg):
    """SentEval's `MLP(nhid=0).fit` for many runs at once; -> [(best dev accuracy, W (C, D),
    b (C,))].

    X: (N, D) features, y: (N,) labels (torch, any device). Each run is (train_idx, dev_idx, l2)
    with numpy indices into X; dev_idx None = SentEval's validation_split: 5% of train_idx, drawn by
    the run's own RNG. What one SentEval run does: seed numpy and torch with 1111; nn.Linear(D, C)
    at torch's default init; every epoch a fresh np.random.permutation of the training rows,
    minibatches of cfg batch_size, mean cross-entropy, Adam (test mode) or RMSprop (fasttest) at
    torch's defaults with weight_decay = l2 on W and b; after every `epoch_size` epochs the dev
    accuracy, keeping the best model; stop at the (tenacity + 1)-th check without a new best (the
    count is never reset), or after epoch 200.

    Every run starts from the same seed, so its RNG stream depends only on its sizes. Runs with the
    same number of minibatches per epoch are trained as one batched model, W: (M, C, D), one row per
    run with its own data, permutations, L2 and early stopping (a shorter last minibatch is masked):
    the same maths as M separate runs. A run that stops leaves the batch with its best weights."""
    bs, results, groups = cfg["batch_size"], [None] * len(runs), {}
    for r, (tr, dev, _) in enumerate(runs):
        n = len(tr) - (int(VALIDATION_SPLIT * len(tr)) if dev is None else 0)  # training rows
        groups.setdefault(-(-n // bs), []).append(r)
    for members in groups.values():
        rngs, split_perm, tr, dev, stream = {}, {}, [], [], []
        for r in members:
            t, d, _ = runs[r]
            key = (len(t), d is None)  # what a run's RNG stream depends on
            if key not in rngs:
                # = np.random.seed(1111) in the classifier's constructor
                rngs[key] = np.random.RandomState(SEED)
                # prepare_split(validation_split=0.05): one permutation, the first 5% are dev
                if d is None:
                    split_perm[key] = rngs[key].permutation(len(t))
            if d is None:
                cut = int(VALIDATION_SPLIT * len(t))
                t, d = t[split_perm[key][cut:]], t[split_perm[key][:cut]]
            tr.append(t)
            dev.append(d)
            stream.append(list(rngs).index(key))
        M, n_tr, n_dev = len(members), [len(t) for t in tr], [len(d) for d in dev]
        rows_per_stream = [n - int(VALIDATION_SPLIT * n) if split else n for n, split in rngs]

        def pad(rows):  # list of 1-d int arrays -> (len(rows), longest), zero-padded
            longest = max(map(len, rows))
            return torch.as_tensor(np.stack([np.pad(a, (0, longest - len(a))) for a in rows]),
                                   device=X.device)

        tr_idx, dev_idx, stream = pad(tr), pad(dev), torch.tensor(stream, device=X.device)
        tr_mask = (torch.arange(tr_idx.shape[1], device=X.device)
                   < torch.tensor(n_tr, device=X.device)[:, None])
        dev_mask = (torch.arange(dev_idx.shape[1], device=X.device)
                    < torch.tensor(n_dev, device=X.device)[:, None])
        X_dev, y_dev = X[dev_idx], y[dev_idx]  # (M, n_dev, D), (M, n_dev)
        # torch.manual_seed(1111); nn.Linear(D, C): SentEval's init
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            linear = torch.nn.Linear(X.shape[1], nclasses)
        W = linear.weight.detach().to(X.device).repeat(M, 1, 1).requires_grad_()  # (M, C, D)
        b = linear.bias.detach().to(X.device).repeat(M, 1).requires_grad_()  # (M, C)
        l2 = torch.tensor([runs[r][2] for r in members], device=X.device)  # (M,)
        # torch defaults
        opt = {"adam": torch.optim.Adam, "rmsprop": torch.optim.RMSprop}[cfg["optim"]]([W, b])
        best_acc, best_W, best_b = [-1.0] * M, W.detach().clone(), b.detach().clone()
        bad_checks, live, nepoch = [0] * M, list(range(M)), 0
        # X_batch = X[idx], (M, bs, D), written in place: a fresh tensor of that size every step
        # (40 MB for MR's 400 runs) costs more than the step itself
        buf = torch.empty(M * bs, X.shape[1], device=X.device)
        while live and nepoch <= MAX_EPOCH:  # live: the runs still training, one row of W each
            for _ in range(cfg["epoch_size"]):
                # per stream
                perms = pad([rng.permutation(n) for rng, n in zip(rngs.values(), rows_per_stream)])
                # (M, n_train): each run's rows in its epoch's order
                order = tr_idx.gather(1, perms[stream])
                for i in range(0, order.shape[1], bs):
                    idx, mask = order[:, i:i + bs], tr_mask[:, i:i + bs]  # (M, bs)
                    X_batch = torch.index_select(X, 0, idx.flatten(),
                                                 out=buf[:idx.numel()]).view(*idx.shape, -1)
                    logits = torch.baddbmm(b.unsqueeze(1), X_batch, W.transpose(1, 2))  # (M, bs, C)
                    ce = F.cross_entropy(logits.transpose(1, 2), y[idx],
                                         reduction="none") * mask  # (M, bs)
                    # sum of the runs' mean losses: each gradient its own
                    loss = (ce.sum(1) / mask.sum(1)).sum()
                    opt.zero_grad()
                    loss.backward()
                    # weight_decay as torch's optimizers apply it: grad + l2 * param
                    with torch.no_grad():
                        W.grad.add_(W * l2[:, None, None])
                        b.grad.add_(b * l2[:, None])
                    opt.step()
            nepoch += cfg["epoch_size"]
            with torch.no_grad():
                pred = torch.baddbmm(b.unsqueeze(1), X_dev,
                                     W.transpose(1, 2)).argmax(-1)  # (M, n_dev)
                correct = ((pred == y_dev) & dev_mask).sum(1).tolist()
            stop = [False] * len(live)
            for j, m in enumerate(live):
                acc = correct[j] / n_dev[m]
                if acc > best_acc[m]:
                    best_acc[m], best_W[m], best_b[m] = acc, W[j].detach(), b[j].detach()
                else:
                    stop[j] = bad_checks[m] >= cfg["tenacity"]
                    bad_checks[m] += 1
            # drop the stopped runs' rows from the batch, and from the optimizer's state
            if any(stop):
                keep = [j for j, s in enumerate(stop) if not s]
                live = [live[j] for j in keep]
                tr_idx, tr_mask, stream, l2 = tr_idx[keep], tr_mask[keep], stream[keep], l2[keep]
                X_dev, y_dev, dev_mask = X_dev[keep], y_dev[keep], dev_mask[keep]
                state = [opt.state[p] for p in (W, b)]
                W, b = W.detach()[keep].requires_grad_(), b.detach()[keep].requires_grad_()
                opt = type(opt)([W, b])
                # Adam: step, exp_avg, exp_avg_sq; RMSprop: step, square_avg
                for p, s in zip((W, b), state):
                    opt.state[p] = {k: v[keep] if v.dim() else v for k, v in s.items()}
        for m, r in enumerate(members):
            results[r] = (best_acc[m], best_W[m], best_b[m])
    return results


def classify(task, X, y, cfg):
    """SentEval's protocol for one task on precomputed features -> {"devacc", "acc"} (x 100,
    2 decimals).

    X, y: {split: tensor}. MR, CR, SUBJ, MPQA: InnerKFoldClassifier (outer k folds; in each, the L2
    chosen by inner k-fold accuracy, then a model trained on the outer train split with 5% held out
    for early stopping). TREC, MRPC: KFoldClassifier (L2 chosen by k-fold accuracy on train; then
    train on all of train, 5% held out). SST2: SplitClassifier (L2 chosen on dev; the final model is
    the grid's model for that L2, which SentEval retrains with the same seed and data, i.e. the same
    model). The probing tasks: SplitClassifier, as SST2, one class per training label (SentEval's
    probing.py: labels 0 .. n-1)."""
    k, nclasses = cfg["kfold"], 6 if task == "TREC" else 2
    if task in PROBING:
        nclasses = int(y["train"].max()) + 1
    if task in ("MR", "CR", "SUBJ", "MPQA"):
        Xa, ya, outer = X["all"], y["all"], stratified_kfold(y["all"].cpu().numpy(), k)
        inner = [stratified_kfold(ya[tr].cpu().numpy(), k) for tr, _ in outer]
        grid = fit_logreg(Xa, ya, [(tr[itr], tr[ite], l2)
                                   for (tr, _), folds in zip(outer, inner)
                                   for l2 in REGS for itr, ite in folds], nclasses, cfg)
        dev, best_l2 = [], []
        # scores per L2: round(100 * mean over inner folds, 2), first best wins
        for o in range(k):
            accs = (np.array([g[0] for g in grid[o * len(REGS) * k:(o + 1) * len(REGS) * k]])
                    .reshape(len(REGS), k))
            scores = [np.round(100 * np.mean(a), 2) for a in accs]
            dev.append(np.max(scores))
            best_l2.append(REGS[int(np.argmax(scores))])
        final = fit_logreg(Xa, ya, [(tr, None, l2) for (tr, _), l2 in zip(outer, best_l2)],
                           nclasses, cfg)
        test = [round(100 * accuracy(W, b, Xa[te], ya[te]), 2)
                for (_, W, b), (_, te) in zip(final, outer)]
        return {"devacc": float(np.round(np.mean(dev), 2)),
                "acc": float(np.round(np.mean(test), 2))}
    if task in ("TREC", "MRPC"):
        folds = stratified_kfold(y["train"].cpu().numpy(), k)
        grid = fit_logreg(X["train"], y["train"],
                          [(tr, te, l2) for l2 in REGS for tr, te in folds], nclasses, cfg)
        scores = [np.round(100 * np.mean([g[0] for g in grid[i * k:(i + 1) * k]]), 2)
                  for i in range(len(REGS))]
        (_, W, b), = fit_logreg(X["train"], y["train"],
                                [(np.arange(len(y["train"])), None, REGS[int(np.argmax(scores))])],
                                nclasses, cfg)
        return {"devacc": float(np.max(scores)),
                "acc": round(100 * accuracy(W, b, X["test"], y["test"]), 2)}
    # SST2, probing tasks: train / dev / test
    Xs = torch.cat([X["train"], X["dev"]])
    ys = torch.cat([y["train"], y["dev"]])
    n, n_dev = len(y["train"]), len(y["dev"])
    grid = fit_logreg(Xs, ys, [(np.arange(n), np.arange(n, n + n_dev), l2) for l2 in REGS],
                      nclasses, cfg)
    scores = [round(100 * g[0], 2) for g in grid]
    _, W, b = grid[int(np.argmax(scores))]
    return {"devacc": float(np.max(scores)),
            "acc": round(100 * accuracy(W, b, X["test"], y["test"]), 2)}


def mrpc_features(a, b):
    """SentEval's MRPC features: [|a - b|, a * b], (N, 2H)."""
    return torch.cat([(a - b).abs(), a * b], dim=1)


def evaluate_transfer(encode, data, tasks, mode="test", device=None, loaded=None):
    """{task: {"devacc", "acc"}} for SentEval's transfer tasks (or its probing tasks), and the
    seconds spent encoding and classifying. Every distinct sentence of the tasks is encoded once
    (length-bucketed, as for STS); SentEval's batcher gets the same sentences (its word lists joined
    with spaces) split into per-task, per-split batches. loaded: the tasks' files as already read
    ({task: load_transfer(data, task)}); else they are read now."""
    device = device or common.pick_device()
    loaded = loaded or {t: load_probing(data, t) if t in PROBING else load_transfer(data, t)
                        for t in tasks}
    t0 = time.perf_counter()
    embed = common.encode_once(encode, {s for splits in loaded.values()
                                        for texts, _ in splits.values()
                                        for col in texts for s in col}, device)
    seconds = {"encode": time.perf_counter() - t0}
    t0, results = time.perf_counter(), {}
    for t, splits in common.progress(loaded.items(), "classifiers", total=len(loaded), unit="task"):
        X = {s: mrpc_features(embed(texts[0]), embed(texts[1])) if t == "MRPC" else embed(texts[0])
             for s, (texts, _) in splits.items()}
        y = {s: torch.as_tensor(labels, device=device) for s, (_, labels) in splits.items()}
        results[t] = classify(t, X, y, TRANSFER_MODES[mode])
    seconds["classifier"] = time.perf_counter() - t0
    return results, seconds


# ---------------------------------------------------------------- probing tasks (SentEval) ------
# Conneau et al. (ACL 2018), "What you can cram into a single $&!#* vector": a logistic regression
# on frozen embeddings predicts one property of the sentence. SSCL's Table 4 reports three of
# SentEval's ten: SentLen (6 bins of word counts), TreeDepth (depth of the parse tree, 5-12),
# CoordInv (two coordinated clauses swapped or not). SentEval's probing.py: one file per task, its
# splits tr, va, te; SplitClassifier (classify's SST2 branch) with the classifier of
# --transfer-mode.
PROBING = {  # SentEval's name: (the papers' name, the file in DIR/downstream/probing)
    "Length": ("SentLen", "sentence_length.txt"),
    "Depth": ("TreeDepth", "tree_depth.txt"),
    "CoordinationInversion": ("CoordInv", "coordination_inversion.txt"),
}
PROBING_SPLITS = {"tr": "train", "va": "dev", "te": "test"}
PROBING_SOURCE = "data/probing of github.com/facebookresearch/SentEval"


def probing_file(data, task):
    """The path of a probing task's file; a missing one stops here, before any model is loaded."""
    path = os.path.join(data, "probing", PROBING[task][1])
    if not os.path.isfile(path):
        common.die(f"missing {path}: SentEval's probing files are not in SimCSE's senteval.tar; "
                   f"copy them from {PROBING_SOURCE} into {os.path.dirname(path)}")
    return path


def load_probing(data, task):
    """{split: ([sentences], labels)} read as SentEval's probing.py reads its file: each line
    `split<TAB>label<TAB>...<TAB>sentence` with split tr, va or te, the last field the sentence
    (words joined by single spaces, as SimCSE's batcher joins them); labels numbered in the sorted
    order of the training labels' strings ('10' < '5'); each split sorted by (word count, label)."""
    path, rows = probing_file(data, task), {s: [] for s in PROBING_SPLITS.values()}
    try:
        with open(path, encoding="utf-8") as f:  # newlines as `for line in open(...)` sees them
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        common.die(f"cannot read {path} as UTF-8 text ({e}); copy it again from "
                   + PROBING_SOURCE)
    for i, line in enumerate(_file_lines(text), 1):
        t = line.rstrip().split("\t")
        if len(t) < 3 or t[0] not in PROBING_SPLITS:
            common.die(f"{path}, line {i}: malformed line (expected 'tr, va or te<TAB>label<TAB>"
                       f"sentence'); copy the file again from {PROBING_SOURCE}")
        rows[PROBING_SPLITS[t[0]]].append((t[-1].split(), t[1], i))
    if empty := [k for k, s in PROBING_SPLITS.items() if not rows[s]]:
        common.die(f"{path} has no '{empty[0]}' lines (SentEval trains on tr, chooses L2 on va, "
                   f"tests on te); copy the file again from {PROBING_SOURCE}")
    number = {label: n for n, label in enumerate(sorted({lab for _, lab, _ in rows["train"]}))}
    if unknown := [(i, lab) for r in rows.values() for _, lab, i in r if lab not in number]:
        i, lab = min(unknown)
        common.die(f"{path}, line {i}: label '{lab}' is not among the training labels "
                   f"({', '.join(number)}), which number SentEval's classes; copy the file "
                   f"again from {PROBING_SOURCE}")
    return {s: _sorted([w for w, _, _ in r], [number[lab] for _, lab, _ in r])
            for s, r in rows.items()}


def format_probing(results):
    """SSCL's Table 4: SentLen TreeDepth CoordInv, test accuracy x 100, two decimals."""
    names = [t for t in PROBING if t in results]
    return (" ".join(f"{PROBING[t][0]:>9}" for t in names) + "\n"
            + " ".join(f"{results[t]['acc']:9.2f}" for t in names))


def transfer_dev(encode, data, loaded=None):
    """The mean dev accuracy (x 100) of SentEval's 7 transfer tasks in fasttest mode: the score
    on which SSCL's example script selects its checkpoint (`--metric_for_best_model
    eval_avg_transfer`: SimCSE's trainer runs SentEval with kfold 5, RMSprop, batch 128, tenacity 3,
    epoch size 2 and averages the tasks' `devacc`). sscl.py --select-on transfer (loaded: the
    files, read once for the run: sscl.select_on)."""
    results, _ = evaluate_transfer(encode, data, TRANSFER, "fasttest", loaded=loaded)
    return sum(results[t]["devacc"] for t in TRANSFER) / len(TRANSFER)


# ---------------------------------------------------------------- alignment and uniformity ------
def align_uniform(encode, data, split="test"):
    """(alignment, uniformity) of the normalised embeddings on STS-B (Wang & Isola 2020, eqs. in
    SimCSE §5):
    alignment  = E_{(x, x+) ~ p_pos} ||f(x) - f(x+)||^2,
                 p_pos = the STS-B pairs with gold score >= 4;
    uniformity = log E_{x, y ~ p_data} exp(-2 ||f(x) - f(y)||^2),
                 p_data = the distinct STS-B sentences (all pairs x != y, torch.pdist).
    Lower is better for both; uniformity lies in [-4, 0]."""
    pairs = common.load_sts(data, "STS-B", split)[split]
    sents = sorted({s for a, b, _ in pairs for s in (a, b)})
    f = F.normalize(encode(sents).float().cpu(), dim=-1)  # (S, H), one row per distinct sentence
    row = {s: i for i, s in enumerate(sents)}
    pos = [(row[a], row[b]) for a, b, gold in pairs if gold >= 4]
    x, x_pos = f[[i for i, _ in pos]], f[[j for _, j in pos]]  # (P, H)
    alignment = (x - x_pos).norm(dim=1).pow(2).mean()
    uniformity = torch.pdist(f).pow(2).mul(-2).exp().mean().log()
    return alignment.item(), uniformity.item()


# ---------------------------------------------------------------- MTEB --------------------------
# MTEB (Muennighoff et al. 2023), the zero-shot benchmark of JTCSE's Table I (right) and Tables
# II-VI: mteb's own tasks and evaluators, fed by the encode function of any model eval_sts.py
# loads (a run of ours: SSCL, a JTCSE twin or distilled tower, BeLLM; a plain HF model; an
# ensemble). mteb is optional (requirements-mteb.txt) and imported only for --mteb. Its tasks
# download their data from the Hugging Face hub; SentEval:TASK is one of our 7 STS tasks read
# from --data-dir instead, scored by mteb's STS evaluator (offline: the parity check with --tasks).
SENTEVAL_PREFIX = "SentEval:"


class MTEBEncoder:
    """mteb's EncoderProtocol (mteb 2.x, `mteb.models.EncoderProtocol`) around one of our encode
    functions, encode(list[str]) -> (N, H) (load_encoder, load_ensemble).

    encode(inputs, task_metadata=..., hf_split=..., hf_subset=..., prompt_type=...): inputs is
    mteb's DataLoader of batches {"text": [str], ...}; -> (N, H) float32 numpy, the rows of our
    encode over all N texts in one call (so our token-length batching applies; mteb's batch size
    does not change a number). Prompts and instructions are ignored: none of the three papers uses
    them (BeLLM's prompt is part of its encode). Similarity: cosine, as our STS evaluation uses."""

    def __init__(self, encode, name):
        self.model_name, self._encode = name, encode

    def encode(self, inputs, *, task_metadata=None, hf_split=None, hf_subset=None,
               prompt_type=None, **kwargs):
        texts = [t for batch in inputs for t in batch["text"]]
        return self._encode(texts).float().cpu().numpy()  # (N, H)

    def similarity(self, e1, e2):  # (N, H), (M, H) -> (N, M)
        a, b = (F.normalize(torch.as_tensor(e).float(), dim=-1) for e in (e1, e2))
        return a @ b.T

    def similarity_pairwise(self, e1, e2):  # (N, H), (N, H) -> (N,)
        return F.cosine_similarity(torch.as_tensor(e1).float(), torch.as_tensor(e2).float(), dim=-1)

    @property
    def mteb_model_meta(self):  # what mteb records in its results: the name, cosine similarity
        from mteb.models.model_meta import ModelMeta
        return ModelMeta.create_empty(overwrites={"name": self.model_name,
                                                  "similarity_fn_name": "cosine"})


def senteval_task(task, data, split="test"):
    """One of our 7 STS tasks as an MTEB STS task ("SentEval:STS-B"): the pairs common.load_sts
    reads from SentEval's files (STS12-16: all subsets pooled, SentEval's "all" setting; STS-B and
    SICK-R: `split`), scored by mteb's evaluator (main score: Spearman of cosine similarity)."""
    from datasets import Dataset
    from mteb.abstasks.sts import AbsTaskSTS
    from mteb.abstasks.task_metadata import TaskMetadata
    split = split if task in ("STS-B", "SICK-R") else "test"

    class SentEvalSTS(AbsTaskSTS):
        min_score, max_score = (1, 5) if task == "SICK-R" else (0, 5)
        metadata = TaskMetadata(
            name=SENTEVAL_PREFIX + task, dataset={"path": data, "revision": "senteval.tar"},
            description=f"{task} ({split}) from SentEval's files, as eval_sts.py --tasks reads it",
            reference="https://github.com/facebookresearch/SentEval", type="STS", category="t2t",
            modalities=["text"], eval_splits=[split], eval_langs=["eng-Latn"],
            main_score="cosine_spearman", date=None, domains=None, task_subtypes=None,
            license=None, annotations_creators=None, dialect=None, sample_creation=None,
            bibtex_citation=None)

        def load_data(self, num_proc=None, **kwargs):  # SentEval's files, not the hub
            rows = [r for rs in common.load_sts(data, task, split).values() for r in rs]
            self.dataset = {split: Dataset.from_dict(dict(zip(("sentence1", "sentence2", "score"),
                                                              map(list, zip(*rows)))))}
            self.data_loaded = True

    return SentEvalSTS()


def mteb_tasks(spec, data, split):
    """--mteb -> [mteb task]: task names, benchmark names (their tasks, with the benchmark's
    subsets and splits) and SentEval:TASK. Every task's data is fetched now, before any model, so
    that a name mteb does not know, or data the hub cannot give, stops here with one line."""
    import re
    try:
        import mteb
    except ImportError:
        common.die("--mteb needs mteb, an optional extra: pip install -r requirements-mteb.txt")
    # commas separate names, except inside a benchmark's parentheses: "MTEB(eng, v1)"
    names = [t.strip() for t in re.split(r",(?![^(]*\))", spec) if t.strip()]
    if not names:
        common.die("--mteb is empty: pass MTEB task names, e.g. --mteb STSBenchmark,SICK-R")
    tasks = {}  # name -> task, each once
    for name in names:
        if name.startswith(SENTEVAL_PREFIX):
            if (ours := name[len(SENTEVAL_PREFIX):]) not in common.TASKS:
                common.die(f"unknown task '{name}': {SENTEVAL_PREFIX}TASK takes TASK from "
                           f"{','.join(common.TASKS)}")
            tasks.setdefault(name, senteval_task(ours, data, split))
            continue
        try:
            found = [mteb.get_task(name)]
        except KeyError as e:  # mteb's message names the closest task, when there is one
            try:
                found = list(mteb.get_benchmark(name).tasks)
            except KeyError:
                common.die(f"--mteb: {str(e.args[0]).removeprefix('KeyError: ')} Pass names "
                           "from mteb's lists (python -m mteb available-tasks, or "
                           f"available-benchmarks), or {SENTEVAL_PREFIX}TASK for one of our STS "
                           "tasks")
        for t in found:
            tasks.setdefault(t.metadata.name, t)
    for t in tasks.values():
        try:
            t.load_data()  # into the datasets cache on disk; mteb loads it again for its run
        except OSError as e:  # offline, hub unreachable, dataset gone
            common.die(f"--mteb {t.metadata.name}: its data did not load from the Hugging Face "
                       f"hub ({str(e).splitlines()[0]}): connect once without HF_HUB_OFFLINE=1 "
                       "(the data is then cached), or check the task name")
        t.unload_data()  # one task in memory at a time
    return list(tasks.values())


def run_mteb(encode, name, tasks):
    """mteb's own evaluation of `tasks` with our encode -> {task: {metric, score, scores}}; score
    = mteb's main score x 100 (its mean over the task's splits and subsets)."""
    import mteb
    show = not common.QUIET and sys.stderr.isatty()
    result = mteb.evaluate(MTEBEncoder(encode, name), tasks, cache=None, co2_tracker=False,
                           show_progress_bar=show, encode_kwargs={"batch_size": 256})
    metric = {t.metadata.name: t.metadata.main_score for t in tasks}
    return {r.task_name: {"metric": metric[r.task_name], "score": 100 * r.get_score(),
                          "scores": r.scores} for r in result.task_results}


def format_mteb(results):
    """One line per MTEB task: name, main score's name, score x 100; then their average."""
    w = max(len(t) for t in results)
    lines = [f"{'MTEB task':<{w}}  {'main score':<18} {'x 100':>7}"]
    lines += [f"{t:<{w}}  {r['metric']:<18} {r['score']:7.2f}" for t, r in results.items()]
    if len(results) > 1:
        avg = sum(r["score"] for r in results.values()) / len(results)
        lines.append(f"{'Avg.':<{w}}  {'':<18} {avg:7.2f}")
    return "\n".join(lines)


# ---------------------------------------------------------------- retrieval (BeLLM Table 5) -----
RECALL_AT = (1, 5, 10)


def read_groups(path):
    """--retrieval FILE: `group_id<TAB>caption` lines (flickr30k: an image's id and one of its 5
    captions), blank lines skipped -> {group_id: [captions]}, each in file order. Every group needs
    2 or more captions: its first queries the others."""
    if not os.path.isfile(path):
        common.die(f"--retrieval '{path}' is not a file: pass a file of group_id<TAB>caption "
                   "lines (docs/evaluation.md, Retrieval)")
    groups = {}
    for i, line in enumerate(common.read_text(path).split("\n"), 1):
        gid, tab, caption = line.partition("\t")
        if not line.strip():
            continue
        if not (tab and gid.strip() and caption.strip()):
            common.die(f"'{path}', line {i}: expected group_id<TAB>caption, got {line[:60]!r}; "
                       "fix or delete the line")
        groups.setdefault(gid.strip(), []).append(caption.strip())
    if small := [g for g, cs in groups.items() if len(cs) < 2]:
        common.die(f"'{path}': group '{small[0]}' has one caption ({len(small)} such group(s)); "
                   "a group's first caption queries its others: give each group 2 or more "
                   "captions, or drop it")
    if len(groups) < 2:
        common.die(f"'{path}' holds {len(groups)} group(s): retrieval needs 2 or more, so that "
                   "other groups' captions compete")
    return groups


@torch.no_grad()
def retrieval(encode, groups, show=0, batch=256):
    """BeLLM Table 5: the first caption of each group queries every other caption of the file,
    by exact cosine search (normalised embeddings, one matmul per batch of queries; the query
    itself excluded). A query whose group has m other captions scores
      strict:   its top m are exactly those m (flickr30k, 5 captions an image: the top 4),
      recall@k: at least one of them is among its top k.
    -> {"queries", "captions", "strict", "recall@1", ...} (percent) and "shown": the top m of the
    first `show` queries [(caption, cosine, of the query's group)]."""
    captions = [c for cs in groups.values() for c in cs]
    gid = torch.tensor([g for g, cs in enumerate(groups.values()) for _ in cs])  # (N,)
    size = torch.tensor([len(cs) for cs in groups.values()])  # (G,)
    first = torch.cumsum(size, 0) - size  # (G,) each group's first caption
    e = F.normalize(encode(captions).float().cpu(), dim=-1)  # (N, H)
    k = min(max(max(RECALL_AT), int(size.max()) - 1), len(captions) - 1)
    strict, recall, shown = [], {r: [] for r in RECALL_AT}, []
    for i in range(0, len(first), batch):
        q = first[i:i + batch]  # (b,) query rows
        sim = e[q] @ e.T  # (b, N) cosines
        sim[torch.arange(len(q)), q] = -float("inf")  # a query never retrieves itself
        top = sim.topk(k, dim=1)  # (b, k), best first
        same = gid[top.indices] == gid[q][:, None]  # (b, k): of the query's group
        m = size[gid[q]] - 1  # (b,) the group's other captions
        strict += [bool(s[:n].all()) for s, n in zip(same, m.tolist())]
        for r in RECALL_AT:
            recall[r] += same[:, :r].any(1).tolist()
        for j in range(min(len(q), show - len(shown))):
            shown.append({"query": captions[int(q[j])], "top": [
                (captions[c], round(v, 4), bool(s)) for c, v, s in
                zip(top.indices[j, :m[j]].tolist(), top.values[j, :m[j]].tolist(), same[j])]})
    out = {"queries": len(first), "captions": len(captions),
           "strict": 100 * float(np.mean(strict))}
    out.update({f"recall@{r}": 100 * float(np.mean(v)) for r, v in recall.items()})
    return {**out, "shown": shown} if show else out


def format_retrieval(r):
    """The scores, then the shown queries: + a caption of the query's group, - another's."""
    head = ["strict"] + [f"R@{k}" for k in RECALL_AT]
    lines = [f"retrieval: {r['queries']:,} queries (each group's first caption) among "
             f"{r['captions']:,} captions, exact cosine",
             " ".join(f"{h:>7}" for h in head),
             " ".join(f"{r[k]:7.2f}" for k in ["strict"] + [f"recall@{k}" for k in RECALL_AT])]
    for s in r.get("shown", []):
        lines.append(f"query: {s['query']}")
        lines += [f"  {'+' if same else '-'} {cos:.4f}  {c}" for c, cos, same in s["top"]]
    return "\n".join(lines)


def csts_prompt(name, pooler, prompt):
    """The prompt a model encodes C-STS with (None when it reads no prompt): a bellm.py run's own,
    or --prompt for a plain decoder (--pooler last)."""
    if pooler == "last":
        return prompt
    meta = runs.read_meta(name) if os.path.isdir(name) else None
    return meta["prompt"] if meta and meta["method"] == "bellm" else None


def read_csts(path, models, ensemble, prompt):
    """--csts FILE: C-STS rows (sentence1, sentence2, condition, label), checked before any model
    loads: a C-STS csv with labels that vary, and models that read a condition."""
    if not os.path.isfile(path) or importlib.import_module("bellm").read_csv(path)[0] != "csts":
        common.die(f"--csts '{path}' is not a C-STS csv (sentence1,sentence2,condition,label)")
    rows = importlib.import_module("bellm").read_csv(path)[1]
    if len({r[3] for r in rows}) < 2:
        common.die(f"--csts '{path}': every label is {rows[0][3]:g}, so Spearman is undefined "
                   "(C-STS's test labels are not public): evaluate csts_validation.csv")
    if ensemble and len(models) > 1:
        common.die("--csts evaluates one model at a time: drop --ensemble")
    for name, pooler in models:
        if "{condition}" not in (csts_prompt(name, pooler, prompt) or ""):
            common.die(f"--csts: '{name}' reads no condition: pass a bellm.py run trained with a "
                       "{condition} prompt, or a decoder with --pooler last --prompt "
                       "'...{condition}...{sentence}...'")
    return rows


def format_transfer(results):
    """The papers' transfer table: MR CR SUBJ MPQA SST TREC MRPC Avg., accuracy x 100, two
    decimals."""
    names = [t for t in TRANSFER if t in results]
    accs = [results[t]["acc"] for t in names] + [sum(results[t]["acc"] for t in names) / len(names)]
    return (" ".join(f"{'SST' if t == 'SST2' else t:>7}" for t in names + ["Avg."]) + "\n"
            + " ".join(f"{a:7.2f}" for a in accs))


def parse_tasks(spec):
    """--tasks -> (STS tasks, transfer tasks, probing tasks), each in the papers' order. 'all' is
    STS and transfer: the probing files are not in SimCSE's senteval.tar."""
    names = {"sts": common.TASKS, "transfer": TRANSFER, "probing": list(PROBING),
             "all": common.TASKS + TRANSFER}
    known = common.TASKS + TRANSFER + list(PROBING)
    asked = [t.strip() for t in spec.split(",") if t.strip()]
    if unknown := [t for t in asked
                   if t not in known and t.lower() not in names]:
        common.die(f"unknown task(s) {', '.join(unknown)}: --tasks takes sts, transfer, probing, "
                   f"all, or names from {','.join(known)}")
    chosen = {n for t in asked for n in names.get(t.lower(), [t])}
    if not chosen:
        common.die("--tasks is empty: pass sts, transfer, probing, all, or task names")
    return ([t for t in common.TASKS if t in chosen], [t for t in TRANSFER if t in chosen],
            [t for t in PROBING if t in chosen])


p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", required=True, nargs="+",
               help="hub name or local folder: plain HF model, or one of our runs; several: each "
                    "in turn, or with --ensemble their sum")
p.add_argument("--ensemble", action="store_true",
               help="evaluate the sum of the --model embeddings as one encoder (JTCSE's +UC: a "
                    "twin plus another encoder)")
p.add_argument("--pooler", default=["cls"], nargs="+",
               choices=["cls", "avg", "avg_first_last", "pooler", "last"],
               help="pooling for a plain HF model: cls = CLS of the last layer, avg = masked mean "
                    "of the last layer, avg_first_last = mean of layer 1 and the last layer, "
                    "pooler = BERT's pooler output, last = a decoder's last token after --prompt "
                    "(BeLLM, zero-shot); ignored for our runs, whose sentemb.json decides; "
                    "one for all models, or one per model")
p.add_argument("--num-layers", type=common.POS_INT, default=None,
               help="a plain HF model cut to its first N layers, as sscl.py --num-layers trains "
                    "it (SSCL Table 1); the last kept layer is pooled")
p.add_argument("--prompt", default='The representative word for {sentence} is:"',
               help="with --pooler last: the prompt around each sentence (BeLLM §3.3)")
p.add_argument("--data-dir", default=None,
               help="SentEval's data folder: DIR/downstream/{STS,SICK,MR,...} as in SimCSE's "
                    "senteval.tar (else $SENTEMB_DATA, else ~/.cache/sentemb/senteval)")
p.add_argument("--tasks", default=None,
               help="comma-separated: STS12,...,SICK-R (or 'sts'), MR,CR,SUBJ,MPQA,SST2,TREC,MRPC "
                    "(or 'transfer'), 'all' = both; Length,Depth,CoordinationInversion (or "
                    "'probing': SentEval's probing tasks, SSCL Table 4, classifier as set by "
                    "--transfer-mode; their files, not in senteval.tar: "
                    "DIR/downstream/probing/*.txt from SentEval's data/probing); "
                    "default: the 7 STS tasks (none with --mteb, --retrieval or "
                    "--csts)")
p.add_argument("--mteb", metavar="TASK[,TASK...]",
               help="run these MTEB tasks or benchmarks (mteb's names, e.g. STSBenchmark, "
                    "Banking77Classification, 'MTEB(eng, v1)'; JTCSE Table I right, Tables II-VI) "
                    "with mteb's own evaluators and print their main scores x 100; SentEval:STS-B "
                    "(any of our 7 STS tasks) reads --data-dir instead of the hub. Needs pip "
                    "install -r requirements-mteb.txt; the data downloads from the Hugging Face "
                    "hub")
p.add_argument("--split", default="test", choices=["test", "dev"],
               help="split for STS-B and SICK-R, and the STS-B split of --align-uniform")
p.add_argument("--transfer-mode", default="test", choices=list(TRANSFER_MODES),
               help="SimCSE's evaluation.py modes: test = 10 folds, Adam, batch 64, tenacity 5, "
                    "4 epochs per check (the papers' tables); fasttest = 5 folds, RMSprop, "
                    "batch 128, tenacity 3, 2 epochs")
p.add_argument("--align-uniform", action="store_true",
               help="also print alignment and uniformity (Wang & Isola 2020, as SimCSE computes "
                    "them) on STS-B")
p.add_argument("--plot", metavar="FILE.png",
               help="with --align-uniform: draw alignment against uniformity, one labelled point "
                    "per --model (JTCSE Fig. 7)")
p.add_argument("--retrieval", metavar="FILE",
               help="also the caption retrieval of BeLLM Table 5: FILE holds group_id<TAB>caption "
                    "lines (flickr30k test: image id, caption); each group's first caption "
                    "queries all other captions; strict accuracy and recall@1/5/10")
p.add_argument("--show", type=common.NONNEG_INT, default=0, metavar="N",
               help="with --retrieval: print the top captions of the first N queries (Table 5)")
p.add_argument("--csts", metavar="FILE",
               help="also C-STS (BeLLM Table 2): Spearman x 100 of cosine against label on a "
                    "C-STS csv (sentence1,sentence2,condition,label), each sentence under its "
                    "condition; a bellm.py run with a {condition} prompt, or --pooler last")
p.add_argument("--batch-size", type=common.POS_INT, default=128,
               help="pairs per batch with --exact")
p.add_argument("--max-len", type=common.POS_INT, default=512, help="truncation, in tokens")
p.add_argument("--exact", action="store_true",
               help="STS only: SentEval's own batches (slower; for parity checks)")
p.add_argument("--bf16", action="store_true",
               help="bf16 autocast on CPU as well (about 2x faster where the CPU has bf16 "
                    "instructions; numbers move by ~0.01)")
p.add_argument("--quiet", action="store_true",
               help="no progress bars (shown only when stderr is a terminal)")
p.add_argument("--json", default=None, help="also write the results to this JSON file")
common.show_ranges(p)

def hf_encoder(name, pooler, max_len, device, num_layers=None):
    """encode(list[str]) -> (N, H) for a plain Hugging Face encoder with the usual poolings
    (SimCSE's names); num_layers: cut to its first N layers (common.load_pretrained)."""
    from transformers import AutoModel, AutoTokenizer
    tok = common.load_pretrained(AutoTokenizer, name)
    model = common.load_pretrained(AutoModel, name, num_layers=num_layers,
                                   strict=pooler == "pooler")
    if pooler == "pooler":  # before the model runs: a decoder's output has no pooler_output
        check_pooler(name, model)
    model = model.to(device).eval()
    max_len = min(max_len, common.positions(model.config) or max_len)

    def embed(batch):  # batch: input_ids, attention_mask (b, L)
        out = model(**batch, output_hidden_states=pooler == "avg_first_last")
        mask = batch["attention_mask"].unsqueeze(-1).float()  # (b, L, 1)
        avg = lambda h: (h * mask).sum(1) / mask.sum(1)  # noqa: E731
        if pooler == "cls":
            return out.last_hidden_state[:, 0]
        if pooler == "avg":
            return avg(out.last_hidden_state)
        # SimCSE: hidden_states[1] is the first Transformer layer's output
        if pooler == "avg_first_last":
            return avg((out.hidden_states[1] + out.hidden_states[-1]) / 2)
        return out.pooler_output

    return common.encoder(embed, tok, max_len, device)  # no gradients, autocast on CUDA


def load_encoder(name, pooler="cls", max_len=512, device=None, prompt=None, cut=None,
                 num_layers=None):
    """Our run folder (sentemb.json) -> its method's encoder; anything else -> a plain HF
    encoder. cut: a token limit for every kind (a run folder's own is its sentemb.json's);
    num_layers: a plain encoder's first N layers (check_num_layers)."""
    device = device or common.pick_device()
    # a plain decoder, zero-shot: BeLLM's encoder with no bidirectional layer, no LoRA
    if pooler == "last":
        meta = {"method": "bellm", "base_model": name, "bi_layers": 0, "bi_mode": "parallel",
                "prompt": prompt, **({"max_len": cut} if cut else {})}
        return importlib.import_module("bellm").load_encoder(None, meta, device)
    if os.path.isdir(name) and (meta := runs.read_meta(name)) is not None:  # checks every file
        return runs.load_run(name, {**meta, "max_len": cut} if cut else meta, device)
    return hf_encoder(name, pooler, cut or max_len, device, num_layers)


def check_model(name):
    """What load_encoder loads, checked before any work (a run folder of ours: every file and
    value; a local model folder; a hub name's config): jtcse.py --distill's teachers."""
    runs.check_model(name)


def one_each(poolers, names):
    """--pooler's values, one for every --model (one value: the same for all)."""
    if len(poolers) not in (1, len(names)):
        common.die(f"--pooler got {len(poolers)} values for {len(names)} models: pass one for "
                   "all, or one per model")
    return list(poolers) * len(names) if len(poolers) == 1 else list(poolers)


def load_ensemble(names, poolers=("cls",), max_len=512, device=None, prompt=None, cut=None,
                  size=None, num_layers=None):
    """encode(list[str]) -> (N, H): the SUM of the members' embeddings, as JTCSE's twin sums its
    towers' CLS (its +UC rows, Table I, add an existing encoder). Each member loads as
    load_encoder loads it: a run folder of ours with its own pooling, a plain model with its entry
    of `poolers` (one entry: the same for all). One member: that member's encode. size: (H, whose)
    when the embedding must have H dimensions."""
    members = [load_encoder(n, q, max_len, device, prompt, cut, num_layers)
               for n, q in zip(names, one_each(poolers, names))]
    # a sum of embeddings of one text, as JTCSE's twin sums its towers': one vocabulary, one limit
    for n, m in zip(names[1:], members[1:]):
        if m.tokenizer.get_vocab() != members[0].tokenizer.get_vocab():
            common.die(f"'{names[0]}' and '{n}' have different tokenizers: an ensemble sums the "
                       "embeddings of one tokenised sentence (as JTCSE's twin sums its towers'), "
                       "so pass models that share a vocabulary")
        if m.max_len != members[0].max_len:
            common.die(f"'{names[0]}' reads up to {members[0].max_len} tokens and '{n}' up to "
                       f"{m.max_len}: an ensemble sums what its members read of one sentence, so "
                       "pass models of one maximum length (--max-len sets a plain model's)")
    sizes = [m(["a probe sentence"]).shape[-1] for m in members] if size or names[1:] else []
    if len(set(sizes + [size[0]] if size else sizes)) > 1:
        want = f"; {size[1]} is {size[0]}" if size else ""
        common.die(f"the embeddings of {' + '.join(names)} have {', '.join(map(str, sizes))} "
                   f"dimensions{want}: an ensemble sums them, so pass models of one size")
    if len(members) == 1:
        return members[0]

    def encode(sentences):
        return sum(m(sentences).float() for m in members)  # (N, H)
    return encode


def check_pooler(name, model=None):
    """--pooler pooler reads BERT's pooler (dense + tanh over CLS): a model without one (a decoder,
    DistilBERT) is refused. model: the loaded one; else built from the config, without weights."""
    if model is None:
        from transformers import AutoConfig, AutoModel
        config = common.load_pretrained(AutoConfig, name)
        with torch.device("meta"):
            model = AutoModel.from_config(config)
    if getattr(model, "pooler", None) is None:
        common.die(f"--pooler pooler: '{name}' ({type(model).__name__}) has no pooler: choose "
                   "--pooler cls, avg or avg_first_last (or last, for a decoder)")


def check_num_layers(num_layers, names, poolers):
    """--num-layers, before any work: plain encoders only (a run folder holds the layers it was
    trained with: sscl.py --num-layers saves the cut model), each with that many layers."""
    from transformers import AutoConfig
    for name, pooler in zip(names if num_layers else [], poolers):
        if pooler == "last" or os.path.isdir(name) and runs.read_meta(name) is not None:
            common.die(f"--num-layers cuts a plain Hugging Face encoder, and '{name}' is "
                       f"{'a decoder (--pooler last)' if pooler == 'last' else 'a run folder'}: "
                       "drop --num-layers (a run of sscl.py --num-layers is saved cut)")
        common.check_num_layers(num_layers, common.load_pretrained(AutoConfig, name), name)


def main():
    a = p.parse_args()
    common.QUIET = a.quiet
    transformers.logging.disable_progress_bar()
    no_tasks = a.tasks is None and (a.retrieval or a.csts or a.mteb)  # STS only when asked for
    sts_tasks, transfer_tasks, probing_tasks = ([], [], []) if no_tasks else parse_tasks(
        "sts" if a.tasks is None else a.tasks)
    if a.plot and not a.align_uniform:
        common.die("--plot draws alignment against uniformity (JTCSE Fig. 7): add --align-uniform")
    if a.json and len(a.model) > 1 and not a.ensemble:
        common.die(f"--json holds one model's results and --model got {len(a.model)}: pass one "
                   "--model, add --ensemble, or run once per model")
    poolers = one_each(a.pooler, a.model)
    check_num_layers(a.num_layers, a.model, poolers)
    for name, pooler in zip(a.model, poolers):  # a run folder's own sentemb.json decides
        if pooler == "pooler" and not (os.path.isdir(name) and runs.read_meta(name)):
            check_pooler(name)
    figures.check(a.plot)
    parent = os.path.dirname(os.path.abspath(a.json or "."))
    if a.json and (os.path.isdir(a.json) or not os.path.isdir(parent)
                   or not os.access(parent, os.W_OK)):
        common.die(f"--json '{a.json}' cannot be written (a folder, or in no writable folder): "
                   "pass a file path")
    if a.show and not a.retrieval:
        common.die("--show prints retrieved captions: add --retrieval FILE")
    # read before any model loads: a bad file costs nothing
    a.groups = read_groups(a.retrieval) if a.retrieval else None
    a.csts_rows = read_csts(a.csts, list(zip(a.model, poolers)), a.ensemble,
                            a.prompt) if a.csts else None
    senteval = (sts_tasks or transfer_tasks or probing_tasks or a.align_uniform
                or SENTEVAL_PREFIX in (a.mteb or ""))
    data = common.senteval_dir(a.data_dir) if senteval else None
    for t in probing_tasks:  # SentEval's probing files are a separate download: say so now
        probing_file(data, t)
    mteb = mteb_tasks(a.mteb, data, a.split) if a.mteb else []  # checked and loaded before a model
    if a.bf16:
        print(f"note: --bf16: {common.bf16_note(torch.device('cpu'))}", file=sys.stderr)
    # what is evaluated: each --model in turn, or with --ensemble one encoder, their sum
    models = [list(zip(a.model, poolers))] if a.ensemble else [[m] for m in zip(a.model, poolers)]
    points, short = {}, []  # model -> (uniformity, alignment), for --plot; its short name
    for members in models:
        if len(models) > 1:
            print(f"{members[0][0]}:")
        out = evaluate_model(a, members, data, sts_tasks, transfer_tasks, probing_tasks, mteb)
        if a.align_uniform:
            points[out["model"]] = (out["uniform"], out["align"])
            short.append(" + ".join(os.path.basename(os.path.normpath(m)) for m, _ in members))
    if a.plot:  # Fig. 7 of JTCSE (SimCSE's Fig. 2): one labelled point per model
        labels = short if len(set(short)) == len(short) else list(points)
        panel = dict(kind="scatter", title=f"STS-B {a.split}; lower is better for both",
                     xlabel="uniformity", ylabel="alignment",
                     points=dict(zip(labels, points.values())))
        figures.draw(a.plot, [panel], "Alignment against uniformity (Wang & Isola 2020)", ncols=1)
    if a.json:  # a temporary file, then one rename: an old file is never left half-written
        write_json(a.json, out)


def evaluate_model(a, members, data, sts_tasks, transfer_tasks, probing_tasks=(), mteb=()):
    """One model, [(name, pooler)], or an ensemble, several: its tables printed, -> the --json
    dict (results, transfer, probing, mteb, align, uniform, seconds)."""
    t0 = time.perf_counter()
    names, poolers = zip(*members)
    encode = load_ensemble(names, poolers, a.max_len, prompt=a.prompt, num_layers=a.num_layers)
    name = " + ".join(names)
    out, seconds = {"model": name, "split": a.split}, {"load": time.perf_counter() - t0}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
        if sts_tasks:
            t0 = time.perf_counter()
            out["results"] = common.evaluate(encode, data, sts_tasks, a.split, a.batch_size,
                                             a.exact)
            seconds["sts"] = time.perf_counter() - t0
            print(common.format_table(out["results"]))
        if transfer_tasks:
            out["transfer_mode"] = a.transfer_mode
            out["transfer"], t = evaluate_transfer(encode, data, transfer_tasks, a.transfer_mode)
            seconds.update({f"transfer_{k}": v for k, v in t.items()})
            print(format_transfer(out["transfer"]))
        if probing_tasks:  # SSCL Table 4, with the classifier of --transfer-mode
            out["transfer_mode"] = a.transfer_mode
            out["probing"], t = evaluate_transfer(encode, data, probing_tasks, a.transfer_mode)
            seconds.update({f"probing_{k}": v for k, v in t.items()})
            print(format_probing(out["probing"]))
        if mteb:
            t0 = time.perf_counter()
            out["mteb"] = run_mteb(encode, name, mteb)
            seconds["mteb"] = time.perf_counter() - t0
            print(format_mteb(out["mteb"]))
        if a.align_uniform:
            t0 = time.perf_counter()
            out["align"], out["uniform"] = align_uniform(encode, data, a.split)
            seconds["align_uniform"] = time.perf_counter() - t0
            print(f"  align uniform\n{out['align']:7.4f} {out['uniform']:7.4f}")
        if a.retrieval:
            t0 = time.perf_counter()
            out["retrieval"] = retrieval(encode, a.groups, a.show)
            seconds["retrieval"] = time.perf_counter() - t0
            print(format_retrieval(out["retrieval"]))
        if a.csts:  # bellm.py's checkpoint selection score, the same function
            t0 = time.perf_counter()
            out["csts"] = importlib.import_module("bellm").dev_score(encode, None, a.csts_rows)
            seconds["csts"] = time.perf_counter() - t0
            print(f"  C-STS\n{out['csts']:7.2f}")
    out["seconds"] = seconds
    print(f"({name}, split {a.split}"
          + (f", transfer {a.transfer_mode}" if transfer_tasks or probing_tasks else "")
          + "; seconds: "
          + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) + ")")
    return out


def write_json(path, out):
    """--json, written after the tables are printed: a write that fails (a full disk, a folder that
    went away) is one line, the results stay on the screen, and an old file at path is kept as it
    was."""
    try:
        common.write_whole(path, lambda f: f.write(json.dumps(out, indent=2).encode()))
    except OSError as e:
        kept = "; the old file is kept" if os.path.isfile(path) else ""
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        what = f"{os.path.basename(e.filename or path)}: {e.strerror or e}"
        common.die(f"cannot write --json '{path}' ({what}): the results are printed above{kept}; "
                   f"{'free disk space or ' if full else ''}pass another --json path")


if __name__ == "__main__":
    main()
