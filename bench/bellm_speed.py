"""Training-step tokens/s of bellm.py on SmolLM2-135M, K = 0 vs K = 1 (parallel, eq. 5), alternating
in one process on the same batch of 16 SNLI triplets (48 prompted texts, --max-len 32), LoRA r 32 on
all linear layers, forward + eq. 6 + backward + AdamW step, like one step of the quick run, as one
padded forward (--no-length-grouping; bench/length_groups.py compares that with length groups).
Median of 5 timed steps per K after one warm-up step each.

  python bench/bellm_speed.py            # fp32
  python bench/bellm_speed.py --bf16     # bf16 autocast, as bellm.py --bf16
  (SMOLLM=model name or folder, NLI=triplet csv; defaults: HuggingFaceTB/SmolLM2-135M-Instruct,
  snli_devtest.csv)
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import bellm
import common
from _inputs import env_input, env_rows

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--bf16", action="store_true", help="bf16 autocast, as bellm.py --bf16")
common.show_ranges(p)
bf16 = p.parse_args().bf16
dev = torch.device("cpu")
rows = env_rows("NLI", "snli_devtest.csv", 16, lambda f: bellm.read_csv(f)[1])
tok, dec = bellm.load_decoder(env_input("SMOLLM", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                              1, "convert", dev)
model = get_peft_model(dec, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.1,
                                       target_modules="all-linear")).train()
# the step's cost, ~no change
opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-9)
texts, n = bellm.prompted(tok, {"prompt": bellm.PROMPT, "max_len": 32},
                          [s for r in rows for s in r])
b = tok(texts, padding=True, truncation=True, max_length=n, return_tensors="pt").to(dev)
ntok = int(b["attention_mask"].sum())
times = {0: [], 1: []}
for rep in range(6):
    for K in (0, 1):
        t = time.perf_counter()
        with common.autocast(dev, "bf16" if bf16 else common.pick_precision(dev)):
            h = bellm.BeLLM(dec, K, "parallel", "convert")(b["input_ids"],
                                                           b["attention_mask"]).float()
        bellm.bellm_loss(h[0::3], h[1::3], h[2::3], 0.05).backward()
        opt.step()
        opt.zero_grad()
        if rep:
            times[K].append(time.perf_counter() - t)
print(f"SmolLM2-135M, {'bf16 autocast' if bf16 else 'fp32'}, {torch.get_num_threads()} threads, "
      f"48 texts, {ntok} real tokens ({b['input_ids'].numel()} with padding), median of "
      f"{len(times[0])} steps")
for K in (0, 1):
    print(f"K={K} parallel: {ntok / statistics.median(times[K]):.0f} tok/s  "
          f"({statistics.median(times[K]):.2f} s/step)")
print(f"K1/K0 time ratio {statistics.median(times[1]) / statistics.median(times[0]):.3f}")
