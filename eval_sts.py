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
  # runs' training curves (loss, gradient norm, dev score against the step), nothing evaluated
  python eval_sts.py --model runs/sscl runs/sscl_2 --curves --plot curves.png
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
import contextlib
import errno
import json
import os
import shutil
import sys
import time

import torch

import bellm
import common
import figures
import harness
import jtcse
import sscl
from eval_more import (SENTEVAL_PREFIX, format_mteb, format_retrieval, mteb_tasks, read_groups,
                       retrieval, run_mteb)
from transfer import (PROBING, TRANSFER, TRANSFER_MODES, align_uniform, evaluate_transfer,
                      format_probing, format_transfer, probing_file)

METHODS = {"sscl": sscl, "jtcse": jtcse, "bellm": bellm}  # sentemb.json's method -> its script


# ---------------------------------------------------------------- run folders -------------------
# A run folder is written and resumed by its own script, and read here through harness.py:
# reading() settles what a kill left when no training run holds the folder, reads the save that
# checkpoint.pt names and keeps it from being swapped while it loads; the script's check_run checks
# every file and value of it, check_prints that each weight file is that save's (a broken, edited
# or mixed folder is one line naming the file, never another model); load_encoder builds the
# encode function its training evaluated with.
def run_folder(name):
    """A run of ours that NAME is: (its script, the run folder (None: a model folder with a
    sentemb.json, e.g. a copy of best/), the model folder to read); None: a plain model."""
    found = harness.run_of(name)
    if not found:
        return None
    method, run_dir, folder = found
    if method not in METHODS:
        common.die(f"{os.path.join(folder, common.META)} is not a run description of sscl.py, "
                   f"jtcse.py or bellm.py (method {method!r}): re-save the run, or delete the "
                   "file to load the folder as a plain model")
    return METHODS[method], run_dir, folder


@contextlib.contextmanager
def reading(name):
    """NAME as it is read: (its script, the folder of its committed save, its sentemb.json
    checked), under the reader's lock of its run folder, its weight files tied to that save once
    the caller has loaded them; (None, NAME, None) for a plain model."""
    found = run_folder(name)
    if not found:
        yield None, name, None
        return
    script, run_dir, folder = found
    with harness.reading(run_dir, script.METHOD, script.check_run, folder) as (folder, meta):
        yield script, folder, meta
        harness.check_prints(folder, meta)  # once its files have loaded (a damaged one named)


def read_meta(name):
    """The sentemb.json of the model a run NAME holds (checked), or None for a plain model."""
    with reading(name) as (_, _, meta):
        return meta


def model_folder(name):
    """The folder that holds the model NAME means (a run's best/; NAME itself otherwise)."""
    with reading(name) as (_, folder, _):
        return folder


def read_curve(name, file=harness.CURVE):
    """A run folder's dev curve (dev.jsonl: {"step", "metric", "score"} per dev evaluation, one
    format in the three scripts; a view of the run's checkpoint, settled first); [] without one. A
    folder without a checkpoint (one of the earlier layout) is read as it is. file
    harness.METRICS: its curves (metrics.jsonl: {"step", NAME: number, ...} per step line or dev
    score; docs/operations.md), read alike."""
    path, lines = curve_lines(name, file)
    curve = []
    for i, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
        except ValueError as e:
            common.die(f"{path}, line {i}, is damaged ({common.first_line(e)}): delete the file, "
                       "or copy the run again")
        if not isinstance(entry, dict):  # a line of another shape: keys missing
            entry = {}
        for key, (what, ok) in curve_keys(entry, file).items():
            if not ok(entry.get(key)):
                said = json.dumps(entry[key]) if key in entry else "missing"
                common.die(f"{path}, line {i}: {key} is {said}, not {what} as a run writes it: "
                           "delete the file, or copy the run again")
        curve.append(entry)
    return curve


def curve_lines(name, file):
    """(the path of file in run NAME, its lines), read under the run's reader's lock."""
    found = run_folder(name)
    run_dir = found[1] if found else None
    lock = contextlib.nullcontext()
    if run_dir:
        script = found[0]
        lock = harness.reading(run_dir, script.METHOD, script.check_run)
    with lock:
        path = os.path.join(run_dir or name, file)
        lines = common.read_text(path).splitlines() if os.path.isfile(path) else []
    return path, lines


def curve_keys(entry, file):
    """{key: (what it holds, its check)} for an entry of file as harness.py writes it."""
    step = ("an integer >= 0", lambda v: type(v) is int and v >= 0)
    if file == harness.CURVE:
        return {"step": step, "metric": ("a name", lambda v: isinstance(v, str)),
                "score": ("a number", lambda v: type(v) in (int, float))}
    value = ("a number or null", lambda v: v is None or type(v) in (int, float))
    return {"step": step, **{k: value for k in entry if k != "step"}}


def csts_prompt(name, pooler, prompt):
    """The prompt a model encodes C-STS with (None when it reads no prompt): a bellm.py run's own,
    or --prompt for a plain decoder (--pooler last)."""
    if pooler == "last":
        return prompt
    meta = read_meta(name) if os.path.isdir(name) else None
    return meta["prompt"] if meta and meta["method"] == "bellm" else None


def read_csts(path, models, ensemble, prompt):
    """--csts FILE: C-STS rows (sentence1, sentence2, condition, label), checked before any model
    loads: a C-STS csv with labels that vary, and models that read a condition."""
    if not os.path.isfile(path) or bellm.read_csv(path)[0] != "csts":
        common.die(f"--csts '{path}' is not a C-STS csv (sentence1,sentence2,condition,label)")
    rows = bellm.read_csv(path)[1]
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


def parse_tasks(spec):
    """--tasks -> (STS tasks, transfer tasks, probing tasks), each in the papers' order. 'all' is
    STS and transfer: the probing files are not in SimCSE's senteval.tar."""
    names = {"sts": common.TASKS, "transfer": TRANSFER, "probing": list(PROBING),
             "all": common.TASKS + TRANSFER}
    known = common.TASKS + TRANSFER + list(PROBING)
    asked = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in asked if t not in known and t.lower() not in names]
    if unknown:
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
                    "per --model (JTCSE Fig. 7); with --curves: the runs' curves")
p.add_argument("--curves", action="store_true",
               help="instead of evaluating: each --model run's training curves (RUN/metrics.jsonl: "
                    "the loss, gradient norm and dev score against the step), a line each, into "
                    "--plot; one line a run on the terminal")
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
p.add_argument("--precision", choices=common.PRECISIONS,
               help="autocast while encoding: default bf16 on a GPU (fp16 where it has no bf16), "
                    "fp32 on a CPU (bf16 there: about 2x faster where the CPU has bf16 "
                    "instructions; numbers move by ~0.01)")
p.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
               help="--precision bf16")
p.add_argument("--compile", action="store_true",
               help="torch.compile each model's forward, a decoder's layer by layer (dynamic "
                    "shapes: compiled once, then reused for every batch; seconds to minutes)")
p.add_argument("--quiet", action="store_true",
               help="no progress bars (shown only when stderr is a terminal)")
p.add_argument("--json", default=None, help="also write the results to this JSON file")
p.add_argument("--export-st", metavar="DIR", default=None,
               help="evaluate nothing: copy the run's best model to DIR, a new folder, with the "
               "sentence-transformers files that encode it as eval_sts.py does (written from its "
               "sentemb.json, any earlier ones replaced) and the model card (for runs saved "
               "before their scripts wrote them)")
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

        def avg(h):  # the masked mean over tokens: (b, H)
            return (h * mask).sum(1) / mask.sum(1)
        if pooler == "cls":
            return out.last_hidden_state[:, 0]
        if pooler == "avg":
            return avg(out.last_hidden_state)
        # SimCSE: hidden_states[1] is the first Transformer layer's output
        if pooler == "avg_first_last":
            return avg((out.hidden_states[1] + out.hidden_states[-1]) / 2)
        return out.pooler_output

    return common.encoder(embed, tok, max_len, device)  # no gradients, the caller's autocast


def load_model(name, pooler="cls", max_len=512, device=None, prompt=None, cut=None,
               num_layers=None):
    """Our run folder (sentemb.json) -> its method's encoder; anything else -> a plain HF
    encoder. cut: a token limit for every kind (a run folder's own is its sentemb.json's);
    num_layers: a plain encoder's first N layers (check_num_layers)."""
    device = device or common.pick_device()
    # a plain decoder, zero-shot: BeLLM's encoder with no bidirectional layer, no LoRA
    if pooler == "last" and os.path.isdir(name):
        run = common.run_kind(name)
        if run:
            common.die(f"--pooler last: '{name}' is {run}, and its sentemb.json says how it "
                       "encodes: drop --pooler last (it reads a plain decoder zero-shot)")
    if pooler == "last":
        meta = {"method": "bellm", "base_model": name, "bi_layers": 0, "bi_mode": "parallel",
                "prompt": prompt, **({"max_len": cut} if cut else {})}
        return bellm.load_encoder(None, meta, device)
    with reading(name) as (script, folder, meta):  # a run of ours: every file checked
        if meta is not None:
            return script.load_encoder(folder, {**meta, "max_len": cut} if cut else meta, device)
    return hf_encoder(name, pooler, cut or max_len, device, num_layers)


def one_each(poolers, names):
    """--pooler's values, one for every --model (one value: the same for all)."""
    if len(poolers) not in (1, len(names)):
        common.die(f"--pooler got {len(poolers)} values for {len(names)} models: pass one for "
                   "all, or one per model")
    return list(poolers) * len(names) if len(poolers) == 1 else list(poolers)


def load_ensemble(names, poolers=("cls",), max_len=512, device=None, prompt=None, cut=None,
                  size=None, num_layers=None, compile=False):
    """encode(list[str]) -> (N, H): the SUM of the members' embeddings, as JTCSE's twin sums its
    towers' CLS (its +UC rows, Table I, add an existing encoder). Each member loads as
    load_model loads it: a run folder of ours with its own pooling, a plain model with its entry
    of `poolers` (one entry: the same for all). One member: that member's encode. size: (H, whose)
    when the embedding must have H dimensions; compile: each member's forward compiled."""
    members = [common.compiled_encode(load_model(n, q, max_len, device, prompt, cut, num_layers),
                                      compile) for n, q in zip(names, one_each(poolers, names))]
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
    check_embedding_size(names, members, size)
    if len(members) == 1:
        return members[0]

    def encode(sentences):
        return sum(m(sentences).float() for m in members)  # (N, H)
    return encode


def check_embedding_size(names, members, size):
    """The members' embeddings of one size: size[0], where size (H, whose) is given."""
    if len(members) == 1 and not size:
        return
    sizes = [m(["a probe sentence"]).shape[-1] for m in members]
    required = {size[0]} if size else set()
    if len(set(sizes) | required) > 1:
        whose = f"; {size[1]} is {size[0]}" if size else ""
        common.die(f"the embeddings of {' + '.join(names)} have {', '.join(map(str, sizes))} "
                   f"dimensions{whose}: an ensemble sums them, so pass models of one size")


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
        if pooler == "last" or os.path.isdir(name) and read_meta(name) is not None:
            common.die(f"--num-layers cuts a plain Hugging Face encoder, and '{name}' is "
                       f"{'a decoder (--pooler last)' if pooler == 'last' else 'a run folder'}: "
                       "drop --num-layers (a run of sscl.py --num-layers is saved cut)")
        common.check_num_layers(num_layers, common.load_pretrained(AutoConfig, name), name)


def export_st(names, dest, num_layers=None):
    """--export-st: a run's best model copied to dest, with the sentence-transformers files that
    encode it as its load_encoder does (write_run_st_files) and the card; the fingerprints of the
    files written replace theirs in dest/sentemb.json (as harness.save_step fingerprints them)."""
    if len(names) != 1 or not run_folder(names[0]):
        common.die("--export-st copies one run of ours (a run folder or its best/): pass one "
                   "--model RUN")
    check_num_layers(num_layers, names, ["cls"])  # a run is exported as it was trained
    if os.path.lexists(dest):
        common.die(f"--export-st '{dest}' exists: pass a new folder")
    with reading(names[0]) as (script, folder, meta):
        harness.check_prints(folder, meta)  # what is copied is the save sentemb.json describes
        shutil.copytree(folder, dest)
    run_dir = run_folder(names[0])[1]
    args = harness.read_checkpoint(run_dir, meta["method"])["args"] if run_dir and \
        os.path.lexists(os.path.join(run_dir, harness.CKPT)) else {}
    custom = write_run_st_files(dest, meta)
    prints = meta.setdefault("fingerprints", {})
    for tower in sorted({".", *meta.get("towers", [])}):
        for name in ("modules.json", "st_module.py", os.path.join("2_Dense", "model.safetensors")):
            rel = os.path.normpath(os.path.join(tower, name))
            if os.path.isfile(os.path.join(dest, rel)):
                prints[rel] = common.fingerprint(os.path.join(dest, rel))
            else:
                prints.pop(rel, None)
    with open(os.path.join(dest, common.META), "w") as f:
        json.dump(meta, f, indent=2)
    harness.write_card(dest, meta, args, next(k for k in meta if k.endswith("_dev")))
    trust = ", trust_remote_code=True" if custom else ""
    print(f"{dest}: SentenceTransformer({dest!r}{trust}) loads it")


def write_run_st_files(folder, meta):
    """The sentence-transformers files of the model in folder that meta (its sentemb.json)
    describes, written now from meta (a best/ saved before, or another encoder's: replaced):
    SSCL's Transformer -> Pooling [-> Dense, proj.pt] (as sscl.save_model); a JTCSE tower's CLS;
    st_module.py's JTCSETwin for a twin, and for a distilled tower whose last LayerNorms are
    dropped (Fig. 8: no Transformer module computes it); st_module.BeLLM for a BeLLM adapter.
    -> st_module.py's class, or None"""
    method = meta["method"]
    towers = meta.get("towers", ["."])
    remove_st_files(folder, towers)
    custom = None  # where no Transformer -> Pooling chain encodes it
    if method == "bellm":
        custom = "BeLLM"
    if method == "jtcse" and (towers != ["."] or meta.get("drop_layernorm", 0)):
        custom = "JTCSETwin"
    if method == "sscl":
        config = common.read_json(os.path.join(folder, "config.json"), folder, common.REFETCH)
        proj = None
        if meta["proj_dim"]:
            proj = torch.load(os.path.join(folder, "proj.pt"), map_location="cpu",
                              weights_only=True)
        common.write_st_files(folder, config["hidden_size"], meta["max_len"], meta["pooler"],
                              proj)
    for tower in towers if method == "jtcse" else []:  # JTCSE: each tower's CLS
        if custom and tower == ".":  # the distilled tower's own folder is st_module's
            continue
        path = os.path.join(folder, tower)
        config = common.read_json(os.path.join(path, "config.json"), folder, common.REFETCH)
        common.write_st_files(path, config["hidden_size"], meta["max_len"], "cls")
    if custom:
        common.write_st_files(folder, pooler=custom)
    return custom


def remove_st_files(folder, towers):
    """The sentence-transformers files write_run_st_files writes, removed from folder's towers."""
    for tower in sorted({".", *towers}):
        for stale in ("sentence_bert_config.json", "1_Pooling", "2_Dense"):
            path = os.path.join(folder, tower, stale)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)


def bf16_note():
    """--precision bf16 on this CPU: whether it has the instructions that make bf16 faster."""
    has = [n for n, f in (("AVX512-BF16", "_is_avx512_bf16_supported"),
                          ("AMX", "_is_amx_tile_supported")) if getattr(torch.cpu, f)()]
    return f"bf16 autocast; this CPU has {' and '.join(has)}" if has else \
        "bf16 autocast, but this CPU has no AVX512-BF16 or AMX: expect it to be slower than fp32"


def draw_curves(names, path):
    """--curves: each run's RUN/metrics.jsonl drawn into path (figures.curves), and summed up in a
    line: its step lines, its last step, its best dev score."""
    if not path:
        common.die("--curves draws into --plot FILE.png: pass one")
    figures.check(path)
    runs = {}
    for name, label in figures.labels(names).items():
        rows = read_curve(name, harness.METRICS) if os.path.isdir(name) else []
        if not rows:
            common.die(f"'{name}' holds no curves (RUN/{harness.METRICS}, which sscl.py, jtcse.py "
                       "and bellm.py write from their first save on): pass a run folder of ours")
        best = max(((v, k, e["step"]) for e in rows if "loss" not in e for k, v in e.items()
                    if k != "step"), key=lambda d: d[0], default=None)  # the first best
        print(f"{label}: {sum('loss' in e for e in rows)} step line(s), to step {rows[-1]['step']}"
              + (f"; best {best[1]} {best[0]:.2f} at step {best[2]}" if best else ""))
        runs[label] = rows
    figures.draw(path, figures.curves(runs), "training curves (RUN/metrics.jsonl)", ncols=3)


def main():
    a = common.parse(p)
    if a.export_st:
        return export_st(a.model, a.export_st, a.num_layers)
    if a.curves:
        return draw_curves(a.model, a.plot)
    sts_tasks, transfer_tasks, probing_tasks = chosen_tasks(a)
    poolers = check_args(a)
    # read before any model loads: a bad file costs nothing
    a.groups = read_groups(a.retrieval) if a.retrieval else None
    a.csts_rows = read_csts(a.csts, list(zip(a.model, poolers)), a.ensemble,
                            a.prompt) if a.csts else None
    data = senteval_data(a, sts_tasks + transfer_tasks + probing_tasks, probing_tasks)
    mteb = mteb_tasks(a.mteb, data, a.split) if a.mteb else []  # checked and loaded before a model
    if a.precision == "bf16" and common.pick_device().type == "cpu":
        print(f"note: --precision bf16: {bf16_note()}", file=sys.stderr)
    # what is evaluated: each --model in turn, or with --ensemble one encoder, their sum
    models = [list(zip(a.model, poolers))] if a.ensemble else [[m] for m in zip(a.model, poolers)]
    points = {}  # model -> (uniformity, alignment), for --plot
    short = []  # each model's short name
    for members in models:
        if len(models) > 1:
            print(f"{members[0][0]}:")
        out = evaluate_model(a, members, data, sts_tasks, transfer_tasks, probing_tasks, mteb)
        if a.align_uniform:
            points[out["model"]] = (out["uniform"], out["align"])
            short.append(" + ".join(figures.labels([m])[m] for m, _ in members))
    if a.plot:
        draw_align_uniform(a.plot, a.split, points, short)
    if a.json:  # a temporary file, then one rename: an old file is never left half-written
        write_json(a.json, out)


def chosen_tasks(a):
    """--tasks -> (STS, transfer, probing tasks); by default STS, unless another task is asked."""
    if a.tasks is not None:
        return parse_tasks(a.tasks)
    if a.retrieval or a.csts or a.mteb:  # STS only when asked for
        return [], [], []
    return parse_tasks("sts")


def check_args(a):
    """The command line checked before any data is read or model loaded. -> --pooler per --model"""
    if a.plot and not a.align_uniform:
        common.die("--plot draws alignment against uniformity (JTCSE Fig. 7): add --align-uniform")
    if a.json and len(a.model) > 1 and not a.ensemble:
        common.die(f"--json holds one model's results and --model got {len(a.model)}: pass one "
                   "--model, add --ensemble, or run once per model")
    poolers = one_each(a.pooler, a.model)
    check_num_layers(a.num_layers, a.model, poolers)
    for name, pooler in zip(a.model, poolers):  # a run folder's own sentemb.json decides
        if pooler == "pooler" and not (os.path.isdir(name) and read_meta(name)):
            check_pooler(name)
    figures.check(a.plot)
    parent = os.path.dirname(os.path.abspath(a.json or "."))
    if a.json and (os.path.isdir(a.json) or not os.path.isdir(parent)
                   or not os.access(parent, os.W_OK)):
        common.die(f"--json '{a.json}' cannot be written (a folder, or in no writable folder): "
                   "pass a file path")
    if a.show and not a.retrieval:
        common.die("--show prints retrieved captions: add --retrieval FILE")
    return poolers


def senteval_data(a, tasks, probing_tasks):
    """SentEval's data folder, where anything reads it (else None), its probing files checked."""
    if not (tasks or a.align_uniform or SENTEVAL_PREFIX in (a.mteb or "")):
        return None
    data = common.senteval_dir(a.data_dir)
    for t in probing_tasks:  # SentEval's probing files are a separate download: say so now
        probing_file(data, t)
    return data


def draw_align_uniform(path, split, points, short):
    """--plot: JTCSE's Fig. 7 (SimCSE's Fig. 2), one labelled point per model."""
    labels = short if len(set(short)) == len(short) else list(points)
    panel = dict(kind="scatter", title=f"STS-B {split}; lower is better for both",
                 xlabel="uniformity", ylabel="alignment", points=dict(zip(labels, points.values())))
    figures.draw(path, [panel], "Alignment against uniformity (Wang & Isola 2020)", ncols=1)


def evaluate_exact(encode, data, tasks, split="test", batch_size=128):
    """--exact: common.evaluate's numbers in SentEval's own batches (each subset's pairs sorted by
    length, batch_size a batch, each side encoded apart), for bit-level comparisons with it."""
    results = {}
    for t in tasks:
        batches = []
        for rows in common.load_sts(data, t, split).values():
            rows = sorted(rows, key=lambda z: (len(z[0].split()), len(z[1].split()), z[2]))
            batches += [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
        results[t] = common.sts_score(encode, batches)
    return results


def evaluate_model(a, members, data, sts_tasks, transfer_tasks, probing_tasks=(), mteb=()):
    """One model, [(name, pooler)], or an ensemble, several: its tables printed, -> the --json
    dict (results, transfer, probing, mteb, align, uniform, seconds)."""
    t0 = time.perf_counter()
    names, poolers = zip(*members)
    encode = load_ensemble(names, poolers, a.max_len, prompt=a.prompt, num_layers=a.num_layers,
                           compile=a.compile)
    name = " + ".join(names)
    out = {"model": name, "split": a.split}
    seconds = {"load": time.perf_counter() - t0}
    with torch.no_grad(), common.autocast(common.pick_device(), a.precision):
        if sts_tasks:
            t0 = time.perf_counter()
            if a.exact:
                out["results"] = evaluate_exact(encode, data, sts_tasks, a.split, a.batch_size)
            else:
                out["results"] = common.evaluate(encode, data, sts_tasks, a.split)
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
            out["csts"] = bellm.dev_score(encode, None, a.csts_rows)
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
        text = json.dumps(common.finite_or_null(out), indent=2, allow_nan=False)  # NaN: null
        common.write_whole(path, lambda f: f.write(text.encode()))
    except OSError as e:
        kept = "; the old file is kept" if os.path.isfile(path) else ""
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        what = f"{os.path.basename(e.filename or path)}: {e.strerror or e}"
        common.die(f"cannot write --json '{path}' ({what}): the results are printed above{kept}; "
                   f"{'free disk space or ' if full else ''}pass another --json path")


if __name__ == "__main__":
    main()
