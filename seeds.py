"""Results over seeds, in the papers' form: per task the mean ± standard deviation of several runs
(BeLLM Table 1: five runs; SSCL Table 2: three; JTCSE Fig. 6: seeds 1-5), and with --against a
paired t-test between two groups of runs (scipy.stats.ttest_rel; run i of one group paired with
run i of the other, in the order the files are given, so give them seed by seed). Input:
eval_sts.py --json files; a column for every score they hold (STS, transfer and probing tasks,
MTEB tasks, alignment, uniformity, retrieval, C-STS).

  # SSCL (layer 5) and SimCSE (layer 0): 36 min on 2 cores
  for s in 1 2 3; do
    for m in sscl:5 simcse:0; do
      python sscl.py --model sentence-transformers/all-MiniLM-L6-v2 --train wiki1m_head.txt \\
          --layer ${m#*:} --max-steps 100 --eval-steps 50 --seed $s --output-dir runs/${m%:*}_s$s \\
          --no-final-eval
      python eval_sts.py --model runs/${m%:*}_s$s --json runs/${m%:*}_s$s.json
    done
  done
  python seeds.py runs/sscl_s1.json runs/sscl_s2.json runs/sscl_s3.json \\
      --against runs/simcse_s1.json runs/simcse_s2.json runs/simcse_s3.json
"""
import argparse
import json
import os

import numpy as np
from scipy.stats import ttest_rel

import common
from eval_more import RECALL_AT
from transfer import PROBING, TRANSFER

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("runs", nargs="+", metavar="RUN.json",
               help="eval_sts.py --json files, one a run (seed)")
p.add_argument("--against", nargs="+", default=None, metavar="RUN.json",
               help="a second group, as many files, paired with the first in the given order: "
                    "adds its mean ± std and a paired t-test per column")


def number(path, out, *keys):
    """The score out[keys[0]][keys[1]]... of the file: a number (NaN allowed: eval_sts.py writes
    one for a constant embedding), or one line naming the file and the key."""
    v = out
    key = ".".join(keys)
    for k in keys:
        if not isinstance(v, dict) or k not in v:
            common.die(f"'{path}': {key} is missing: the file is not as eval_sts.py --json writes "
                       "it; write it again with eval_sts.py --json FILE")
        v = v[k]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        common.die(f"'{path}': {key} is {json.dumps(v)}, not a number: the file is not as "
                   "eval_sts.py --json writes it; write it again with eval_sts.py --json FILE")
    return float(v)


# what eval_sts.py --json writes per task: the kind's key -> the field of a task's entry that holds
# its score (None: the entry is the score)
PER_TASK = {"results": None, "transfer": "acc", "probing": "acc", "mteb": "score"}
RETRIEVAL = ("strict", *(f"recall@{k}" for k in RECALL_AT))  # eval_more.retrieval's scores
KINDS = (*PER_TASK, "align", "uniform", "retrieval", "csts")


def scores(path):
    """{column: score} of one eval_sts.py --json file, every score it holds: STS tasks (Spearman
    × 100), transfer and probing tasks (test accuracy; probing by the papers' names), each of the
    two families' Avg. when it has all 7 tasks, MTEB tasks (main score × 100, "MTEB TASK"),
    alignment, uniformity, retrieval (strict, recall@k) and C-STS."""
    out = read_result(path)
    task = {k: task_scores(path, out, k, field) for k, field in PER_TASK.items()}
    row = dict(task["results"])
    if len(task["results"]) == len(common.TASKS):
        row["STS Avg."] = float(np.mean(list(task["results"].values())))
    row.update(task["transfer"])
    if len(task["transfer"]) == len(TRANSFER):
        row["transfer Avg."] = float(np.mean(list(task["transfer"].values())))
    row.update({PROBING.get(t, (t,))[0]: v for t, v in task["probing"].items()})
    row.update({f"MTEB {t}": v for t, v in task["mteb"].items()})
    row.update({k: number(path, out, k) for k in ("align", "uniform") if k in out})
    if "retrieval" in out:
        row.update({f"retrieval {k}": number(path, out, "retrieval", k) for k in RETRIEVAL})
    if "csts" in out:
        row["C-STS"] = number(path, out, "csts")
    return row


def read_result(path):
    """The object of one eval_sts.py --json file, or one line saying the file is not one."""
    try:
        out = json.loads(common.read_text(path))
    except ValueError:
        out = None
    if not isinstance(out, dict) or not any(k in out for k in KINDS):  # e.g. a run's sentemb.json
        common.die(f"'{path}' is not an eval_sts.py --json result (it holds no "
                   f"{', '.join(KINDS)}): write one with eval_sts.py --json FILE")
    for k in (*PER_TASK, "retrieval"):
        if not isinstance(out.get(k, {}), dict):
            common.die(f"'{path}' is not an eval_sts.py --json result: its {k} is "
                       f"{json.dumps(out[k])[:40]}, not an object; write it again with "
                       "eval_sts.py --json FILE")
    return out


def task_scores(path, out, kind, field):
    """{task: score} of one kind of PER_TASK: each task's entry out[kind][task][field], or the
    entry itself when field is None."""
    keys = [field] if field else []
    return {t: number(path, out, kind, t, *keys) for t in out.get(kind, {})}


def table(groups):
    """groups: {name: [row, ...]} -> {name: {column: (mean, sample std, n)}} over the columns every
    run has."""
    cols = [c for c in next(iter(groups.values()))[0]
            if all(c in r for rows in groups.values() for r in rows)]
    stats = {g: {c: mean_std([r[c] for r in rows]) for c in cols} for g, rows in groups.items()}
    return cols, stats


def mean_std(values):
    """(mean, sample standard deviation (ddof 1; NaN for one value), n)."""
    std = np.std(values, ddof=1) if len(values) > 1 else float("nan")
    return np.mean(values), std, len(values)


def check_files(paths):
    """Each path a file, or one line saying what it is."""
    for path in paths:
        if not os.path.isfile(path):
            what = "is a folder" if os.path.isdir(path) else "does not exist"
            common.die(f"'{path}' {what}: pass eval_sts.py --json files")


def print_table(cols, stats, groups, width):
    """The header, then a line per group: each column's mean ± std."""
    print(f"{'':<12}" + "".join(f"{c:>{width[c]}}" for c in cols))
    for g, st in stats.items():
        name = f"{g} ({len(groups[g])})"
        print(f"{name:<12}" + "".join(f"{f'{st[c][0]:.2f} ± {st[c][1]:<4.2f}':>{width[c]}}"
                                      for c in cols))


def print_t_test(cols, groups, width):
    """The paired t-test's t and p per column: run i of each group shares its seed."""
    tests = {c: ttest_rel([r[c] for r in groups["runs"]], [r[c] for r in groups["against"]])
             for c in cols}
    print(f"{'t':<12}" + "".join(f"{tests[c].statistic:>{width[c]}.3f}" for c in cols))
    print(f"{'p':<12}" + "".join(f"{tests[c].pvalue:>{width[c]}.4f}" for c in cols))


def main():
    a = p.parse_args()
    check_files(a.runs + (a.against or []))
    if a.against and len(a.against) != len(a.runs):
        common.die(f"--against has {len(a.against)} files for {len(a.runs)} runs: "
                   "a paired test needs one per run")
    groups = {"runs": [scores(f) for f in a.runs]}
    if a.against:
        groups["against"] = [scores(f) for f in a.against]
    cols, stats = table(groups)
    if not cols:
        common.die("the files share no task: evaluate every run on the same --tasks")
    width = {c: max(16, len(c) + 2) for c in cols}  # MTEB's task names are long
    print_table(cols, stats, groups, width)
    if a.against:
        print_t_test(cols, groups, width)
    summary = f"mean ± sample std (ddof 1) over runs; files: {', '.join(a.runs)}"
    if a.against:
        summary += f"; against: {', '.join(a.against)} (paired t-test, two-sided)"
    print(summary)
    return stats


if __name__ == "__main__":
    main()
