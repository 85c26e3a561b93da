"""Input files for BeLLM's Table 5 (eval_sts.py --retrieval) and Table 2 (C-STS), written to
stdout (docs/bellm.md, "Retrieval" and "C-STS").

  # flickr30k's Karpathy test split: 1,000 images x 5 captions -> group_id<TAB>caption
  python bench/bellm_files.py flickr30k dataset_flickr30k.json > flickr30k_test.tsv
  # a stand-in built offline from STS-B test (NOT flickr30k): the connected groups of sentences
  # joined by pairs with gold score >= 4
  python bench/bellm_files.py stsb-groups > stsb_groups.tsv
  # a synthetic file in C-STS's format (NOT C-STS): NLI triplets under made-up conditions,
  # rows FIRST..LAST of the triplet csv
  python bench/bellm_files.py csts-synthetic snli_devtest.csv 0 200 > csts_synth_train.csv
"""
import argparse
import csv
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import bellm
import common

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
sub = p.add_subparsers(dest="what", required=True)
flickr = sub.add_parser("flickr30k", help="group_id<TAB>caption of Karpathy's test split")
flickr.add_argument("json", metavar="JSON", help="Karpathy's dataset_flickr30k.json")
sub.add_parser("stsb-groups", help="group_id<TAB>sentence: STS-B test's sentences joined by "
               "pairs with gold >= 4 (NOT flickr30k)")
csts = sub.add_parser("csts-synthetic", help="NLI triplets in C-STS's csv format, under made-up "
                      "conditions (NOT C-STS)")
csts.add_argument("csv", metavar="CSV", help="triplet csv (SimCSE's NLI format)")
csts.add_argument("first", metavar="FIRST", type=common.NONNEG_INT,
                  help="the first triplet row taken (0: the row after the header)")
csts.add_argument("last", metavar="LAST", type=common.NONNEG_INT,
                  help="the row after the last one taken (0 200: 200 triplets)")
for q in (p, flickr, csts):
    common.show_ranges(q)
args = p.parse_args()  # (`a` names a sentence below)
if args.what == "csts-synthetic" and args.last <= args.first:  # else an empty file, silently
    csts.error(f"LAST ({args.last}) must be greater than FIRST ({args.first})")
if args.what == "flickr30k":  # Karpathy's: {"images": [{"split", "imgid", "sentences": [{"raw"}]}]}
    try:
        lines = [f"{img['imgid']}\t{' '.join(s['raw'].split())}"
                 for img in json.loads(common.read_text(args.json))["images"]
                 if img["split"] == "test" for s in img["sentences"]]  # the first: the query
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or other keys
        common.die(f"'{args.json}' is not Karpathy's dataset_flickr30k.json, whose images hold "
                   "split, imgid and sentences (with raw): pass that file")
    print("\n".join(lines))
elif args.what == "stsb-groups":  # union-find over STS-B test sentences linked by gold >= 4
    pairs = common.load_sts(common.senteval_dir(None), "STS-B")["test"]
    parent = {}

    def root(s):
        while parent.setdefault(s, s) != s:
            s = parent[s]
        return s
    for a, b, gold in pairs:
        if gold >= 4:
            parent[root(b)] = root(a)
    groups = {}
    for a, b, gold in pairs:  # sentences in order of first appearance, each once
        for s in (a, b):
            if gold >= 4 and s not in groups.setdefault(root(s), []):
                groups[root(s)].append(s)
    for g, (_, sents) in enumerate(groups.items()):
        for s in sents:
            print(f"{g}\t{s}")
elif args.what == "csts-synthetic":  # premise/entailment high, premise/contradiction low
    kind, rows = bellm.read_csv(args.csv)
    if kind != "nli" or args.last > len(rows):  # else fewer rows than asked for, silently
        common.die(f"'{args.csv}' holds {len(rows)} {kind} rows: LAST must be at most "
                   f"{len(rows) if kind == 'nli' else 0} (a csv of NLI triplets, SimCSE's format)")
    rows = rows[args.first:args.last]
    conditions = ["the main action", "the people involved", "the place"]
    w = csv.writer(sys.stdout, lineterminator=os.linesep)
    w.writerow(["sentence1", "sentence2", "condition", "label"])
    for i, (premise, entailment, contradiction) in enumerate(rows):
        w.writerow([premise, entailment, conditions[i % 3], 5 - i % 2])
        w.writerow([premise, contradiction, conditions[(i + 1) % 3], 1 + i % 2])
