"""What the scripts (sscl.py, jtcse.py, bellm.py) and the tools (eval_sts.py, the analyses, bench/)
share, and no equation of a paper: the data, argument types, strict loading of model folders (one
line naming a broken file), the steps' rows, length groups, batched encoding, FLOP counts,
sentence-transformers files, and the STS evaluation (SentEval's "all" setting; Spearman x 100) of
any encode(list[str]) -> (N, H). It imports no module of the project (harness.py: the run)."""
import argparse
import codecs
import contextlib
import functools
import json
import math
import os
import re
import shutil
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.utils._pytree as pytree
from scipy.stats import spearmanr
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R"]
STS_SUBSETS = {  # SentEval's subsets (STS13 SMT is withheld by its licence, as in SentEval)
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"]}
# holds senteval.tar, wiki1m_for_simcse.txt, nli_for_simcse.csv
HUB_DATASET = "princeton-nlp/datasets-for-simcse"
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "sentemb")
META = "sentemb.json"  # in every saved model of ours (RUN/best): how eval_sts.py must encode it
BEST = "best"  # a run folder's best model (harness.py), named in the loaders' messages


def die(msg):
    """Bad input: one line that names the fix, exit code 2, no traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def finite_or_null(value):
    """value as strict JSON holds it: each float that is not finite (NaN, inf) as None (null), in
    lists and dicts too (json.dumps would write NaN, which JSON readers refuse)."""
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_whole(path, write, pause=None):
    """Replace the file at path whole (--json, --plot, harness.py's saves): write(f) fills path.tmp,
    synced and renamed over path, the folder synced: a kill or a full disk leaves the old file or
    the new, never a mix (an error removes .tmp). pause(): before the sync (where tests kill)."""
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


def fsync(path):
    """A file's data, or a folder's entries (renames), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fingerprint(path):
    """A file's CRC-32 and size, one pass over its bytes, once a process (None: no such file)."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        return _crc(path, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.cache  # by the file's identity: a file replaced or written again is read again
def _crc(path, *identity):
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
        return f"{crc:08x}-{f.tell()}"

QUIET = False  # --quiet: no progress bars


def progress(iterable, desc, total=None, unit="it"):
    """A progress bar (tqdm, stderr) for long loops; off when stderr is no terminal, or --quiet."""
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=False, file=sys.stderr,
                disable=True if QUIET else None)


def pick_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}  # autocast's dtype


def pick_precision(device, chosen=None, say=False):
    """--precision on this device: by default bf16, fp16 on a GPU without bf16 (say: one line says
    so), fp32 on a CPU; bf16 on a GPU without it: one line, exit 2."""
    bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if chosen == "bf16" and not bf16:
        die("--precision bf16: this GPU has no bf16: pass --precision fp16 (or fp32)")
    if say and not (chosen or bf16):
        print("note: this GPU has no bf16: fp16 autocast, with a gradient scaler", file=sys.stderr)
    if device.type != "cuda":
        return chosen or "fp32"
    return chosen or ("bf16" if bf16 else "fp16")


def autocast(device, precision=None):
    """Autocast in precision: bf16 or fp16; fp32: none; None: the caller's (nothing changes)."""
    if precision is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, PRECISIONS[precision], precision != "fp32")


def decay_groups(model, weight_decay):
    """HF Trainer's AdamW parameter groups: the trained weights decay by weight_decay, but biases
    and norm weights (LayerNorm, RMSNorm) do not (transformers 4.2.1's trainer.py L553:
    `no_decay = ["bias", "LayerNorm.weight"]`; 4.38's L962-970, by the norm's type)."""
    norms = {id(q) for m in model.modules() if "norm" in type(m).__name__.lower()
             for q in m.parameters(recurse=False)}
    trained = [(name, q) for name, q in model.named_parameters() if q.requires_grad]
    decayed = [q for name, q in trained if "bias" not in name and id(q) not in norms]
    not_decayed = [q for name, q in trained if "bias" in name or id(q) in norms]
    groups = zip((decayed, not_decayed), (weight_decay, 0.0))
    return [{"params": g, "weight_decay": wd} for g, wd in groups if g]


def check_keys(path, meta, required, optional):
    """sentemb.json's keys (optional: those older runs lack), each of its type, or one line."""
    bad = [k for k, ok in required.items() if k not in meta or not ok(meta[k])]
    bad += [k for k, ok in optional.items() if k in meta and not ok(meta[k])]
    if bad:
        die(f"{path} is not a run description of sscl.py, jtcse.py or bellm.py ({', '.join(bad)} "
            "missing or of the wrong type): re-save the run, or delete the file to load the "
            "folder as a plain model")


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
    """The folder of SimCSE's senteval.tar, unpacked (downstream/STS, downstream/SICK): --data-dir,
    else $SENTEMB_DATA, else ~/.cache/sentemb/senteval (downloaded when missing)."""
    root = flag or os.environ.get("SENTEMB_DATA") or os.path.join(CACHE, "senteval")
    for d in (os.path.join(root, "downstream"), root):  # accept the folder itself or its parent
        if os.path.isdir(os.path.join(d, "STS")) and os.path.isdir(os.path.join(d, "SICK")):
            return d
    tar = None if flag or os.environ.get("SENTEMB_DATA") else _from_hub("senteval.tar")
    if tar:
        import tarfile
        with tarfile.open(tar) as t:
            t.extractall(root, filter="data")
        return senteval_dir(root)
    die(f"no STS data in '{root}': pass --data-dir DIR or set SENTEMB_DATA=DIR, where "
        "DIR/downstream/STS/STS12-en-test/... and DIR/downstream/SICK/... are SimCSE's "
        "senteval.tar, unpacked")


def sts_data(flag=None, tasks=TASKS):
    """senteval_dir, STS-B dev and the tasks' test sets read now (a bad file stops a run first)."""
    data = senteval_dir(flag)
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
    downloaded = None if path else _from_hub(hub_name)
    if downloaded:
        return downloaded
    die(f"training file '{path or hub_name}' not found: pass --train FILE "
        f"(SimCSE's {hub_name} from the hub dataset {HUB_DATASET}, or any file in its format)")


def read_text(path):
    """A whole UTF-8 text file, newlines as open() translates them, without a spreadsheet's
    byte-order mark; anything else is a bad input naming the file and the line."""
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


def read_sentences(path, hub_name="wiki1m_for_simcse.txt"):
    """--train's sentences, one a line (no --train: SimCSE's hub_name); blank lines are skipped."""
    path = train_file(path, hub_name)
    sents = [line.strip() for line in read_text(path).split("\n") if line.strip()]
    if not sents:
        die(f"'{path}' has no sentences: pass a --train file with one sentence per line")
    return sents


# ---------------------------------------------------------------- argument types ----------------
def _typed(convert, ok, text):
    def parse(s):
        with contextlib.suppress(ValueError):
            v = convert(s)
            if ok(v):
                return v
        raise argparse.ArgumentTypeError(f"{s!r} is not {text}")
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
    --compile is checked to work before anything is read or written; --precision: this device's."""
    a = p.parse_args()
    if getattr(a, "max_steps", -1) != -1 and a.epochs != p.get_default("epochs"):
        die("--max-steps sets the run's length, so --epochs would do nothing: drop one of them")
    if getattr(a, "compile", False):
        check_compile()
    global QUIET
    QUIET = a.quiet
    a.precision = pick_precision(pick_device(), getattr(a, "precision", None), "precision" in a)
    import transformers
    transformers.logging.disable_progress_bar()
    return a


def show_ranges(parser):
    """Append each typed argument's allowed range to its --help text."""
    for act in parser._actions:
        if hasattr(act.type, "range") and act.help:
            act.help += f" [{act.type.range}]"


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
    """What a folder with a run description (sentemb.json, or best/sentemb.json) is; else None."""
    best = os.path.join(folder, BEST)
    if os.path.isfile(os.path.join(best, META)):
        return f"a run folder whose best model, {best}, is {run_kind(best)}"
    if not os.path.isfile(os.path.join(folder, META)):
        return None
    with contextlib.suppress(Exception):
        return RUN_KINDS[json.loads(read_text(os.path.join(folder, META)))["method"]]
    return "a run folder (it holds a sentemb.json)"


def check_hf_folder(folder, kind, where, fix=REFETCH):
    """A local folder holds whole what from_pretrained reads for kind (config, tokenizer, model)."""
    def has(name):
        return os.path.isfile(os.path.join(folder, name))
    if kind == "tokenizer":
        found = any(map(has, TOKENIZER_FILES))
        needs = "tokenizer file"
    else:
        found = has("config.json")
        needs = "config.json"
    run = None if found else run_kind(folder)
    if run:  # say what it is before naming a missing file
        die(f"{where}: it is {run}, not a model folder (no {needs}): pass it to eval_sts.py "
            "--model without --pooler, which reads run folders, or pass a model folder")
    for f in READS[kind]:
        if os.path.exists(os.path.join(folder, f)):
            read_json(os.path.join(folder, f), where, REFETCH)
    if kind == "tokenizer" and not found:
        die(f"{where}: tokenizer.json is missing (no tokenizer file at all): pass a model "
            f"folder with its tokenizer, or {REFETCH}")
    if kind != "tokenizer" and not found:
        die(f"{where}: config.json is missing (not a model folder, or an incomplete "
            f"copy): pass a model folder, or {REFETCH}")
    config = os.path.join(folder, "config.json")
    if kind != "tokenizer" and "model_type" not in read_json(config, where, REFETCH):
        die(f"{where}: config.json is damaged (no model_type): {REFETCH}")
    if kind == "model":
        _check_weights_file(folder, where, fix)


def _check_weights_file(folder, where, fix):
    """A model folder's weights: a file of them, its safetensors header whole, config.json's."""
    weights = next((f for f in WEIGHT_FILES if os.path.isfile(os.path.join(folder, f))), None)
    if weights is None:
        die(f"{where}: model.safetensors is missing (no weights file): {REFETCH}")
    if weights == "model.safetensors":
        safetensors_keys(os.path.join(folder, weights), where, REFETCH)
    if weights.startswith("model.safetensors"):
        check_weights(folder, where, fix)


def _shapes(folder):
    """name -> shape of every tensor in a folder's model.safetensors (or shards), from headers."""
    from safetensors import safe_open
    index = os.path.join(folder, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.isfile(index):  # sharded
        files = sorted(set(read_json(index, folder, REFETCH).get("weight_map", {}).values()))
    shapes = {}
    for name in files:
        with safe_open(os.path.join(folder, name), "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in list(f.keys())})
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
    """A local model folder's weights are the model its config.json describes (built on the meta
    device): no tensor its own modules lack (a config cut to fewer layers), each in its shape; heads
    beside it (cls.*, lm_head.*) unread; missing weights are refused at load (load_pretrained)."""
    from transformers import AutoConfig, AutoModel
    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModel.from_config(config)
    except Exception:  # an architecture AutoModel cannot build: its loader says why
        return
    odd, wrong = _mismatches(model, folder)
    said = f"config.json describes {config.model_type}"
    if hasattr(config, "hidden_size"):
        said += f" with {config.num_hidden_layers} layers, hidden size {config.hidden_size}"
    if odd:
        above = sorted({i for i in map(_layer, odd) if i is not None})
        which = f"layers {above[0]}..{above[-1]}, " if above else ""
        die(f"{where}: model.safetensors holds {len(odd)} weights that config.json does "
            f"not describe ({which}{odd[0]}{', ...' if len(odd) > 1 else ''}; {said}): the two "
            f"files are of different models; {fix}")
    if wrong:
        key, shape, implied = wrong[0]
        die(f"{where}: model.safetensors holds {key} of shape {list(shape)} where "
            f"config.json implies {list(implied)} ({len(wrong)} such weights; {said}): "
            f"the two files are of different models; {fix}")


def _mismatches(model, folder):
    """check_weights' comparison: the keys model lacks, (key, shape, model's) of other shapes."""
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
    return odd, wrong


def load_pretrained(cls, name, strict=False, fresh=None, num_layers=None, label=None, **kw):
    """cls.from_pretrained(name, **kw) for a config, tokenizer or model class, from a hub name or a
    local folder (check_hf_folder first), or one line naming the broken file and the fix. A model
    whose weights lack any of its parameters is refused (transformers would initialise them at
    random); strict=False tolerates a missing BERT pooler (roberta-base's). fresh: a prefix of
    weights that may be missing and are then trained from transformers' initialisation (said on
    stderr). num_layers: the model cut to its first N layers (SSCL Table 1), as transformers
    builds it; saved, an N-layer model. label: names the model in errors (a variable: MINILM)."""
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
    if "Tokenizer" in cls.__name__:
        kind = "tokenizer"
    elif "Config" in cls.__name__:
        kind = "config"
    else:
        kind = "model"
    where = f"cannot load {label + '=' if label else ''}'{name}'"
    local = os.path.isdir(name)
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
    new = sorted(k for k in info["missing_keys"] if k.startswith(fresh)) if fresh else []
    if new:
        print(f"note: '{name}' has no {fresh}* weights ({', '.join(new)}): they start from "
              "transformers' initialisation (seeded) and are trained", file=sys.stderr)
    _check_loaded(model, info, where, local, strict, fresh, kw.get("num_hidden_layers"))
    return model


def _check_loaded(model, info, where, local, strict, fresh, cut):
    """load_pretrained's checks of transformers' loading report (info): no weight odd or missing."""
    owns = {k: _own(model, k) for k in info["unexpected_keys"]}  # None: a head beside it, unread
    odd = sorted(k for k, own in owns.items() if own is not None
                 and not (cut and (_layer(own) or 0) >= cut))  # a layer above the cut: dropped
    if odd:  # local folders were checked before (check_weights): this is a hub model
        die(f"{where}: its weights hold {len(odd)} tensors its config does not describe "
            f"({odd[0]}{', ...' if len(odd) > 1 else ''}): the two are of different models; "
            f"{REFETCH}")
    missing = sorted(k for k in info["missing_keys"] if (strict or not k.startswith("pooler."))
                     and not (fresh and k.startswith(fresh)))
    if missing:
        weights = "model.safetensors" if local else "its weights"
        die(f"{where}: {weights} lacks {len(missing)} of the model's weights ({missing[0]}"
            f"{', ...' if len(missing) > 1 else ''}): it is damaged or another model's; "
            f"{REFETCH}")


def check_num_layers(num_layers, config, name, flag="--num-layers"):
    """A cut keeps 1 to all of the model's layers (None: no cut)."""
    n = config.num_hidden_layers
    if num_layers is not None and not 1 <= num_layers <= n:
        die(f"{flag} {num_layers}: '{name}' has {n} layers (num_hidden_layers in its "
            f"config.json): pass 1 to {n}")


def positions(config):
    """The tokens a model reads: max_position_embeddings, less RoBERTa's offset (514 hold 512)."""
    n = getattr(config, "max_position_embeddings", None)
    return n - config.pad_token_id - 1 if n and config.model_type in ROBERTA_LIKE else n


ROBERTA_LIKE = ("roberta", "xlm-roberta", "camembert")  # RobertaEmbeddings' position ids


def check_max_len(max_len, config, name, flag="--max-len", extra=0):
    """A token limit (plus extra tokens around it) that fits the model's positions, or one line."""
    limit = positions(config)
    if limit and max_len + extra > limit:
        plus = f" plus the prompt's {extra} tokens" if extra else ""
        fix = f"set it to {limit - extra} or less"
        if flag.startswith("--"):
            fix = f"pass {flag} {limit - extra} or less"
        die(f"{flag} {max_len}{plus} is more than the {limit} positions of '{name}' "
            f"(max_position_embeddings in its config.json): {fix}")
    return max_len


# ---------------------------------------------------------------- sentence-transformers -------
ST_MODULE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "st_module.py")


def write_st_files(folder, hidden=None, max_len=None, pooler="cls", dense=None):
    """Beside a plain HF model folder, the files of a sentence-transformers folder (Transformer ->
    Pooling, cls or avg [-> Dense: dense, sscl.py --proj-dim's state dict, its weights written to
    2_Dense/model.safetensors]): SentenceTransformer(folder) encodes as our scripts evaluate (no
    normalisation: cosine needs none). pooler a class of st_module.py (JTCSETwin, BeLLM): one
    module of ours, st_module.py copied in, which reads sentemb.json (trust_remote_code=True)."""
    if pooler not in ("cls", "avg"):
        if os.path.exists(ST_MODULE):  # a copied script without it: harness.Run said so
            shutil.copyfile(ST_MODULE, os.path.join(folder, "st_module.py"))
        with open(os.path.join(folder, "modules.json"), "w") as f:
            return json.dump([{"idx": 0, "name": "0", "path": "", "type": f"st_module.{pooler}"}],
                             f, indent=2)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling")]
    if dense:
        modules.append(("2_Dense", "Dense"))
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
        files["2_Dense/config.json"] = {"in_features": hidden, "out_features": len(dense["weight"]),
                                        "bias": True,
                                        "activation_function": "torch.nn.modules.linear.Identity"}
    for name, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=2)
    if dense is not None:  # sentence-transformers' Dense names them linear.*
        from safetensors.torch import save_file
        weights = {f"linear.{k}": v.detach().contiguous().cpu() for k, v in dense.items()}
        save_file(weights, os.path.join(folder, "2_Dense", "model.safetensors"))


# ---------------------------------------------------------------- the steps and their batches ---
def step_rows(n, per_step, epochs, max_steps, seed):
    """The row indices of every optimisation step, the same on every rank: epoch e is a permutation
    of range(n) drawn from seed + e, cut into steps of per_step rows (all ranks' micro-batches), the
    last incomplete step dropped. max_steps N (not -1): N steps, over the epochs they need."""
    if n < per_step:
        die(f"{n} training rows < {per_step} per step: lower --batch-size or --grad-accum")
    per_epoch = n // per_step
    total = epochs * per_epoch if max_steps < 0 else max_steps
    steps = []
    for e in range(math.ceil(total / per_epoch)):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist()
        steps += [order[i * per_step:(i + 1) * per_step] for i in range(per_epoch)]
    return steps[:total]


def ahead(items, n=2):
    """items' values, each made on a background thread up to n ahead of the loop that reads them:
    the next steps' batches tokenised on the host while the device runs this one (torch and the
    tokenizer release the GIL). The same values in their order; an error there is raised here.
    items must share no tokenizer with the loop (a fast tokenizer is not thread-safe)."""
    items, end = iter(items), object()
    with ThreadPoolExecutor(1) as thread:  # one thread: the values made in their order
        made = [thread.submit(next, items, end) for _ in range(n)]
        while (x := made.pop(0).result()) is not end:
            made.append(thread.submit(next, items, end))
            yield x


GROUP_COST = 64  # a forward pass's fixed cost, in token slots (bench/length_groups.py measures it)


def length_groups(lengths, cost=GROUP_COST):
    """Real tokens a row -> groups of row indices, shortest first, cut to minimise Σ_groups (rows x
    longest + cost): padded token slots plus a forward's fixed cost (dynamic programming, O(d²))."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best, cut = {0: 0}, {}  # best[j]: order[:j]'s least cost, its last group order[cut[j]:j]
    for j in range(1, len(order) + 1):  # a cut between two rows of one length never pays
        if j == len(order) or lengths[order[j]] > lengths[order[j - 1]]:
            best[j], cut[j] = min((best[i] + (j - i) * lengths[order[j - 1]] + cost, i)
                                  for i in best)  # last group order[i:j], padded to its longest
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def on_device(v, device):
    """A host tensor copied to device, the host not waiting: on CUDA from pinned memory."""
    return (v.pin_memory() if device.type == "cuda" else v).to(device, non_blocking=True)


def in_length_groups(forward, grouped=True, device=None, cost=GROUP_COST):
    """forward(batch, ...)'s outputs ((N, ...) tensors, in tuples or lists; up to float rounding)
    for the real tokens' cost: computed on length_groups of the rows (grouped=False: one). batch:
    the tokenizer's (N, L), padded on either side, on the host. .slots: the token slots computed."""
    def run(batch, *args, **kw):
        mask = batch["attention_mask"]  # (N, L), on the host: a GPU is not waited for
        lengths = mask.sum(1).tolist()
        dev = device or mask.device
        groups = length_groups(lengths, cost if grouped else math.inf)
        run.slots += sum(len(g) * max(lengths[i] for i in g) for g in groups)
        if len(groups) == 1:
            return forward({k: on_device(v, dev) for k, v in batch.items()}, *args, **kw)
        return _in_groups(forward, batch, groups, lengths, dev, args, kw)
    run.slots = 0
    return run


def _in_groups(forward, batch, groups, lengths, device, args, kw):
    """forward on each group of rows, padded to its own longest and copied to device; row order."""
    left = not bool(batch["attention_mask"][:, 0].all())  # left padding: the pad slots come first
    parts = []
    for g in groups:
        idx = torch.tensor(g)
        L = max(lengths[i] for i in g)
        rows = {k: v[idx, -L:] if left else v[idx, :L] for k, v in batch.items()}  # (n_g, L_g)
        parts.append(forward({k: on_device(v, device) for k, v in rows.items()}, *args, **kw))
    inv = on_device(torch.tensor([i for g in groups for i in g]).argsort(), device)  # -> rows
    def in_row_order(*outputs):  # one output of every group, concatenated in row order
        return None if outputs[0] is None else torch.cat(outputs)[inv]
    return pytree.tree_map(in_row_order, *parts)


class FlopCount(TorchDispatchMode):
    """`with FlopCount() as c:` c.flops counts the FLOPs of the matrix products run inside (forward
    and backward) by torch's FlopCounterMode's formulas, without its per-module bookkeeping."""
    flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **(kwargs or {}), out_val=out)
        return out


# dense bf16 tensor-core peaks, FLOP/s (NVIDIA's datasheets; with sparsity they say twice these;
# fp16's are the same): a step line's MFU in bf16 or fp16; the first name in the device's applies
GPU_PEAKS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200 NVL": 835e12,
             "H200": 989e12, "A100": 312e12}

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


@contextlib.contextmanager
def evaluating(model):
    """The block run with model (None: as it is) in eval mode, its training mode then restored."""
    training = model is not None and model.training
    if training:
        model.eval()
    try:
        yield
    finally:
        if training:
            model.train()


def encoder(embed, tokenizer, max_len, device, precision=None, model=None):
    """Each method's encode(list[str]) -> (N, H): .embed(batch dict) -> (b, H) over length-sorted
    batches, in precision (None: the caller's), no gradients, model (embed's net) in eval mode."""
    @torch.no_grad()
    def encode(sentences):
        with autocast(device, precision), evaluating(model):
            return encode_in_batches(encode.embed, tokenizer, sentences, max_len, device)
    encode.tokenizer = tokenizer  # (--ensemble)
    encode.max_len = max_len
    encode.embed = embed
    return encode


@functools.cache  # once a process and backend (common.parse, then compiled_*)
def check_compile(backend="inductor"):
    """--compile where torch.compile cannot run, found before any work (a tiny function compiled
    on the device: inductor on a CPU needs a C++ compiler): one line naming the fix."""
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
    """model, each Transformer layer compiled in place when on (regional compilation, for BeLLM's
    decoder): the layers of a class share one graph, so compiling costs a layer's tracing, not the
    model's (SmolLM2-135M: a minute, not a quarter of an hour); the rest runs eager."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    if on:
        check_compile(backend)
        for m in model.modules():
            if isinstance(m, GradientCheckpointingLayer):
                m.compile(dynamic=True, backend=backend)  # in place: the state_dict keeps its keys
    return model


def compiled_encode(encode, on=True, backend="inductor"):
    """encode (encoder's, bellm.make_encode's), compiled when on: its embed whole (dynamic shapes:
    batches of other sizes reuse its code), or its .layers (a decoder LLM's) one by one."""
    if on and getattr(encode, "layers", None) is not None:
        compiled_layers(encode.layers, backend=backend)
    elif on:
        check_compile(backend)
        encode.embed = torch.compile(encode.embed, dynamic=True, backend=backend)
    return encode


def encode_once(encode, sentences, device="cpu"):
    """Each distinct sentence encoded once, in one call -> embed(list[str]) -> (n, H) on device."""
    distinct = sorted(set(sentences))
    cache = dict(zip(distinct, encode(distinct).float().to(device)))
    return lambda sents: torch.stack([cache[s] for s in sents])


# ---------------------------------------------------------------- STS data ----------------------
def _lines(path):
    if not os.path.isfile(path):
        die(f"missing {path}: the STS data folder is incomplete; unpack senteval.tar again or fix "
            "--data-dir")
    lines = read_text(path).split("\n")
    return lines[:-1] if lines[-1] == "" else lines  # as a file iterates: none after the last \n


def _row(path, i, s1, s2, gold):
    """(sent1, sent2, score) as SentEval reads them: words re-joined with single spaces."""
    try:
        return " ".join(s1.split()), " ".join(s2.split()), float(gold)
    except ValueError:
        die(f"{path}, line {i}: malformed line (expected a score, got {gold!r}); fix it or "
            "re-download senteval.tar")


def load_sts(data, task, split="test"):
    """{subset: [(sent1, sent2, gold)]}; pairs with an empty gold line dropped (as SentEval)."""
    if task in STS_SUBSETS:
        folder = os.path.join(data, "STS", f"{task}-en-test")
        return check_gold({name: _subset(folder, name) for name in STS_SUBSETS[task]}, folder)
    path, skip, cols = _one_file(data, task, split)
    rows = []
    for i, line in enumerate(_lines(path)[skip:], skip + 1):
        fields = line.split("\t")
        if len(fields) <= max(cols):
            die(f"{path}, line {i}: malformed line (expected at least "
                f"{max(cols) + 1} tab-separated fields); fix it or re-download senteval.tar")
        rows.append(_row(path, i, *(fields[c] for c in cols)))
    return check_gold({split: rows}, path)


def _subset(folder, name):
    """An STS12-16 subset's scored pairs: STS.input.NAME.txt's beside STS.gs.NAME.txt's scores."""
    base = os.path.join(folder, f"STS.%s.{name}.txt")
    pairs = [line.split("\t") for line in _lines(base % "input")]
    gold = [g.strip() for g in _lines(base % "gs")]
    if len(gold) != len(pairs):
        die(f"{base % 'gs'}: {len(gold)} scores for {len(pairs)} pairs; re-download senteval.tar")
    bad = next((i for i, p in enumerate(pairs, 1) if len(p) != 2), None)
    if bad:
        die(f"{base % 'input'}, line {bad}: malformed line (expected two tab-separated "
            "sentences); fix it or re-download senteval.tar")
    return [_row(base % "gs", i, *p, g) for i, (p, g) in enumerate(zip(pairs, gold), 1) if g]


def _one_file(data, task, split):
    """STS-B's or SICK-R's file of split, its header lines, its (sent1, sent2, gold) columns."""
    if task == "STS-B":  # gold = 5th field, sentences = 6th and 7th
        return os.path.join(data, "STS", "STSBenchmark", f"sts-{split}.csv"), 0, (5, 6, 4)
    if task == "SICK-R":  # header line; sentences = 2nd and 3rd field, gold = 4th
        name = {"test": "SICK_test_annotated", "dev": "SICK_trial", "train": "SICK_train"}[split]
        return os.path.join(data, "SICK", f"{name}.txt"), 1, (1, 2, 3)
    die(f"unknown task '{task}': choose from {', '.join(TASKS)}")


def check_gold(subsets, where):
    """A task's pairs (subsets pooled) with two gold values or more, for Spearman; or one line."""
    gold = {r[2] for rows in subsets.values() for r in rows}
    if len(gold) < 2:
        what = f"its gold scores are all {gold.pop()}" if gold else "no scored pair"
        die(f"{where}: {what}: a Spearman correlation needs two gold values or more; "
            "re-download senteval.tar")
    return subsets


# ---------------------------------------------------------------- STS evaluation ----------------
@torch.no_grad()
def evaluate(encode, data, tasks=TASKS, split="test"):
    """{task: Spearman x 100} of cosine similarity against gold, subsets pooled ("all" setting):
    encode() gets every distinct sentence once. split: STS-B's and SICK-R's (the others: test)."""
    loaded = {t: load_sts(data, t, split) for t in tasks}
    embed = encode_once(encode, {s for subsets in loaded.values() for rows in subsets.values()
                                 for r in rows for s in r[:2]})
    return {t: sts_score(embed, [rows for rows in loaded[t].values() if rows]) for t in tasks}


def sts_score(embed, batches):
    """Spearman x 100 of cosine similarity against gold, over batches of (sent1, sent2, gold) rows
    pooled; embed(list[str]) -> (P, H) encodes each batch's two sides apart."""
    sims, gold = [], []
    for rows in batches:
        a = embed([r[0] for r in rows]).float().cpu()  # (P, H)
        b = embed([r[1] for r in rows]).float().cpu()  # (P, H)
        sims.append(torch.nn.functional.cosine_similarity(a, b, dim=-1))
        gold += [r[2] for r in rows]
    return 100 * spearmanr(torch.cat(sims).numpy(), gold).statistic


def stsb_dev(encode, data):
    """STS-B dev, Spearman x 100: the score that selects the checkpoint during training."""
    return evaluate(encode, data, ["STS-B"], split="dev")["STS-B"]


def format_table(results):
    """The papers' table: STS12 ... SICK-R Avg., two decimals."""
    names = [t for t in TASKS if t in results]
    avg = sum(results[t] for t in names) / len(names)
    head = " ".join(f"{t:>7}" for t in names + ["Avg."])
    return head + "\n" + " ".join(f"{results[t]:7.2f}" for t in names) + f" {avg:7.2f}"
