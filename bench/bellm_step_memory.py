"""Peak resident memory of one bellm.py training step on SmolLM2-135M (the quick run's batch: 16
SNLI triplets, --max-len 32, one padded forward, LoRA r 32, AdamW) above the memory after loading,
next to bellm.py's estimate.

  python bench/bellm_step_memory.py                          # fp32
  python bench/bellm_step_memory.py --grad-ckpt
  python bench/bellm_step_memory.py --bf16-weights --grad-ckpt --bf16
  # freed memory returned at once
  MALLOC_MMAP_THRESHOLD_=65536 python bench/bellm_step_memory.py --grad-ckpt
  (SMOLLM=model name or folder, NLI=triplet csv; defaults: HuggingFaceTB/SmolLM2-135M-Instruct,
  snli_devtest.csv)
"""
import argparse
import resource
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import bellm
import common
from _inputs import env_input, env_rows

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
p.add_argument("--bf16-weights", action="store_true", help="the base model's weights in bfloat16 "
               "(as bellm.py --dtype bfloat16)")
p.add_argument("--bf16", action="store_true", help="bf16 autocast, as bellm.py --bf16")
common.show_ranges(p)
a = p.parse_args()
ckpt = a.grad_ckpt
bf16 = a.bf16
dtype = torch.bfloat16 if a.bf16_weights else torch.float32
dev = torch.device("cpu")
rows = env_rows("NLI", "snli_devtest.csv", 16, lambda f: bellm.read_csv(f)[1])
tok, dec = bellm.load_decoder(env_input("SMOLLM", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                              1, "convert", dev, dtype)
if ckpt:
    dec.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
model = get_peft_model(dec, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.1,
                                       target_modules="all-linear")).train()
net = bellm.BeLLM(dec, 1, "parallel", "convert")
texts = [s for r in rows for s in r]
texts, n = bellm.prompted(tok, {"prompt": bellm.PROMPT, "max_len": 32}, texts)
b = tok(texts, padding=True, truncation=True, max_length=n, return_tensors="pt").to(dev)
params = [q for q in model.parameters() if q.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-9)
with open("/proc/self/status") as f:
    base = int(f.read().split("VmRSS:")[1].split()[0]) / 2**20  # GiB resident after loading
with common.autocast(dev, "bf16" if bf16 else common.pick_precision(dev)):
    h = net(b["input_ids"], b["attention_mask"]).float()
bellm.bellm_loss(h[0::3], h[1::3], h[2::3], 0.05).backward()
opt.step()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
s = 2 if dtype == torch.bfloat16 or bf16 else 4
w, o, act = bellm.memory_estimate(dec, sum(q.numel() for q in params), s, b["input_ids"].numel(),
                                  b["input_ids"].shape[1], 32, ckpt)
print(f"{' '.join(sys.argv[1:]) or 'fp32'}: {tuple(b['input_ids'].shape)} tokens; "
      f"after loading {base:.2f} GiB, step peak {peak:.2f} GiB: +{peak - base:.2f} GiB; "
      f"estimate +{o + act:.2f} (activations {act:.2f}, LoRA + AdamW {o:.2f}) over weights {w:.2f}")
