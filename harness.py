"""The run folder and the training process, written once for sscl.py, jtcse.py and bellm.py. A
reader of a paper may skip this file: each main()'s step is plain torch, and it calls here only
  add_run_flags(p)              the flags of the run and its process, in every script's
  start()                       this process, or one of torchrun's: rank, world, device, log
  gather(z)                     a step's (B, D) rows of every rank, in order (in-batch negatives)
  Run(a, method, ...)           the run folder opened, locked and settled; --resume: .state
  run.complete(steps)           a resumed run with nothing left to train (it says so)
  run.rate(a.lr, paper)         --lr, else the resumed run's, else the paper's
  run.start_training(model=...) what every save holds; signals, trackers and the loss watch on
  run.load_resumed_state()      --resume: each part loaded as saved; -> the first step (new: 0)
  run.watch(step, loss)         a loss not finite, noted on the device (no wait inside a step)
  run.check_loss()              ... read where the run reads anyway: one line, the last save good
  run.log(step, meter, **nums)  a step line: printed, kept (metrics.jsonl), sent to --report-to
  run.stop_requested(read)      a signal (SIGINT, SIGTERM) on any rank: stop here, saved
  run.save(step, metric, ...)   checkpoint.pt, the one commit point; a new best model into best/
  run.finish(step)              peak memory; a stopped run exits 128 + the signal's number
  run.final_table(...)          the best model on the test sets, loaded as eval_sts.py loads it
  Meter(...): meter.step(...)   the step lines' speed and FLOP/s; meter.line(): the line
Readers (eval_sts.py, the analyses, --distill) use run_of and reading; checkpoint.pt is read with
torch.load(weights_only=True), never running code (an earlier version's: python convert_run.py
RUN, for a folder you trust). What all this guarantees (a kill at any instant, readers during
saves, a full disk, --resume as the uninterrupted run) and how it is tested: docs/operations.md,
"Run folders" and "Failure and recovery"."""
import argparse
import atexit
import contextlib
import errno
import functools
import importlib
import json
import math
import os
import random
import resource
import shutil
import signal
import time

import numpy as np
import torch

import common

fcntl = importlib.import_module("fcntl") if os.name == "posix" else None  # Windows: no locks
CKPT = "checkpoint.pt"  # the training state and record: the one commit point
LOCK = ".lock"  # held by the training run, its process id in it
BEST = common.BEST  # the best model, a whole folder
NEW, OLD = ".best.new", ".best.old"  # a new best written whole, then swapped in by renames
CURVE, METRICS = "dev.jsonl", "metrics.jsonl"  # views of checkpoint.pt: the dev curve, step lines
OURS = {LOCK, NEW, OLD, CKPT + ".tmp", CURVE + ".tmp", METRICS + ".tmp"}  # a save under way's
TRACKERS = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "trackio": "trackio"}
SHOWN = {"gnorm": ".3g", "lr": ".2e"}  # a step line's numbers: these, integers as they are, .4f
RECOPY = "copy the whole run folder again, or train again"
MOVABLE = {"base_model", "teacher"}  # sentemb.json: where a model it reads lives (checked apart)
RECORD = {"best": -math.inf, "save": None, "curve": [], "described": None, "log": [], "id": None}
# a new run's record (save_step carries it on): the best dev score, its save's id and sentemb.json,
# the dev curve, the step lines' values and dev scores (metrics.jsonl), the trackers' run id
STOP = {"signum": 0, "now": False, "writes": 0}  # SIGINT/SIGTERM: stop at the next step, saved
RESUMABLE = {"resume", "log_steps", "final_eval", "precision", "compile", "quiet", "report_to",
             "bf16"}  # add_run_flags' that --resume may change (bf16: --precision bf16's alias)
PAPERS = {"sscl": "SSCL (Chen et al., ACL 2023; arXiv:2305.06154)",  # the model cards'
          "jtcse": "JTCSE (Zong et al., 2025; arXiv:2505.02366)",
          "bellm": "BeLLM (Li & Li, NAACL 2024; arXiv:2311.05296)"}


# ---------------------------------------------------------------- the process ---------------------
def add_run_flags(p, compiled="the model"):
    """The flags of the run and its process, the same in every script (after the paper's)."""
    p.add_argument("--seed", type=common.SEED, default=42)
    p.add_argument("--log-steps", type=common.POS_INT, default=10, help="the loss every N steps")
    p.add_argument("--precision", choices=common.PRECISIONS, help="the step's autocast (fp16 with "
                   "a gradient scaler): default bf16 on a GPU (fp16 if it has no bf16), fp32 on a "
                   "CPU")
    p.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                   help="bf16 autocast")
    p.add_argument("--compile", action="store_true",
                   help=f"torch.compile {compiled} (training, eval)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--resume", action="store_true", help="continue OUTPUT_DIR/checkpoint.pt")
    p.add_argument("--report-to", nargs="+", default=["none"], choices=["none", *TRACKERS],
                   help="also send the step lines and dev scores there (docs/operations.md)")
    p.add_argument("--final-eval", action=argparse.BooleanOptionalAction, default=True,
                   help="the 7 STS tasks of the best checkpoint at the end")


def start():
    """This process, or one of torchrun's (NCCL on GPUs, gloo on CPUs): rank, world, device, log"""
    STOP.update(signum=0, now=False, writes=0)
    rank, world = 0, 1
    device = common.pick_device()
    if "RANK" in os.environ:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(torch.distributed.destroy_process_group)  # before the interpreter goes
        rank = torch.distributed.get_rank()
        world = torch.distributed.get_world_size()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
    log = functools.partial(print, flush=True) if rank == 0 else do_nothing
    return rank, world, device, log


def do_nothing(*args, **kwargs):
    """What a rank but 0 logs; the check of a model that a reader does not check."""


def collective(call, /, *tensors, **options):
    """call(*tensors), a torch.distributed collective, returned once gloo's worker thread has let go
    of the tensors (one it frees at exit aborts the process); NCCL's watchdog holds its own."""
    call(*tensors, **options)
    held = [t for x in tensors for t in (x if isinstance(x, list) else [x])]
    while held and held[0].device.type == "cpu" and any(t._use_count() > 1 for t in held):
        time.sleep(1e-4)  # a use count of 1: its Python object's reference alone


def gather(z):
    """(B, D) on each rank -> (world·B, D), ranks in order; this rank's rows are z (its graph)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return z
    parts = [torch.empty_like(z) for _ in range(dist.get_world_size())]
    collective(dist.all_gather, parts, z.detach().contiguous())
    parts[dist.get_rank()] = z
    return torch.cat(parts)


def numpy_rng_state():
    """NumPy's global RNG state with its keys as a tensor: what torch.load(weights_only=True)
    reads (an ndarray it refuses)."""
    name, keys, *rest = np.random.get_state()
    return (name, torch.from_numpy(keys.astype(np.int64)), *rest)


def on_signal(signum, frame):
    """SIGINT, SIGTERM: stop at the next step, saved; a second one, or one after training: now."""
    name = signal.Signals(signum).name
    if STOP["signum"] or STOP["now"]:
        os.write(2, f"\n{name}: stopped\n".encode())
        os._exit(128 + signum)
    STOP["signum"] = signum
    os.write(2, f"\n{name}: stopping after this step (again: at once)\n".encode())


# ---------------------------------------------------------------- the run -------------------------
class Run:
    """OUTPUT_DIR opened for training by method's script (check_run(folder, meta) checks a model it
    saved; custom_module: best/ encodes through st_module.py in sentence-transformers); .state:
    with --resume, the checkpoint it goes on from (None: a new run). Helpers: sections below."""

    def __init__(self, a, method, resumable, check_run, inputs, device, custom_module=False):
        dist = torch.distributed
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) \
            if dist.is_available() and dist.is_initialized() else (0, 1)
        self.dir = a.output_dir
        self.method = method
        self.check_run = check_run
        self.device = device
        self.flags = {k: absolute(v) for k, v in vars(a).items()}  # its paths absolute
        self.say = functools.partial(print, flush=True) if self.rank == 0 else do_nothing
        if custom_module and not os.path.exists(common.ST_MODULE):
            self.say(f"note: no st_module.py beside {os.path.basename(common.__file__)}, so best/ "
                     "will lack it: eval_sts.py scores best/, but sentence-transformers loads it "
                     "only with st_module.py in it; copy st_module.py from the repository beside "
                     "common.py to have it there")
        self.packages = tracker_packages(a.report_to) if self.rank == 0 else {}  # before writing
        self.lock, self.made = open_folder(self.dir, method, a.resume, inputs, check_run) \
            if self.rank == 0 else (None, [])  # the lock held till exit; undo()'s
        if self.world > 1:
            dist.barrier()
        self.state = self.read_resume(resumable) if a.resume else None
        self.record = {k: self.state[k] for k in RECORD} if self.state else dict(RECORD)
        self.record["id"] = self.record["id"] or os.urandom(4).hex()
        self.trackers = []

    def read_resume(self, resumable):
        """checkpoint.pt, if its run had these flags (but resumable ones) and world; or one line."""
        state = read_checkpoint(self.dir, self.method, self.device)
        old, now = state["args"], self.flags  # the run's flags, this command's
        path = os.path.join(self.dir, CKPT)
        bad = [k for k in old if k in now and None not in (old[k], now[k])
               and flag_kind(old[k]) != flag_kind(now[k])]
        if bad:
            common.die(f"--resume: {path} is damaged ({bad[0]} of the wrong type): {RECOPY}")
        lost = [k for k in now if k not in old and k not in resumable]
        if lost:
            common.die(f"--resume: {path} holds no --{lost[0].replace('_', '-')} among the run's "
                       f"flags (damaged, or of another version of {self.method}.py): {RECOPY}")
        if state["save"]:  # best/: the model this checkpoint records
            read_meta(committed(self.dir, self.method, state), self.method, do_nothing, state)
        if state["world"] != self.world:
            common.die(f"--resume: the run was trained by {state['world']} process(es), this "
                       f"command runs {self.world}: resume it with torchrun --nproc_per_node "
                       f"{state['world']} (1: without torchrun), for its steps' global batch")
        changed = [k for k in old if k not in resumable and old[k] != now.get(k)
                   and (k in now or old[k])]  # a flag now gone: ignored where it was off
        if changed:
            common.die(f"--resume: the run was started with {flags_said(changed, old)}, this "
                       f"command says {flags_said(changed, now)}: resume with the run's own "
                       "settings")
        return state

    def rate(self, given, paper):
        """The learning rate: --lr if given, else the resumed run's, else the paper's."""
        if given or self.state is None:
            return given or paper
        return self.state["args"]["lr"]

    def complete(self, steps):
        """Whether a resumed run has no step left to train (then it says what to do)."""
        done = self.state is not None and self.state["step"] >= steps
        if done:
            self.say(f"the run is complete (step {self.state['step']} of {steps}): nothing to "
                     f"train in '{self.dir}'; evaluate it with eval_sts.py --model {self.dir}, or "
                     "pass a larger --max-steps or --epochs with --resume to train on")
        return done

    def start_training(self, *, model, optimizer, scheduler, scaler, lr, meta, generators=None):
        """What every save holds: the model's trained weights, optimiser (and fp16's gradient
        scaler), schedule, rate lr, meta (sentemb.json), generators (JTCSE's R). From here signals
        stop training at a step, saved; --report-to's trackers are open; watch() notes a loss."""
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.lr = lr
        self.meta = meta
        self.generators = generators or {}
        optimizer.register_state_dict_post_hook(lambda _, d: {**d, "scaler": scaler.state_dict()})
        self.nonfinite = torch.tensor([-1.0, 0.0], device=self.device)  # watch(): (step, loss)
        self.skipped = 0  # fp16's skipped steps, as say_skipped() last said
        self.handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.trackers = [open_tracker(n, m, self) for n, m in self.packages.items()]  # (rank 0)
        self.reported = len(self.record["log"])  # sent by the runs before (each save's)

    def load_resumed_state(self):
        """--resume: the saved step's weights, optimiser, schedule, generators and RNG states, as
        saved; the rate lr over this command's schedule. -> the first step (a new run: 0)"""
        state = self.state
        if state is None:
            return 0
        bad = [k for k in self.generators if not torch.is_tensor(state.get(k))]
        if bad:
            common.die(f"--resume: {CKPT} is damaged ({bad[0]} missing or of the wrong type): "
                       f"{RECOPY}")
        other = differs(self.meta, state["meta"], skip=MOVABLE)  # the model this command builds
        if other:
            common.die(f"--resume: this command's model has {other[0]} {other[1]}, the model "
                       f"{os.path.join(self.dir, CKPT)} records has {other[0]} {other[2]}: resume "
                       "with the run's own settings (its record damaged: train again)")
        trained = {k for k, v in self.model.state_dict(keep_vars=True).items() if v.requires_grad}
        try:  # the saved step's weights, optimiser, schedule and generators
            if set(state["model"]) != trained:  # the trained weights, no more, no fewer
                raise KeyError(sorted(set(state["model"]) ^ trained)[0])
            self.model.load_state_dict(state["model"], strict=False)
            self.optimizer.load_state_dict(state["opt"])
            self.scheduler.load_state_dict(state["sched"])
            self.scaler.load_state_dict(state["opt"].get("scaler") or self.scaler.state_dict())
            for k, g in self.generators.items():
                g.set_state(state[k].cpu())
        except (KeyError, RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
            common.die(f"--resume: the checkpoint does not fit the model and settings of this "
                       f"command ({type(e).__name__}: {common.first_line(e)}): pass the "
                       "--output-dir of a run of this model and settings")
        restore_rng(state["rng"], self.device)
        for g in self.optimizer.param_groups:  # the rate over this command's schedule (HF's way)
            g["initial_lr"] = self.lr
            g["lr"] = self.lr * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self.scheduler.base_lrs = [self.lr] * len(self.optimizer.param_groups)
        old = state["args"]["lr"]
        if self.lr != old:  # a new --lr from the resumed step on
            self.say(f"--lr {self.lr:g} replaces the run's {old:g} from step {state['step']} on")
        self.state = {k: v for k, v in state.items() if k not in ("model", "opt")}  # (in use)
        return state["step"] + 1

    def watch(self, step, loss):
        """The first step whose loss is not finite, noted on the device (no wait): check_loss()"""
        first = torch.stack([torch.full_like(loss, step), loss]).detach().float()  # (2,)
        bad = ~torch.isfinite(loss) & (self.nonfinite[0] < 0)
        self.nonfinite = torch.where(bad, first, self.nonfinite)

    def check_loss(self):
        """A non-finite loss since the last check: exit, one line (fp16: new skips, one line)."""
        step, loss = self.nonfinite.tolist()
        if step >= 0:
            common.die(f"loss became {loss} at step {int(step)}: resume with a lower --lr (now "
                       f"{self.lr:g}; --resume --lr ...) or check the data; the run in "
                       f"{self.dir} is kept")
        if self.scaler.is_enabled():
            self.say_skipped()

    def say_skipped(self):
        """fp16: the steps the gradient scaler skipped (inf/NaN gradients), when more: one line."""
        took = [s["step"] for s in self.optimizer.state.values()]  # AdamW's count
        ran = self.scheduler.last_epoch  # the steps run (the schedule's count), skipped or not
        skipped = ran - int(torch.stack(took).max()) if took else 0  # less those AdamW took
        if skipped > self.skipped:
            self.skipped = skipped
            self.say(f"fp16: {skipped} of {ran} steps skipped (inf/NaN gradients)")

    def log(self, step, meter, **values):
        """A step line: values (loss, terms, gnorm, rate) and the meter's speeds, printed, kept."""
        v = {k: x.item() if torch.is_tensor(x) else x for k, x in values.items()}
        line = f"step {step:>5}"
        for k, x in v.items():
            shown_as = SHOWN.get(k, ".4f") if type(x) is float else ""  # an int as it is
            line += f"  {k} {x:{shown_as}}"
        self.say(f"{line}  {meter.line()}")
        self.record["log"] = [*self.record["log"], {"step": step, **v, **meter.values}]  # (a copy)

    def stop_requested(self, agree=True):
        """Whether a signal asked training to stop; torchrun, where agree: by any rank, all stop."""
        if self.world > 1 and agree:
            t = torch.tensor(STOP["signum"], device=self.device)
            collective(torch.distributed.all_reduce, t, op=torch.distributed.ReduceOp.MAX)
            STOP["signum"] = int(t)
        return bool(STOP["signum"]) and (agree or self.world == 1)

    def save(self, step, metric, dev, write):
        """Rank 0 saves the state (dev: the score, None at a stop), a new best by write(folder)."""
        self.check_loss()  # a save reads the device: never after a loss that was not finite
        if self.rank == 0:
            self.record = save_step(self.dir, self.method, self.check_run, self.record, step,
                                    metric, dev, self.training_state(step), write, self.say,
                                    self.undo)
            self.report()
        if self.world > 1:
            torch.distributed.barrier()

    def report(self):
        """What the last save committed (step lines, dev scores), sent to --report-to's trackers."""
        for e in self.record["log"][self.reported:]:
            for send in self.trackers:
                send({k: v for k, v in e.items() if k != "step"}, e["step"])
        self.reported = len(self.record["log"])

    def training_state(self, step):
        """What checkpoint.pt holds of this step (save_step adds the record to it)."""
        weights = {k: v.detach() for k, v in self.model.state_dict(keep_vars=True).items()
                   if v.requires_grad}
        rng = (torch.get_rng_state(), random.getstate(), numpy_rng_state())
        if self.device.type == "cuda":  # its generator too: a resumed run's dropout
            rng = (*rng, torch.cuda.get_rng_state(self.device))
        return {"model": weights, "opt": self.optimizer.state_dict(),
                "sched": self.scheduler.state_dict(), "step": step, "method": self.method,
                "meta": self.meta, "args": {**self.flags, "lr": self.lr}, "rng": rng,
                **{k: g.get_state() for k, g in self.generators.items()}, "world": self.world}

    def undo(self):
        """A first save failed: what the run made goes (.lock, the folders), as it began."""
        for path in reversed(self.made):
            with contextlib.suppress(OSError):
                (os.rmdir if os.path.isdir(path) else os.remove)(path)

    @contextlib.contextmanager
    def finish(self, step):
        """Training ended: peak memory; stopped by a signal: exit 128 + its number. Inside: now."""
        if self.device.type == "cuda":
            gib, how = torch.cuda.max_memory_allocated(self.device) / 2**30, "max_memory_allocated"
        else:  # (Linux: KiB)
            gib, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "ru_maxrss"
        self.say(f"peak memory {gib:.2f} GiB ({how}{', rank 0' if self.world > 1 else ''})")
        try:
            signum = STOP["signum"]
            if signum:
                self.say(f"stopped at step {step} ({signal.Signals(signum).name}): the training "
                         f"state is in {os.path.join(self.dir, CKPT)}; run the same command with "
                         "--resume to continue")
                raise SystemExit(128 + signum)
            STOP["now"] = True
            yield
        finally:
            for s, h in self.handlers.items():
                signal.signal(s, h)

    def final_table(self, load_encoder, data, tasks, precision):
        """The best model on the test sets, loaded as eval_sts.py loads it (on rank 0 only)."""
        if self.rank != 0:
            return
        folder = os.path.join(self.dir, BEST)
        meta = read_meta(folder, self.method, self.check_run,
                         {**self.record, "meta": self.meta})  # as its checkpoint records it
        encode = load_encoder(folder, meta, self.device)
        check_prints(folder, meta)
        with common.autocast(self.device, precision):
            table = common.format_table(common.evaluate(encode, data, tasks))
        print(f"the best checkpoint (dev {self.record['best']:.2f}) on the test sets:\n{table}")
        write_card(folder, meta, {**self.flags, "lr": self.lr},
                   self.record["curve"][-1]["metric"], table)  # rewritten whole


# ---------------------------------------------------------------- the run's parts ----------------
def absolute(value):
    """A flag's value with each local path in it made absolute (in a list too: --distill)."""
    if isinstance(value, list):
        return [absolute(v) for v in value]
    if isinstance(value, str) and os.path.exists(value):
        return os.path.abspath(value)
    return value


def open_folder(out, method, resume, inputs, check_run):
    """Rank 0: OUTPUT_DIR, not an input model, new or ours (--resume: a run), locked and settled.
    -> (the lock, what it made: the folders, outermost first, and .lock)"""
    for name in inputs:
        if os.path.isdir(name) and os.path.isdir(out) and os.path.samefile(name, out):
            common.die(f"--output-dir '{out}' is the input model '{name}': training would "
                       "overwrite its weights; pass another --output-dir")
    if not resume:  # before .lock is made: a folder of the user's stays as it is
        refuse_taken(out, method)
    path = os.path.join(out, LOCK)
    made = [] if os.path.lexists(path) else [path]
    up = os.path.abspath(out)
    while not os.path.lexists(up):
        made.insert(0, up)
        up = os.path.dirname(up)
    lock = open_lock(out)
    if not flock(lock, "EX", "NB"):
        with open(path) as f:
            pid = f.read().strip() or "?"
        common.die(f"'{out}' is in use by another training run (pid {pid}): wait for it to end, "
                   "or pass another --output-dir")
    lock.truncate(0)
    print(os.getpid(), file=lock, flush=True)
    if settle(out, method, check_run) is None and resume:
        common.die(f"--resume: no {os.path.join(out, CKPT)}; drop --resume to start a new run")
    return lock, made


def refuse_taken(out, method):
    """A new run's OUTPUT_DIR holds nothing but a save under way's files; else one line."""
    found = sorted(set(os.listdir(out)) - OURS - set(TRACKERS)) if os.path.isdir(out) else []
    if not found:
        return
    there = run_of(out)
    other = there[0] if there else None  # the method of a run there
    if not other:
        common.die(f"'{out}' holds {', '.join(found[:3])}, which {method}.py did not write: pass "
                   "a new or empty --output-dir")
    again = "--resume to continue it, or " if other == method else ""
    common.die(f"'{out}' already holds a run of {other}.py: pass {again}another --output-dir")


def open_lock(out):
    """OUTPUT_DIR made and its .lock opened (made if missing), or one line."""
    path = os.path.join(out, LOCK)
    try:
        os.makedirs(out, exist_ok=True)
        return open(path, "a+")
    except OSError as e:
        common.die(f"cannot write '{path}' ({e.strerror}): pass a writable --output-dir (a "
                   f"folder named {LOCK} in it: delete it)")


def tracker_packages(names):
    """--report-to's packages imported, or one line."""
    try:
        return {n: importlib.import_module(TRACKERS[n]) for n in names if n != "none"}
    except Exception as e:  # ImportError; a package of another version: any
        common.die(f"--report-to: {common.first_line(e)}; pip install it, or leave it out")


def flag_kind(value):  # a flag's type as --resume compares them (an int and a float alike)
    return "number" if type(value) in (int, float) else type(value)


def flags_said(names, values):  # "--name value, ..." of these flags
    return ", ".join(f"--{k.replace('_', '-')} {values.get(k)}" for k in names)


def restore_rng(rng, device):
    """The saved RNG states set: torch's, Python's, NumPy's, and CUDA's where it was saved."""
    torch.set_rng_state(rng[0].cpu())  # map_location may have put it on the device
    random.setstate(rng[1])
    name, keys, *rest = rng[2]  # NumPy's, its keys as a tensor
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if len(rng) == 4 and device.type == "cuda":  # saved on a GPU
        torch.cuda.set_rng_state(rng[3].cpu(), device)


def open_tracker(name, module, run):
    """--report-to NAME's run (rank 0; never prompting; docs/operations.md) -> send(values, step)"""
    if name == "tensorboard":  # events in RUN/tensorboard
        writer = module.SummaryWriter(os.path.join(run.dir, name))

        def send(values, step):
            for k, x in values.items():
                writer.add_scalar(k, x, step)
            writer.flush()
        return send
    options = {}
    if name == "wandb":  # not logged in: offline
        logged_in = module.login(prompt=False, verify=False)
        options = dict(id=run.record["id"], dir=run.dir, mode=None if logged_in else "offline")
    title = f"{os.path.basename(os.path.abspath(run.dir))}-{run.record['id']}"  # its own
    return module.init(project=run.method, config=run.flags, resume="allow", name=title,
                       **options).log


# ---------------------------------------------------------------- a save --------------------------
CARD = """---
library_name: sentence-transformers
pipeline_tag: sentence-similarity
tags:
- sentence-transformers
- sentence-similarity
- feature-extraction
- {method}
{base_model}---

# {name} sentence encoder{base}

A sentence encoder trained by `{method}.py` of *Sentence embeddings: reference implementations of
SSCL, JTCSE and BeLLM*, which implements {paper}.

## This model

This is the checkpoint of step {step}: {metric} {score:.2f} (the development score that selected
it).
{results}
## Use

```python
from sentence_transformers import SentenceTransformer

model = SentenceTransformer("{{this folder or its hub name}}"{trust})
embeddings = model.encode(["A man is playing a guitar.", "Someone plays music."])
```

{module_note}With the repository: `python eval_sts.py --model {{this folder}}` scores it
on STS12–16, STS-B and SICK-R.

## Training

`{method}.py`, with these flags (a path is given by its file name):

| flag | value |
|---|---|
{flags}
"""  # best/README.md, the model card (write_card fills it in)


def shown(value):
    """A flag's value as the card shows it: a local path by its file name (in a list too)."""
    if isinstance(value, list):
        return [shown(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return os.path.basename(value)
    return value


def write_card(folder, meta, flags, metric, table=None):
    """folder/README.md, the model card (CARD filled in), written whole, with no local path."""
    base = ""  # a base model given by its hub name, not a local path
    for k in ("model", "model_a"):
        v = flags.get(k)
        if isinstance(v, str) and not os.path.isabs(v) and not os.path.exists(v):
            base = v
            break
    modules = os.path.join(folder, "modules.json")  # write_st_files': st_module.py's class?
    custom = os.path.isfile(modules) and '"st_module.' in common.read_text(modules)
    trust, module_note = "", ""
    if custom and os.path.isfile(os.path.join(folder, "st_module.py")):
        trust = ", trust_remote_code=True"
        module_note = "Its `st_module.py` computes the embedding (`trust_remote_code`).\n"
    elif custom:
        module_note = ("This folder lacks the `st_module.py` that computes its embedding in "
                       "sentence-transformers:\ncopy it from the repository into this folder, "
                       "then load it with `trust_remote_code=True`.\n")
    rows = [f"| `--{k.replace('_', '-')}` | `{shown(v)}` |" for k, v in sorted(flags.items())
            if k != "output_dir"]
    paper = PAPERS[meta["method"]]
    text = CARD.format(
        method=meta["method"], step=meta["step"], metric=metric, score=meta[metric], paper=paper,
        name=paper.split()[0], base=f" ({base})" if base else "",
        base_model=f"base_model: {base}\n" if base else "", trust=trust, module_note=module_note,
        results=f"\nOn the test sets:\n\n```\n{table}\n```\n" if table else "",
        flags="\n".join(rows))
    common.write_whole(os.path.join(folder, "README.md"), lambda f: f.write(text.encode()))


def save_step(out, method, check_run, run, step, metric, dev, state, write, log, undo=do_nothing):
    """The training state and record (RECORD; dev None at a stop) replace checkpoint.pt, the commit;
    a new best goes whole into .best.new first (write(folder), sentemb.json). -> the record"""
    if dev is not None:  # a Python float (scipy's is NumPy's, which weights_only refuses)
        dev = float(dev)
    if dev is not None and not math.isfinite(dev):  # never a silent NaN: saved, then one line
        save_step(out, method, check_run, run, step, metric, None, state, write, log, undo)
        common.die(f"the {metric} at step {step} is {dev}: undefined for this model's embeddings "
                   f"(all alike?); the training state is saved in {out}")
    if not all(bool(torch.isfinite(v).all()) for v in state["model"].values()):
        common.die(f"the weights are no longer finite: not saved; {out} holds the last good "
                   "step: resume from it with a lower --lr (--resume --lr ...)")
    new_best = dev is not None and dev > run["best"]
    if dev is not None:  # the dev curve; metrics.jsonl's lines
        run = {**run, "curve": run["curve"] + [{"step": step, "metric": metric, "score": dev}],
               "log": run["log"] + [{"step": step, metric: dev}]}
    try:
        if new_best:
            run = write_best(out, run, step, metric, dev, state, write)
        state = {**state, **run}  # the commit:
        common.write_whole(os.path.join(out, CKPT), lambda f: torch.save(state, f), pause)
    except Exception as e:  # OSError; torch's and safetensors' writers on a full disk
        save_failed(out, e, undo)
    settle(out, method, check_run, state)  # .best.new renamed to best/
    if dev is not None:
        log(f"step {step:>5}  {metric} {dev:.2f}  (best {run['best']:.2f})")
    return run


def write_best(out, run, step, metric, dev, state, write):
    """A new best model whole in .best.new, on disk: write(folder)'s files, sentemb.json (its save
    id, step, score and files' fingerprints), README.md. -> the record naming it"""
    new = os.path.join(out, NEW)
    save = f"{step}-{os.urandom(4).hex()}"
    os.makedirs(new)
    write(new)
    prints = {os.path.relpath(os.path.join(root, f), new): common.fingerprint(
        os.path.join(root, f)) for root, _, files in os.walk(new) for f in files
        if f.endswith((".safetensors", ".pt", ".bin", ".py")) or f == "modules.json"}
    described = json.loads(json.dumps({**state["meta"], "save": save, "step": step,
                                       metric: dev, "fingerprints": prints}))
    with open(os.path.join(new, common.META), "w") as f:
        json.dump(described, f, indent=2)
    write_card(new, described, state["args"], metric)  # README.md
    for root, _, files in os.walk(new):  # on disk before the commit names it: each
        for name in files:  # file, then the folders' entries
            common.fsync(os.path.join(root, name))
        common.fsync(root)
    pause()  # killed before the commit: .best.new is no save (settle removes it)
    return {**run, "best": dev, "save": save, "described": described}


def save_failed(out, error, undo):
    """A save cut short: .best.new goes; a first save's: the folder as before the run (undo())."""
    shutil.rmtree(os.path.join(out, NEW), ignore_errors=True)
    full = getattr(error, "errno", None) == 28 or any(s in str(error) for s in (
        "unexpected pos", "file write failed", "os error 28", "No space left"))  # torch, Rust
    reason = "No space left on device" if full else getattr(error, "strerror", None) or str(error)
    if os.path.lexists(os.path.join(out, CKPT)):
        fix = "what was saved before is kept, and --resume continues from it"
    else:
        undo()
        fix = "nothing of this run was saved: run the same command again, without --resume"
    common.die(f"cannot save in {out} ({reason}): free disk space or pass another "
               f"--output-dir; {fix}")


def settle(run_dir, method, check_run, state=None):
    """What a kill left, by the save ids (lock held): the save checkpoint.pt names, checked, into
    best/; other .best.new, .best.old, .tmp files go; the views (*.jsonl) rewritten. -> state"""
    at = functools.partial(os.path.join, run_dir)
    ours = state is not None  # just written (a save's): no need to check it
    check_kinds(run_dir, method)
    if not state and os.path.lexists(at(CKPT)):
        state = read_checkpoint(run_dir, method)
    try:  # the committed save never goes: in best/, else in .best.new (rolled forward), else stop
        if state and state["save"] and committed(run_dir, method, state) == at(NEW):
            if not ours:  # a leftover: checked before it is used
                check_prints(at(NEW), read_meta(at(NEW), method, check_run, state))
            roll_forward(run_dir)  # the folder locked: a reader of best/ is never inside a swap
        for name in OURS - {LOCK}:  # a save never committed, the best model replaced, .tmp files
            if os.path.lexists(at(name)):
                (shutil.rmtree if name in (NEW, OLD) else os.remove)(at(name))
        if state:
            write_view(at(CURVE), state["curve"], even_empty=True)
            write_view(at(METRICS), state["log"], even_empty=False)  # an older run's: none
    except OSError as e:
        fix = "free disk space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
        common.die(f"cannot settle the run folder '{run_dir}' ({e.strerror}: {e.filename}): "
                   f"{fix}, then run again")
    return state


def check_kinds(run_dir, method):
    """Each of our names in the run folder a file, or a folder where we write one; or one line."""
    for name in OURS - {LOCK} | {CKPT, CURVE, METRICS, BEST}:
        path = os.path.join(run_dir, name)
        folder = name in (NEW, OLD, BEST)
        if os.path.lexists(path) and os.path.isdir(path) != folder:
            common.die(f"'{path}' is not the {'folder' if folder else 'file'} "
                       f"{method}.py writes there: delete it, then run again")


def roll_forward(run_dir):
    """.best.new, the committed save, renamed to best/ (the best/ before it to .best.old first)."""
    at = functools.partial(os.path.join, run_dir)
    with folder_lock(run_dir, "EX"):
        pause()
        if os.path.isdir(at(BEST)):
            os.replace(at(BEST), at(OLD))
            pause()
        os.replace(at(NEW), at(BEST))
        common.fsync(run_dir)
        pause()


def write_view(path, entries, even_empty):
    """A view of the record, a JSON line an entry, rewritten if it differs (empty: even_empty)."""
    lines = [json.dumps(common.finite_or_null(e), allow_nan=False) for e in entries]
    view = "".join(line + "\n" for line in lines).encode()  # a NaN (fp16's gnorm): null
    old = None
    if os.path.isfile(path):
        with open(path, "rb") as f:
            old = f.read()
    if view != old and (view or old or even_empty):
        common.write_whole(path, lambda f: f.write(view), pause)


def committed(run_dir, method, state=None):
    """The committed save's folder: best/, or .best.new (whole, not yet in place); or one line."""
    at = functools.partial(os.path.join, run_dir)
    if state is None and not os.path.lexists(at(CKPT)):
        return at(BEST)
    state = state or read_checkpoint(run_dir, method)
    save = state["save"]
    if save is None:
        common.die(f"'{run_dir}' holds no best model yet (no dev evaluation has saved one): train "
                   "on with the command that made it and --resume")
    for name in (BEST, NEW):
        if save_id(at(name)) == save:
            return at(name)
    common.die(f"{at(NEW if os.path.isdir(at(NEW)) else BEST, common.META)} does not name the save "
               f"{save} that {at(CKPT)} names (missing, damaged or another save's); nothing was "
               f"changed: {RECOPY}")


# ---------------------------------------------------------------- the readers ---------------------
def differs(found, want, whole=True, skip=()):
    """The first key of want (whole: or of found), not in skip, that found lacks or holds otherwise
    as JSON (numbers within 1e-6): (key, found's, want's as JSON, "none" where missing); None."""
    def same(a, b):  # numbers within 1e-6: a checksum computed on another device
        return a == b or {type(a), type(b)} <= {int, float} and math.isclose(a, b, rel_tol=1e-6)
    found, want = (json.loads(json.dumps(d, default=str)) for d in (found, want))
    for k in {**want, **(found if whole else {})}:
        if k not in skip and not (k in found and k in want and same(found[k], want[k])):
            return k, *(json.dumps(d[k]) if k in d else "none" for d in (found, want))


@contextlib.contextmanager
def reading(run, method, check_run, folder=None):
    """A reader: -> the committed save's folder, sentemb.json checked (run None: folder alone)."""
    if run is None:
        yield folder, read_meta(folder, method, check_run)
        return
    with contextlib.suppress(OSError), open(os.path.join(run, LOCK), "a+") as lock:
        if flock(lock, "EX", "NB"):
            settle(run, method, check_run)
    with folder_lock(run, "SH"):  # one checkpoint read: a commit may follow while inside
        state = read_checkpoint(run, method) if os.path.lexists(os.path.join(run, CKPT)) else None
        folder = committed(run, method, state)
        yield folder, read_meta(folder, method, check_run, state)


def load_checkpoint(path, device="cpu"):
    """checkpoint.pt as torch.load(weights_only=True) reads it (tensors, numbers, strings, and
    lists, tuples and dicts of them; never code), or one line."""
    try:
        return torch.load(path, map_location=device, weights_only=True, mmap=True)
    except Exception as e:  # truncated, empty, not a torch file: torch raises many types
        if "Weights only load failed" in str(e):  # a pickle of more than these: never read
            run_dir = os.path.dirname(path) or "."
            common.die(f"{path} holds more than tensors, numbers and strings (a checkpoint of an "
                       "earlier version, or not ours), and reading it could run code: it is not "
                       "read; if you trust where it comes from, convert it: python convert_run.py "
                       f"{run_dir}")
        common.die(f"{path} cannot be read ({type(e).__name__}); it is damaged: {RECOPY}")


def rng_state(v):
    """Whether v is a saved RNG state: (CPU's, Python's, NumPy's with its keys a tensor[, CUDA's:
    saved on a GPU])."""
    if not isinstance(v, (tuple, list)) or len(v) not in (3, 4):
        return False
    numpy_state = v[2]
    if not isinstance(numpy_state, tuple) or len(numpy_state) != 5:
        return False
    tensors = [v[0], numpy_state[1], *v[3:]]
    return all(map(torch.is_tensor, tensors)) and isinstance(v[1], tuple)


def is_rows(v, *keys):
    """A list of dicts, each with an int "step" and a number at each key (the curve, the log)."""
    return isinstance(v, list) and all(
        isinstance(e, dict) and type(e.get("step")) is int
        and all(isinstance(e.get(k), (int, float)) for k in keys) for e in v)


FIELDS = {"model": lambda v: isinstance(v, dict) and all(map(torch.is_tensor, v.values())),
          "opt": lambda v: isinstance(v, dict) and {"state", "param_groups"} <= set(v),
          "sched": lambda v: isinstance(v, dict), "meta": lambda v: isinstance(v, dict),
          "rng": rng_state,
          "args": lambda v: isinstance(v, dict) and isinstance(v.get("lr"), float),
          "step": lambda v: type(v) is int and v >= 0, "world": lambda v: type(v) is int and v > 0,
          "best": lambda v: isinstance(v, (int, float)), "log": is_rows,
          "save": lambda v: v is None or isinstance(v, str),
          "described": lambda v: v is None or isinstance(v, dict),
          "curve": lambda v: is_rows(v, "score"), "id": lambda v: v is None or isinstance(v, str)}


def read_checkpoint(run_dir, method, device="cpu"):
    """checkpoint.pt of a run of method's script, every field of its type (FIELDS), or one line."""
    path = os.path.join(run_dir, CKPT)
    state = load_checkpoint(path, device)
    if not isinstance(state, dict) or state.get("method") != method:
        common.die(f"{path} was not written by {method}.py: pass a run folder of {method}.py")
    if "save" not in state and "step" in state:
        common.die(f"{path} predates best/ (an earlier {method}.py's run): eval_sts.py reads it, "
                   f"the {method}.py that wrote it resumes it")
    state = {"described": None, "log": [], "id": None, **state}  # an earlier version's lacks them
    bad = [k for k, good in FIELDS.items() if k not in state or not good(state[k])]
    if bad:
        common.die(f"{path} is damaged ({bad[0]} missing or of the wrong type): {RECOPY}")
    return state


def read_meta(folder, method, check_run, state=None):
    """The sentemb.json of a model method's script saved, checked by check_run and (state: the
    checkpoint naming its save) against the one it records (older runs': its meta); or one line."""
    path = os.path.join(folder, common.META)
    meta = common.read_json(path, f"cannot load '{folder}'", RECOPY)
    if meta.get("method") != method:
        common.die(f"{path} is not a run description of {method}.py (method "
                   f"{meta.get('method')!r}): {RECOPY}")
    check_run(folder, meta)
    bad = differs(meta, state["described"] or state["meta"], state["described"] is not None,
                  skip=MOVABLE) if state else None  # as the checkpoint naming its save records it
    if bad:
        ckpt = os.path.join(os.path.dirname(folder), CKPT)
        common.die(f"{path}: {bad[0]} {bad[1]} disagrees with {ckpt}, whose save {state['save']} "
                   f"has {bad[0]} {bad[2]}: the file was edited or is another save's; {RECOPY}")
    return meta


def check_prints(folder, meta):
    """Each weight file of a saved model is its save's (sentemb.json's fingerprints; older runs
    have none), or one line: checked after loading, which names a damaged file first."""
    path = os.path.join(folder, common.META)
    prints = meta.get("fingerprints", {})
    if not isinstance(prints, dict):
        common.die(f"{path} is damaged (fingerprints of the wrong type): {RECOPY}")
    bad = [f for f, v in prints.items() if common.fingerprint(os.path.join(folder, f)) != v]
    if bad:
        common.die(f"{os.path.join(folder, bad[0])} is not the file of the save {meta.get('save')} "
                   f"that {path} describes (another save's, or damaged): {RECOPY}")


def run_of(name):
    """NAME to a reader: (method, run folder, model folder) for a run folder of ours or its best/;
    (method, None, NAME) for a copy of best/ (or a run of the layout before it); None: a model."""
    up, base = os.path.split(os.path.abspath(name))
    run = up if base == BEST and os.path.isfile(os.path.join(up, CKPT)) else name
    at = functools.partial(os.path.join, run)
    if not os.path.lexists(at(CKPT)) and not os.path.isdir(at(BEST)) and \
            any(os.path.lexists(at(n)) for n in (NEW, CKPT + ".tmp")):
        common.die(f"'{run}' is a run folder with no committed save yet (killed in its first save):"
                   " run the command that made it again, without --resume: it starts over")
    if os.path.isdir(at(BEST)) or os.path.isfile(at(CKPT)) and not os.path.isfile(at(common.META)):
        with contextlib.suppress(Exception), open(at(BEST, common.META)) as f:
            return json.load(f)["method"], run, at(BEST)
        state = load_checkpoint(at(CKPT))  # no best model yet (or a damaged one): it names it
        if not isinstance(state, dict) or not isinstance(state.get("method"), str):
            common.die(f"'{run}' is a run folder without a readable best/{common.META} or "
                       f"{CKPT}: {RECOPY}")
        return state["method"], run, at(BEST)
    meta = os.path.join(name, common.META)
    if os.path.isfile(meta):
        with contextlib.suppress(Exception):
            return json.loads(common.read_text(meta))["method"], None, name
        return "?", None, name  # the reader names the damaged file


def save_id(folder):
    """The save that a model folder of ours holds (its sentemb.json's "save"; None: unreadable)."""
    with contextlib.suppress(OSError, ValueError, AttributeError), \
            open(os.path.join(folder, common.META)) as f:
        return json.load(f).get("save")


# ---------------------------------------------------------------- the file system -----------------
def pause():
    """An instant between a save's writes: SENTEMB_KILL_AT=N kills, SENTEMB_SAVE_PAUSE=s waits."""
    STOP["writes"] += 1
    if STOP["writes"] == int(os.environ.get("SENTEMB_KILL_AT", 0)):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("SENTEMB_SAVE_PAUSE", 0)))


def flock(f, *how):
    """An advisory lock on an open file or folder till closed or exit; -> False: "NB" and held."""
    if not fcntl:  # Windows: no advisory locks
        return True
    try:
        fcntl.flock(f, sum(getattr(fcntl, "LOCK_" + h) for h in how))
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def folder_lock(folder, how):
    """The folder locked while inside: "EX" while a save swaps best/, "SH" while a reader loads."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        yield flock(fd, how)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the step lines' meter -----------
class Meter:
    """The step lines' speed: `with meter.step(step_model):` around each step; line(): rows (unit),
    tokens (.tokens), FLOPs (the first step's per padded slot, times .slots) a second, MFU (known
    GPUs), since the last, all ranks (.values); timed on the device (CUDA events read in line())."""

    def __init__(self, device, per_step, unit, precision="fp32"):
        self.device = device
        self.per_step = per_step  # rows a step, all ranks
        self.unit = unit
        self.precision = precision
        self.per_slot = None  # FLOPs a padded token slot: the first step's count
        self.spans = []  # (start, end) of each step since the last line
        self.flops = 0
        self.tokens = 0

    def now(self):  # an instant on the device's clock: a recorded CUDA event, or the host's time
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def step(self, step_model):
        """One step, timed. Its FLOPs: the first step's counted op by op (common.FlopCount, a
        dispatch mode: that step runs slower), per padded token slot; later steps': that × slots."""
        start = self.now()
        slots = step_model.slots  # the padded token slots run so far
        if self.per_slot is None:  # the first step: every op counted
            with common.FlopCount() as counted:
                yield
            self.per_slot = counted.flops / max(step_model.slots - slots, 1)
        else:
            yield
        self.flops += self.per_slot * (step_model.slots - slots)
        self.spans.append((start, self.now()))

    def line(self):
        """The speeds since the last line, all ranks (kept in .values); counted anew from here."""
        cuda = self.device.type == "cuda"
        unit = f"{self.unit}/s"
        if cuda:  # the steps' kernels done: their events read
            torch.cuda.synchronize(self.device)
        dt = sum(a.elapsed_time(b) / 1e3 if cuda else b - a for a, b in self.spans)
        both = torch.tensor([float(self.tokens), float(self.flops)], device=self.device)
        if torch.distributed.is_initialized():  # all ranks'
            collective(torch.distributed.all_reduce, both)
        tokens, flops = (both / dt).tolist()
        v = {unit: self.per_step * len(self.spans) / dt}
        if tokens:
            v["tok/s"] = tokens
        v["TFLOP/s" if cuda else "GFLOP/s"] = flops / (1e12 if cuda else 1e9)
        name = torch.cuda.get_device_name(self.device) if cuda and self.precision != "fp32" else ""
        peak = next(((k, p) for k, p in common.GPU_PEAKS.items() if k in name), None)  # MFU's
        if peak:
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            v["MFU"] = 100 * flops / (world * peak[1])
        self.spans = []
        self.flops = 0
        self.tokens = 0
        self.values = v
        places = {"tok/s": 0, unit: 2}  # decimals (the others: 1)
        text = "  ".join(f"{k} {x:.{places.get(k, 1)}f}" for k, x in v.items())
        return text + (f"% of {peak[0]} {self.precision}" if peak else "")
