"""SSCL's analyses, no training: for each --model, eq. 1 token-wise similarity and eq. 2 inter-layer
similarity per layer on the STS-B test sentences (Fig. 1, Fig. 4), and with --sentence the last
layer's token-by-token cosines of one sentence (Fig. 5); --plot draws them. With --convergence
instead: the dev curves that training recorded in run folders (dev.jsonl), against steps (Fig. 6).

  python sscl_analysis.py --model sentence-transformers/all-MiniLM-L6-v2 runs/simcse runs/sscl \\
      --sentence "A man is playing a guitar." --plot fig.png
  python sscl_analysis.py --convergence --model runs/simcse runs/sscl --plot fig6.png
"""
import argparse
import os

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

import common
import eval_sts
import figures
import harness

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", nargs="+", required=True, help="hub names or local folders (BERT-like "
               "encoders; sscl.py runs, distilled jtcse.py runs: RUN or RUN/best); with "
               "--convergence: run folders")
p.add_argument("--data-dir", help="SentEval's data folder (else $SENTEMB_DATA, else "
               "~/.cache/sentemb/senteval)")
p.add_argument("--max-len", type=common.POS_INT, default=32, help="tokens read of each sentence "
               "(sscl.py's training length)")
p.add_argument("--pooler", default="cls", choices=["cls", "avg"],
               help="the sentence vector of eq. 2")
p.add_argument("--sentence", help="also this sentence's last-layer token cosines (Fig. 5)")
p.add_argument("--convergence", action="store_true", help="Fig. 6: the runs' dev curves instead")
p.add_argument("--plot", metavar="FILE.png", help="draw Figs. 1, 4 (and 5), or Fig. 6")
p.add_argument("--quiet", action="store_true", help="no progress bars")
common.show_ranges(p)


@torch.no_grad()
def over_smoothing(name, a, sents, device):
    """Per layer l = 0 (embeddings) .. n, means over the sentences:
    eq. 1 token-wise similarity: the mean cos(h_i^l, h_j^l) over real tokens i ≠ j of a sentence;
    eq. 2 inter-layer similarity: cos(s^l, s^(l+1)), s^l the pooled sentence vector (--pooler).
    With --sentence: also that sentence's last-layer token-by-token cosine matrix (Fig. 5) and its
    tokens."""
    # a run (RUN or RUN/best): its best model, a BERT for sscl.py's and a distilled jtcse.py
    # tower's; a twin or a BeLLM adapter is no model folder: refused, saying what it is
    with eval_sts.reading(name) as (_, folder, _):
        tokenizer = common.load_pretrained(AutoTokenizer, folder)
        bert = common.load_pretrained(AutoModel, folder).to(device).eval()
    common.check_max_len(a.max_len, bert.config, name)
    n = bert.config.num_hidden_layers
    tok_sim = torch.zeros(n + 1)  # eq. 1, summed over the sentences
    layer_sim = torch.zeros(n)  # eq. 2, summed over the sentences
    for i in common.progress(range(0, len(sents), 128), "analyze", unit="batch"):
        batch = tokenizer(sents[i:i + 128], padding=True, truncation=True, max_length=a.max_len,
                          return_tensors="pt").to(device)
        with common.autocast(device, common.pick_precision(device)):
            hs = bert(**batch, output_hidden_states=True).hidden_states  # n+1 × (b, L, H)
        mask = batch["attention_mask"].float()  # (b, L)
        off_diagonal = 1 - torch.eye(mask.shape[1], device=device)
        pair = mask.unsqueeze(1) * mask.unsqueeze(2) * off_diagonal  # (b, L, L): real tokens, i ≠ j
        pooled = []
        for layer, h in enumerate(hs):
            h = F.normalize(h.float(), dim=-1)
            cos = h @ h.transpose(1, 2)  # (b, L, L)
            mean_cos = (cos * pair).sum((1, 2)) / pair.sum((1, 2)).clamp(min=1)  # (b,): eq. 1
            tok_sim[layer] += mean_cos.sum().cpu()
            if a.pooler == "cls":
                pooled.append(h[:, 0])
            else:
                pooled.append((h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True))
        for layer in range(n):
            layer_sim[layer] += F.cosine_similarity(pooled[layer], pooled[layer + 1],
                                                    dim=-1).sum().cpu()
    heat = None
    if a.sentence:  # Fig. 5: (L, L) cosines of the last layer's tokens, special tokens included
        batch = tokenizer([a.sentence], padding=True, truncation=True, max_length=a.max_len,
                          return_tensors="pt").to(device)
        h = F.normalize(bert(**batch).last_hidden_state[0].float(), dim=-1)  # (L, H)
        heat = ((h @ h.T).cpu().numpy(), tokenizer.convert_ids_to_tokens(batch["input_ids"][0]))
    return (tok_sim / len(sents)).tolist(), (layer_sim / len(sents)).tolist(), heat


def analyze(a, device):
    """Prints eqs. 1-2 per layer for each --model; --plot draws Fig. 1 (eq. 2) and Fig. 4 (eq. 1)
    with one line per model, and with --sentence a Fig. 5 heat map per model. --convergence:
    Fig. 6 instead."""
    if a.convergence:
        return convergence(a)
    figures.check(a.plot)
    rows = common.load_sts(common.senteval_dir(a.data_dir), "STS-B")["test"]
    sents = sorted({s for r in rows for s in r[:2]})
    res = {name: over_smoothing(name, a, sents, device) for name in a.model}
    print_over_smoothing(a, sents, res)
    if a.plot:
        draw_over_smoothing(a, sents, res)


def print_over_smoothing(a, sents, res):
    """Per model of res ({name: over_smoothing's result}): eqs. 1-2 a layer, and Fig. 5's mean
    off-diagonal cosine."""
    for name, (tok_sim, layer_sim, heat) in res.items():
        print(f"over-smoothing of {name} on {len(sents)} STS-B test sentences ({a.pooler} pooling)")
        print(f"{'layer':>5} {'token-wise sim (eq. 1)':>23} {'sim to next layer (eq. 2)':>26}")
        for layer, t in enumerate(tok_sim):
            next_sim = f"{layer_sim[layer]:26.4f}" if layer < len(layer_sim) else ""
            print(f"{layer:5d} {t:23.4f} " + next_sim)
        if heat:
            m, k = heat[0], len(heat[1])
            print(f"Fig. 5, last-layer token cosines of {a.sentence!r}: mean off-diagonal "
                  f"{(m.sum() - m.trace()) / (k ** 2 - k):.4f}")


def draw_over_smoothing(a, sents, res):
    """Fig. 1 (eq. 2) and Fig. 4 (eq. 1), a line a model, and a Fig. 5 heat map a model that has
    one, into --plot."""
    label = figures.labels(a.model)
    panels = [dict(kind="lines", title="Fig. 1: similarity of adjacent layers (eq. 2)",
                   xlabel="layer l", ylabel=f"cos(s^l, s^(l+1)), {a.pooler} pooling",
                   series={label[m]: (range(len(r[1])), r[1]) for m, r in res.items()}),
              dict(kind="lines", title="Fig. 4: token-wise similarity (eq. 1)",
                   xlabel="layer l (0 = embeddings)", ylabel="mean cos(h_i, h_j), i ≠ j",
                   series={label[m]: (range(len(r[0])), r[0]) for m, r in res.items()})]
    panels += [dict(kind="heat", title=f"Fig. 5: {label[m]}, last layer", matrix=r[2][0],
                    labels=r[2][1], vmin=-1, vmax=1, cbar="cosine", xlabel="token", ylabel="token")
               for m, r in res.items() if r[2]]
    figures.draw(a.plot, panels, f"Over-smoothing on STS-B test ({len(sents)} sentences)")


def convergence(a):
    """Fig. 6: the dev curve of each --model run folder (its dev.jsonl: the score of every dev
    evaluation of training, any of our scripts), printed as one table, step by step; --plot draws
    the curves against steps, one panel per dev metric (stsb_dev, transfer_dev, ...)."""
    figures.check(a.plot)
    curves = read_curves(a.model)
    label = figures.labels(a.model)
    metrics = {m: sorted({e["metric"] for e in c}) for m, c in curves.items()}
    print_curves(a.model, curves, metrics, label)
    if a.plot:
        draw_curves(a.plot, curves, metrics, label)


def read_curves(runs):
    """{run folder: its dev curve (eval_sts.read_curve)}; a run without one stops, in one line."""
    curves = {}
    for m in runs:
        curves[m] = eval_sts.read_curve(m) if os.path.isdir(m) else []
        if not curves[m]:
            common.die(f"'{m}' holds no dev curve ({harness.CURVE}): --convergence takes run "
                       "folders of sscl.py, jtcse.py or bellm.py, trained with this version")
    return curves


def print_curves(runs, curves, metrics, label):
    """The dev curves as one table: a row a step, a column a run ("-" where it has no score)."""
    score = {m: {e["step"]: e["score"] for e in c} for m, c in curves.items()}
    print("Fig. 6: dev score against training steps (" + "; ".join(
        f"{label[m]}: {', '.join(metrics[m])}" for m in runs) + ")")
    width = max(9, *map(len, label.values()))
    print(f"{'step':>6} " + " ".join(f"{label[m]:>{width}}" for m in runs))
    for step in sorted({s for sc in score.values() for s in sc}):
        cells = []
        for m in runs:
            if step in score[m]:
                cells.append(f"{score[m][step]:{width}.2f}")
            else:
                cells.append(" " * (width - 1) + "-")
        print(f"{step:6d} " + " ".join(cells))


def draw_curves(plot, curves, metrics, label):
    """Fig. 6 into `plot`: one panel per dev metric, a line a run that has it."""
    panels = []
    for metric in sorted({x for ms in metrics.values() for x in ms}):
        series = {}
        for m, c in curves.items():
            if metric in metrics[m]:
                series[label[m]] = tuple(zip(*[(e["step"], e["score"]) for e in c
                                               if e["metric"] == metric]))
        panels.append(dict(kind="lines", title=f"Fig. 6: convergence ({metric})",
                           xlabel="training step", ylabel=f"{metric} (x 100)", series=series))
    figures.draw(plot, panels, "Dev score during training", ncols=len(panels))


def main():
    a = common.parse(p)
    if a.convergence and a.sentence:
        common.die("--sentence draws Fig. 5 of the over-smoothing analysis: drop --convergence")
    analyze(a, common.pick_device())


if __name__ == "__main__":
    main()
