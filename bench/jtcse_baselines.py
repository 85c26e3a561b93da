"""Tower I, tower II and the untrained twin (CLS(I) + CLS(II)) on STS-B dev and the 7 test tasks.
Each tower encodes every distinct sentence once (jtcse.make_encode, no truncation); the twin's
embedding is the sum of the two cached CLS vectors, which is what jtcse.make_encode([A, B]) computes
batch by batch.

  python bench/jtcse_baselines.py TOWER_I TOWER_II
"""
import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import common
import jtcse


def encoder(vector):
    """The encode function (sentences -> (N, H)) whose rows are vector(sentence), a sentence's
    cached embedding."""
    def encode(ss):
        return torch.stack([vector(s) for s in ss])
    return encode


p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("tower_i", metavar="TOWER_I", help="a BERT-like model: hub name or folder "
               "(jtcse.py --model-a; its tokenizer serves both towers)")
p.add_argument("tower_ii", metavar="TOWER_II", help="the second tower (jtcse.py --model-b)")
common.show_ranges(p)
a = p.parse_args()
torch.set_grad_enabled(False)
data = common.senteval_dir(None)
names = [a.tower_i, a.tower_ii]
tok = common.load_pretrained(AutoTokenizer, names[0])
sents = sorted({s for t in common.TASKS for rs in common.load_sts(data, t).values()
                for r in rs for s in r[:2]}
               | {s for rs in common.load_sts(data, "STS-B", "dev").values()
                  for r in rs for s in r[:2]})
emb = []
for n in names:
    t0 = time.time()
    m = common.load_pretrained(BertModel, n).eval()
    emb.append(dict(zip(sents, jtcse.make_encode([m], tok, 512, torch.device("cpu"))(sents))))
    print(f"encoded {len(sents)} sentences with {n} in {time.time() - t0:.0f} s", flush=True)
for label, vector in [("tower I", lambda s: emb[0][s]), ("tower II", lambda s: emb[1][s]),
                      ("untrained twin", lambda s: emb[0][s] + emb[1][s])]:
    enc = encoder(vector)
    dev = common.evaluate(enc, data, ["STS-B"], split="dev")["STS-B"]
    print(f"{label}: STS-B dev {dev:.2f}")
    print(common.format_table(common.evaluate(enc, data)), flush=True)
