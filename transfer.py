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
SEED = 1111
MAX_EPOCH = 200
VALIDATION_SPLIT = 0.05
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


# MR, CR, SUBJ, MPQA: one file a class, label 1 = the first file (SUBJ: objective)
BINARY_FILES = {"MR": ("rt-polarity.pos", "rt-polarity.neg"),
                "CR": ("custrev.pos", "custrev.neg"),
                "SUBJ": ("subj.objective", "subj.subjective"),
                "MPQA": ("mpqa.pos", "mpqa.neg")}


def load_transfer(data, task):
    """{split: (texts, labels)} read as SentEval reads them (senteval/binary.py, sst.py, trec.py,
    mrpc.py); texts = [sentences], or [sentences A, sentences B] for MRPC; each split in SentEval's
    sample order."""
    if task in BINARY_FILES:
        return _load_binary(os.path.join(data, task), BINARY_FILES[task])
    if task == "SST2":
        return _load_sst2(os.path.join(data, "SST"))
    if task == "TREC":
        return _load_trec(os.path.join(data, task))
    if task == "MRPC":
        return _load_mrpc(os.path.join(data, task))
    common.die(f"unknown transfer task '{task}': choose from {', '.join(TRANSFER)}")


def _load_binary(folder, files):
    """senteval/binary.py: {"all": ...}, the lines of the positive file, then the negative one."""
    pos_file, neg_file = files
    pos = [line.split() for line in _read(os.path.join(folder, pos_file), "latin-1").splitlines()]
    neg = [line.split() for line in _read(os.path.join(folder, neg_file), "latin-1").splitlines()]
    return {"all": _sorted(pos + neg, [1] * len(pos) + [0] * len(neg))}


def _load_sst2(folder):
    """senteval/sst.py: train, dev, test, each 'sentence<TAB>0 or 1' lines."""
    out = {}
    for split in ("train", "dev", "test"):
        path = os.path.join(folder, "binary", f"sentiment-{split}")
        rows = []
        for i, line in enumerate(_file_lines(_read(path, "utf-8")), 1):
            t = line.strip().split("\t")
            if len(t) < 2 or t[1] not in ("0", "1"):
                common.die(f"{path}, line {i}: malformed line "
                           "(expected 'sentence<TAB>0 or 1'); re-download senteval.tar")
            rows.append((t[0].split(), int(t[1])))
        out[split] = _sorted(*zip(*rows))
    return out


def _load_trec(folder):
    """senteval/trec.py: train and test, each 'COARSE:fine question words' lines."""
    out = {}
    for split, name in (("train", "train_5500.label"), ("test", "TREC_10.label")):
        path = os.path.join(folder, name)
        rows = []
        for i, line in enumerate(_file_lines(_read(path, "latin-1")), 1):
            target, _, rest = line.strip().partition(":")
            if target not in TREC_CLASSES or " " not in rest:
                common.die(f"{path}, line {i}: malformed line (expected 'COARSE:fine question' "
                           f"with COARSE one of {', '.join(TREC_CLASSES)}); "
                           "re-download senteval.tar")
            rows.append((rest.split(" ", 1)[1].split(), TREC_CLASSES[target]))
        out[split] = _sorted(*zip(*rows))
    return out


def _load_mrpc(folder):
    """senteval/mrpc.py: train and test, each a header line, then
    'label<TAB>id1<TAB>id2<TAB>sentence 1<TAB>sentence 2' lines."""
    out = {}
    for split in ("train", "test"):
        path = os.path.join(folder, f"msr_paraphrase_{split}.txt")
        rows = []
        for i, line in enumerate(_file_lines(_read(path, "utf-8"))[1:], 2):
            t = line.strip().split("\t")
            if len(t) < 5 or t[0] not in ("0", "1"):
                common.die(f"{path}, line {i}: malformed line (expected "
                           "'label<TAB>id1<TAB>id2<TAB>sentence 1<TAB>sentence 2'); "
                           "re-download senteval.tar")
            rows.append((t[3].split(), t[4].split(), int(t[0])))
        out[split] = _sorted(*zip(*rows))
    return out


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
    results = [None] * len(runs)
    for members in _groups_by_minibatches(runs, cfg["batch_size"]):
        model = BatchedLogReg(X, y, [runs[r] for r in members], nclasses, cfg)
        for r, result in zip(members, model.fit()):
            results[r] = result
    return results


def _groups_by_minibatches(runs, batch_size):
    """[[run index]]: the runs grouped by their number of minibatches per epoch, each group one
    batched model."""
    groups = {}
    for r, (tr, dev, _) in enumerate(runs):
        n = len(tr)  # training rows
        if dev is None:
            n -= int(VALIDATION_SPLIT * len(tr))
        groups.setdefault(-(-n // batch_size), []).append(r)
    return list(groups.values())


def _prepare_split(runs):
    """Each run's RNG stream, training rows and dev rows. -> (rngs {(len(train_idx), dev_idx is
    None): RandomState}: one stream per distinct key, since a run's draws depend on nothing else;
    [train rows], [dev rows], [the run's stream: its key's position in rngs])."""
    rngs = {}
    split_perm = {}
    train = []
    dev = []
    stream = []
    for t, d, _ in runs:
        key = (len(t), d is None)  # what a run's RNG stream depends on
        if key not in rngs:
            # = np.random.seed(1111) in the classifier's constructor
            rngs[key] = np.random.RandomState(SEED)
            # prepare_split(validation_split=0.05): one permutation, the first 5% are dev
            if d is None:
                split_perm[key] = rngs[key].permutation(len(t))
        if d is None:
            cut = int(VALIDATION_SPLIT * len(t))
            d = t[split_perm[key][:cut]]  # dev first: both are cut from the run's whole train_idx
            t = t[split_perm[key][cut:]]
        train.append(t)
        dev.append(d)
        stream.append(list(rngs).index(key))
    return rngs, train, dev, stream


def _pad(rows, device):
    """List of 1-d int arrays -> (len(rows), longest) tensor, zero-padded."""
    longest = max(map(len, rows))
    return torch.as_tensor(np.stack([np.pad(a, (0, longest - len(a))) for a in rows]),
                           device=device)


def _mask(lengths, width, device):
    """(len(lengths), width) bool: True at the first lengths[i] places of row i."""
    return torch.arange(width, device=device) < torch.tensor(lengths, device=device)[:, None]


OPTIMIZERS = {"adam": torch.optim.Adam, "rmsprop": torch.optim.RMSprop}  # cfg["optim"]


class BatchedLogReg:
    """M runs of SentEval's PyTorchClassifier (tools/classifier.py) with the same number of
    minibatches per epoch, as one model: W (M, C, D), b (M, C), a row per run still training
    (`live`: their indices among the M). The methods are SentEval's: fit, trainepoch, score."""

    def __init__(self, X, y, runs, nclasses, cfg):
        self.X = X
        self.y = y
        self.cfg = cfg
        device = X.device
        self.rngs, train, dev, stream = _prepare_split(runs)
        self.rows_per_stream = [n - int(VALIDATION_SPLIT * n) if split else n
                                for n, split in self.rngs]
        self.n_dev = [len(d) for d in dev]
        M = len(runs)
        # the live runs' rows: training indices, their mask, stream, L2, dev set
        self.tr_idx = _pad(train, device)  # (M, n_train)
        dev_idx = _pad(dev, device)  # (M, n_dev)
        self.stream = torch.tensor(stream, device=device)  # (M,)
        self.tr_mask = _mask([len(t) for t in train], self.tr_idx.shape[1], device)
        self.dev_mask = _mask(self.n_dev, dev_idx.shape[1], device)
        self.X_dev = X[dev_idx]  # (M, n_dev, D)
        self.y_dev = y[dev_idx]  # (M, n_dev)
        # torch.manual_seed(1111); nn.Linear(D, C): SentEval's init
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            linear = torch.nn.Linear(X.shape[1], nclasses)
        self.W = linear.weight.detach().to(device).repeat(M, 1, 1).requires_grad_()  # (M, C, D)
        self.b = linear.bias.detach().to(device).repeat(M, 1).requires_grad_()  # (M, C)
        self.l2 = torch.tensor([l2 for _, _, l2 in runs], device=device)  # (M,)
        self.opt = OPTIMIZERS[cfg["optim"]]([self.W, self.b])  # torch defaults
        # per run: the best dev accuracy and its weights, the checks without a new best
        self.best_acc = [-1.0] * M
        self.best_W = self.W.detach().clone()
        self.best_b = self.b.detach().clone()
        self.bad_checks = [0] * M
        self.live = list(range(M))
        # X_batch = X[idx], (M, bs, D), written in place: a fresh tensor of that size every step
        # (40 MB for MR's 400 runs) costs more than the step itself
        self.buf = torch.empty(M * cfg["batch_size"], X.shape[1], device=device)

    def fit(self):
        """Train until every run has stopped, or after epoch 200. -> [(best dev accuracy, W, b)]."""
        nepoch = 0
        while self.live and nepoch <= MAX_EPOCH:
            self.trainepoch()
            nepoch += self.cfg["epoch_size"]
            stop = self.early_stop(self.score())
            if any(stop):
                self.drop(stop)
        return [(acc, self.best_W[m], self.best_b[m]) for m, acc in enumerate(self.best_acc)]

    def trainepoch(self):
        """`epoch_size` epochs: each a fresh permutation of each stream's training rows, then its
        minibatches."""
        bs = self.cfg["batch_size"]
        for _ in range(self.cfg["epoch_size"]):
            perms = _pad([rng.permutation(n)
                          for rng, n in zip(self.rngs.values(), self.rows_per_stream)],
                         self.X.device)  # per stream
            # (M, n_train): each run's rows in its epoch's order
            order = self.tr_idx.gather(1, perms[self.stream])
            for i in range(0, order.shape[1], bs):
                self.step(order[:, i:i + bs], self.tr_mask[:, i:i + bs])

    def step(self, idx, mask):
        """One minibatch of every live run: idx, mask (M, bs), its rows and which of them are
        real (a shorter last minibatch is padded)."""
        W = self.W
        b = self.b
        X_batch = torch.index_select(self.X, 0, idx.flatten(),
                                     out=self.buf[:idx.numel()]).view(*idx.shape, -1)
        logits = torch.baddbmm(b.unsqueeze(1), X_batch, W.transpose(1, 2))  # (M, bs, C)
        ce = F.cross_entropy(logits.transpose(1, 2), self.y[idx],
                             reduction="none") * mask  # (M, bs)
        # sum of the runs' mean losses: each gradient its own
        loss = (ce.sum(1) / mask.sum(1)).sum()
        self.opt.zero_grad()
        loss.backward()
        # weight_decay as torch's optimizers apply it: grad + l2 * param
        with torch.no_grad():
            W.grad.add_(W * self.l2[:, None, None])
            b.grad.add_(b * self.l2[:, None])
        self.opt.step()

    @torch.no_grad()
    def score(self):
        """[dev accuracy] of the live runs."""
        pred = torch.baddbmm(self.b.unsqueeze(1), self.X_dev,
                             self.W.transpose(1, 2)).argmax(-1)  # (M, n_dev)
        correct = ((pred == self.y_dev) & self.dev_mask).sum(1).tolist()
        return [c / self.n_dev[m] for c, m in zip(correct, self.live)]

    def early_stop(self, accs):
        """Keep each live run's best model; -> [whether the run stops], True at the (tenacity +
        1)-th check without a new best."""
        stop = [False] * len(self.live)
        for j, m in enumerate(self.live):
            if accs[j] > self.best_acc[m]:
                self.best_acc[m] = accs[j]
                self.best_W[m] = self.W[j].detach()
                self.best_b[m] = self.b[j].detach()
            else:
                stop[j] = self.bad_checks[m] >= self.cfg["tenacity"]
                self.bad_checks[m] += 1
        return stop

    def drop(self, stop):
        """Drop the stopped runs' rows from the batch, and from the optimizer's state."""
        keep = [j for j, s in enumerate(stop) if not s]
        self.live = [self.live[j] for j in keep]
        self.tr_idx = self.tr_idx[keep]
        self.tr_mask = self.tr_mask[keep]
        self.stream = self.stream[keep]
        self.l2 = self.l2[keep]
        self.X_dev = self.X_dev[keep]
        self.y_dev = self.y_dev[keep]
        self.dev_mask = self.dev_mask[keep]
        state = [self.opt.state[p] for p in (self.W, self.b)]
        self.W = self.W.detach()[keep].requires_grad_()
        self.b = self.b.detach()[keep].requires_grad_()
        self.opt = type(self.opt)([self.W, self.b])
        # Adam: step, exp_avg, exp_avg_sq; RMSprop: step, square_avg
        for p, s in zip((self.W, self.b), state):
            self.opt.state[p] = {k: v[keep] if v.dim() else v for k, v in s.items()}


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
    nclasses = 6 if task == "TREC" else 2
    if task in PROBING:
        nclasses = int(y["train"].max()) + 1
    if task in BINARY_FILES:
        return inner_kfold_classifier(X["all"], y["all"], nclasses, cfg)
    if task in ("TREC", "MRPC"):
        return kfold_classifier(X, y, nclasses, cfg)
    # SST2, probing tasks: train / dev / test
    return split_classifier(X, y, nclasses, cfg)


def inner_kfold_classifier(X, y, nclasses, cfg):
    """SentEval's InnerKFoldClassifier on X, y: (N, D), (N,) (MR, CR, SUBJ, MPQA)."""
    k = cfg["kfold"]
    outer = stratified_kfold(y.cpu().numpy(), k)
    inner = [stratified_kfold(y[tr].cpu().numpy(), k) for tr, _ in outer]
    runs = []  # per outer fold, per L2, per inner fold
    for (tr, _), folds in zip(outer, inner):
        for l2 in REGS:
            for itr, ite in folds:
                runs.append((tr[itr], tr[ite], l2))
    grid = fit_logreg(X, y, runs, nclasses, cfg)
    dev = []
    best_l2 = []
    # scores per L2: round(100 * mean over inner folds, 2), first best wins
    for o in range(k):
        accs = (np.array([g[0] for g in grid[o * len(REGS) * k:(o + 1) * len(REGS) * k]])
                .reshape(len(REGS), k))
        scores = [np.round(100 * np.mean(a), 2) for a in accs]
        dev.append(np.max(scores))
        best_l2.append(REGS[int(np.argmax(scores))])
    final = fit_logreg(X, y, [(tr, None, l2) for (tr, _), l2 in zip(outer, best_l2)],
                       nclasses, cfg)
    test = [round(100 * accuracy(W, b, X[te], y[te]), 2)
            for (_, W, b), (_, te) in zip(final, outer)]
    return {"devacc": float(np.round(np.mean(dev), 2)),
            "acc": float(np.round(np.mean(test), 2))}


def kfold_classifier(X, y, nclasses, cfg):
    """SentEval's KFoldClassifier on X, y: {"train", "test": tensor} (TREC, MRPC)."""
    k = cfg["kfold"]
    folds = stratified_kfold(y["train"].cpu().numpy(), k)
    grid = fit_logreg(X["train"], y["train"],
                      [(tr, te, l2) for l2 in REGS for tr, te in folds], nclasses, cfg)
    scores = [np.round(100 * np.mean([g[0] for g in grid[i * k:(i + 1) * k]]), 2)
              for i in range(len(REGS))]
    everything = np.arange(len(y["train"]))
    _, W, b = fit_logreg(X["train"], y["train"],
                         [(everything, None, REGS[int(np.argmax(scores))])], nclasses, cfg)[0]
    return {"devacc": float(np.max(scores)),
            "acc": round(100 * accuracy(W, b, X["test"], y["test"]), 2)}


def split_classifier(X, y, nclasses, cfg):
    """SentEval's SplitClassifier on X, y: {"train", "dev", "test": tensor} (SST2, probing)."""
    Xs = torch.cat([X["train"], X["dev"]])
    ys = torch.cat([y["train"], y["dev"]])
    n = len(y["train"])
    n_dev = len(y["dev"])
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
    t0 = time.perf_counter()
    results = {}
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
    path = probing_file(data, task)
    rows = _probing_rows(path)
    number = _probing_classes(path, rows)
    return {s: _sorted([w for w, _, _ in r], [number[lab] for _, lab, _ in r])
            for s, r in rows.items()}


def _probing_rows(path):
    """{split: [(words, label string, line number)]} of a probing file, every split present."""
    rows = {s: [] for s in PROBING_SPLITS.values()}
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
    empty = [k for k, s in PROBING_SPLITS.items() if not rows[s]]
    if empty:
        common.die(f"{path} has no '{empty[0]}' lines (SentEval trains on tr, chooses L2 on va, "
                   f"tests on te); copy the file again from {PROBING_SOURCE}")
    return rows


def _probing_classes(path, rows):
    """{label string: class}: the training labels numbered in sorted order; a label of dev or
    test that training lacks stops here."""
    number = {label: n for n, label in enumerate(sorted({lab for _, lab, _ in rows["train"]}))}
    unknown = [(i, lab) for r in rows.values() for _, lab, i in r if lab not in number]
    if unknown:
        i, lab = min(unknown)
        common.die(f"{path}, line {i}: label '{lab}' is not among the training labels "
                   f"({', '.join(number)}), which number SentEval's classes; copy the file "
                   f"again from {PROBING_SOURCE}")
    return number


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
