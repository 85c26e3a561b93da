"""Evaluations beyond SentEval, for any encode function: MTEB's tasks with mteb's own evaluators
(JTCSE's Table I right and Tables II-VI; `pip install -r requirements-mteb.txt`) and BeLLM's caption
retrieval (Table 5). eval_sts.py runs them with `--mteb TASK[,TASK...]` and `--retrieval FILE`.
"""
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import common

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
        self.model_name = name
        self._encode = encode

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
    try:
        import mteb
    except ImportError:
        common.die("--mteb needs mteb, an optional extra: pip install -r requirements-mteb.txt")
    tasks = {}  # name -> task, each once
    for name in _mteb_names(spec):
        if name.startswith(SENTEVAL_PREFIX):
            tasks.setdefault(name, _senteval_task_named(name, data, split))
            continue
        for t in _mteb_tasks_named(mteb, name):
            tasks.setdefault(t.metadata.name, t)
    for t in tasks.values():
        _fetch_data(t)
    return list(tasks.values())


def _mteb_names(spec):
    """The names --mteb lists: commas separate them, except inside a benchmark's parentheses
    ("MTEB(eng, v1)")."""
    import re
    names = [t.strip() for t in re.split(r",(?![^(]*\))", spec) if t.strip()]
    if not names:
        common.die("--mteb is empty: pass MTEB task names, e.g. --mteb STSBenchmark,SICK-R")
    return names


def _senteval_task_named(name, data, split):
    """SentEval:TASK -> senteval_task(TASK), TASK one of our 7 STS tasks."""
    ours = name[len(SENTEVAL_PREFIX):]
    if ours not in common.TASKS:
        common.die(f"unknown task '{name}': {SENTEVAL_PREFIX}TASK takes TASK from "
                   f"{','.join(common.TASKS)}")
    return senteval_task(ours, data, split)


def _mteb_tasks_named(mteb, name):
    """[mteb task]: the task of that name, else the tasks of the benchmark of that name."""
    try:
        return [mteb.get_task(name)]
    except KeyError as e:  # mteb's message names the closest task, when there is one
        try:
            return list(mteb.get_benchmark(name).tasks)
        except KeyError:
            common.die(f"--mteb: {str(e.args[0]).removeprefix('KeyError: ')} Pass names "
                       "from mteb's lists (python -m mteb available-tasks, or "
                       f"available-benchmarks), or {SENTEVAL_PREFIX}TASK for one of our STS "
                       "tasks")


def _fetch_data(task):
    """The task's data into the datasets cache on disk (mteb loads it again for its run), then out
    of memory: one task in memory at a time."""
    try:
        task.load_data()
    except OSError as e:  # offline, hub unreachable, dataset gone
        common.die(f"--mteb {task.metadata.name}: its data did not load from the Hugging Face "
                   f"hub ({str(e).splitlines()[0]}): connect once without HF_HUB_OFFLINE=1 "
                   "(the data is then cached), or check the task name")
    task.unload_data()


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
    small = [g for g, cs in groups.items() if len(cs) < 2]
    if small:
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
    strict = []
    recall = {r: [] for r in RECALL_AT}
    shown = []
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
        shown += _top_of_queries(captions, q, top, same, m, show - len(shown))
    out = {"queries": len(first), "captions": len(captions),
           "strict": 100 * float(np.mean(strict))}
    out.update({f"recall@{r}": 100 * float(np.mean(v)) for r, v in recall.items()})
    if show:
        out["shown"] = shown
    return out


def _top_of_queries(captions, q, top, same, m, n):
    """The first n queries of a batch as retrieval shows them: {"query", "top": [(caption,
    cosine, of the query's group)]}, the query's top m[j]."""
    shown = []
    for j in range(min(len(q), n)):
        found = zip(top.indices[j, :m[j]].tolist(), top.values[j, :m[j]].tolist(), same[j])
        shown.append({"query": captions[int(q[j])],
                      "top": [(captions[c], round(v, 4), bool(s)) for c, v, s in found]})
    return shown


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


if __name__ == "__main__":  # a module of eval_sts.py and the analyses: nothing to run alone
    common.die("eval_more.py is a module: its evaluations run with python eval_sts.py --model "
               "MODEL --mteb TASK[,TASK...] or --retrieval FILE")
