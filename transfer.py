"""SentEval's transfer and probing tasks, and alignment/uniformity, for any encode function:
a logistic regression on frozen sentence embeddings with SentEval's own protocol (folds, L2 grid,
early stopping), so that the numbers equal SentEval's. eval_sts.py prints them (`--tasks
transfer`, `--tasks probing`, `--align-uniform`); sscl.py's `--select-on transfer` selects its
checkpoint with `transfer_dev`.

  from transfer import TRANSFER, evaluate_transfer, format_transfer, load_transfer
  results, seconds = evaluate_transfer(encode, "data/senteval", TRANSFER, mode="test")
  print(format_transfer(results))

encode(list[str]) -> (N, D) tensor; DIR/downstream/{MR,CR,...} as in SimCSE's senteval.tar.
"""
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import common

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


def format_transfer(results):
    """The papers' transfer table: MR CR SUBJ MPQA SST TREC MRPC Avg., accuracy x 100, two
    decimals."""
    names = [t for t in TRANSFER if t in results]
    accs = [results[t]["acc"] for t in names] + [sum(results[t]["acc"] for t in names) / len(names)]
    return (" ".join(f"{'SST' if t == 'SST2' else t:>7}" for t in names + ["Avg."]) + "\n"
            + " ".join(f"{a:7.2f}" for a in accs))


if __name__ == "__main__":  # a module of eval_sts.py and the analyses: nothing to run alone
    common.die("transfer.py is a module: its tasks run with python eval_sts.py --model MODEL "
               "--tasks transfer (or probing, or --align-uniform)")
