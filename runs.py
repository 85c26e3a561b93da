"""Reading the run folders of sscl.py, jtcse.py and bellm.py, for the tools (eval_sts.py, the
analyses); each script writes and resumes its own. read_meta completes a save that a kill cut short
after its commit point, then hands the folder to its method's check_run (its script knows what its
files must agree on), and load_run to its load_encoder: a broken or edited folder is one line
naming the file, never a traceback and never another model.
"""
import contextlib
import importlib
import json
import os
import shutil
import time

import common

# the names of a run folder's files, as the scripts write them (their harness)
CKPT, CURVE, STAGING, PENDING, LOCK = ("checkpoint.pt", "dev.jsonl", ".best.staging",
                                       ".best.pending", ".lock")
METHODS = ("sscl", "jtcse", "bellm")  # the only modules a run folder's sentemb.json may name


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
# RUN/dev.jsonl: one line per dev evaluation of the run, {"step", "metric", "score"}, in step order
# (SSCL Fig. 6 draws it: sscl_analysis.py --convergence). Each script rewrites it whole at every
# evaluation, and --resume drops the entries past the step it resumes from.


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
        if not (isinstance(e, dict) and type(e.get("step")) is int and e["step"] >= 0
                and isinstance(e.get("metric"), str) and type(e.get("score")) in (int, float)):
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


def check_model(name):
    """What eval_sts.py loads, checked before any work: a run folder of ours (read_meta), a local
    model folder (config, tokenizer, whole weights), or a hub name (its config)."""
    if not os.path.isdir(name):
        from transformers import AutoConfig
        common.load_pretrained(AutoConfig, name)
    elif read_meta(name) is None:
        common.check_hf_folder(name, "model", f"cannot load '{name}'")
        common.check_hf_folder(name, "tokenizer", f"cannot load '{name}'")


def read_meta(run_dir):
    """A run folder's sentemb.json (after settle()), or None when it has none. A damaged one (not
    JSON, a method other than ours) is a bad input, and so is anything its method's check_run
    refuses (a key missing or of the wrong type, a file missing or damaged, a value the weights
    cannot have): it is never loaded as something else."""
    settle(run_dir)
    path = os.path.join(run_dir, common.META)
    if not os.path.isfile(path):
        return None
    try:
        meta = json.loads(common.read_text(path))
    except ValueError:
        meta = None
    method = meta.get("method") if isinstance(meta, dict) else None
    if method not in METHODS:
        said = f"method {method!r}" if method is not None else "damaged or edited"
        common.die(f"{path} is not a run description of sscl.py, jtcse.py or bellm.py ({said}): "
                   "re-save the run, or delete the file to load the folder as a plain model")
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
    module = importlib.import_module(METHODS[METHODS.index(meta["method"])])
    return module.load_encoder(run_dir, meta, device)
