"""Training-step tokens/s, K = 0 vs K = 1 parallel, alternating in one process on the same batch (CPU, LoRA).
fp32; `python bench/bellm_speed.py --bf16` for bf16 autocast (bellm.py --bf16)."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import csv, time, torch, bellm, common
from peft import LoraConfig, get_peft_model
dev = torch.device("cpu")
tok, dec = bellm.load_decoder("/root/.cache/sentemb-models/smollm2-135m", 1, "convert", dev)
model = get_peft_model(dec, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.1, target_modules="all-linear")).train()
rows = list(csv.reader(open(Path(__file__).resolve().parents[2] / "shared/data/train/snli_devtest_for_simcse.csv")))[1:9]
b = common.tokenize(tok, *bellm.prompted(tok, {"prompt": bellm.PROMPT, "max_len": 32}, [s for r in rows for s in r]), dev)
ntok, times = int(b["attention_mask"].sum()), {0: [], 1: []}
for rep in range(3):
    for K in (0, 1):
        t = time.perf_counter()
        with common.autocast(dev, "--bf16" in sys.argv):
            h = bellm.last_token(bellm.forward(dec, b["input_ids"], b["attention_mask"], K, "parallel", "convert"), b["attention_mask"])
        h = h.float()
        bellm.bellm_loss(h[0::3], h[1::3], h[2::3], 0.05).backward()
        model.zero_grad()
        if rep:
            times[K].append(time.perf_counter() - t)
for K in (0, 1):
    print(f"K={K} parallel: {ntok / (sum(times[K]) / len(times[K])):.0f} tok/s (fwd+bwd, {ntok} real tokens, 24 texts, mean of 2 after warm-up)")
print(f"K1/K0 time ratio {sum(times[1]) / sum(times[0]):.3f}")
