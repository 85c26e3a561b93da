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
import csv
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import bellm  # noqa: E402
import common  # noqa: E402

what, args = sys.argv[1], sys.argv[2:]
if what == "flickr30k":  # Karpathy's: {"images": [{"split", "imgid", "sentences": [{"raw"}]}]}
    for img in json.loads(common.read_text(args[0]))["images"]:
        if img["split"] == "test":
            for s in img["sentences"]:  # the first caption listed is the query
                print(f"{img['imgid']}\t{' '.join(s['raw'].split())}")
elif what == "stsb-groups":  # union-find over STS-B test sentences linked by gold >= 4
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
elif what == "csts-synthetic":  # premise/entailment high, premise/contradiction low
    rows = bellm.read_csv(args[0])[1][int(args[1]):int(args[2])]
    conditions = ["the main action", "the people involved", "the place"]
    w = csv.writer(sys.stdout, lineterminator=os.linesep)
    w.writerow(["sentence1", "sentence2", "condition", "label"])
    for i, (premise, entailment, contradiction) in enumerate(rows):
        w.writerow([premise, entailment, conditions[i % 3], 5 - i % 2])
        w.writerow([premise, contradiction, conditions[(i + 1) % 3], 1 + i % 2])
else:
    sys.exit(__doc__)
