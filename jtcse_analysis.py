"""JTCSE's analyses, no training (run them through jtcse.py --analyze [TWIN_DIR]): E_CLS per layer
(eq. 6) for tower I alone and the twin with and without cross-attention, and the cosines of STS-B
test pairs grouped by gold score (Fig. 5) for each tower and the twin. With `--plot FILE.png` both
are drawn.

  python jtcse.py --analyze runs/jtcse_minilm --model-a sentence-transformers/all-MiniLM-L6-v2 \\
      --plot fig.png
"""
import os

import numpy as np
import torch
import torch.nn.functional as F

import common
import figures
from jtcse import Twin, layer_forward, make_encode


# ---------------------------------------------------------------- analysis ----------------------
@torch.no_grad()
def analyze(a, device):
    """eq. 6: E_CLS = ‖ctx_cls‖₂ / ‖ctx_−‖_F per layer (ctx = attention context SA·V or SA·V_other,
    ctx_− = every other real token), mean over STS-B test sentences."""
    figures.check(a.plot)
    twin_names = ([os.path.join(a.analyze, "tower_a"), os.path.join(a.analyze, "tower_b")]
                  if a.analyze else [a.model_a, a.model_b])
    common.check_towers(twin_names, num_cael=a.num_cael)
    common.check_towers([a.model_a])
    towers, tokenizer = common.load_towers(twin_names)
    single, _ = common.load_towers([a.model_a])
    common.check_max_len(a.max_len, towers[0].config, twin_names[0])
    n = towers[0].config.num_hidden_layers
    k = Twin(towers, a.num_cael).k
    runs = {"single": (single, 0, ["single"]), "twin": (towers, 0, ["I", "II"]),
            "twin+CA": (towers, k, ["I+CA", "II+CA"])}
    rows = common.load_sts(common.senteval_dir(a.data_dir), "STS-B")["test"]
    sents = sorted({s for r in rows for s in r[:2]})
    E = {col: torch.zeros(n) for _, _, cols in runs.values() for col in cols}
    for i in common.progress(range(0, len(sents), 128), "analyze", unit="batch"):
        batch = common.tokenize(tokenizer, sents[i:i + 128], a.max_len, device)
        m = batch["attention_mask"].float()[:, 1:, None]  # (b, L-1, 1): real tokens other than CLS
        for ts, kk, cols in runs.values():
            ts = [t.to(device).eval() for t in ts]
            xs = [t.embeddings(input_ids=batch["input_ids"],
                               token_type_ids=batch.get("token_type_ids")) for t in ts]
            mask = common.additive_mask(batch["attention_mask"], xs[0].dtype)
            for j in range(1, n + 1):
                ctxs = []  # one (b, L, H) context per tower
                xs = layer_forward([t.encoder.layer[j - 1] for t in ts], xs, mask,
                                   kk > 0 and j % kk == 0, ctxs=ctxs)
                for col, ctx in zip(cols, ctxs):  # eq. 6 per sentence, summed over the batch
                    E[col][j - 1] += (ctx[:, 0].norm(dim=-1)
                                      / (ctx[:, 1:] * m).flatten(1).norm(dim=-1)).sum().cpu()
    print(f"E_CLS (eq. 6) per layer, mean over {len(sents)} STS-B test sentences; "
          f"single = {a.model_a}, twin = {twin_names}, +CA = cross stream with CAELs every "
          f"{k or '-'} layers")
    print(f"{'layer':>5} " + " ".join(f"{col:>8}" for col in E))
    for j in range(n):
        print(f"{j + 1:5d} " + " ".join(f"{E[col][j] / len(sents):8.4f}" for col in E))
    # Fig. 5: cos of each STS-B test pair under tower I, tower II and the twin, by gold score
    e1, e2 = (make_encode([t], tokenizer, a.max_len, device)(sents)  # (N, H) each
              for t in towers)
    # the twin's embedding: CLS(I) + CLS(II)
    emb = {"tower I": e1, "tower II": e2, "twin (I + II)": e1 + e2}
    at = {s: i for i, s in enumerate(sents)}
    i, j = torch.tensor([[at[r[0]], at[r[1]]] for r in rows]).T  # (P,) each: the pairs' sentences
    gold = torch.tensor([r[2] for r in rows])  # (P,)
    bins = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5.01)]  # gold score groups; 5.0 joins the last
    cos = {name: F.cosine_similarity(e[i].float(), e[j].float()).cpu()  # (P,)
           for name, e in emb.items()}
    cos = {name: {b: c[(gold >= b[0]) & (gold < b[1])].tolist() for b in bins}
           for name, c in cos.items()}
    print("Fig. 5: mean cos of STS-B test pairs by gold score (pairs in the group)")
    print(f"{'gold':>8} " + " ".join(f"{name:>14}" for name in cos))
    for b in bins:
        print(f"{f'{b[0]}-{min(b[1], 5):g}':>8} "
              + " ".join(f"{np.mean(c[b]):14.4f}" for c in cos.values())
              + f"  ({len(cos['tower I'][b])})")
    if a.plot:
        panels = [dict(kind="lines", title="E_CLS per layer (eq. 6)", xlabel="layer",
                       ylabel="‖ctx_CLS‖ / ‖ctx_rest‖_F",
                       series={col: (range(1, n + 1), (E[col] / len(sents)).tolist())
                               for col in E})]
        panels += [dict(kind="boxes", title=f"Fig. 5: {name}",
                        xlabel="gold similarity score (STS-B test)",
                        ylabel="cosine similarity of the pair",
                        groups={f"{lo}-{min(hi, 5):g}": c[lo, hi] for lo, hi in bins})
                   for name, c in cos.items()]
        figures.draw(a.plot, panels,
                     "JTCSE: attention to CLS and similarity distributions, STS-B test")
