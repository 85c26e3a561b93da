"""Zero-shot STS-B dev of bellm.py's encoder for K = 0,1,2,4 (parallel and sequential, convert) plus
the degradation curve (k = 1..n), sharing one causal pass per batch. Checks on the first batch that
every config equals bellm.decoder_forward (the function load_encoder/eval_sts.py use).

  python bench/bellm_sweep.py MODEL [PROMPT] [K0]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import bellm
import common

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("model", metavar="MODEL", help="a decoder LLM: hub name or folder")
p.add_argument("prompt", metavar="PROMPT", nargs="?", default=bellm.PROMPT,
               help="with {sentence} (default: bellm.py's)")
p.add_argument("only", metavar="K0", nargs="?", choices=["K0"], help="the K = 0 row only")
common.show_ranges(p)
a = p.parse_args()
dev = torch.device("cpu")
M = a.model
PROMPT = a.prompt
tok, dec = bellm.load_decoder(M, 0, "convert", dev)
dec.eval()
n = len(dec.layers)
KS = (1, 2, 4)  # the K of each wiring
names = (["K0"] + [f"{m}{k}" for m in ("par", "seq") for k in KS]
         + [f"deg{k}" for k in range(1, n + 1)])
checked = []  # one entry once the first batch is checked


@torch.no_grad()
def embed_all(b):
    ids, am = b["input_ids"], b["attention_mask"]
    x = dec.embed_tokens(ids)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    kw = dict(position_embeddings=dec.rotary_emb(x, pos), position_ids=pos)
    mc = bellm.attn_mask(am, True, x.dtype)  # causal
    mb = bellm.attn_mask(am, False, x.dtype)  # bidirectional
    hs = [x]
    for layer in dec.layers:
        hs.append(layer(hs[-1], attention_mask=mc, **kw))
    out = {"K0": dec.norm(hs[n])}
    for k in KS:
        g_par = x
        g_seq = hs[n - k]
        for layer in dec.layers[n - k:]:
            g_par = layer(g_par, attention_mask=mb, **kw)
            g_seq = layer(g_seq, attention_mask=mb, **kw)
        out[f"par{k}"] = dec.norm(hs[n - k] + g_par)
        out[f"seq{k}"] = dec.norm(g_seq)
    for k in range(1, n + 1):
        out[f"deg{k}"] = dec.norm(hs[k])
    if not checked:  # the shared pass must equal bellm.decoder_forward for every config
        for k in (0,) + KS:
            for m in ("parallel", "sequential"):
                ref = bellm.decoder_forward(dec, ids, am, k, m, "convert")
                got = out["K0" if k == 0 else f"{m[:3]}{k}"]
                assert torch.allclose(ref, got, atol=1e-4), (k, m)
        checked.append(1)
    return torch.stack([bellm.last_token(out[nm], am) for nm in names], 1)


memo = {}  # sentence -> its vector under every config of names


def encoder(i):
    """encode(sentences) of the i-th config of names (each sentence run once for all configs)."""
    def encode(sents):
        miss = [s for s in dict.fromkeys(sents) if s not in memo]
        if miss:
            texts, ml = bellm.prompted(tok, {"prompt": PROMPT, "max_len": 64}, miss)
            memo.update(zip(miss, common.encode_in_batches(embed_all, tok, texts, ml, dev, 64)))
        return torch.stack([memo[s][i] for s in sents])
    return encode


t = time.time()
data = common.senteval_dir(None)
for i, nm in enumerate(names):
    if a.only and nm != "K0":
        break
    r = common.evaluate(encoder(i), data, ["STS-B"], "dev")["STS-B"]
    print(f"{nm:>6}  STS-B dev {r:.2f}   ({time.time() - t:.0f}s, prompt {PROMPT!r})", flush=True)
