"""Run folders that lose nothing, shared by sscl.py, jtcse.py and bellm.py (and read by
eval_sts.py): atomic saves of the best model and the training state, a lock per folder, the checks
of --resume, stopping at a step boundary on SIGINT/SIGTERM, and the sentence-transformers files
beside a saved model. Reading is checked here too: every model and run folder the scripts load goes
through common.load_pretrained / read_meta / load_run, which turn any broken file into one
line naming it.
"""
import contextlib
import errno
import importlib
import json
import os
import random
import resource
import shutil
import signal
import sys
import time

import numpy as np
import torch
from safetensors import SafetensorError

import common

CKPT = "checkpoint.pt"  # the training state, for --resume
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
RECOPY = "copy the whole run folder again, or train again"
STAGING, PENDING, LOCK = ".best.staging", ".best.pending", ".lock"  # see save_best() and lock_run()


# ---------------------------------------------------------------- nothing lost ------------------
# A run folder holds the best model (plain HF or peft files + sentemb.json) and checkpoint.pt (the
# training state). Every write is atomic: a kill, a full disk or a power cut at any instant leaves
# the old version or the new one. Only one process at a time may write a run folder (lock_run).
def _pause():
    """For tests: SENTEMB_SAVE_PAUSE=seconds makes every save wait between its writes, so that a
    kill can be aimed inside a save."""
    if t := os.environ.get("SENTEMB_SAVE_PAUSE"):
        time.sleep(float(t))


def _fsync(path):
    """Flush a file, or a folder's entries (renames), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# a full disk as torch's zip writer says it (no errno) and as safetensors does (Rust's io error)
FULL_DISK = ("unexpected pos", "file write failed", "os error 28", "No space left on device",
             "StorageFull")


def _save_failed(what, e):
    reason = e.strerror if isinstance(e, OSError) and e.strerror else common.first_line(e)
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    if full or any(s in str(e) for s in FULL_DISK):
        reason = "No space left on device"
    common.die(f"cannot save {what} ({reason}): free disk space or pass another --output-dir; "
               "what was saved before is kept, and --resume continues from it")


def _check_finite(params, out_dir):
    if not all(bool(torch.isfinite(q).all()) for q in params):
        common.die(f"the weights are no longer finite: not saved; {out_dir} holds the last good "
                   "step: resume from it with a lower --lr (--resume --lr ...)")


def save_state(state, out_dir, params):
    """torch.save(state, OUT_DIR/checkpoint.pt) atomically: a temporary file beside it, fsync, one
    rename. Weights that are no longer finite are never saved: the checkpoint of the last good step
    stays."""
    _check_finite(params, out_dir)
    path = os.path.join(out_dir, CKPT)
    try:
        common.write_whole(path, lambda f: torch.save(state, f), _pause)
    except (OSError, RuntimeError) as e:  # RuntimeError: torch's writer on a full disk
        _save_failed(path, e)


def save_best(out_dir, write, state, params, **meta):
    """A new best model and the training state, replaced together as one. write(folder) saves the
    weights and tokenizer into an empty staging folder; checkpoint.pt (state) and sentemb.json
    (meta) are added, every file is synced, and the folder is renamed to .best.pending: the commit
    point. Before it a kill leaves the previous save untouched; after it the files are moved over
    the old ones, sentemb.json last, and a move cut short by a kill is completed by finish_save()
    the next time a command of this project opens the folder (training, --resume, eval_sts.py)."""
    _check_finite(params, out_dir)
    staging = os.path.join(out_dir, STAGING)
    try:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        write(staging)
        torch.save(state, os.path.join(staging, CKPT))
        with open(os.path.join(staging, common.META), "w") as f:
            json.dump(meta, f, indent=2)
        for root, _, files in os.walk(staging):
            for name in files:
                _fsync(os.path.join(root, name))
                _pause()
            _fsync(root)
        os.replace(staging, os.path.join(out_dir, PENDING))  # the commit point
        _fsync(out_dir)
    except (OSError, RuntimeError, SafetensorError) as e:  # RuntimeError: torch's writer
        shutil.rmtree(staging, ignore_errors=True)
        _save_failed(f"the best model in {out_dir}", e)
    finish_save(out_dir)


def finish_save(out_dir):
    """Complete an interrupted save (call it holding the folder's lock): an uncommitted staging
    folder is dropped (the old model stands), a committed one is moved into place; stray temporary
    files go."""
    shutil.rmtree(os.path.join(out_dir, STAGING), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, CKPT + ".tmp"))
    pending = os.path.join(out_dir, PENDING)
    if not os.path.isdir(pending):
        return
    # files still to move: meanwhile the folder describes no run
    if os.path.exists(os.path.join(pending, common.META)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, common.META))
    files = sorted((os.path.relpath(os.path.join(root, n), pending)
                    for root, _, names in os.walk(pending) for n in names),
                   key=lambda rel: (rel == common.META, rel))  # sentemb.json last
    for rel in files:
        os.makedirs(os.path.dirname(os.path.join(out_dir, rel)), exist_ok=True)
        os.replace(os.path.join(pending, rel), os.path.join(out_dir, rel))
        _pause()
    for root, _, _ in os.walk(out_dir):
        _fsync(root)
    shutil.rmtree(pending)


# ---------------------------------------------------------------- the dev curve -----------------
# OUT_DIR/dev.jsonl: one line per dev evaluation of the run, {"step", "metric", "score"}, in step
# order (SSCL Fig. 6 draws it: sscl.py --analyze --convergence). Rewritten whole at every
# evaluation, before the save of that step (a temporary file, fsync, one rename), so that a kill
# leaves the old curve or the new one; --resume drops the entries past the step it resumes from
# (a kill after the curve's write and before the checkpoint's), and evaluates them again.
CURVE = "dev.jsonl"


def write_curve(out_dir, entries):
    """OUT_DIR/dev.jsonl = entries, atomically."""
    path = os.path.join(out_dir, CURVE)
    text = "".join(json.dumps(e) + "\n" for e in entries).encode()
    try:
        common.write_whole(path, lambda f: f.write(text), _pause)
    except OSError as e:
        _save_failed(path, e)


def read_curve(run_dir, fix=None):
    """The entries of RUN_DIR/dev.jsonl; [] when there is none. A damaged file (a line that is not
    {"step": int, "metric": str, "score": number}) is one line naming it and fix."""
    path = os.path.join(run_dir, CURVE)
    if not os.path.isfile(path):
        return []
    fix = fix or "delete it (the curve restarts) or copy the run folder again"
    entries = []
    for i, line in enumerate(common.read_text(path).splitlines(), 1):
        try:
            e = json.loads(line)
        except ValueError:
            e = None
        if not (isinstance(e, dict) and _int(0)(e.get("step")) and isinstance(e.get("metric"), str)
                and isinstance(e.get("score"), (int, float)) and not isinstance(e["score"], bool)):
            common.die(f"{path} is damaged (line {i} is not "
                       '{"step": N, "metric": NAME, "score": X}): ' + fix)
        entries.append(e)
    return entries


_held = {}  # real path -> open lock file, for the run folders this process holds


def lock_run(out_dir):
    """An exclusive lock on OUT_DIR/.lock that lasts as long as this process (the kernel drops it
    when the process ends, however it ends). True when this process holds it, False when another
    process does."""
    key = os.path.realpath(out_dir)
    if key in _held:
        return True
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        return True
    try:
        f = open(os.path.join(out_dir, LOCK), "a+")
    except OSError as e:  # e.g. a folder of that name
        common.die(f"cannot open {os.path.join(out_dir, LOCK)} ({e.strerror}): delete it (it only "
                   "holds the pid of the run that writes the folder) and run again")
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
    """-> OUT_DIR/checkpoint.pt, once rank 0 has made sure that nothing already saved can be lost:
    the folder is not one of the input models and is writable; it is locked for this run; an
    interrupted save is completed; a folder that holds a run (sentemb.json or checkpoint.pt) needs
    --resume, and --resume needs a checkpoint. Other ranks wait for that (they read the checkpoint
    next)."""
    ckpt = os.path.join(out_dir, CKPT)
    if rank == 0:
        for m in models:
            if m and os.path.isdir(m) and os.path.isdir(out_dir) and os.path.samefile(m, out_dir):
                common.die(f"--output-dir '{out_dir}' is the input model '{m}': training would "
                           "overwrite its weights; pass another --output-dir")
        try:
            os.makedirs(out_dir, exist_ok=True)
            open(os.path.join(out_dir, ".write_test"), "w").close()
            os.remove(os.path.join(out_dir, ".write_test"))
        except OSError as e:
            common.die(f"cannot write to output folder '{out_dir}' ({e.strerror}): pass a "
                       "writable --output-dir")
        if not lock_run(out_dir):
            with open(os.path.join(out_dir, LOCK)) as f:
                pid = f.read().strip()
            common.die(f"'{out_dir}' is in use by another training run (pid {pid or '?'}): wait "
                       "for it to end, or pass another --output-dir")
        finish_save(out_dir)
        holds_run = os.path.exists(os.path.join(out_dir, common.META)) or os.path.exists(ckpt)
        if not resume and holds_run:
            common.die(f"'{out_dir}' already holds a run: pass --resume to continue it, or "
                       "another --output-dir")
        if not holds_run and any(os.path.exists(os.path.join(out_dir, f))
                                 for f in ("config.json", "adapter_config.json")):
            common.die(f"'{out_dir}' holds a model that is not a run of this project: pass a new "
                       "or empty --output-dir")
        if resume and not os.path.isfile(ckpt):
            common.die(f"--resume: no {ckpt}; drop --resume to start a new run")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return ckpt


def unmake_run(out_dir, before, existed):
    """A new run whose first save failed: the folder as it was before the run (the files it added
    go: the dev curve, the lock; a folder it made goes too)."""
    lock = _held.pop(os.path.realpath(out_dir), None)
    if lock:
        lock.close()
    for name in set(os.listdir(out_dir)) - (before or set()):
        path = os.path.join(out_dir, name)
        with contextlib.suppress(OSError):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if not existed:
        with contextlib.suppress(OSError):
            os.rmdir(out_dir)


def settle(run_dir):
    """Before reading a run folder: complete a save that a kill cut short after its commit point. If
    a training run holds the folder, it completes its own save within moments: wait for it."""
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
            common.die(f"'{run_dir}' holds an interrupted save that cannot be completed "
                       f"({e.strerror}): make the "
                       "folder writable and run again")
        time.sleep(0.1)
    common.die(f"'{run_dir}' is being saved by a training run: try again in a moment")


# ---------------------------------------------------------------- reading: every file checked ---
# Every model and run folder the scripts read is loaded here, and every way a file can be broken
# (missing, cut short, edited, another model's) is one line naming it: never a traceback, never a
# silently different model (random weights where a file lacks them, a base LLM without its adapter).
METHODS = ("sscl", "jtcse", "bellm")  # the only modules a run folder's sentemb.json may name
def _int(lo):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


_number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731


def _tower(t):  # a tower's folder inside the run folder: "." (a distilled tower) or one plain name
    return isinstance(t, str) and (t == "." or (t not in ("", "..") and os.path.basename(t) == t))


META_KEYS = {  # per method: the keys sentemb.json must hold, and the values each may take
    "sscl": {"pooler": ("cls", "avg").__contains__, "proj_dim": _int(0), "max_len": _int(1)},
    "jtcse": {"towers": lambda v: isinstance(v, list) and 1 <= len(v) <= 2 and all(map(_tower, v)),
              "max_len": _int(1)},
    "bellm": {"base_model": lambda v: isinstance(v, str) and v != "", "bi_layers": _int(0),
              "bi_mode": ("parallel", "sequential").__contains__,
              "prompt": lambda v: isinstance(v, str) and "{sentence}" in v},
}
_score = lambda v: v is None or _number(v)  # noqa: E731
_strs = lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)  # noqa: E731
META_OPTIONAL = {  # keys that older runs lack (then: the value the flag's default gives)
    "sscl": {"layers": lambda v: isinstance(v, list) and all(map(_int(1), v)),
             "objective": ("paper", "authors").__contains__,
             "select_on": ("stsb", "transfer").__contains__, "num_layers": _int(1),
             "step": _int(0), "stsb_dev": _score, "transfer_dev": _score},
    "jtcse": {"drop_layernorm": _int(0), "objective": (None, "paper", "authors").__contains__,
              "num_cael": lambda v: v is None or _int(0)(v), "step": _int(0), "stsb_dev": _score,
              "teacher": lambda v: v is None or isinstance(v, str) or _strs(v)},
    "bellm": {"bi_strategy": ("convert", "add").__contains__,
              "dtype": ("float32", "bfloat16").__contains__, "max_len": _int(1),
              "lora_r": _int(1), "lora_alpha": lambda v: _score(v) and v is not None and v > 0,
              "base_checksum": _number}}


def check_model(name):
    """What eval_sts.py loads, checked before any work: a run folder of ours (read_meta), a local
    model folder (config, tokenizer, whole weights), or a hub name (its config)."""
    if not os.path.isdir(name):
        from transformers import AutoConfig
        common.load_pretrained(AutoConfig, name)
    elif read_meta(name) is None:
        common.check_hf_folder(name, "model", f"cannot load '{name}'")
        common.check_hf_folder(name, "tokenizer", f"cannot load '{name}'")


def load_weights(module, path):
    """module.load_state_dict(torch.load(path)) for a small torch file of a run folder (sscl.py's
    proj.pt), or one line naming the file."""
    try:
        module.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as e:  # truncated, not a torch file, other keys or shapes
        common.die(f"cannot load {path} ({type(e).__name__}: {common.first_line(e)}): it is "
                   "damaged or "
                   f"another model's; {RECOPY}")


def needed_files(meta):
    """The files (paths relative to the run folder) that a run of meta's method needs besides
    sentemb.json: what its script saves and its load_encoder reads (BeLLM: the base model is named
    by base_model)."""
    if meta["method"] == "sscl":
        return list(HF_FILES) + (["proj.pt"] if meta["proj_dim"] else [])
    if meta["method"] == "jtcse":
        return [os.path.normpath(os.path.join(t, f)) for t in meta["towers"] for f in HF_FILES]
    return ["adapter_config.json", "adapter_model.safetensors"]


def read_meta(run_dir):
    """A run folder's sentemb.json (after settle()), or None when it has none. A damaged one (not
    JSON, a method other than ours, a key missing or of the wrong type) is a bad input, and so is a
    folder that lacks a file its method needs or holds a damaged one: it is never loaded as
    something else."""
    settle(run_dir)
    path = os.path.join(run_dir, common.META)
    if not os.path.isfile(path):
        return None
    try:
        meta = json.loads(common.read_text(path))
    except ValueError:
        meta = None
    method = meta.get("method") if isinstance(meta, dict) else None
    bad = ["method"] if method not in METHODS else [
        k for k, ok in META_KEYS[method].items() if k not in meta or not ok(meta[k])] + [
        k for k, ok in META_OPTIONAL.get(method, {}).items() if k in meta and not ok(meta[k])]
    if bad:
        said = f"method {method!r}" if bad == ["method"] and method is not None else \
            f"{', '.join(bad)} missing or of the wrong type" if method in METHODS else \
            "damaged or edited"
        common.die(f"{path} is not a run description of sscl.py, jtcse.py or bellm.py ({said}): "
                   "re-save the run, or delete the file to load the folder as a plain model")
    for rel in needed_files(meta):
        common.check_file(run_dir, rel, f"cannot load the {method}.py run in '{run_dir}'", RECOPY)
    check_meta(run_dir, meta)
    return meta


def check_meta(run_dir, meta):
    """Every value of a run's files against the weights and configuration it is applied to: the
    method's own check_run (its script knows its folder)."""
    importlib.import_module(METHODS[METHODS.index(meta["method"])]).check_run(run_dir, meta)


def load_run(run_dir, meta, device):
    """encode(list[str]) -> (N, H) of a run folder of ours (meta: its read_meta()), built by its
    method's load_encoder, the function its script evaluates with. The module is one of METHODS,
    never a name taken from the file."""
    import importlib
    module = importlib.import_module(METHODS[METHODS.index(meta["method"])])
    return module.load_encoder(run_dir, meta, device)


# settings that may change on --resume; any other difference is refused, listing the flags
RESUMABLE = {"resume", "lr", "epochs", "max_steps", "eval_steps", "log_steps", "final_eval",
             "data_dir", "output_dir", "bf16", "tasks", "eval_first", "quiet",
             "length_grouping", "grad_ckpt"}


def run_args(args):
    """The settings a checkpoint records; paths that exist are made absolute (a resume may start
    elsewhere)."""
    return {k: os.path.abspath(v) if isinstance(v, str) and os.path.exists(v) else v
            for k, v in vars(args).items()}


_dict, _tensor = (lambda v: isinstance(v, dict)), (lambda v: isinstance(v, torch.Tensor))
# torch's, Python's and NumPy's RNG states (Run.save); runs saved before: torch's alone
_rng = lambda v: _tensor(v) or (isinstance(v, (tuple, list)) and len(v) == 3)  # noqa: E731
STATE_KEYS = {  # what each script's checkpoint.pt holds (its state dict in main), and of what type
    "sscl": {"encoder": _dict, "opt": _dict, "sched": _dict, "rng": _rng},
    "jtcse": {"model": _dict, "opt": _dict, "rng": _rng, "r_gen": _tensor},
    "bellm": {"trainable": lambda v: isinstance(v, list), "opt": _dict, "sched": _dict,
              "rng": _rng}}
STATE_ALL = {"args": lambda v: _dict(v) and _number(v.get("lr")), "step": _int(0), "best": _number}


def load_state(path, method, args, device, defaults=None):
    """The training state of OUT_DIR/checkpoint.pt for --resume, or one line saying why it cannot be
    used: unreadable or of another structure (damaged), written by another script, or by a run with
    other settings. When the run has saved a best model, the folder must hold it whole
    (read_meta)."""
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # truncated, empty, not a torch file: torch raises many types
        common.die(f"--resume: {path} cannot be read ({type(e).__name__}); it is damaged: start "
                   "again without --resume in another --output-dir")
    if not isinstance(state, dict) or state.get("method", method) != method:
        common.die(f"--resume: {path} was not written by {method}.py: pass the --output-dir of a "
                   f"{method}.py run")
    checks = {**STATE_ALL, **STATE_KEYS[method]}
    if bad := [k for k, ok in checks.items() if k not in state or not ok(state[k])]:
        common.die(f"--resume: {path} is damaged ({', '.join(bad)} missing or of the wrong "
                   f"type; not the training state {method}.py writes): start again without "
                   "--resume in another --output-dir")
    old, new = state.get("args", {}), run_args(args)
    if not isinstance(old, dict):
        old = {}  # refused below: a state without its settings
    # a flag that the run predates: the run had its default (a flag is added with the default
    # that keeps the behaviour before it), so --resume compares with that
    predates = {k: v for k, v in (defaults or {}).items() if k in new and k not in old}
    old = {**predates, **old}
    # a flag that no longer exists is ignored where the run left it off (e.g. the former --loss-mix)
    changed = [k for k in old if k not in RESUMABLE and old[k] != new.get(k)
               and (k in new or old[k])]
    if changed:
        flag = lambda k, v: f"--{k.replace('_', '-')} {v}" + (  # noqa: E731
            " (its default: the run predates the flag)" if k in predates and v is old[k] else "")
        common.die("--resume: the run was started with "
                   f"{', '.join(flag(k, old[k]) for k in changed)}, this command says "
                   f"{', '.join(flag(k, new.get(k)) for k in changed)}: resume with the run's own "
                   "settings")
    if state["best"] > -float("inf"):  # a best model was saved with this state: it must be whole
        run_dir = os.path.dirname(path)
        meta, where = read_meta(run_dir), os.path.join(run_dir, common.META)
        if meta is None:
            common.die(f"--resume: {where} is missing, but the run has saved a best model: "
                       f"{RECOPY}")
        if meta["method"] != method:
            common.die(f"--resume: {where} describes a {meta['method']}.py run: pass the "
                       f"--output-dir of a {method}.py run")
    return state


def complete(state, total, out_dir):
    """--resume of a run that has reached its last step: one line that says so, and exit code 0
    (nothing is wrong and nothing is left to do; the folder is not touched)."""
    if state is None or state["step"] < total:
        return
    if os.environ.get("RANK", "0") == "0":
        at = f"step {total} of {total}" if state["step"] == total else \
            f"step {state['step']}, past the last step {total} of this command"
        print(f"the run is complete ({at}): nothing to train in '{out_dir}'; evaluate it with "
              f"eval_sts.py --model {out_dir}, or pass a larger --max-steps or --epochs with "
              "--resume to train on", flush=True)
    sys.exit(0)


def fit(load, what):
    """Load a checkpoint's tensors into the model; a mismatch is a foreign checkpoint, one line."""
    try:
        load()
    except (KeyError, RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
        common.die(f"--resume: the checkpoint does not fit {what} ({type(e).__name__}): pass the "
                   "--output-dir of a run "
                   "of this model and settings")


def resume_lr(opt, lr, state, log, sched=None):
    """A new --lr on --resume: the optimizer's groups (and a LambdaLR's base) take it from the
    resumed step on, and the log says so. The same lr as the run's: nothing to do."""
    if lr == state["args"].get("lr", lr):
        return
    for i, g in enumerate(opt.param_groups):
        g["initial_lr"] = lr
        g["lr"] = lr * (sched.lr_lambdas[i](sched.last_epoch) if sched else 1)
    if sched:
        sched.base_lrs = [lr] * len(opt.param_groups)
    log(f"--lr {lr:g} replaces the run's {state['args']['lr']:g} from step {state['step']} on")


class StopOnSignal(contextlib.AbstractContextManager):
    """SIGINT (Ctrl-C) and SIGTERM (a cluster's pre-emption): training stops at the next step
    boundary, saves its state and exits with 128 + the signal number; a second signal exits at once
    (every save is atomic, so that loses nothing already saved). The previous handlers come back on
    exit."""

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
        os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step (again: at once)\n"
                 .encode())

    def __call__(self, device, world):
        """True on every rank once any rank has had a signal (ranks must leave the loop at the same
        step)."""
        if world > 1:
            t = torch.tensor(self.signum, device=device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            self.signum = int(t)
        return bool(self.signum)

    def exit(self, step, out_dir):
        print(f"stopped at step {step} ({signal.Signals(self.signum).name}): the training state "
              f"is in {os.path.join(out_dir, CKPT)}; run the same command with --resume to "
              "continue", flush=True)
        sys.exit(128 + self.signum)

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------- the training harness ----------
def given(option):
    """Whether the command line names this option (as `--lr 1e-5` or `--lr=1e-5`)."""
    return any(x == option or x.startswith(option + "=") for x in sys.argv[1:])


class Run:
    """What a training script does besides its method, one call each, shared by sscl.py, jtcse.py
    and bellm.py: processes (torchrun), the run folder (lock, --resume checks), logging from rank 0,
    micro-batches, resuming, the NaN guard, evaluation on rank 0, atomic saves of the best model and
    the training state, and stopping at a step boundary on SIGINT/SIGTERM (saved, exit 128 +
    signal)."""

    def __init__(self, args, method, parser=None):
        self.args, self.method = args, method
        # each flag's default, for a checkpoint written before the flag existed (load_state)
        self.defaults = {a.dest: a.default for a in parser._actions} if parser else {}
        # torchrun: one process per GPU
        self.rank, self.world, self.device = common.init_distributed()
        self.state, self.step, self.best, self._lr, self._stop = None, 0, -float("inf"), None, None
        self.unsaved = None
        self.curve = []  # the dev curve so far (dev.jsonl)

    def open(self, inputs, total):
        """Lock --output-dir (refusing to overwrite an input model or another run) and, with
        --resume, read its training state (same script, same settings; a run already at its last
        step of `total` says so and exits 0). -> the learning rate: the resumed run's unless the
        command line gives --lr."""
        out = self.args.output_dir
        # a new run: what the folder held before (nothing, if it is new), restored if its first
        # save fails (unsaved)
        self.unsaved = None if self.args.resume or self.rank else (
            set(os.listdir(out)) if os.path.isdir(out) else None, os.path.isdir(out))
        path = open_run(out, self.args.resume, inputs, self.rank)
        if self.args.resume:
            self.state = load_state(path, self.method, self.args, self.device, self.defaults)
            complete(self.state, total, self.args.output_dir)
            self.step, self.best = self.state["step"], self.state["best"]
            self.curve = self.resume_curve() if self.rank == 0 else []
        resumed = self.state and not given("--lr")
        self._lr = self.state["args"]["lr"] if resumed else self.args.lr
        return self._lr

    def resume_curve(self):
        """--resume: dev.jsonl's entries up to the resumed step; the file is rewritten at once
        when it holds later ones (evaluated after the checkpoint, which a kill then prevented)."""
        fix = "delete it to resume with the curve restarting here, or copy the run folder again"
        curve = read_curve(self.args.output_dir, fix=fix)
        kept = [e for e in curve if e["step"] <= self.step]
        if len(kept) < len(curve):
            write_curve(self.args.output_dir, kept)
        return kept

    def log(self, msg):
        if self.rank == 0:
            print(msg, flush=True)

    def start(self, text):
        """The run's first log line: text, then the processes and the device (and what --bf16
        means on it)."""
        bf16 = f" ({common.bf16_note(self.device)})" if self.args.bf16 else ""
        self.log(f"{text}, {self.world} process(es), device {self.device}{bf16}")

    def wrap(self, module):
        """The module DDP runs under torchrun (gradients averaged over the ranks); itself on one
        process."""
        return module if self.world == 1 else torch.nn.parallel.DistributedDataParallel(module)

    def rows(self, step_rows, k, batch_size):
        """This rank's rows of micro-batch k (a step's rows hold every rank's micro-batches)."""
        start = (k * self.world + self.rank) * batch_size
        return step_rows[start:start + batch_size]

    def sync(self, ddp, k, grad_accum):
        """Gradients are all-reduced once, after the last micro-batch of a step."""
        last = self.world == 1 or k == grad_accum - 1
        return contextlib.nullcontext() if last else ddp.no_sync()

    def resume(self, what, **objects):
        """With --resume, each object (model, optimiser, scheduler: load_state_dict; a
        torch.Generator: set_state; a list of tensors: copied) takes its saved state, as do torch's,
        Python's and NumPy's RNGs; a new --lr applies from here. From now on SIGINT/SIGTERM stop the
        run at the next step boundary, saved. what: named in the error line of a checkpoint that
        does not fit."""
        if self.state:
            def load():
                for name, obj in objects.items():
                    if isinstance(obj, torch.Generator):
                        obj.set_state(self.state[name])
                    elif isinstance(obj, list):  # tensors (e.g. LoRA weights), copied in place
                        if len(obj) != len(self.state[name]):
                            raise ValueError(
                                f"{len(self.state[name])} saved tensors, {len(obj)} here")
                        for q, v in zip(obj, self.state[name]):
                            q.data.copy_(v)
                    else:
                        obj.load_state_dict(self.state[name])
            fit(load, what)
            rng = self.state["rng"]
            if isinstance(rng, (tuple, list)):  # torch, Python and NumPy
                torch.set_rng_state(rng[0]), random.setstate(rng[1]), np.random.set_state(rng[2])
            else:  # runs saved before the other two were recorded
                torch.set_rng_state(rng)
            if "opt" in objects:
                resume_lr(objects["opt"], self._lr, self.state, self.log, objects.get("sched"))
        self._stop = StopOnSignal().__enter__()

    def steps(self, total):
        """Step numbers, each = the optimisation steps done: 0 for a new run (the model as loaded),
        then 1..total; a resumed run continues after its saved step. run.step follows."""
        self._clock = (time.perf_counter(), self.step)
        for step in range(self.step + 1 if self.state else 0, total + 1):
            self.step = step
            yield step

    def check_finite(self, loss):
        """The NaN guard, before opt.step(): the weights and the run folder are still the last good
        ones."""
        if not torch.isfinite(loss):
            common.die(f"loss became {loss.item()} at step {self.step}: resume with a lower --lr "
                       f"(now {self._lr:g}; --resume --lr ...) or check the data; "
                       f"the run in {self.args.output_dir} is kept")

    def log_step(self, text, rows, unit="sent", tokens=None):
        """'step N  <text>  sent/s X [tok/s Y]': rows (real tokens) per second of all ranks since
        the last such line or evaluation."""
        t0, s0 = self._clock
        dt = time.perf_counter() - t0
        line = f"step {self.step:>5}  {text}  {unit}/s {rows * (self.step - s0) / dt:.2f}"
        if tokens is not None:
            n = torch.tensor(float(tokens), device=self.device)
            if self.world > 1:
                torch.distributed.all_reduce(n)
            line += f"  tok/s {n.item() / dt:.0f}"
        self.log(line)
        self._clock = (time.perf_counter(), self.step)

    def evaluate(self, model, score, *args):
        """score(*args) on rank 0, the model in eval mode (None on the other ranks); not counted as
        training time."""
        if self.rank != 0:
            return None
        model.eval()
        dev = score(*args)
        model.train()
        return dev

    def save(self, state, params, dev=None, write=None, metric="stsb_dev", **meta):
        """Rank 0 writes the training state (state + method, args, step, best, RNGs) to
        checkpoint.pt and, when dev is a new best, the model too (write(folder), and sentemb.json =
        meta), atomically, as one; weights that are no longer finite are never saved. All ranks
        wait. With dev: first the dev curve (dev.jsonl: step, metric, score), then a log line."""
        if self.rank == 0:
            if dev is not None:
                self.curve.append({"step": self.step, "metric": metric, "score": dev})
                write_curve(self.args.output_dir, self.curve)
            new_best = dev is not None and dev > self.best
            self.best = dev if new_best else self.best
            full = {**state, "method": self.method, "args": {**run_args(self.args), "lr": self._lr},
                    "step": self.step, "best": self.best,
                    "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state())}
            try:
                if new_best:
                    save_best(self.args.output_dir, write, full, params, method=self.method,
                              **meta)
                else:
                    save_state(full, self.args.output_dir, params)
            except SystemExit:  # the save failed and said so: a new run leaves no file behind
                if self.unsaved:
                    unmake_run(self.args.output_dir, *self.unsaved)
                raise
            self.unsaved = None
            if dev is not None:
                self.log(f"step {self.step:>5}  {metric} {dev:.2f}  (best {self.best:.2f})")
        if self.world > 1:
            torch.distributed.barrier()
        self._clock = (time.perf_counter(), self.step)

    def stopping(self):
        """True on every rank once any rank has had SIGINT/SIGTERM: save this step and leave the
        loop."""
        return self._stop(self.device, self.world)

    def end(self):
        """After the loop: the peak memory; a stop by signal exits (128 + signal) with the --resume
        hint; otherwise a signal now ends the process at once (nothing is left to save)."""
        self.log(peak_memory(self.device, self.world))
        if self._stop.signum:
            self._stop.exit(self.step, self.args.output_dir)
        self._stop.now = True

    def final_eval(self, data, tasks=common.TASKS, cpu_bf16=False):
        """With --final-eval (the default), on rank 0: the best checkpoint, loaded as eval_sts.py
        loads it, on the test sets."""
        if not self.args.final_eval or self.rank != 0:
            return
        from eval_sts import load_encoder
        encode = load_encoder(self.args.output_dir, device=self.device)
        print(f"the best checkpoint (dev {self.best:.2f}) on the test sets:")
        with common.autocast(self.device, cpu_bf16):
            print(common.format_table(common.evaluate(encode, data, tasks)))


def peak_memory(device, world):
    """The process's peak memory, for the last log line."""
    rank0 = ", rank 0" if world > 1 else ""
    if device.type == "cuda":
        gib = torch.cuda.max_memory_allocated(device) / 2**30
        return f"peak memory {gib:.2f} GiB (torch.cuda.max_memory_allocated{rank0})"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    return f"peak memory {kib / 2**20:.2f} GiB (ru_maxrss{rank0})"


def save_sentence_transformers(folder, hidden, pooling, max_len, dense=None):
    """The small files sentence-transformers reads beside a plain HF model (its classic layout,
    which v2 to v6 load), so that SentenceTransformer(folder) encodes as we evaluate: Transformer
    (no truncation below max_len) -> Pooling (pooling: "cls" or "mean") [-> Dense, the linear
    projection `dense`]. No normalisation: cosine similarity does not need it."""
    modules = ([("", "Transformer"), ("1_Pooling", "Pooling")]
               + ([("2_Dense", "Dense")] if dense is not None else []))
    files = {"modules.json": [{"idx": i, "name": str(i), "path": path,
                               "type": f"sentence_transformers.models.{kind}"}
                              for i, (path, kind) in enumerate(modules)],
             "sentence_bert_config.json": {"max_seq_length": max_len, "do_lower_case": False},
             "1_Pooling/config.json": {"word_embedding_dimension": hidden,
                                       "pooling_mode_cls_token": pooling == "cls",
                                       "pooling_mode_mean_tokens": pooling == "mean",
                                       "pooling_mode_max_tokens": False,
                                       "pooling_mode_mean_sqrt_len_tokens": False}}
    if dense is not None:
        files["2_Dense/config.json"] = {"in_features": dense.in_features,
                                        "out_features": dense.out_features,
                                        "bias": dense.bias is not None,
                                        "activation_function": "torch.nn.modules.linear.Identity"}
        from safetensors.torch import save_file
        os.makedirs(os.path.join(folder, "2_Dense"))
        save_file({f"linear.{k}": v.detach().contiguous().cpu()
                   for k, v in dense.state_dict().items()},
                  os.path.join(folder, "2_Dense", "model.safetensors"))
    for name, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=2)
