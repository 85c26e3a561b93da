"""What sscl.py, jtcse.py, bellm.py and eval_sts.py share, and nothing method-specific:
finding the data, reading training text, run folders that lose nothing (atomic saves, a lock, --resume
checks, stopping on a signal), range-checked argument types, tokenisation with dynamic padding, and the STS
evaluation (STS12-16 in SentEval's "all" setting, STS-B test, SICK-R test; Spearman x 100).

The evaluator takes any `encode(list[str]) -> Tensor (N, H)`; each method passes its own, so the
numbers printed during training and by eval_sts.py come from the same function.
"""
import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time

import numpy as np
import torch
from scipy.stats import spearmanr

TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R"]
STS_SUBSETS = {  # SentEval's subsets (STS13 SMT is withheld by its licence, as in SentEval)
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}
HUB_DATASET = "princeton-nlp/datasets-for-simcse"  # holds senteval.tar, wiki1m_for_simcse.txt, nli_for_simcse.csv
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "sentemb")
META = "sentemb.json"  # written beside every checkpoint: how eval_sts.py must encode with it
CKPT = "checkpoint.pt"  # the training state, for --resume
STAGING, PENDING, LOCK = ".best.staging", ".best.pending", ".lock"  # see save_best() and lock_run()


def die(msg):
    """Bad input: one line that names the fix, exit code 2, no traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


QUIET = False  # --quiet: no progress bars


def progress(iterable, desc, total=None, unit="it"):
    """A progress bar (tqdm, on stderr) for loops that can take more than ~10 s on a CPU. It is off when stderr
    is not a terminal (logs stay parseable) and with --quiet."""
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=False, file=sys.stderr,
                disable=True if QUIET else None)


def pick_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bf16_note(device):
    """For the start-up line with --bf16: whether this CPU has the instructions that make bf16 faster."""
    if device.type != "cpu":
        return "bf16 autocast"
    has = [n for n, f in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
           if getattr(torch.cpu, f, lambda: False)()]
    return (f"bf16 autocast; this CPU has {' and '.join(has)}" if has else
            "bf16 autocast, but this CPU has no AVX512-BF16 or AMX: expect it to be slower than fp32")


def autocast(device, cpu_bf16=False):
    """bf16 autocast on CUDA; on CPU plain fp32, unless cpu_bf16 (--bf16: for CPUs with bf16 instructions)."""
    if device.type == "cuda" or cpu_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def seed_everything(seed):
    import random
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


# ---------------------------------------------------------------- multi-GPU (torchrun) ----------
def init_distributed():
    """-> (rank, world_size, device). Under `torchrun`, one process per GPU (NCCL), or per CPU process
    (gloo); without it, (0, 1, pick_device())."""
    if "RANK" not in os.environ:
        return 0, 1, pick_device()
    import torch.distributed as dist
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = pick_device()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def gather(z):
    """(B, D) on each rank -> (world·B, D), ranks in order. all_gather returns tensors without a graph,
    so the local slot is replaced by z itself: gradients flow into this rank's embeddings."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return z
    parts = [torch.empty_like(z) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, z.detach().contiguous())
    parts[dist.get_rank()] = z
    return torch.cat(parts)


# ---------------------------------------------------------------- data location -----------------
def _from_hub(filename):
    """Download one file of SimCSE's hub dataset; None when offline or unreachable."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return None
    try:
        from huggingface_hub import hf_hub_download
        return hf_hub_download(HUB_DATASET, filename, repo_type="dataset", cache_dir=CACHE)
    except Exception:  # offline, blocked, or hub down: the caller explains what to do instead
        return None


def senteval_dir(flag=None):
    """The folder holding `downstream/STS` and `downstream/SICK` (SimCSE's senteval.tar, unpacked).
    Order: --data-dir, then $SENTEMB_DATA, then ~/.cache/sentemb/senteval (downloaded when missing)."""
    root = flag or os.environ.get("SENTEMB_DATA") or os.path.join(CACHE, "senteval")
    for d in (os.path.join(root, "downstream"), root):  # accept the folder itself or its parent
        if os.path.isdir(os.path.join(d, "STS")) and os.path.isdir(os.path.join(d, "SICK")):
            return d
    if not flag and not os.environ.get("SENTEMB_DATA") and (tar := _from_hub("senteval.tar")):
        import tarfile
        with tarfile.open(tar) as t:
            t.extractall(root, filter="data")
        return senteval_dir(root)
    die(f"no STS data in '{root}': pass --data-dir DIR or set SENTEMB_DATA=DIR, where DIR/downstream/"
        "STS/STS12-en-test/... and DIR/downstream/SICK/... are SimCSE's senteval.tar, unpacked")


def check_sts(data, tasks=TASKS):
    """Read every evaluation file now (STS-B dev and the tasks' test sets), so that a malformed one stops a
    training run before it starts rather than at its final table."""
    load_sts(data, "STS-B", "dev")
    for t in tasks:
        load_sts(data, t)
    return data


def train_file(path, hub_name):
    """A training file given on the command line, or SimCSE's default downloaded from the hub."""
    if path and os.path.isfile(path):
        return path
    if not path and (got := _from_hub(hub_name)):
        return got
    die(f"training file '{path or hub_name}' not found: pass --train FILE "
        f"(SimCSE's {hub_name} from the hub dataset {HUB_DATASET}, or any file in its format)")


def read_text(path):
    """A whole UTF-8 text file, newlines translated as open() in text mode does; anything else is a bad
    input naming the file and the line."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        die(f"cannot read '{path}' ({e.strerror}): pass a readable file")
    try:
        return raw.decode("utf8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        die(f"'{path}', line {line}: not UTF-8 text; convert the file to UTF-8 "
            "(e.g. iconv -f latin1 -t utf8)")


def read_sentences(path):
    """One sentence per line; blank lines are skipped; a file with no sentence is an error."""
    sents = [line.strip() for line in read_text(path).split("\n") if line.strip()]
    if not sents:
        die(f"'{path}' has no sentences: pass a --train file with one sentence per line")
    return sents


# ---------------------------------------------------------------- nothing lost ------------------
# A run folder holds the best model (plain HF or peft files + sentemb.json) and checkpoint.pt (the training
# state). Every write is atomic: a kill, a full disk or a power cut at any instant leaves the old version or
# the new one. Only one process at a time may write a run folder (lock_run).
def _pause():
    """For tests: SENTEMB_SAVE_PAUSE=seconds makes every save wait between its writes, so that a kill can
    be aimed inside a save."""
    if t := os.environ.get("SENTEMB_SAVE_PAUSE"):
        time.sleep(float(t))


def _fsync(path):
    """Flush a file, or a folder's entries (renames), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_failed(what, e):
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
    die(f"cannot save {what} ({reason}): free disk space or pass another --output-dir; what was saved before "
        "is kept, and --resume continues from it")


def _check_finite(params, out_dir):
    if not all(bool(torch.isfinite(q).all()) for q in params):
        die(f"the weights are no longer finite: not saved; {out_dir} holds the last good step: "
            "resume from it with a lower --lr (--resume --lr ...)")


def save_state(state, out_dir, params):
    """torch.save(state, OUT_DIR/checkpoint.pt) atomically: a temporary file beside it, fsync, one rename.
    Weights that are no longer finite are never saved: the checkpoint of the last good step stays."""
    _check_finite(params, out_dir)
    path = os.path.join(out_dir, CKPT)
    try:
        with open(path + ".tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            _pause()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        _fsync(out_dir)
    except (OSError, RuntimeError) as e:  # RuntimeError: torch's writer on a full disk
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        _save_failed(path, e)


def save_best(out_dir, write, state, params, **meta):
    """A new best model and the training state, replaced together as one. write(folder) saves the weights
    and tokenizer into an empty staging folder; checkpoint.pt (state) and sentemb.json (meta) are added,
    every file is synced, and the folder is renamed to .best.pending: the commit point. Before it a kill
    leaves the previous save untouched; after it the files are moved over the old ones, sentemb.json
    last, and a move cut short by a kill is completed by finish_save() the next time a command of this
    project opens the folder (training, --resume, eval_sts.py)."""
    _check_finite(params, out_dir)
    staging = os.path.join(out_dir, STAGING)
    try:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        write(staging)
        torch.save(state, os.path.join(staging, CKPT))
        with open(os.path.join(staging, META), "w") as f:
            json.dump(meta, f, indent=2)
        for root, _, files in os.walk(staging):
            for name in files:
                _fsync(os.path.join(root, name))
                _pause()
            _fsync(root)
        os.replace(staging, os.path.join(out_dir, PENDING))  # the commit point
        _fsync(out_dir)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        _save_failed(f"the best model in {out_dir}", e)
    finish_save(out_dir)


def finish_save(out_dir):
    """Complete an interrupted save (call it holding the folder's lock): an uncommitted staging folder is
    dropped (the old model stands), a committed one is moved into place; stray temporary files go."""
    shutil.rmtree(os.path.join(out_dir, STAGING), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, CKPT + ".tmp"))
    pending = os.path.join(out_dir, PENDING)
    if not os.path.isdir(pending):
        return
    if os.path.exists(os.path.join(pending, META)):  # files still to move: meanwhile the folder describes no run
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, META))
    files = sorted((os.path.relpath(os.path.join(root, n), pending) for root, _, names in os.walk(pending)
                    for n in names), key=lambda rel: (rel == META, rel))  # sentemb.json last
    for rel in files:
        os.makedirs(os.path.dirname(os.path.join(out_dir, rel)), exist_ok=True)
        os.replace(os.path.join(pending, rel), os.path.join(out_dir, rel))
        _pause()
    for root, _, _ in os.walk(out_dir):
        _fsync(root)
    shutil.rmtree(pending)


_held = {}  # real path -> open lock file, for the run folders this process holds


def lock_run(out_dir):
    """An exclusive lock on OUT_DIR/.lock that lasts as long as this process (the kernel drops it when the
    process ends, however it ends). True when this process holds it, False when another process does."""
    key = os.path.realpath(out_dir)
    if key in _held:
        return True
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        return True
    f = open(os.path.join(out_dir, LOCK), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return False
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    _held[key] = f
    return True


def open_run(out_dir, resume, models=(), rank=0):
    """-> OUT_DIR/checkpoint.pt, once rank 0 has made sure that nothing already saved can be lost: the folder
    is not one of the input models and is writable; it is locked for this run; an interrupted save is
    completed; a folder that holds a run (sentemb.json or checkpoint.pt) needs --resume, and --resume needs
    a checkpoint. Other ranks wait for that (they read the checkpoint next)."""
    ckpt = os.path.join(out_dir, CKPT)
    if rank == 0:
        for m in models:
            if m and os.path.isdir(m) and os.path.isdir(out_dir) and os.path.samefile(m, out_dir):
                die(f"--output-dir '{out_dir}' is the input model '{m}': training would overwrite its weights; "
                    "pass another --output-dir")
        try:
            os.makedirs(out_dir, exist_ok=True)
            open(os.path.join(out_dir, ".write_test"), "w").close()
            os.remove(os.path.join(out_dir, ".write_test"))
        except OSError as e:
            die(f"cannot write to output folder '{out_dir}' ({e.strerror}): pass a writable --output-dir")
        if not lock_run(out_dir):
            with open(os.path.join(out_dir, LOCK)) as f:
                pid = f.read().strip()
            die(f"'{out_dir}' is in use by another training run (pid {pid or '?'}): wait for it to end, or pass "
                "another --output-dir")
        finish_save(out_dir)
        holds_run = os.path.exists(os.path.join(out_dir, META)) or os.path.exists(ckpt)
        if not resume and holds_run:
            die(f"'{out_dir}' already holds a run: pass --resume to continue it, or another --output-dir")
        if not holds_run and any(os.path.exists(os.path.join(out_dir, f)) for f in ("config.json",
                                                                                     "adapter_config.json")):
            die(f"'{out_dir}' holds a model that is not a run of this project: pass a new or empty --output-dir")
        if resume and not os.path.isfile(ckpt):
            die(f"--resume: no {ckpt}; drop --resume to start a new run")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return ckpt


def settle(run_dir):
    """Before reading a run folder: complete a save that a kill cut short after its commit point. If a
    training run holds the folder, it completes its own save within moments: wait for it."""
    key = os.path.realpath(run_dir)
    for _ in range(300):
        if not os.path.isdir(os.path.join(run_dir, PENDING)):
            return
        mine = key in _held
        try:
            if lock_run(run_dir):
                finish_save(run_dir)
                if not mine and key in _held:
                    _held.pop(key).close()
                return
        except OSError as e:
            die(f"'{run_dir}' holds an interrupted save that cannot be completed ({e.strerror}): make the folder "
                "writable and run again")
        time.sleep(0.1)
    die(f"'{run_dir}' is being saved by a training run: try again in a moment")


META_KEYS = {"sscl": ["pooler", "proj_dim", "max_len"], "jtcse": ["towers", "max_len"],
             "bellm": ["base_model", "bi_layers", "bi_mode", "prompt"]}


def read_meta(run_dir):
    """A run folder's sentemb.json (after settle()), or None when it has none; a damaged one is a bad input."""
    settle(run_dir)
    path = os.path.join(run_dir, META)
    if not os.path.isfile(path):
        return None
    try:
        meta = json.loads(read_text(path))
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or any(k not in meta for k in META_KEYS.get(meta.get("method"), ["method"])):
        die(f"{path} is not a run description of sscl.py, jtcse.py or bellm.py (damaged or edited): "
            "re-save the run, or delete the file to load the folder as a plain model")
    return meta


# settings that may change on --resume; any other difference is refused, listing the flags
RESUMABLE = {"resume", "lr", "epochs", "max_steps", "eval_steps", "log_steps", "final_eval", "data_dir",
             "output_dir", "bf16", "tasks", "eval_first", "quiet"}


def run_args(args):
    """The settings a checkpoint records; paths that exist are made absolute (a resume may start elsewhere)."""
    return {k: os.path.abspath(v) if isinstance(v, str) and os.path.exists(v) else v for k, v in vars(args).items()}


def load_state(path, method, args, device):
    """The training state of OUT_DIR/checkpoint.pt for --resume, or one line saying why it cannot be used:
    unreadable (damaged), written by another script, or by a run with other settings."""
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # truncated, empty, not a torch file: torch raises many types
        die(f"--resume: {path} cannot be read ({type(e).__name__}); it is damaged: start again without --resume "
            "in another --output-dir")
    if not isinstance(state, dict) or state.get("method", method) != method:
        die(f"--resume: {path} was not written by {method}.py: pass the --output-dir of a {method}.py run")
    old, new = state.get("args", {}), run_args(args)
    if changed := [k for k in old if k not in RESUMABLE and old[k] != new.get(k)]:
        flag = lambda k, v: f"--{k.replace('_', '-')} {v}"  # noqa: E731
        die(f"--resume: the run was started with {', '.join(flag(k, old[k]) for k in changed)}, this command "
            f"says {', '.join(flag(k, new.get(k)) for k in changed)}: resume with the run's own settings")
    return state


def fit(load, what):
    """Load a checkpoint's tensors into the model; a mismatch is a foreign checkpoint, one line."""
    try:
        load()
    except (KeyError, RuntimeError, ValueError) as e:
        die(f"--resume: the checkpoint does not fit {what} ({type(e).__name__}): pass the --output-dir of a run "
            "of this model and settings")


def set_lr(opt, lr, sched=None):
    """A new --lr on --resume: the optimizer's groups (and a LambdaLR's base) take it from this step on."""
    for i, g in enumerate(opt.param_groups):
        g["initial_lr"] = lr
        g["lr"] = lr * (sched.lr_lambdas[i](sched.last_epoch) if sched else 1)
    if sched:
        sched.base_lrs = [lr] * len(opt.param_groups)


class StopOnSignal(contextlib.AbstractContextManager):
    """SIGINT (Ctrl-C) and SIGTERM (a cluster's pre-emption): training stops at the next step boundary,
    saves its state and exits with 128 + the signal number; a second signal exits at once (every save is
    atomic, so that loses nothing already saved). The previous handlers come back on exit."""

    def __enter__(self):
        self.signum, self.now = 0, False  # now: exit at the first signal (training has ended)
        self.old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self.old:
            signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum or self.now:
            os.write(2, f"\n{signal.Signals(signum).name}: stopped\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step (again: at once)\n".encode())

    def __call__(self, device, world):
        """True on every rank once any rank has had a signal (ranks must leave the loop at the same step)."""
        if world > 1:
            t = torch.tensor(self.signum, device=device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            self.signum = int(t)
        return bool(self.signum)

    def exit(self, step, out_dir):
        print(f"stopped at step {step} ({signal.Signals(self.signum).name}): the training state is in "
              f"{os.path.join(out_dir, CKPT)}; run the same command with --resume to continue", flush=True)
        sys.exit(128 + self.signum)

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------- argument types ----------------
def _typed(convert, ok, text):
    def parse(s):
        try:
            v = convert(s)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"{s!r} is not {text}")
        return v
    parse.range = text
    return parse


POS_INT = _typed(int, lambda v: v >= 1, "an integer >= 1")
NONNEG_INT = _typed(int, lambda v: v >= 0, "an integer >= 0")
STEPS = _typed(int, lambda v: v == -1 or v >= 1, "-1 or an integer >= 1")
SEED = _typed(int, lambda v: 0 <= v < 2**32, "an integer in 0..2**32-1")
POS_FLOAT = _typed(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
PROB = _typed(float, lambda v: 0 <= v < 1, "a probability in [0, 1)")


def show_ranges(parser):
    """Append each typed argument's allowed range to its --help text."""
    for act in parser._actions:
        if hasattr(act.type, "range") and act.help:
            act.help += f" [{act.type.range}]"
    return parser


def load_pretrained(cls, name, **kw):
    """cls.from_pretrained(name), or one line saying what to do when it cannot be had."""
    try:
        return cls.from_pretrained(name, **kw)
    except (OSError, ValueError) as e:
        die(f"cannot load '{name}' ({type(e).__name__}): pass a local model folder, or a hub name "
            f"with the hub reachable")


def save_sentence_transformers(folder, hidden, pooling, max_len, dense=None):
    """The small files sentence-transformers reads beside a plain HF model (its classic layout, which v2 to v6
    load), so that SentenceTransformer(folder) encodes as we evaluate: Transformer (no truncation below
    max_len) -> Pooling (pooling: "cls" or "mean") [-> Dense, the linear projection `dense`]. No normalisation:
    cosine similarity does not need it."""
    modules = [("", "Transformer"), ("1_Pooling", "Pooling")] + ([("2_Dense", "Dense")] if dense is not None else [])
    files = {"modules.json": [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
                              for i, (path, kind) in enumerate(modules)],
             "sentence_bert_config.json": {"max_seq_length": max_len, "do_lower_case": False},
             "1_Pooling/config.json": {"word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == "cls",
                                       "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
                                       "pooling_mode_mean_sqrt_len_tokens": False}}
    if dense is not None:
        files["2_Dense/config.json"] = {"in_features": dense.in_features, "out_features": dense.out_features,
                                        "bias": dense.bias is not None,
                                        "activation_function": "torch.nn.modules.linear.Identity"}
        from safetensors.torch import save_file
        os.makedirs(os.path.join(folder, "2_Dense"))
        save_file({f"linear.{k}": v.detach().contiguous().cpu() for k, v in dense.state_dict().items()},
                  os.path.join(folder, "2_Dense", "model.safetensors"))
    for name, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=2)


# ---------------------------------------------------------------- tokenisation ------------------
def tokenize(tokenizer, sentences, max_len, device):
    """Dynamic padding to the longest sentence of the batch; longer sentences are truncated."""
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def encode_in_batches(embed, tokenizer, sentences, max_len, device, batch_size=128):
    """(N, H) embeddings in the order given. Every sentence is tokenised once, then batched by token
    length, so a batch pads to little more than its own length; embed(batch dict) -> (b, H)."""
    ids = tokenizer(sentences, truncation=True, max_length=max_len)["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = [None] * len(ids)
    for i in progress(range(0, len(order), batch_size), "encoding", unit="batch"):
        idx = order[i:i + batch_size]
        batch = tokenizer.pad({"input_ids": [ids[j] for j in idx]}, return_tensors="pt")
        for j, e in zip(idx, embed({k: v.to(device) for k, v in batch.items()}).float()):
            out[j] = e
    return torch.stack(out)


def encode_once(encode, sentences, device="cpu"):
    """Encode every distinct sentence once, in one call (batched by token length); -> embed(list[str]) ->
    (n, H) float32 on `device`, looked up from that cache."""
    distinct = sorted(set(sentences))
    cache = dict(zip(distinct, encode(distinct).float().to(device)))
    return lambda sents: torch.stack([cache[s] for s in sents])


# ---------------------------------------------------------------- STS data ----------------------
def _lines(path):
    if not os.path.isfile(path):
        die(f"missing {path}: the STS data folder is incomplete; unpack senteval.tar again or fix --data-dir")
    lines = read_text(path).split("\n")
    return lines[:-1] if lines[-1] == "" else lines  # as iterating over the file: no line after the last \n


def _row(path, i, s1, s2, gold):
    """(sent1, sent2, score) as SentEval reads them: whitespace-split and re-joined with single spaces."""
    try:
        return " ".join(s1.split()), " ".join(s2.split()), float(gold)
    except ValueError:
        die(f"{path}, line {i}: malformed line (expected a score, got {gold!r}); fix it or re-download senteval.tar")


def load_sts(data, task, split="test"):
    """{subset: [(sent1, sent2, gold)]}; STS pairs with an empty gold line are dropped (as SentEval)."""
    if task in STS_SUBSETS:
        subsets = {}
        for name in STS_SUBSETS[task]:
            base = os.path.join(data, "STS", f"{task}-en-test", f"STS.%s.{name}.txt")
            pairs, gold = [l.split("\t") for l in _lines(base % "input")], [g.strip() for g in _lines(base % "gs")]
            if len(gold) != len(pairs):
                die(f"{base % 'gs'}: {len(gold)} scores for {len(pairs)} pairs; re-download senteval.tar")
            if bad := next((i for i, p in enumerate(pairs, 1) if len(p) != 2), None):
                die(f"{base % 'input'}, line {bad}: malformed line (expected two tab-separated "
                    "sentences); fix it or re-download senteval.tar")
            subsets[name] = [_row(base % "gs", i, *p, g) for i, (p, g) in enumerate(zip(pairs, gold), 1) if g]
        return subsets
    if task == "STS-B":  # gold = 5th field, sentences = 6th and 7th
        path, skip, cols = os.path.join(data, "STS", "STSBenchmark", f"sts-{split}.csv"), 0, (5, 6, 4)
    elif task == "SICK-R":  # header line; sentences = 2nd and 3rd field, gold = 4th
        name = {"test": "SICK_test_annotated", "dev": "SICK_trial", "train": "SICK_train"}[split]
        path, skip, cols = os.path.join(data, "SICK", f"{name}.txt"), 1, (1, 2, 3)
    else:
        die(f"unknown task '{task}': choose from {', '.join(TASKS)}")
    rows = []
    for i, line in enumerate(_lines(path)[skip:], skip + 1):
        t = line.split("\t")
        if len(t) <= max(cols):
            die(f"{path}, line {i}: malformed line (expected at least "
                f"{max(cols) + 1} tab-separated fields); fix it or re-download senteval.tar")
        rows.append(_row(path, i, *(t[c] for c in cols)))
    return {split: rows}


# ---------------------------------------------------------------- STS evaluation ----------------
@torch.no_grad()
def evaluate(encode, data, tasks=TASKS, split="test", batch_size=128, exact=False):
    """{task: Spearman x 100} of cosine similarity against gold, subsets pooled ("all" setting).

    Default: encode() gets every distinct sentence once, in one call (our encoders batch by token
    length). exact=True: SentEval's own batches (each subset's pairs sorted by length, `batch_size`
    pairs a batch, each side encoded separately): slower, for bit-level comparisons."""
    loaded = {t: load_sts(data, t, split if t in ("STS-B", "SICK-R") else "test") for t in tasks}
    embed = encode if exact else encode_once(
        encode, {s for subsets in loaded.values() for rs in subsets.values() for r in rs for s in r[:2]})
    results = {}
    for t in tasks:
        sims, gold = [], []
        for rs in loaded[t].values():
            if exact:
                rs = sorted(rs, key=lambda z: (len(z[0].split()), len(z[1].split()), z[2]))
            step = batch_size if exact else max(len(rs), 1)
            for i in range(0, len(rs), step):
                chunk = rs[i:i + step]
                a = embed([r[0] for r in chunk]).float().cpu()  # (P, H)
                b = embed([r[1] for r in chunk]).float().cpu()  # (P, H)
                sims.append(torch.nn.functional.cosine_similarity(a, b, dim=-1))
                gold += [r[2] for r in chunk]
        results[t] = 100 * spearmanr(torch.cat(sims).numpy(), gold).statistic
    return results


def format_table(results):
    """The papers' table: STS12 ... SICK-R Avg., two decimals."""
    names = [t for t in TASKS if t in results]
    avg = sum(results[t] for t in names) / len(names)
    head = " ".join(f"{t:>7}" for t in names + ["Avg."])
    return head + "\n" + " ".join(f"{results[t]:7.2f}" for t in names) + f" {avg:7.2f}"
