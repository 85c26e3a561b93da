"""Zero-shot STS-B dev of SmolLM2-135M through bellm.load_encoder (what eval_sts.py runs), one row
a SPEC: K bidirectional layers, their wiring, the prompt.

  python bench/bellm_zeroshot.py 0:parallel [1:parallel ...]
  python bench/bellm_zeroshot.py '0:parallel:The representative word for sentence {sentence} is:"'
  (SMOLLM=model name or folder; default HuggingFaceTB/SmolLM2-135M-Instruct)
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import bellm
import common
from _inputs import env_input


def spec(s):
    """K:MODE[:PROMPT] -> (K, MODE, PROMPT)."""
    parts = s.split(":", 2)
    if len(parts) < 2 or parts[1] not in ("parallel", "sequential"):
        raise argparse.ArgumentTypeError(f"{s!r} is not K:MODE[:PROMPT] with MODE parallel or "
                                         "sequential")
    return common.NONNEG_INT(parts[0]), parts[1], parts[2] if len(parts) > 2 else bellm.PROMPT


spec.range = "K an integer >= 0"  # for show_ranges
p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("specs", metavar="SPEC", nargs="+", type=spec,
               help="K:MODE[:PROMPT]: K bidirectional layers (bellm.py --bi-layers), MODE "
               "parallel or sequential (--bi-mode), PROMPT with {sentence} (default: bellm.py's)")
common.show_ranges(p)
a = p.parse_args()
torch.set_num_threads(2)
dev = torch.device("cpu")
M = env_input("SMOLLM", "HuggingFaceTB/SmolLM2-135M-Instruct")  # or a local folder
data = common.senteval_dir(None)
for k, mode, prompt in a.specs:
    meta = dict(method="bellm", base_model=M, bi_layers=k, bi_mode=mode, prompt=prompt,
                max_len=64)
    t = time.time()
    enc = bellm.load_encoder(None, meta, dev)
    r = common.evaluate(enc, data, ["STS-B"], "dev")
    print(f"K={k} {mode:10s} prompt={prompt!r}: STS-B dev {r['STS-B']:.2f}  "
          f"({time.time()-t:.0f}s)", flush=True)
