"""JTCSE's analyses, no training. One twin (--analyze [TWIN_DIR]): E_CLS per layer (eq. 6) for
tower I alone and the twin with and without cross-attention, and the cosines of STS-B test pairs
grouped by gold score (Fig. 5). Several models (--compare MODEL ...: BERTs, sscl.py runs, jtcse.py
twins or distilled towers): the last layer's E_CLS against the 7-STS average (Fig. 10); with --cost,
parameters and GMACs per sentence against the 7-STS average (Table VII); with --attention, each
layer's attention map of one sentence (Fig. 9); with --modulus, STS and |h| of runs by the number of
LayerNorms removed (Fig. 8). With `--plot FILE.png` the figure is drawn.

  python jtcse_analysis.py --analyze runs/jtcse_minilm \\
      --model-a sentence-transformers/all-MiniLM-L6-v2 --plot fig.png
  python jtcse_analysis.py --compare sentence-transformers/all-MiniLM-L6-v2 runs/sscl_minilm \\
      runs/jtcse_minilm --cost 64
  python jtcse_analysis.py --compare sentence-transformers/all-MiniLM-L6-v2 runs/jtcse_minilm \\
      --attention "This is an example sentence for visualizing attention scores." --plot fig9.png
"""
import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import pearsonr, spearmanr
from transformers import AutoConfig, AutoModel

import common
import eval_sts
import figures
import jtcse
from jtcse import Twin, drop_layernorm, layer_forward, make_encode

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model-a", default="bert-base-uncased", help="--analyze: tower I (and the "
               "untrained twin's towers with --model-b)")
p.add_argument("--model-b", default="bert-base-uncased", help="--analyze: tower II")
p.add_argument("--num-cael", type=common.NONNEG_INT, help="--analyze: the twin's cross-attention "
               "layers (as jtcse.py --num-cael)")
p.add_argument("--max-len", type=common.POS_INT, default=64, help="tokens read of a sentence")
p.add_argument("--data-dir", help="STS data: DIR/downstream/{STS,SICK} (else $SENTEMB_DATA)")
p.add_argument("--quiet", action="store_true", help="no progress bars")
p.add_argument("--analyze", nargs="?", const="", metavar="TWIN_DIR", help="no training: E_CLS "
               "(eq. 6) per layer and Fig. 5, --model-a and the twin: a jtcse.py twin's run "
               "(RUN or RUN/best), else --model-a and --model-b")
p.add_argument("--compare", nargs="+", metavar="MODEL", help="no training: last-layer E_CLS "
               "against the 7-STS average (Fig. 10); a twin run = its two towers")
p.add_argument("--cost", nargs="?", const=64, type=common.POS_INT, metavar="TOKENS", help="with "
               "--compare: parameters, GMACs of a TOKENS-token sentence, Avg./GMACs (Table VII)")
p.add_argument("--attention", metavar="SENTENCE", help="with --compare: attention maps (Fig. 9)")
p.add_argument("--modulus", action="store_true", help="with --compare: STS and |h| by N (Fig. 8)")
p.add_argument("--plot", metavar="FILE.png", help="--analyze, --compare: draw into this PNG")
common.show_ranges(p)


def analyze(a, device):
    """--analyze: one twin (E_CLS per layer and Fig. 5) or the models of --compare
    (Fig. 10; --cost: Table VII; --attention: Fig. 9; --modulus: Fig. 8)."""
    figures.check(a.plot)  # a bad --plot path stops before any model is loaded
    check_flags(a)
    if a.compare is None:
        return twin(a, device)
    towers = {name: towers_of(name) for name in a.compare}  # every model checked before any work
    for name, names in towers.items():
        jtcse.check_towers(names)
        length_flag = "--cost" if a.cost else "--max-len"
        common.check_max_len(a.cost or a.max_len, load_config(names[0]), name, length_flag)
    if a.cost is not None:
        return cost_table(a, towers, device)
    if a.attention is not None:
        return attention_figure(a, towers, device)
    if a.modulus:
        return modulus_figure(a, towers, device)
    return e_cls_against_sts(a, towers, device)


def check_flags(a):
    """The flags that cannot go together (--analyze with --compare, two of --cost, --attention
    and --modulus, ...), or an empty --attention: one line, exit 2."""
    if a.attention is not None and not a.attention.strip():
        common.die("--attention is empty: pass a sentence, e.g. --attention \"This is an example "
                   "sentence for visualizing attention scores.\"")
    analyses = [a.cost is not None, a.attention is not None, a.modulus]  # of --compare
    if a.compare is None:
        if any(analyses):
            common.die("--cost, --attention and --modulus compare models: add --compare MODEL "
                       "[MODEL ...]")
        return
    if a.analyze:
        common.die(f"--analyze '{a.analyze}' analyses one twin and --compare several models: "
                   "pass the twin to --compare instead")
    if sum(analyses) > 1:
        common.die("--cost, --attention and --modulus are three analyses: run one at a time")
    if a.cost is not None and a.plot:
        common.die("--cost prints Table VII and draws nothing: drop --plot")


# ---------------------------------------------------------------- the models --------------------
def members(name):
    """An ensemble (JTCSE's +UC) is named A+B[+C...]: the sum of its members' embeddings, as
    eval_sts.py --ensemble computes it. -> [A, B, ...]; any other name -> [name]."""
    return [name] if os.path.exists(name) or "+" not in name else name.split("+")


def towers_of(name):
    """The BERT folders whose CLS vectors sum to one embedding of `name` (what eval_sts.py encodes
    with): a jtcse.py twin -> [tower I, tower II]; its distilled tower, an sscl.py run, a plain
    BERT -> [name]; an ensemble A+B -> A's, then B's."""
    if len(members(name)) > 1:
        return [t for m in members(name) for t in towers_of(m)]
    meta = eval_sts.read_meta(name) if os.path.isdir(name) else None  # checks a run's files
    folder = eval_sts.model_folder(name)  # a run's best/
    if meta is None or meta["method"] == "sscl":
        return [folder]
    if meta["method"] == "jtcse":
        return [os.path.normpath(os.path.join(folder, t)) for t in meta["towers"]]
    common.die(f"'{name}' is a bellm.py run: --analyze and --compare take BERT encoders (Hugging "
               "Face BERTs, sscl.py and jtcse.py runs)")


def dropped(name):
    """Per tower of towers_of(name): the --drop-layernorm its jtcse.py run trained with (Fig. 8),
    0 for any other model."""
    if len(members(name)) > 1:
        return [n for m in members(name) for n in dropped(m)]
    meta = eval_sts.read_meta(name) if os.path.isdir(name) else None
    if meta is None or meta["method"] != "jtcse":
        return [0]
    return [meta.get("drop_layernorm", 0)] * len(meta["towers"])


def load_model(name, names):
    """The towers of `name` (towers_of) as its encoder runs them, and their tokenizer."""
    ts, tokenizer = jtcse.load_towers(names)
    return [drop_layernorm(t, n) for t, n in zip(ts, dropped(name))], tokenizer


def load_config(name):
    """The checked config.json of `name`: its shapes (layers, hidden, heads, positions)."""
    return common.load_pretrained(AutoConfig, name)


def sts_average(name, data, device):
    """The 7-STS average (Spearman x 100) of `name` as eval_sts.py computes it (its encoder, no
    truncation); an ensemble's, of the sum of its members' embeddings."""
    from eval_sts import load_ensemble
    encode = load_ensemble(members(name), device=device)
    with common.autocast(device, common.pick_precision(device)):  # eval_sts.py's default
        return float(np.mean(list(common.evaluate(encode, data).values())))


# ---------------------------------------------------------------- E_CLS (eq. 6) -----------------
@torch.no_grad()
def e_cls(models, sents, max_len, device, batch_size=128):
    """eq. 6: E_CLS = ‖ctx_cls‖₂ / ‖ctx_−‖_F per tower and layer (ctx = the attention context SA·V,
    or SA·V_other at a CAEL, heads merged; ctx_− = every other real token), mean over sentences.
    models: {key: (towers, tokenizer, k)}, towers [BertModel] walked layer by layer together, with
    a CAEL (eq. 10) at every k-th layer (k = 0: none, each tower = its stock forward).
    -> {key: (T, n) tensor}, T towers, n layers."""
    E = {key: torch.zeros(len(ts), ts[0].config.num_hidden_layers)
         for key, (ts, _, _) in models.items()}
    for i in common.progress(range(0, len(sents), batch_size), "E_CLS", unit="batch"):
        for key, (ts, tokenizer, k) in models.items():
            batch = tokenizer(sents[i:i + batch_size], padding=True, truncation=True,
                              max_length=max_len, return_tensors="pt").to(device)
            E[key] += e_cls_of_batch(ts, batch, k)
    return {key: e / len(sents) for key, e in E.items()}


def e_cls_of_batch(towers, batch, k):
    """eq. 6 of each sentence of one tokenised batch, summed over the batch: (T, n), the towers
    walked layer by layer together, a CAEL at every k-th layer (k = 0: none)."""
    n = towers[0].config.num_hidden_layers
    sums = torch.zeros(len(towers), n)
    m = batch["attention_mask"].float()[:, 1:, None]  # (b, L-1, 1): real tokens but CLS
    xs = [t.embeddings(input_ids=batch["input_ids"],
                       token_type_ids=batch.get("token_type_ids")) for t in towers]  # (b, L, H)
    mask = jtcse.additive_mask(batch["attention_mask"], xs[0].dtype)  # (b, 1, 1, L)
    for j in range(1, n + 1):
        cael = k > 0 and j % k == 0
        xs, ctxs = layer_forward([t.encoder.layer[j - 1] for t in towers], xs, mask,
                                 cael)  # one (b, L, H) context a tower
        for t, ctx in enumerate(ctxs):  # eq. 6 per sentence, summed over the batch
            ratio = ctx[:, 0].norm(dim=-1) / (ctx[:, 1:] * m).flatten(1).norm(dim=-1)  # (b,)
            sums[t, j - 1] = ratio.sum().cpu()
    return sums


def stsb_sentences(data):
    """The distinct STS-B test sentences and the test rows (sent1, sent2, gold)."""
    rows = common.load_sts(data, "STS-B")["test"]
    return sorted({s for r in rows for s in r[:2]}), rows


def twin(a, device):
    """E_CLS per layer (eq. 6) of --model-a alone and of the twin (TWIN_DIR's towers, or --model-a
    and --model-b) without and with its cross streams; Fig. 5: the cosines of STS-B test pairs by
    gold score under each tower and the twin."""
    twin_names = twin_towers(a)
    if a.analyze:
        towers, tokenizer = load_model(a.analyze, twin_names)
    else:
        towers, tokenizer = jtcse.load_towers(twin_names)
    single, single_tok = jtcse.load_towers([a.model_a])
    common.check_max_len(a.max_len, towers[0].config, twin_names[0])
    n = towers[0].config.num_hidden_layers
    k = Twin(towers, a.num_cael).k
    towers = [t.to(device).eval() for t in towers]
    single = [t.to(device).eval() for t in single]
    cols = {"single": ["single"], "twin": ["I", "II"], "twin+CA": ["I+CA", "II+CA"]}
    sents, rows = stsb_sentences(common.senteval_dir(a.data_dir))
    by_run = e_cls({"single": (single, single_tok, 0), "twin": (towers, tokenizer, 0),
                   "twin+CA": (towers, tokenizer, k)}, sents, a.max_len, device)
    E = {col: e for key, names in cols.items() for col, e in zip(names, by_run[key])}
    print(f"E_CLS (eq. 6) per layer, mean over {len(sents)} STS-B test sentences; "
          f"single = {a.model_a}, twin = {twin_names}, +CA = cross stream with CAELs every "
          f"{k or '-'} layers")
    print(f"{'layer':>5} " + " ".join(f"{col:>8}" for col in E))
    for j in range(n):
        print(f"{j + 1:5d} " + " ".join(f"{E[col][j]:8.4f}" for col in E))
    cos = cosines_by_gold(towers, tokenizer, a.max_len, device, sents, rows)
    print_cosines_by_gold(cos)
    if a.plot:
        draw_twin(a.plot, E, cos, n)


def twin_towers(a):
    """The twin's two tower folders (TWIN_DIR's, or --model-a and --model-b), checked with
    --model-a: one line, exit 2, for anything else."""
    twin_names = towers_of(a.analyze) if a.analyze else [a.model_a, a.model_b]  # RUN or RUN/best
    if len(twin_names) != 2:
        common.die(f"--analyze '{a.analyze}' is not a jtcse.py twin's run: pass one (RUN or "
                   "RUN/best), or no TWIN_DIR and the towers as --model-a and --model-b")
    jtcse.check_towers(twin_names, num_cael=a.num_cael)
    jtcse.check_towers([a.model_a])
    return twin_names


GOLD_BINS = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5.01)]  # Fig. 5's gold score groups; 5.0: the last


def cosines_by_gold(towers, tokenizer, max_len, device, sents, rows):
    """Fig. 5: the cos of each STS-B test pair (rows) under tower I, tower II and the twin, CLS(I)
    + CLS(II), in GOLD_BINS. -> {name: {bin: [cos, ...]}}"""
    precision = common.pick_precision(device)  # eval_sts.py's default
    e1, e2 = [make_encode([t], tokenizer, max_len, device, precision=precision)(sents)
              for t in towers]  # (N, H) each
    # the twin's embedding: CLS(I) + CLS(II)
    emb = {"tower I": e1, "tower II": e2, "twin (I + II)": e1 + e2}
    at = {s: i for i, s in enumerate(sents)}
    i, j = torch.tensor([[at[r[0]], at[r[1]]] for r in rows]).T  # (P,) each: the pairs' sentences
    gold = torch.tensor([r[2] for r in rows])  # (P,)
    cos = {name: F.cosine_similarity(e[i].float(), e[j].float()).cpu()  # (P,)
           for name, e in emb.items()}
    return {name: {b: c[(gold >= b[0]) & (gold < b[1])].tolist() for b in GOLD_BINS}
            for name, c in cos.items()}


def print_cosines_by_gold(cos):
    """Fig. 5 as a table: a row a gold score group, a column a model, and the group's pairs."""
    print("Fig. 5: mean cos of STS-B test pairs by gold score (pairs in the group)")
    print(f"{'gold':>8} " + " ".join(f"{name:>14}" for name in cos))
    for b in GOLD_BINS:
        print(f"{f'{b[0]}-{min(b[1], 5):g}':>8} "
              + " ".join(f"{np.mean(c[b]):14.4f}" for c in cos.values())
              + f"  ({len(cos['tower I'][b])})")


def draw_twin(plot, E, cos, n):
    """E_CLS per layer (a line a column of E) and Fig. 5 (a box plot a model of cos) into plot."""
    panels = [dict(kind="lines", title="E_CLS per layer (eq. 6)", xlabel="layer",
                   ylabel="‖ctx_CLS‖ / ‖ctx_rest‖_F",
                   series={col: (range(1, n + 1), E[col].tolist()) for col in E})]
    panels += [dict(kind="boxes", title=f"Fig. 5: {name}",
                    xlabel="gold similarity score (STS-B test)",
                    ylabel="cosine similarity of the pair",
                    groups={f"{lo}-{min(hi, 5):g}": c[lo, hi] for lo, hi in GOLD_BINS})
               for name, c in cos.items()]
    figures.draw(plot, panels, "JTCSE: attention to CLS and similarity distributions, STS-B test")


def e_cls_against_sts(a, towers, device):
    """Fig. 10: for each model, E_CLS per layer (eq. 6, mean over the STS-B test sentences and over
    a twin's two towers, no cross-attention: what inference runs) and the 7-STS average; Spearman
    and Pearson correlation of each layer's E_CLS with the average over the models; the figure
    plots the last layer's."""
    data = common.sts_data(a.data_dir)  # every file, before the work
    sents, _ = stsb_sentences(data)
    E = {}
    avg = {}
    for name, names in towers.items():
        ts, tokenizer = load_model(name, names)
        ts = [t.to(device).eval() for t in ts]
        E[name] = e_cls({name: (ts, tokenizer, 0)}, sents, a.max_len, device)[name].mean(0)
        del ts
        avg[name] = sts_average(name, data, device)
    width = max(len(n) for n in towers)
    n = max(len(e) for e in E.values())
    print(f"Fig. 10: E_CLS (eq. 6) per layer, mean over {len(sents)} STS-B test sentences (and a "
          "twin's towers), against the 7-STS average (Spearman x 100)")
    print(f"{'model':<{width}} " + " ".join(f"{f'E_CLS {j}':>8}" for j in range(1, n + 1))
          + f" {'STS Avg.':>8}")
    for name in towers:
        print(f"{name:<{width}} " + " ".join(f"{e:8.4f}" for e in E[name].tolist())
              + " " * 9 * (n - len(E[name])) + f" {avg[name]:8.2f}")
    corr = print_correlations(towers, E, avg, width, n)
    if a.plot:
        label = figures.labels(list(towers))
        figures.draw(a.plot, [dict(
            kind="scatter", title="Fig. 10: " + (corr or "attention to CLS and STS"),
            xlabel="E_CLS of the last layer (eq. 6), STS-B test",
            ylabel="7-STS Avg. (Spearman x 100)",
            points={label[m]: (float(E[m][-1]), avg[m]) for m in towers})],
            "JTCSE: attention to CLS against STS", ncols=1)


def print_correlations(towers, E, avg, width, n):
    """Fig. 10's correlations over the models (3 or more): Spearman and Pearson of each layer's
    E_CLS with the 7-STS average where every model has n layers, then of the last layer's.
    -> the last layer's in words ("" under 3 models)"""
    if len(towers) < 3:
        print("correlation: needs 3 models or more")
        return ""
    y = [avg[m] for m in towers]
    if len({len(e) for e in E.values()}) == 1:  # one layer count: each layer's correlation
        for what, f in (("Spearman", spearmanr), ("Pearson", pearsonr)):
            print(f"{what:<{width}} " + " ".join(
                f"{f([float(E[m][j]) for m in towers], y).statistic:8.3f}" for j in range(n)))
    x = [float(E[m][-1]) for m in towers]
    rho = spearmanr(x, y).statistic
    r = pearsonr(x, y).statistic
    corr = f"Spearman {rho:.3f}, Pearson {r:.3f}"
    print(f"last layer's E_CLS against the 7-STS average over {len(towers)} models: {corr}")
    return corr


# ---------------------------------------------------------------- Table VII: inference cost -----
@torch.no_grad()
def inference_cost(name, tokens):
    """(parameters, MACs of every matmul, MACs of the Linear layers) of one embedding of `name` for
    a sentence of `tokens` tokens, batch 1: each tower's BertModel forward (embeddings, encoder,
    pooler; eager attention) and an sscl.py run's --proj-dim projection. FLOPs are counted by
    torch.utils.flop_counter.FlopCounterMode, which counts matmul-type ops only (aten.mm, addmm,
    bmm, ...): every Linear layer and attention's Q·K^T and A·V; MACs = FLOPs / 2. Embedding
    lookups, LayerNorm, softmax, GELU and residual additions are not counted. Linear MACs: what
    thop's nn.Linear rule counts, in_features per output element. The towers are built from their
    configs (random weights): shapes are all a count needs. An ensemble costs its members."""
    if len(members(name)) > 1:
        return tuple(map(sum, zip(*(inference_cost(m, tokens) for m in members(name)))))
    meta = eval_sts.read_meta(name) if os.path.isdir(name) else None
    nets = [AutoModel.from_config(load_config(n), attn_implementation="eager").eval()
            for n in towers_of(name)]
    H = nets[0].config.hidden_size
    proj = None
    if meta and meta.get("proj_dim"):
        proj = torch.nn.Linear(H, meta["proj_dim"])
    modules = nets if proj is None else nets + [proj]
    macs, linear = count_macs(nets, proj, modules, tokens)
    params = sum(p.numel() for net in modules for p in net.parameters())
    return params, macs, linear


def count_macs(nets, proj, modules, tokens):
    """One embedding of a `tokens`-token sentence: each tower of nets, then proj (None: none) on
    its CLS. -> (MACs of every matmul: FlopCounterMode's FLOPs / 2, MACs of the Linear layers of
    modules: thop's count)"""
    from torch.utils.flop_counter import FlopCounterMode
    linear = [0]

    def count(module, inputs, out):  # thop's count_linear
        linear[0] += module.in_features * out.numel()
    hooks = [m.register_forward_hook(count) for net in modules
             for m in net.modules() if isinstance(m, torch.nn.Linear)]
    ids = torch.ones(1, tokens, dtype=torch.long)  # (1, L): the ids do not change the count
    batch = {"input_ids": ids, "attention_mask": ids, "token_type_ids": torch.zeros_like(ids)}
    with FlopCounterMode(display=False) as counter:
        for net in nets:
            h = net(**batch).last_hidden_state[:, 0]  # (1, H): CLS, summed over a twin's towers
            if proj is not None:
                proj(h)
    for hook in hooks:
        hook.remove()
    return counter.get_total_flops() // 2, linear[0]


def cost_table(a, towers, device):
    """Table VII: per model, its parameters, GMACs for one sentence of --cost tokens, the 7-STS
    average and η = Avg. / GMACs."""
    data = common.sts_data(a.data_dir)
    rows = {}
    for name in towers:
        params, macs, linear = inference_cost(name, a.cost)
        rows[name] = (len(towers[name]), params, macs, linear, sts_average(name, data, device))
    width = max(len(n) for n in towers)
    print(f"Table VII: inference cost of one embedding, a sentence of {a.cost} tokens, batch 1. "
          "GMACs = FLOPs / 2 of torch's FlopCounterMode: every matmul (Linear layers, attention's "
          "Q·K^T and A·V); Linear = thop's nn.Linear count (no attention matmuls, which thop "
          "does not see); η = Avg. / GMACs")
    print(f"{'model':<{width}} {'towers':>6} {'params':>8} {'GMACs':>7} {'Linear':>7} "
          f"{'STS Avg.':>8} {'η':>7}")
    for name, (t, params, macs, linear, avg) in rows.items():
        print(f"{name:<{width}} {t:6d} {params / 1e6:7.2f}M {macs / 1e9:7.3f} {linear / 1e9:7.3f} "
              f"{avg:8.2f} {avg / (macs / 1e9):7.2f}")


# ---------------------------------------------------------------- Fig. 9: attention maps --------
def split_heads(t, d):
    """(N, L, heads · d) -> (N, heads, L, d): one attention head's d dimensions a slice."""
    return t.view(*t.shape[:-1], -1, d).transpose(1, 2)


@torch.no_grad()
def attention_maps(tower, batch):
    """eq. 8 per layer, heads averaged: [(N, L, L)] x layers, row i = query token i's attention
    weights over the keys (each row sums to 1). SA = softmax(Q·K^T / √d + mask) from each layer's
    own query and key projections; the layer's input comes from layer_forward (the stock layer)."""
    x = tower.embeddings(input_ids=batch["input_ids"],
                         token_type_ids=batch.get("token_type_ids"))  # (N, L, H)
    mask = jtcse.additive_mask(batch["attention_mask"], x.dtype)  # (N, 1, 1, L)
    maps = []
    for layer in tower.encoder.layer:
        att = layer.attention.self
        d = att.attention_head_size
        q = split_heads(att.query(x), d)  # (N, heads, L, d)
        k = split_heads(att.key(x), d)  # (N, heads, L, d)
        sa = torch.softmax(q @ k.transpose(-1, -2) * att.scaling + mask, dim=-1)  # (N, heads, L, L)
        maps.append(sa.mean(1))
        (x,), _ = layer_forward([layer], [x], mask, False)
    return maps


def attention_figure(a, towers, device):
    """Fig. 9: each tower's head-averaged attention map of --attention per layer; printed: each
    layer's share of attention (mean over the query rows) on [CLS], [SEP] and the sentence's final
    punctuation token."""
    rows = attention_rows(a, towers, device)
    print(f"Fig. 9: attention of {a.attention!r}, heads averaged; per layer the share of "
          "attention (mean over the query tokens) on [CLS], [SEP] and the final punctuation token")
    for _, key, tokens, maps in rows:
        print_attention_shares(key, tokens, maps)
    if a.plot:
        panels = [dict(kind="heat", title=f"{row}, layer {j}", matrix=m.numpy(), labels=tokens,
                       vmin=0, colorbar=False, xlabel="key", ylabel="query")
                  for row, _, tokens, maps in rows for j, m in enumerate(maps, 1)]
        figures.draw(a.plot, panels, f"Fig. 9: attention maps of {a.attention!r}, heads averaged "
                     "(colour: 0 to the panel's largest weight)",
                     ncols=max(len(r[3]) for r in rows), size=(3.0, 3.0))


def attention_rows(a, towers, device):
    """Fig. 9's rows, a tower of each model: (label, key, tokens, [(L, L) map] a layer)."""
    rows = []
    label = figures.labels(list(towers))
    for name, names in towers.items():
        ts, tokenizer = load_model(name, names)
        batch = tokenizer([a.attention], padding=True, truncation=True, max_length=a.max_len,
                          return_tensors="pt").to(device)
        tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
        for t, tower in enumerate(ts):
            suffix = "" if len(ts) == 1 else " " + "I" * (t + 1)
            maps = [m[0].cpu() for m in attention_maps(tower.to(device).eval(), batch)]
            rows.append((label[name] + suffix, name + suffix, tokens, maps))
    return rows


def final_punctuation(tokens):
    """The position of the token before [SEP] when it is punctuation (no letter, no digit), else
    None."""
    punct = len(tokens) - 2
    if punct > 0 and not any(c.isalnum() for c in tokens[punct]):
        return punct
    return None


def print_attention_shares(key, tokens, maps):
    """One row of Fig. 9 as a table: a line a layer, the share of attention (mean over the query
    rows) on [CLS], [SEP] and the final punctuation token."""
    punct = final_punctuation(tokens)
    print(f"{key} ({len(tokens)} tokens: {' '.join(tokens)})")
    punct_title = f"{repr(tokens[punct]):>7}" if punct else f"{'punct.':>7}"
    print(f"{'layer':>5} {'[CLS]':>7} {'[SEP]':>7} " + punct_title)
    for j, m in enumerate(maps, 1):
        share = m.mean(0)  # (L,): mean over the query rows
        punct_share = f"{share[punct]:7.3f}" if punct else f"{'-':>7}"
        print(f"{j:5d} {share[0]:7.3f} {share[-1]:7.3f} " + punct_share)


# ---------------------------------------------------------------- Fig. 8: LayerNorm removed -----
@torch.no_grad()
def modulus(towers, tokenizer, sents, max_len, device, batch_size=128):
    """The mean L2 norm of the last hidden state over every real token, and of its CLS vector,
    over the sentences (and a twin's towers). -> (tokens' mean, CLS mean)"""
    tokens = cls = count = 0.0
    for i in common.progress(range(0, len(sents), batch_size), "modulus", unit="batch"):
        batch = tokenizer(sents[i:i + batch_size], padding=True, truncation=True,
                          max_length=max_len, return_tensors="pt").to(device)
        real = batch["attention_mask"].bool()  # (b, L)
        for t in towers:
            norms = t(**batch).last_hidden_state.norm(dim=-1)  # (b, L)
            tokens += norms[real].sum().item()
            cls += norms[:, 0].sum().item()
            count += real.sum().item()
    return tokens / count, cls / (len(sents) * len(towers))


def modulus_figure(a, towers, device):
    """Fig. 8: per model, the LayerNorms removed (its --drop-layernorm N), the 7-STS average and
    the mean L2 norm of the last hidden state (every token; CLS) over the STS-B test sentences;
    the figure: both against N."""
    data = common.sts_data(a.data_dir)  # every file, before the work
    sents, _ = stsb_sentences(data)
    rows = {}
    for name, names in towers.items():
        ts, tokenizer = load_model(name, names)
        norms = modulus([t.to(device).eval() for t in ts], tokenizer, sents, a.max_len, device)
        rows[name] = (max(dropped(name)), *norms, sts_average(name, data, device))
    width = max(len(n) for n in towers)
    print(f"Fig. 8: LayerNorms removed (N = --drop-layernorm), the last hidden state's mean L2 "
          f"norm over {len(sents)} STS-B test sentences (every token; CLS), 7-STS average")
    print(f"{'model':<{width}} {'N':>2} {'|h|':>8} {'|h_CLS|':>8} {'STS Avg.':>8}")
    for name, (n, tok, cls, avg) in rows.items():
        print(f"{name:<{width}} {n:2d} {tok:8.3f} {cls:8.3f} {avg:8.2f}")
    if a.plot:
        order = sorted(rows, key=lambda m: rows[m][0])
        ns = [rows[m][0] for m in order]
        figures.draw(a.plot, [
            dict(kind="lines", title="7-STS average", xlabel="LayerNorms removed (N)",
                 ylabel="Avg. (Spearman x 100)", series={"STS": (ns, [rows[m][3] for m in order])}),
            dict(kind="lines", title="modulus of the last hidden state",
                 xlabel="LayerNorms removed (N)", ylabel="mean L2 norm",
                 series={"every token": (ns, [rows[m][1] for m in order]),
                         "CLS": (ns, [rows[m][2] for m in order])})],
            "Fig. 8: removing the LayerNorm of the last N layers (TMC on the CLS hidden state)")


def main():
    a = common.parse(p)
    if a.analyze is None and not a.compare and a.cost is None and a.attention is None \
            and not a.modulus:
        common.die("pass --analyze [TWIN_DIR] (E_CLS per layer, Fig. 5) or --compare MODEL ... "
                   "(Figs. 8-10, Table VII)")
    analyze(a, common.pick_device())


if __name__ == "__main__":
    main()
