import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import time, torch, common, bellm
torch.set_num_threads(2)
dev = torch.device("cpu")
M = os.environ.get("SMOLLM", "HuggingFaceTB/SmolLM2-135M-Instruct")  # or a local folder
data = common.senteval_dir(None)
for spec in sys.argv[1:]:
    k, mode, prompt = (spec.split(":", 2) if spec.count(":") >= 2
                       else (*spec.split(":"), bellm.PROMPT))
    meta = dict(method="bellm", base_model=M, bi_layers=int(k), bi_mode=mode, prompt=prompt,
                max_len=64)
    t = time.time()
    enc = bellm.load_encoder(None, meta, dev)
    r = common.evaluate(enc, data, ["STS-B"], "dev")
    print(f"K={k} {mode:10s} prompt={prompt!r}: STS-B dev {r['STS-B']:.2f}  "
          f"({time.time()-t:.0f}s)", flush=True)
