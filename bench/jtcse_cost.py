"""Time and memory of training steps: SimCSE (sscl.py's encoder and loss with no layer-M negatives =
`sscl.py --layer 0`) vs JTCSE (jtcse.py's Twin + eqs. 11-15), same MiniLM, batch 64, max_len 32,
same text.
Usage: [MINILM=..] [WIKI=..] python bench/jtcse_cost.py simcse|jtcse [num_cael] [tower_b].
1 warm-up step + 4 timed steps, AdamW (fused) as both scripts.
Memory: peak RSS (ru_maxrss) of the process after the steps minus RSS after loading the model(s)."""
import argparse
import resource
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import common
import jtcse
import sscl
from _inputs import env_input, env_rows


def rss_mb():
    """This process's resident memory now (VmRSS), MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("mode", choices=["simcse", "jtcse"], help="SimCSE's step (sscl.py --layer 0) or "
               "JTCSE's (the twin)")
p.add_argument("num_cael", nargs="?", type=common.NONNEG_INT, help="jtcse: cross-attention "
               "layers (jtcse.py --num-cael; default: every 2nd layer)")
# tower II: a MiniLM trained by sscl.py
p.add_argument("tower_b", nargs="?", default="runs/sscl_minilm/best",
               help="jtcse: tower II (jtcse.py --model-b; default runs/sscl_minilm/best)")
common.show_ranges(p)
a = p.parse_args()
mode = a.mode
A = env_input("MINILM", "sentence-transformers/all-MiniLM-L6-v2")  # or a local folder
B = a.tower_b
sents = env_rows("WIKI", "wiki1m_head.txt", 5 * 64, common.read_sentences)  # README's
torch.manual_seed(42)
tok = common.load_pretrained(AutoTokenizer, A, label="MINILM")
if mode == "simcse":
    model = sscl.SentenceEncoder(common.load_pretrained(AutoModel, A, label="MINILM"), "cls")

    def step_loss(batch, n):
        z, _ = model(batch, [])
        return sscl.sscl_loss(z[:n], z[n:], [], 0.05)
else:
    model = jtcse.Twin([common.load_pretrained(BertModel, A, label="MINILM"),
                        common.load_pretrained(BertModel, B)], a.num_cael)

    def step_loss(batch, n):
        h, hP, c = model(batch)
        return jtcse.jtcse_loss(h, hP, c, 1, 0.05)[0]
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
model.train()
base = rss_mb()
times = []
for i in range(5):
    batch = tok(sents[i * 64:(i + 1) * 64], padding=True, truncation=True, max_length=32,
                return_tensors="pt").to("cpu")
    batch = {k: torch.cat([v, v]) for k, v in batch.items()}  # two dropout views: (2B, L)
    t0 = time.perf_counter()
    loss = step_loss(batch, 64)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - t0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{mode} {sys.argv[2:]} threads {torch.get_num_threads()}: {64 * 4 / sum(times[1:]):.2f} "
      f"sent/s ({sum(times[1:]) / 4:.2f} s/step, steps {[round(t, 1) for t in times]}), "
      f"RSS after load {base:.0f} MB, peak RSS {peak:.0f} MB, "
      f"step peak over load {peak - base:.0f} MB", flush=True)
