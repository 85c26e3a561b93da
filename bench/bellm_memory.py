"""bellm.py's start-up memory estimate (bellm.memory_estimate) for any decoder config, without
loading weights (the model is built on the meta device): weights, LoRA + AdamW states, activations
with and without gradient checkpointing, for a step of --batch-size triplets padded to --max-len +
the prompt. Needs only the model's config.json.

  # the paper's model and batch, 1 GPU
  python bench/bellm_memory.py meta-llama/Llama-2-7b-hf --batch-size 64
  # per GPU of 4
  python bench/bellm_memory.py meta-llama/Llama-2-7b-hf --batch-size 16
"""
import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import bellm
import common

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("model", help="hub name or folder with a config.json")
p.add_argument("--batch-size", type=common.POS_INT, default=64, help="triplets per GPU")
p.add_argument("--max-len", type=common.POS_INT, default=64, help="as bellm.py --max-len")
p.add_argument("--prompt-tokens", type=common.NONNEG_INT, default=11,
               help="tokens of the prompt without the sentence (LLaMA-2's tokenizer: 11 with <s>)")
p.add_argument("--lora-r", type=common.POS_INT, default=32, help="as bellm.py --lora-r")
p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
common.show_ranges(p)
a = p.parse_args()
cfg = common.load_pretrained(AutoConfig, a.model)
with torch.device("meta"):
    dec = AutoModel.from_config(cfg, dtype=getattr(torch, a.dtype)).requires_grad_(False)
if not all(hasattr(dec, m) for m in ("embed_tokens", "layers", "norm")):
    common.die(f"'{a.model}' is a {cfg.model_type} model ({type(dec).__name__}), not a decoder LLM "
               "with embed_tokens, layers and norm: pass a LLaMA / Mistral / Qwen2-style model")
# LoRA on every Linear of the layers (A: r x in, B: out x r)
n_lora = sum(a.lora_r * (m.in_features + m.out_features) for m in dec.layers.modules()
             if isinstance(m, torch.nn.Linear))
s = 2 if a.dtype == "bfloat16" else 4  # bytes a weight
longest = a.max_len + a.prompt_tokens
tokens = 3 * a.batch_size * longest
print(f"{a.model}: {len(dec.layers)} layers, {a.dtype} weights, LoRA r {a.lora_r} "
      f"({n_lora / 1e6:.1f} M parameters), {a.batch_size} triplets x {longest} tokens = "
      f"{tokens:,} token slots (an upper bound: padded)")
for ckpt in (False, True):
    w, o, act = bellm.memory_estimate(dec, n_lora, s, tokens, longest, a.lora_r, ckpt)
    print(f"{'with' if ckpt else 'without'} gradient checkpointing: weights {w:.1f} GiB + LoRA and "
          f"AdamW {o:.2f} GiB + activations {act:.1f} GiB "
          f"({act * 2**20 / tokens:,.0f} KiB a token) = {w + o + act:.1f} GiB")
