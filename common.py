"""What sscl.py, jtcse.py and bellm.py share with each other and with the tools (eval_sts.py, the
analyses, bench/), and no equation of a paper: finding the data and reading training text;
range-checked argument types; loading a model folder (every file checked, one line naming a broken
one); tokenisation, length groups and batched encoding; the sentence-transformers files of a saved
model; the STS evaluation (STS12-16 in SentEval's "all" setting, STS-B test, SICK-R test; Spearman
x 100); the training process around a method (torchrun, signals, micro-batches, the file-system
steps of a save, the folder locks). It imports no module of the project: each script needs only
this file beside it. A run folder's format (checkpoint.pt, best/) is each script's harness, which
eval_sts.py reads run folders with.

The evaluator takes any `encode(list[str]) -> Tensor (N, H)`; each method passes its own, so the
numbers printed during training and by eval_sts.py come from the same function.
"""
import argparse
import atexit
import codecs
import contextlib
import csv
import functools
import io
import json
import math
import os
import random
import re
import resource
import signal
import sys
import time

import numpy as np
import torch
from scipy.stats import spearmanr
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R"]
STS_SUBSETS = {  # SentEval's subsets (STS13 SMT is withheld by its licence, as in SentEval)
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}
# holds senteval.tar, wiki1m_for_simcse.txt, nli_for_simcse.csv
HUB_DATASET = "princeton-nlp/datasets-for-simcse"
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "sentemb")
META = "sentemb.json"  # in every saved model of ours (RUN/best): how eval_sts.py must encode it


def die(msg):
    """Bad input: one line that names the fix, exit code 2, no traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def write_whole(path, write, pause=None):
    """Replace the file at path whole: write(f) fills a temporary file in the same folder (binary),
    which is synced and renamed over path, and the folder synced. A kill or a full disk at any
    instant leaves the old file or the new one, never a mix; on an error the temporary file is
    removed and the error raised again. pause(): called before the sync (tests aim kills there)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if pause:
                pause()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync(os.path.dirname(os.path.abspath(path)))  # the rename on disk
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


QUIET = False  # --quiet: no progress bars


def progress(iterable, desc, total=None, unit="it"):
    """A progress bar (tqdm, on stderr) for loops that can take more than ~10 s on a CPU. It is off
    when stderr is not a terminal (logs stay parseable) and with --quiet."""
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=False, file=sys.stderr,
                disable=True if QUIET else None)


def pick_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bf16_note(device):
    """For the start-up line with --bf16: whether this CPU has the instructions that make bf16
    faster."""
    if device.type != "cpu":
        return "bf16 autocast"
    has = [n for n, f in (("AVX512-BF16", "_is_avx512_bf16_supported"),
                          ("AMX", "_is_amx_tile_supported"))
           if getattr(torch.cpu, f, lambda: False)()]
    return (f"bf16 autocast; this CPU has {' and '.join(has)}" if has else
            "bf16 autocast, but this CPU has no AVX512-BF16 or AMX: expect it to be slower than "
            "fp32")


def device_line(world, device, bf16=False):
    """The start-up line's end: '1 process(es), device cpu', and with --bf16 what autocast does
    there (bf16_note)."""
    return f"{world} process(es), device {device}" + (f" ({bf16_note(device)})" if bf16 else "")


def autocast(device, cpu_bf16=False):
    """bf16 autocast on CUDA; on CPU plain fp32, unless cpu_bf16 (--bf16: for CPUs with bf16
    instructions)."""
    if device.type == "cuda" or cpu_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def decay_groups(model, weight_decay):
    """HF Trainer's AdamW parameter groups: the trained weights decay by weight_decay, but biases
    and norm weights (LayerNorm, RMSNorm) do not (transformers 4.2.1's trainer.py L553:
    `no_decay = ["bias", "LayerNorm.weight"]`; 4.38's L962-970, by the norm's type)."""
    norms = {id(q) for m in model.modules() if "norm" in type(m).__name__.lower()
             for q in m.parameters(recurse=False)}
    groups = ([], [])  # decayed, not decayed
    for name, q in model.named_parameters():
        if q.requires_grad:
            groups["bias" in name or id(q) in norms].append(q)
    return [{"params": g, "weight_decay": wd} for g, wd in zip(groups, (weight_decay, 0.0)) if g]


def clip_gradients(params, max_norm):
    """The gradients' global 2-norm before clipping, after scaling them to max_norm if it exceeds
    it (HF Trainer's torch.nn.utils.clip_grad_norm_, in its two halves; max_norm 0: measured only,
    no pass over the gradients). Under torchrun the gradients are the all-reduced ones, so the
    norm is the global batch's."""
    params = [q for q in params if q.grad is not None]
    norm = torch.nn.utils.get_total_norm([q.grad for q in params])
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


# ---------------------------------------------------------------- multi-GPU (torchrun) ----------


def rng_states():
    """The random-number states a run saves: torch's (CPU), Python's, NumPy's."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def set_rng_states(rng):
    torch.set_rng_state(rng[0].cpu())  # map_location may have put it on the device
    random.setstate(rng[1])
    np.random.set_state(rng[2])


def world_size():
    """The number of processes training (torchrun's world; 1 without it)."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def collective(call, /, *tensors, **options):
    """call(*tensors), a torch.distributed collective, returned once gloo's worker thread has let
    go of the tensors. One whose Python object is gone while that thread holds it is freed there,
    under the GIL: if the interpreter is exiting by then, the process aborts ("terminate called
    without an active exception"); DDP keeps gloo's threads alive to the end. NCCL's work is held
    by its watchdog, which destroy_process_group stops at exit."""
    call(*tensors, **options)
    held = [t for x in tensors for t in (x if isinstance(x, list) else [x])]
    if held and held[0].device.type == "cpu":
        while any(t._use_count() > 1 for t in held):  # 1: its Python object's reference alone
            time.sleep(1e-4)


def gather(z):
    """(B, D) on each rank -> (world·B, D), ranks in order. all_gather returns tensors without a
    graph, so the local slot is replaced by z itself: gradients flow into this rank's embeddings."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return z
    parts = [torch.empty_like(z) for _ in range(dist.get_world_size())]
    collective(dist.all_gather, parts, z.detach().contiguous())
    parts[dist.get_rank()] = z
    return torch.cat(parts)


# adapter_config.json: what bellm.py trains (plain LoRA on every Linear); any other value of these
# would run another model than the one trained
LORA_FIXED = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "bias": "none",
              "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
              "modules_to_save": None, "layers_to_transform": None, "layer_replication": None,
              "lora_bias": False, "trainable_token_indices": None, "target_parameters": None}


def check_lora_config(lora_path, meta, path, where, fix):
    """A bellm.py run's adapter_config.json: plain LoRA as bellm.py trains it, its r and alpha
    those of sentemb.json (meta, at path), or one line naming the key."""
    lora = read_json(lora_path, where, fix)
    ok = {"r": lambda v: type(v) is int and v >= 1,
          "lora_alpha": lambda v: type(v) in (int, float) and v > 0,
          **{k: (lambda x, v=v: x == v or x is None and not v) for k, v in LORA_FIXED.items()}}
    for key, good in ok.items():
        if key in lora and not good(lora[key]):
            want = "an integer >= 1" if key == "r" else "a number > 0" if key == "lora_alpha" \
                else json.dumps(LORA_FIXED[key])
            die(f"{lora_path}: {key} {json.dumps(lora[key])} is not what bellm.py trains ({key} "
                f"{want}): set it so, or {fix}")
    for key, ours in (("lora_r", "r"), ("lora_alpha", "lora_alpha")):
        if key in meta and lora.get(ours) != meta[key]:
            die(f"{lora_path}: {ours} {json.dumps(lora.get(ours))} disagrees with {path}'s {key} "
                f"{meta[key]} (bellm.py --{key.replace('_', '-')}): set it to {meta[key]}, or "
                f"{fix}")


# ---------------------------------------------------------------- bellm.py's memory estimate ----
def memory_estimate(dec, n_lora, s, tokens, longest, r, grad_ckpt):
    """GiB of one training step, estimated from the config: (weights, LoRA + gradients + AdamW
    moments in fp32, activations kept for the backward). Activations, bytes a token a layer
    (counted with saved-tensor hooks on LLaMA configs; RMSNorm and the LoRA path keep fp32 copies,
    so bf16 does not halve them): A = α·H + β·I + 28·r + heads·L·(4 or 6), α = 68 / 62 and
    β = 20 / 14 for fp32 / bf16 (s = 4 / 2 bytes). With checkpointing: each layer keeps only its
    input (s·H) and one layer is recomputed at a time."""
    c, n = dec.config, len(dec.layers) + len(getattr(dec, "bellm_added", []))
    A = (68 if s == 4 else 62) * c.hidden_size + (20 if s == 4 else 14) * c.intermediate_size \
        + 28 * r + c.num_attention_heads * longest * (4 if s == 4 else 6)
    act = tokens * (n * s * c.hidden_size + A if grad_ckpt else n * A)
    weights = sum(q.numel() * q.element_size() for q in dec.parameters() if not q.requires_grad)
    return weights / 2**30, 16 * n_lora / 2**30, act / 2**30


def memory_line(dec, params, r, texts, longest, bf16, grad_ckpt):
    """The start-up line: a step's memory, estimated (docs/operations.md); bf16: bf16 weights or
    autocast (2 bytes a value, mostly)."""
    s, n = 2 if bf16 else 4, sum(q.numel() for q in params)
    est = [memory_estimate(dec, n, s, texts * longest, longest, r, c) for c in (0, 1)]
    per_tok = [e[2] * 2**20 / (texts * longest) for e in est]  # KiB a token
    w, o, act = est[grad_ckpt]
    return (f"memory (estimate): weights {w:.2f} GiB, LoRA + AdamW {o:.2f} GiB, activations "
            f"{per_tok[0]:,.0f} KiB a token ({per_tok[1]:,.0f} with --grad-ckpt): {act:.2f} GiB "
            f"for {texts} x {longest} tokens {'with' if grad_ckpt else 'without'} checkpointing; "
            f"{w + o + act:.2f} GiB in all")


# ---------------------------------------------------------------- the training process ----------
# What every script's loop calls around the method: torchrun, signals, micro-batches, and the
# file-system steps of a save (its harness holds the run folder's format).
STOP = {"signum": 0, "now": False, "writes": 0}  # SIGINT/SIGTERM: stop at the next step, saved
CKPT, BEST, LOCK = "checkpoint.pt", "best", ".lock"  # a run folder's names (the harness's format)


def start():
    """One process, or one of torchrun's (NCCL on GPUs, gloo on CPUs). -> rank, world size, device,
    log (print on rank 0, flushed; nothing on the other ranks)."""
    STOP.update(signum=0, now=False, writes=0)
    rank, world, device = 0, 1, pick_device()
    if "RANK" in os.environ:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(torch.distributed.destroy_process_group)  # before the interpreter goes
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
    log = functools.partial(print, flush=True) if rank == 0 else lambda *_, **__: None
    return rank, world, device, log


def catch_signals():
    """SIGINT (Ctrl-C) and SIGTERM stop training at the next step, saved; a second one, or one
    after training, exits at once. -> the handlers replaced (restore_signals puts them back)."""
    return {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def _on_signal(signum, frame):
    if STOP["signum"] or STOP["now"]:  # a second signal, or none is needed: out at once
        os.write(2, f"\n{signal.Signals(signum).name}: stopped\n".encode())
        os._exit(128 + signum)
    STOP["signum"] = signum
    os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step (again: at "
             "once)\n".encode())


def restore_signals(handlers):
    for s, h in handlers.items():
        signal.signal(s, h)


def stop_requested(world, device):
    """Whether a signal asked training to stop; with torchrun, a signal on any rank stops every rank
    at the same step."""
    if world > 1:
        t = torch.tensor(STOP["signum"], device=device)
        collective(torch.distributed.all_reduce, t, op=torch.distributed.ReduceOp.MAX)
        STOP["signum"] = int(t)
    return bool(STOP["signum"])


def ddp(model, world):
    """The model as training runs it: wrapped by DDP under torchrun (gradients averaged over the
    ranks), itself on one process."""
    return torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model


def micro_batches(rows, batch_size, grad_accum, rank, world):
    """One optimisation step's rows (every rank's micro-batches) -> this rank's grad_accum
    micro-batches, each as (rows, whether it is the step's last: DDP all-reduces after it)."""
    return [(rows[(k * world + rank) * batch_size:][:batch_size], k == grad_accum - 1)
            for k in range(grad_accum)]


def no_sync(model, last):
    """DDP all-reduces the gradients only after a step's last micro-batch."""
    return contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()


def check_loss(loss, step, lr, out_dir):
    """The NaN guard, before the optimiser step: the weights saved are still good."""
    if not torch.isfinite(loss):
        die(f"loss became {loss.item()} at step {step}: resume with a lower --lr (now {lr:g}; "
            f"--resume --lr ...) or check the data; the run in {out_dir} is kept")


def dev_eval(model, score, *args):
    """score(*args) with the model in eval mode (no dropout), then back in training mode."""
    model.eval()
    try:
        return score(*args)
    finally:
        model.train()


def saved(world, step, clock):
    """Every rank waits for rank 0's save. -> the clock, restarted after it"""
    if world > 1:
        torch.distributed.barrier()
    return new_clock(step, clock)


def stopped(step, out_dir, log):
    """Training stopped by a signal, saved at this step: what to do. -> the exit code, 128 + the
    signal's number (130 for Ctrl-C, 143 for SIGTERM)"""
    log(f"stopped at step {step} ({signal.Signals(STOP['signum']).name}): the training state is "
        f"in {os.path.join(out_dir, CKPT)}; run the same command with --resume to continue")
    return 128 + STOP["signum"]


def pause():
    """Each instant between two writes of a save. Tests aim kills here: SENTEMB_SAVE_PAUSE=seconds
    sleeps; SENTEMB_KILL_AT=N sends SIGKILL to this process at its N-th such instant."""
    STOP["writes"] += 1
    if STOP["writes"] == int(os.environ.get("SENTEMB_KILL_AT", 0)):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("SENTEMB_SAVE_PAUSE", 0)))


def fsync(path):
    """A file's data, or a folder's entries (renames), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flock(f, *how):
    """An advisory lock on an open file or folder (flock: the kernel drops it when the file is
    closed or the process ends, however it ends); how: "EX" or "SH", and "NB" not to wait. ->
    False when NB and another process holds it. Windows has none: always True."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        fcntl.flock(f, sum(getattr(fcntl, "LOCK_" + h) for h in how))
        return True
    except BlockingIOError:
        return False


def lock_run(out_dir):
    """OUT_DIR (made if need be), locked for one training run: an exclusive lock on OUT_DIR/.lock,
    which holds the pid, for as long as the file returned is open; one line when the folder is not
    writable or another run holds it."""
    path = os.path.join(out_dir, LOCK)
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(path, "a+")
    except OSError as e:
        die(f"cannot write '{path}' ({e.strerror}): pass a writable --output-dir (a folder named "
            f"{LOCK} in it: delete it)")
    if not flock(lock, "EX", "NB"):
        die(f"'{out_dir}' is in use by another training run (pid {open(path).read().strip() or '?'}"
            "): wait for it to end, or pass another --output-dir")
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def save_id(folder):
    """The save that a model folder of ours holds (its sentemb.json's "save"; None: unreadable)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        with open(os.path.join(folder, META)) as f:
            return json.load(f).get("save")


def flags(a):
    """The command's flags, its paths absolute."""
    return {k: os.path.abspath(v) if isinstance(v, str) and os.path.exists(v) else v
            for k, v in vars(a).items()}


def complete(step, steps, out_dir):
    """--resume of a run with nothing left to train (exit 0, the folder untouched): what to do."""
    return (f"the run is complete (step {step} of {steps}): nothing to train in '{out_dir}'; "
            f"evaluate it with eval_sts.py --model {out_dir}, or pass a larger --max-steps or "
            "--epochs with --resume to train on")


def save_failed(e, out_dir):
    """A save that failed (a full disk): one line."""
    full = getattr(e, "errno", None) == 28 or any(s in str(e) for s in (
        "unexpected pos", "file write failed", "os error 28", "No space left"))  # torch's, Rust's
    reason = "No space left on device" if full else getattr(e, "strerror", None) or str(e)
    die(f"cannot save in {out_dir} ({reason}): free disk space or pass another --output-dir;"
        " what was saved before is kept, and --resume continues from it")


def check_keys(path, meta, required, optional):
    """sentemb.json's keys (required, and optional ones older runs lack), each of its type: one
    line naming those that are not."""
    if bad := [k for k, ok in required.items() if k not in meta or not ok(meta[k])] + [
            k for k, ok in optional.items() if k in meta and not ok(meta[k])]:
        die(f"{path} is not a run description of sscl.py, jtcse.py or bellm.py ({', '.join(bad)} "
            "missing or of the wrong type): re-save the run, or delete the file to load the "
            "folder as a plain model")


def sync_tree(folder):
    """Every file of a folder written, then the folders' entries, on the disk (pause() between)."""
    for root, _, files in os.walk(folder):
        for name in files:
            fsync(os.path.join(root, name))
            pause()
        fsync(root)


@contextlib.contextmanager
def folder_lock(folder, how):
    """A lock on the folder itself while inside: "EX" while a save swaps best/, "SH" while a reader
    loads it (a reader never sees a mix of two saves)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        flock(fd, how)
        yield
    finally:
        os.close(fd)


def run_of(name):
    """What NAME is to a reader: (method, run folder, model folder) for a run of sscl.py, jtcse.py
    or bellm.py: a run folder (its checkpoint.pt, best/) or its best/ (the run folder is settled
    before best/ is read), or a folder with a sentemb.json (a copy of best/, a run folder saved
    before best/ existed; run folder None); None for anything else (a plain model)."""
    run = os.path.dirname(os.path.abspath(name)) if os.path.basename(os.path.abspath(name)) == \
        BEST and os.path.isfile(os.path.join(name, "..", CKPT)) else name
    if os.path.isdir(os.path.join(run, BEST)) or os.path.isfile(os.path.join(run, CKPT)) \
            and not os.path.isfile(os.path.join(run, META)):
        try:
            with open(os.path.join(run, BEST, META)) as f:
                method = json.load(f)["method"]
        except Exception:  # no best model yet (or a damaged one): the checkpoint names it
            try:
                method = torch.load(os.path.join(run, CKPT), map_location="cpu", mmap=True,
                                    weights_only=False)["method"]
            except Exception as e:
                die(f"'{run}' is a run folder without a readable best/{META} or {CKPT} "
                    f"({type(e).__name__}): copy the whole run folder again, or train again")
        return method, run, os.path.join(run, BEST)
    if os.path.isfile(os.path.join(name, META)):
        try:
            return json.loads(read_text(os.path.join(name, META)))["method"], None, name
        except Exception:
            return "?", None, name  # the reader names the damaged file
    return None


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
    Order: --data-dir, then $SENTEMB_DATA, then ~/.cache/sentemb/senteval (downloaded when
    missing)."""
    root = flag or os.environ.get("SENTEMB_DATA") or os.path.join(CACHE, "senteval")
    for d in (os.path.join(root, "downstream"), root):  # accept the folder itself or its parent
        if os.path.isdir(os.path.join(d, "STS")) and os.path.isdir(os.path.join(d, "SICK")):
            return d
    if not flag and not os.environ.get("SENTEMB_DATA") and (tar := _from_hub("senteval.tar")):
        import tarfile
        with tarfile.open(tar) as t:
            t.extractall(root, filter="data")
        return senteval_dir(root)
    die(f"no STS data in '{root}': pass --data-dir DIR or set SENTEMB_DATA=DIR, where "
        "DIR/downstream/STS/STS12-en-test/... and DIR/downstream/SICK/... are SimCSE's "
        "senteval.tar, unpacked")


def check_sts(data, tasks=TASKS):
    """Read every evaluation file now (STS-B dev and the tasks' test sets), so that a malformed one
    stops a training run before it starts rather than at its final table."""
    load_sts(data, "STS-B", "dev")
    for t in tasks:
        load_sts(data, t)
    return data


def train_file(path, hub_name):
    """A training file given on the command line, or SimCSE's default downloaded from the hub."""
    if path and os.path.isfile(path):
        return path
    if path and os.path.isdir(path):
        die(f"training file '{path}' is a folder: pass --train FILE, a file inside it")
    if not path and (got := _from_hub(hub_name)):
        return got
    die(f"training file '{path or hub_name}' not found: pass --train FILE "
        f"(SimCSE's {hub_name} from the hub dataset {HUB_DATASET}, or any file in its format)")


def read_text(path):
    """A whole UTF-8 text file, newlines translated as open() in text mode does, without the
    byte-order mark that spreadsheet programs write first; anything else is a bad input naming the
    file and the line."""
    try:
        with open(path, "rb") as f:
            raw = f.read().removeprefix(codecs.BOM_UTF8)
    except OSError as e:
        die(f"cannot read '{path}' ({e.strerror}): pass a readable file")
    try:
        return raw.decode("utf8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        die(f"'{path}', line {line}: not UTF-8 text; convert the file to UTF-8 "
            "(e.g. iconv -f latin1 -t utf8)")


def env_input(var, default, kind="model"):
    """An input that an environment variable names (bench/: MINILM, SMOLLM, WIKI, NLI), checked as
    a flag's is: a file (kind "file"), or a model folder or hub name (a path that is not a folder:
    one line naming the variable). -> its value"""
    value = os.environ.get(var, default)
    if kind == "file" and not os.path.isfile(value):
        die(f"{var}='{value}' is not a file: set {var} to the training file")
    if kind == "model" and not os.path.isdir(value) and (
            os.path.exists(value) or value.startswith((".", "/", "~")) or value.count("/") > 1):
        die(f"{var}='{value}' is not a model folder: set {var} to one, or to a hub name")
    return value


def env_rows(var, default, n, read):
    """The first n rows of the training file an environment variable names (bench/: WIKI, NLI),
    read(path) -> its rows; a missing or shorter file is one line naming the variable."""
    path = env_input(var, default, "file")
    if len(rows := read(path)) < n:
        die(f"{var}='{path}' has {len(rows)} rows; {n} are needed here: set {var} to a longer file")
    return rows[:n]


def read_sentences(path):
    """One sentence per line; blank lines are skipped; a file with no sentence is an error."""
    sents = [line.strip() for line in read_text(path).split("\n") if line.strip()]
    if not sents:
        die(f"'{path}' has no sentences: pass a --train file with one sentence per line")
    return sents


def finite(text):
    """float(text), refusing nan and inf as ValueError."""
    if not math.isfinite(v := float(text)):
        raise ValueError(text)
    return v


def read_csv(path):
    """bellm.py's --train and C-STS files: NLI triplets (sent0, sent1, hard_neg) or C-STS rows
    (sentence1, sentence2, condition, label); an empty or missing cell is a bad input naming its
    line."""
    text = read_text(path)  # UTF-8; a spreadsheet's byte-order mark is dropped
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))  # a field as long as the file
    reader = csv.DictReader(io.StringIO(text))
    cols = set(reader.fieldnames or [])
    if {"sent0", "sent1", "hard_neg"} <= cols:
        kind, need = "nli", ("sent0", "sent1", "hard_neg")
    elif {"sentence1", "sentence2", "condition", "label"} <= cols:
        kind, need = "csts", ("sentence1", "sentence2", "condition", "label")
    else:
        has = ",".join(sorted(cols)) or "no header"
        die(f"'{path}' needs the columns sent0,sent1,hard_neg (NLI triplets) or sentence1,"
                   f"sentence2,condition,label (C-STS); it has {has}")
    rows = []
    for r in reader:
        if missing := [c for c in need if not (r[c] or "").strip()]:  # short rows give None
            die(f"'{path}', line {reader.line_num}: no {', '.join(missing)}: fill in or "
                       "delete the row")
        try:
            rows.append(tuple(r[c] for c in need[:-1]) + (finite(r["label"]),)
                        if kind == "csts" else tuple(r[c] for c in need))
        except ValueError:
            die(f"'{path}', line {reader.line_num}: label {r['label']!r} is not a number; "
                       "C-STS labels are 1-5")
    if not rows:
        die(f"'{path}' has a header but no rows: pass a --train file with data")
    return kind, rows


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
NONNEG_FLOAT = _typed(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
PROB = _typed(float, lambda v: 0 <= v < 1, "a probability in [0, 1)")
FRACTION = _typed(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")


def parse(p):
    """The command line; --quiet silences our progress bars, Hugging Face's are always off;
    --compile is checked to work before anything is read or written."""
    a = p.parse_args()
    if getattr(a, "max_steps", -1) != -1 and a.epochs != p.get_default("epochs"):
        die("--max-steps sets the run's length, so --epochs would do nothing: drop one of them")
    if getattr(a, "compile", False):
        check_compile()
    global QUIET
    QUIET = a.quiet
    import transformers
    transformers.logging.disable_progress_bar()
    return a


def show_ranges(parser):
    """Append each typed argument's allowed range to its --help text."""
    for act in parser._actions:
        if hasattr(act.type, "range") and act.help:
            act.help += f" [{act.type.range}]"
    return parser


# ---------------------------------------------------------------- loading a model folder --------
# Every model folder the scripts read is loaded here, and every way a file can be broken (missing,
# cut short, edited, another model's) is one line naming it: never a traceback, never a silently
# different model (random weights where a file lacks them, weights the config does not describe).
REFETCH = "copy or download the model folder again"


def first_line(e):
    """An exception's first line, short enough for an error line."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return line if len(line) <= 120 else line[:117] + "..."


def read_json(path, where, fix, name=None):
    """The JSON object in path, or one line `WHERE: NAME is damaged (...): FIX`."""
    name = name or os.path.basename(path)
    try:
        obj = json.loads(read_text(path))
    except ValueError as e:
        die(f"{where}: {name} is damaged (not JSON: {first_line(e)}): {fix}")
    if not isinstance(obj, dict):
        die(f"{where}: {name} is damaged (not a JSON object): {fix}")
    return obj


def safetensors_keys(path, where, fix, name=None):
    """The tensor names of a safetensors file, once its header and sizes are found whole."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, "pt") as f:
            return set(f.keys())
    except (SafetensorError, OSError) as e:
        why = first_line(e).removeprefix("Error while deserializing header: ")
        die(f"{where}: {name or os.path.basename(path)} is damaged (cut short, or not a "
                   f"safetensors file: {why}): {fix}")


def check_file(folder, rel, where, fix):
    """folder/rel exists and, for JSON and safetensors files, reads whole."""
    path = os.path.join(folder, rel)
    if rel.endswith("model.safetensors") and os.path.isfile(path + ".index.json"):  # sharded
        return
    if not os.path.isfile(path):
        die(f"{where}: {rel} is missing: {fix}")
    if rel.endswith(".json"):
        read_json(path, where, fix, rel)
    elif rel.endswith(".safetensors"):
        safetensors_keys(path, where, fix, rel)


# what from_pretrained reads, per kind of class: JSON files checked first (when present)
READS = {"config": ("config.json",),
         "tokenizer": ("config.json", "tokenizer.json", "tokenizer_config.json",
                       "special_tokens_map.json", "added_tokens.json"),
         "model": ("config.json", "generation_config.json", "model.safetensors.index.json")}
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


RUN_KINDS = {  # a run folder of ours, by the method in its sentemb.json: what it is
    "bellm": "a bellm.py run (a LoRA adapter for the base model its sentemb.json names)",
    "jtcse": "a jtcse.py run (a twin: its towers are the model folders tower_a and tower_b)",
    "sscl": "an sscl.py run"}


def run_kind(folder):
    """What a folder that holds a run description (sentemb.json; a run folder's, in its best/) is,
    for an error line; None without one."""
    best = os.path.join(folder, BEST)
    if os.path.isfile(os.path.join(best, META)):
        return f"a run folder whose best model, {best}, is {run_kind(best)}"
    if not os.path.isfile(os.path.join(folder, META)):
        return None
    with contextlib.suppress(Exception):
        return RUN_KINDS[json.loads(read_text(os.path.join(folder, META)))["method"]]
    return "a run folder (it holds a sentemb.json)"


def check_hf_folder(folder, kind, where, fix=REFETCH):
    has = lambda f: os.path.isfile(os.path.join(folder, f))  # noqa: E731
    needs = "config.json" if kind != "tokenizer" else "a tokenizer file"
    if not (has("config.json") if kind != "tokenizer" else any(map(has, TOKENIZER_FILES))) \
            and (run := run_kind(folder)):  # say what it is before naming a missing file
        die(f"{where}: it is {run}, not a model folder (no {needs}): pass it to eval_sts.py "
            "--model without --pooler, which reads run folders, or pass a model folder")
    for f in READS[kind]:
        if os.path.exists(os.path.join(folder, f)):
            read_json(os.path.join(folder, f), where, REFETCH)
    if kind != "tokenizer":
        if not has("config.json"):
            die(f"{where}: config.json is missing (not a model folder, or an incomplete "
                       f"copy): pass a model folder, or {REFETCH}")
        if "model_type" not in read_json(os.path.join(folder, "config.json"), where, REFETCH):
            die(f"{where}: config.json is damaged (no model_type): {REFETCH}")
    if kind == "tokenizer" and not any(map(has, TOKENIZER_FILES)):
        die(f"{where}: tokenizer.json is missing (no tokenizer file at all): pass a model "
                   f"folder with its tokenizer, or {REFETCH}")
    if kind == "model":
        weights = next(filter(has, WEIGHT_FILES), None)
        if weights is None:
            die(f"{where}: model.safetensors is missing (no weights file): {REFETCH}")
        if weights == "model.safetensors":
            safetensors_keys(os.path.join(folder, weights), where, REFETCH)
        if weights.startswith("model.safetensors"):
            check_weights(folder, where, fix)


def _shapes(folder):
    """name -> shape of every tensor in a folder's model.safetensors (or its shards), read from
    the headers alone."""
    from safetensors import safe_open
    index = os.path.join(folder, "model.safetensors.index.json")
    files = sorted(set(read_json(index, folder, REFETCH).get("weight_map", {}).values())) \
        if os.path.isfile(index) else ["model.safetensors"]
    shapes = {}
    for name in files:
        with safe_open(os.path.join(folder, name), "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def _own(model, key):
    """key of a checkpoint as the base model (AutoModel) names it, or None for a head beside it
    (BERT's cls.*, a causal LM's lm_head.*), which the base model never reads."""
    children = {n for n, _ in model.named_children()}
    prefix = model.base_model_prefix + "."
    if key.startswith(prefix) and key[len(prefix):].split(".")[0] in children:
        key = key[len(prefix):]
    return key if key.split(".")[0] in children else None


def _layer(key):
    """The layer index of a per-layer weight (encoder.layer.3.*, layers.3.*), else None."""
    m = re.search(r"(?:^|\.)layers?\.(\d+)\.", key)
    return int(m.group(1)) if m else None


def check_weights(folder, where, fix=REFETCH):
    """A local model folder's weights are the model its config.json describes: the model is built
    from config.json on the meta device (no memory, no weights) and model.safetensors' header must
    hold no tensor of the model's own modules that it lacks (a config cut to fewer layers than the
    file holds) and each tensor in the shape it has (hidden size, vocabulary, positions). Heads
    beside the base model (cls.*, lm_head.*) are never read and not checked; weights the file
    lacks are refused at load (load_pretrained)."""
    from transformers import AutoConfig, AutoModel
    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModel.from_config(config)
    except Exception:  # an architecture AutoModel cannot build: its loader says why
        return
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want.update({k: tuple(v.shape) for k, v in model.named_buffers()})  # non-persistent ones too
    ignore = [re.compile(r) for r in getattr(model, "_keys_to_ignore_on_load_unexpected", None)
              or []]
    odd, wrong = [], []
    for key, shape in _shapes(folder).items():
        own = _own(model, key)
        if own is None or any(r.search(key) for r in ignore):
            continue
        if own not in want:
            odd.append(key)
        elif want[own] != shape:
            wrong.append((key, shape, want[own]))
    said = (f"config.json describes {config.model_type} with {config.num_hidden_layers} layers, "
            f"hidden size {config.hidden_size}") if hasattr(config, "hidden_size") else \
        f"config.json describes {config.model_type}"
    if odd:
        above = sorted({i for i in map(_layer, odd) if i is not None})
        which = f"layers {above[0]}..{above[-1]}, " if above else ""
        die(f"{where}: model.safetensors holds {len(odd)} weights that config.json does "
                   f"not describe ({which}{odd[0]}{', ...' * (len(odd) > 1)}; {said}): the two "
                   f"files are of different models; {fix}")
    if wrong:
        key, shape, implied = wrong[0]
        die(f"{where}: model.safetensors holds {key} of shape {list(shape)} where "
                   f"config.json implies {list(implied)} ({len(wrong)} such weights; {said}): "
                   f"the two files are of different models; {fix}")


def load_pretrained(cls, name, strict=False, fresh=None, num_layers=None, label=None, **kw):
    """cls.from_pretrained(name, **kw) for a config, tokenizer or model class, from a hub name or a
    local folder, or one line naming the broken file and the fix. A local folder is checked first:
    its JSON files parse, it has a config.json with a model_type (models, configs), a tokenizer file
    (tokenizers) and whole weights (models). A model whose weights lack any of its parameters is
    refused, where transformers would only warn and initialise them at random; strict=False
    tolerates a missing BERT pooler (`pooler.*`, as in roberta-base), for callers that never use
    it. fresh: a prefix of weights that may be missing and are then trained from transformers'
    initialisation (said on stderr). num_layers: the model cut to its first N layers (SSCL Table 1;
    check_num_layers first): transformers builds N layers and loads their weights; those of the
    layers above are dropped. Saved, it is an N-layer model for every loader. label: what names
    the model (an environment variable: MINILM), said in every error."""
    name = str(name)
    if num_layers:  # transformers' load report would list each dropped weight of the cut
        import transformers
        level = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            return load_pretrained(cls, name, strict, fresh, label=label,
                                   num_hidden_layers=num_layers, **kw)
        finally:
            transformers.logging.set_verbosity(level)
    kind = "tokenizer" if "Tokenizer" in cls.__name__ else \
        "config" if "Config" in cls.__name__ else "model"
    where, local = f"cannot load {label + '=' if label else ''}'{name}'", os.path.isdir(name)
    if local:
        check_hf_folder(name, kind, where)
    try:
        if kind != "model":
            return cls.from_pretrained(name, **kw)
        model, info = cls.from_pretrained(name, output_loading_info=True, **kw)
    except Exception as e:  # from_pretrained raises many types (OSError, ValueError, ...)
        if not local:
            die(f"{where} ({type(e).__name__}): pass a local model folder, or a hub name "
                       "with the hub reachable")
        die(f"{where} ({type(e).__name__}: {first_line(e)}): a file of the {kind} is damaged or "
                   f"another model's; {REFETCH}")
    if fresh and (new := sorted(k for k in info["missing_keys"] if k.startswith(fresh))):
        print(f"note: '{name}' has no {fresh}* weights ({', '.join(new)}): they start from "
              "transformers' initialisation (seeded) and are trained", file=sys.stderr)
    cut = kw.get("num_hidden_layers")  # common.load_pretrained's num_layers: the layers above go
    odd = sorted(k for k in info["unexpected_keys"] if (own := _own(model, k)) is not None
                 and not (cut and (_layer(own) or 0) >= cut))
    if odd:  # local folders were checked before (check_weights): this is a hub model
        die(f"{where}: its weights hold {len(odd)} tensors its config does not describe "
                   f"({odd[0]}{', ...' * (len(odd) > 1)}): the two are of different models; "
                   f"{REFETCH}")
    if missing := sorted(k for k in info["missing_keys"] if (strict or not k.startswith("pooler."))
                         and not (fresh and k.startswith(fresh))):
        weights = "model.safetensors" if local else "its weights"
        more = ", ..." * (len(missing) > 1)
        die(f"{where}: {weights} lacks {len(missing)} of the model's weights ({missing[0]}"
                   f"{more}): it is damaged or another model's; {REFETCH}")
    return model


def check_num_layers(num_layers, config, name, flag="--num-layers"):
    """A cut keeps 1 to all of the model's layers (None: no cut)."""
    n = config.num_hidden_layers
    if num_layers is not None and not 1 <= num_layers <= n:
        die(f"{flag} {num_layers}: '{name}' has {n} layers (num_hidden_layers in its "
            f"config.json): pass 1 to {n}")


def positions(config):
    """The tokens a model reads at most: max_position_embeddings, less RoBERTa's offset (its
    position ids start after the padding index: roberta-base's 514 positions hold 512 tokens)."""
    n = getattr(config, "max_position_embeddings", None)
    return n - config.pad_token_id - 1 if n and config.model_type in ROBERTA_LIKE else n


ROBERTA_LIKE = ("roberta", "xlm-roberta", "camembert")  # RobertaEmbeddings' position ids


def check_max_len(max_len, config, name, flag="--max-len", extra=0):
    """A token limit must fit the model's positions (max_position_embeddings, common.positions), or
    the first longer sentence would crash inside the model. extra: tokens added around it."""
    limit = positions(config)
    if limit and max_len + extra > limit:
        plus = f" plus the prompt's {extra} tokens" if extra else ""
        fix = f"pass {flag} {limit - extra} or less" if flag.startswith("--") else \
            f"set it to {limit - extra} or less"
        die(f"{flag} {max_len}{plus} is more than the {limit} positions of '{name}' "
            f"(max_position_embeddings in its config.json): {fix}")
    return max_len


# ---------------------------------------------------------------- sentence-transformers -------
def write_st_files(folder, hidden, max_len, pooler, dense=None):
    """Beside a plain HF model folder, the files that make it a sentence-transformers folder (its
    classic layout: Transformer -> Pooling (cls or avg) [-> Dense]), so that
    SentenceTransformer(folder) encodes as our scripts evaluate (no normalisation: cosine needs
    none). dense: a torch.nn.Linear kept at evaluation (sscl.py --proj-dim)."""
    modules = [("", "Transformer"), ("1_Pooling", "Pooling")] + [("2_Dense", "Dense")] * bool(dense)
    files = {"modules.json": [{"idx": i, "name": str(i), "path": path,
                               "type": f"sentence_transformers.models.{kind}"}
                              for i, (path, kind) in enumerate(modules)],
             "sentence_bert_config.json": {"max_seq_length": max_len, "do_lower_case": False},
             "1_Pooling/config.json": {"word_embedding_dimension": hidden,
                                       "pooling_mode_cls_token": pooler == "cls",
                                       "pooling_mode_mean_tokens": pooler == "avg",
                                       "pooling_mode_max_tokens": False,
                                       "pooling_mode_mean_sqrt_len_tokens": False}}
    if dense is not None:
        from safetensors.torch import save_file
        files["2_Dense/config.json"] = {"in_features": hidden, "out_features": dense.out_features,
                                        "bias": True, "activation_function":
                                        "torch.nn.modules.linear.Identity"}
        os.makedirs(os.path.join(folder, "2_Dense"))
        save_file({f"linear.{k}": v.detach().contiguous().cpu()
                   for k, v in dense.state_dict().items()},
                  os.path.join(folder, "2_Dense", "model.safetensors"))
    for name, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=2)


# ---------------------------------------------------------------- tokenisation ------------------
def tokenize(tokenizer, sentences, max_len, device):
    """Dynamic padding to the longest sentence of the batch; longer sentences are truncated."""
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=max_len,
                      return_tensors="pt")
    return {k: v.to(device) for k, v in batch.items()}


GROUP_COST = 64  # a forward pass's fixed cost, in token slots (bench/length_groups.py measures it)


def length_groups(lengths, cost=GROUP_COST):
    """Rows sorted by length, cut into groups where cutting pays: the cuts minimise Σ_groups (rows x
    longest + cost), i.e. padded token slots plus a fixed cost per forward pass (dynamic
    programming, O(n²)). lengths: real tokens per row -> list of groups of row indices, shortest
    group first."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    # best[j]: cheapest split of order[:j]
    best, cut = [0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):  # last group = order[i:j], padded to its longest, lengths[order[j-1]]
            c = best[i] + (j - i) * lengths[order[j - 1]] + cost
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def by_length(forward, batch, cost=GROUP_COST, slots=None, lookups=()):
    """forward(batch) computed on length groups of the batch's rows, each padded only to its own
    longest, and put back in row order: the same rows and the same result as forward(batch) (up to
    float rounding) for the cost of the real tokens. batch: dict of (N, L) tensors with an
    attention_mask, padded on either side; forward's outputs: (N, ...) tensors, or tuples / lists of
    them (nested; None kept). slots: a list that receives the padded token slots computed (rows x
    length, summed over the groups). lookups: word-embedding modules (trained) that forward applies
    to the group's input_ids: each looks the whole batch up once, and every group reads its rows of
    that, so that the backward builds one vocabulary-sized gradient, not one a group."""
    mask = batch["attention_mask"]  # (N, L)
    lengths = mask.sum(1).tolist()
    groups = length_groups(lengths, cost)
    if slots is not None:
        slots.append(sum(len(g) * max(lengths[i] for i in g) for g in groups))
    if len(groups) == 1:
        return forward(batch)
    left = not bool(mask[:, 0].all())  # left padding: the pad slots come first
    cut = lambda v, idx, L: v[idx, -L:] if left else v[idx, :L]  # noqa: E731  (n_g, L_g, ...)
    group = {}  # the group being computed: its rows and length

    def reader(whole):  # a forward hook: the group's rows of the whole batch's lookup (N, L, H)
        return lambda e, args, out: cut(whole, group["idx"], group["L"])
    hooks = [e.register_forward_hook(reader(e(batch["input_ids"]))) for e in lookups]
    parts = []
    try:
        for g in groups:
            group.update(idx=torch.tensor(g, device=mask.device), L=max(lengths[i] for i in g))
            parts.append(forward({k: cut(v, group["idx"], group["L"])
                                  for k, v in batch.items()}))  # (n_g, L_g)
    finally:
        for h in hooks:
            h.remove()
    # grouped row -> row
    inv = torch.tensor([i for g in groups for i in g], device=mask.device).argsort()

    def merge(outs):  # the groups' outputs -> one output in row order
        if outs[0] is None:
            return None
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs)[inv]
        return type(outs[0])(merge(list(o)) for o in zip(*outs))
    return merge(parts)


def in_length_groups(forward, grouped=True, model=None):
    """forward(batch, ...) as a function computed in length groups (by_length): the same outputs,
    for the cost of the real tokens; grouped=False: in one padded batch. model: the module forward
    runs, whose trained word embeddings then look a batch up once (by_length's lookups), unless
    forward is compiled (hooks that change every call would recompile its graphs). Its .slots
    counts the padded token slots it has computed (rows x length), which the scripts turn into
    FLOPs."""
    compiled = hasattr(forward, "_orig_mod") or hasattr(forward, "_torchdynamo_orig_callable")
    lookups = word_embeddings(model) if model is not None and not compiled else []

    def run(batch, *args, **kw):
        slots = []
        out = by_length(lambda b: forward(b, *args, **kw), batch, slots=slots,
                        lookups=lookups if torch.is_grad_enabled() else []) if grouped else \
            forward(batch, *args, **kw)
        run.slots += slots[0] if grouped else batch["attention_mask"].numel()
        return out
    run.slots = 0
    return run


def word_embeddings(model):
    """The trained input-embedding modules of the Hugging Face models in model (each once)."""
    from transformers import PreTrainedModel
    found = []
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and (e := m.get_input_embeddings()) is not None \
                and e.weight.requires_grad and all(e is not f for f in found):
            found.append(e)
    return found


class FlopCount(TorchDispatchMode):
    """`with FlopCount() as c:` c.flops counts the FLOPs of the matrix products run inside (forward
    and backward: mm, addmm, bmm, attention, ...) by the formulas of torch's FlopCounterMode,
    without its per-module bookkeeping (which makes a CPU step half again as long; this, 15%)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (formula := flop_registry.get(func._overloadpacket)) is not None:
            self.flops += formula(*args, **(kwargs or {}), out_val=out)
        return out


# dense bf16 tensor-core peaks, FLOP/s (NVIDIA's datasheets; with sparsity they say twice these):
# a step's share of its GPU's peak (bf16 autocast is on with CUDA). The first name that a device's
# name contains applies.
GPU_PEAKS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200 NVL": 835e12,
             "H200": 989e12, "A100": 312e12}


def summed(x, world, device):
    """A number summed over the ranks (torchrun), as a float."""
    t = torch.tensor(float(x), device=device)
    if world > 1:
        collective(torch.distributed.all_reduce, t)
    return t.item()


def new_clock(step, clock=None):
    """The step lines' clock from this step on: the time, the FLOPs and real tokens since, and the
    run's FLOPs a padded token slot once its first step has been counted (metered)."""
    return {"time": time.perf_counter(), "step": step, "flops": 0, "tokens": 0,
            "per_slot": clock and clock["per_slot"]}


@contextlib.contextmanager
def metered(clock, forward):
    """One optimisation step inside: its matrix products' FLOPs into clock["flops"]. The run's first
    step is counted (FlopCount), which gives its FLOPs a padded token slot (forward.slots,
    in_length_groups); any other step is that times its own slots: within 0.2% of a count,
    since attention, whose FLOPs grow with a length's square, is a small part."""
    slots = forward.slots
    if clock["per_slot"] is None:
        with FlopCount() as counted:
            yield
        clock["per_slot"] = counted.flops / max(forward.slots - slots, 1)
    else:
        yield
    clock["flops"] += clock["per_slot"] * (forward.slots - slots)


def rates(clock, step, per_step, unit, world, device):
    """The step line's speed since the clock started, all ranks together: sentences (or rows) a
    second, real tokens a second where counted, the matrix products' FLOP/s, and on a GPU whose
    peak is known (gpu_peak) the share of it (MFU)."""
    dt = time.perf_counter() - clock["time"]
    text = f"{unit}/s {per_step * (step - clock['step']) / dt:.2f}"
    if clock["tokens"]:
        text += f"  tok/s {summed(clock['tokens'], world, device) / dt:.0f}"
    flops = summed(clock["flops"], world, device) / dt
    text += f"  TFLOP/s {flops / 1e12:.1f}" if device.type == "cuda" else \
        f"  GFLOP/s {flops / 1e9:.1f}"
    if peak := gpu_peak(device):
        text += f"  MFU {100 * flops / (world * peak[1]):.1f}% of {peak[0]} bf16"
    return text


def peak_memory(device, world):
    """The peak memory line: the GPU's allocations (CUDA), else the process's largest RSS."""
    if device.type == "cuda":
        gib = torch.cuda.max_memory_allocated(device) / 2**30
        how = "torch.cuda.max_memory_allocated"
    else:
        gib, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "ru_maxrss"  # KiB
    return f"peak memory {gib:.2f} GiB ({how}{', rank 0' if world > 1 else ''})"


def gpu_peak(device):
    """(the GPU's name as in GPU_PEAKS, its dense bf16 peak FLOP/s), or None: a CPU, another GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next(((k, v) for k, v in GPU_PEAKS.items() if k in name), None)


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


def encoder(embed, tokenizer, max_len, device):
    """encode(list[str]) -> (N, H): embed(batch dict) -> (b, H) over length-sorted batches, under
    autocast (bf16 on CUDA), without gradients: each method's encode function. Its .embed is what
    it runs (compiled_encode replaces it)."""
    @torch.no_grad()
    def encode(sentences):
        with autocast(device):
            return encode_in_batches(encode.embed, tokenizer, sentences, max_len, device)
    encode.tokenizer, encode.max_len = tokenizer, max_len  # what it reads (eval_sts.py --ensemble)
    encode.embed = embed
    return encode


def compiled(fn, on=True, backend="inductor"):
    """fn under torch.compile when on, with dynamic shapes from its first call, so that batches and
    length groups of other sizes reuse its code (a size of 1 compiles once more); else fn itself.
    The first call compiles: seconds to minutes (--compile in docs/operations.md)."""
    if not on:
        return fn
    check_compile(backend)
    return torch.compile(fn, dynamic=True, backend=backend)


@functools.cache  # once a process and backend (common.parse, then compiled())
def check_compile(backend="inductor"):
    """--compile where torch.compile cannot run, found before any work: one line naming the fix. A
    tiny function is compiled and run on the device training uses, which needs what the model's
    compilation will (inductor on a CPU: a working C++ compiler)."""
    import torch._dynamo
    if not torch._dynamo.is_dynamo_supported():  # e.g. a Python that torch.compile does not know
        die("--compile: torch.compile does not run on this platform (Python "
            f"{sys.version.split()[0]}, torch {torch.__version__}): drop --compile")
    try:
        torch.compile(lambda x: x * 2 + 1, backend=backend)(torch.ones(2, device=pick_device()))
    except Exception as e:  # inductor's InvalidCxxCompiler, a missing Triton, ...
        die(f"--compile: torch.compile cannot run here ({type(e).__name__}: {first_line(e)}): "
            "install what it names (a C++ compiler: e.g. apt-get install g++), or drop --compile: "
            "the run works without it")


def compiled_layers(model, on=True, backend="inductor"):
    """model with each of its Transformer layers compiled in place when on (regional compilation,
    for a decoder LLM: BeLLM): the layers of a class (transformers' GradientCheckpointingLayer,
    e.g. LlamaDecoderLayer) share one compiled graph, traced from the first and reused by the
    rest, so compiling costs a layer's tracing, not the model's (SmolLM2-135M's step: a minute, not
    a quarter of an hour); the rest runs eager. Dynamic shapes, as compiled(); returns model."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    if on:
        check_compile(backend)
        for m in model.modules():
            if isinstance(m, GradientCheckpointingLayer):
                m.compile(dynamic=True, backend=backend)  # in place: the state_dict keeps its keys
    return model


def compiled_encode(encode, on=True, backend="inductor"):
    """An encode function (encoder, bellm.make_encode) that runs compiled when on: its embed whole,
    or a decoder LLM's layers (its .layers, from bellm.make_encode) one by one (compiled_layers)."""
    if on and getattr(encode, "layers", None) is not None:
        compiled_layers(encode.layers, backend=backend)
    elif on:
        encode.embed = compiled(encode.embed, backend=backend)
    return encode


def encode_once(encode, sentences, device="cpu"):
    """Encode every distinct sentence once, in one call (batched by token length); ->
    embed(list[str]) -> (n, H) float32 on `device`, looked up from that cache."""
    distinct = sorted(set(sentences))
    cache = dict(zip(distinct, encode(distinct).float().to(device)))
    return lambda sents: torch.stack([cache[s] for s in sents])


# ---------------------------------------------------------------- STS data ----------------------
def _lines(path):
    if not os.path.isfile(path):
        die(f"missing {path}: the STS data folder is incomplete; unpack senteval.tar again or fix "
            "--data-dir")
    lines = read_text(path).split("\n")
    # as iterating over the file: no line after the last \n
    return lines[:-1] if lines[-1] == "" else lines


def _row(path, i, s1, s2, gold):
    """(sent1, sent2, score) as SentEval reads them: whitespace-split and re-joined with single
    spaces."""
    try:
        return " ".join(s1.split()), " ".join(s2.split()), float(gold)
    except ValueError:
        die(f"{path}, line {i}: malformed line (expected a score, got {gold!r}); fix it or "
            "re-download senteval.tar")


def load_sts(data, task, split="test"):
    """{subset: [(sent1, sent2, gold)]}; STS pairs with an empty gold line are dropped (as
    SentEval)."""
    if task in STS_SUBSETS:
        subsets = {}
        for name in STS_SUBSETS[task]:
            base = os.path.join(data, "STS", f"{task}-en-test", f"STS.%s.{name}.txt")
            pairs, gold = ([l.split("\t") for l in _lines(base % "input")],
                           [g.strip() for g in _lines(base % "gs")])
            if len(gold) != len(pairs):
                die(f"{base % 'gs'}: {len(gold)} scores for {len(pairs)} pairs; "
                    "re-download senteval.tar")
            if bad := next((i for i, p in enumerate(pairs, 1) if len(p) != 2), None):
                die(f"{base % 'input'}, line {bad}: malformed line (expected two tab-separated "
                    "sentences); fix it or re-download senteval.tar")
            subsets[name] = [_row(base % "gs", i, *p, g)
                             for i, (p, g) in enumerate(zip(pairs, gold), 1) if g]
        return check_gold(subsets, os.path.dirname(base))
    if task == "STS-B":  # gold = 5th field, sentences = 6th and 7th
        path, skip, cols = (os.path.join(data, "STS", "STSBenchmark", f"sts-{split}.csv"), 0,
                            (5, 6, 4))
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
    return check_gold({split: rows}, path)


def check_gold(subsets, where):
    """A task's pairs whose gold scores can give a Spearman correlation (two values at least; the
    subsets pooled, SentEval's "all" setting), else one line naming the file or folder."""
    gold = {r[2] for rows in subsets.values() for r in rows}
    if len(gold) < 2:
        die(f"{where}: {'its gold scores are all ' + str(gold.pop()) if gold else 'no scored pair'}"
            ": a Spearman correlation needs two gold values or more; re-download senteval.tar")
    return subsets


# ---------------------------------------------------------------- STS evaluation ----------------
@torch.no_grad()
def evaluate(encode, data, tasks=TASKS, split="test", batch_size=128, exact=False):
    """{task: Spearman x 100} of cosine similarity against gold, subsets pooled ("all" setting).

    Default: encode() gets every distinct sentence once, in one call (our encoders batch by token
    length). exact=True: SentEval's own batches (each subset's pairs sorted by length, `batch_size`
    pairs a batch, each side encoded separately): slower, for bit-level comparisons."""
    loaded = {t: load_sts(data, t, split if t in ("STS-B", "SICK-R") else "test") for t in tasks}
    embed = encode if exact else encode_once(
        encode, {s for subsets in loaded.values() for rs in subsets.values() for r in rs
                 for s in r[:2]})
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


def stsb_dev(encode, data):
    """STS-B dev, Spearman x 100: the score that selects the checkpoint during training."""
    return evaluate(encode, data, ["STS-B"], split="dev")["STS-B"]


def format_table(results):
    """The papers' table: STS12 ... SICK-R Avg., two decimals."""
    names = [t for t in TASKS if t in results]
    avg = sum(results[t] for t in names) / len(names)
    head = " ".join(f"{t:>7}" for t in names + ["Avg."])
    return head + "\n" + " ".join(f"{results[t]:7.2f}" for t in names) + f" {avg:7.2f}"
