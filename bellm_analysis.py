"""BeLLM's analyses, no training: Fig. 4, the STS score of the causal LLM cut after each layer
(`--degradation`), Fig. 2 / Fig. 5, how much the pooled pivot token depends on the sentence's tokens
(`--dependency`), and App. A, the word the LM head predicts after the prompt
(`--representative-words`). With `--plot FILE.png` the figures are drawn.

  python bellm_analysis.py --degradation --model HuggingFaceTB/SmolLM2-135M-Instruct \\
      --tasks STS-B --plot fig4.png
  python bellm_analysis.py --dependency --model HuggingFaceTB/SmolLM2-135M-Instruct runs/bellm \\
      sentence-transformers/all-MiniLM-L6-v2 --bi-layers 0 1 --plot fig5.png
  python bellm_analysis.py --representative-words --model HuggingFaceTB/SmolLM2-135M-Instruct \\
      runs/bellm
"""
import argparse
import functools
import json
import os
import re
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

import common
import eval_sts
import figures
import jtcse_analysis
from bellm import (BeLLM, PROMPT, check_prompt, read_csv, check_tasks, fill, decoder_forward,
                   last_token, load_adapted, load_decoder, make_encode, prompted)

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", nargs="+", default=["meta-llama/Llama-2-7b-hf"], help="decoder LLMs, "
               "bellm.py runs (RUN or RUN/best; --degradation: a decoder); --dependency: "
               "BERT-like encoders too, sscl.py and jtcse.py runs")
p.add_argument("--bi-layers", type=common.NONNEG_INT, nargs="+", default=[1], help="K of the "
               "plain decoders: each (--dependency, --representative-words)")
p.add_argument("--bi-mode", default="parallel", choices=["parallel", "sequential"],
               help="of the plain decoders, as bellm.py --bi-mode")
p.add_argument("--bi-strategy", default="convert", choices=["convert", "add"],
               help="of the plain decoders, as bellm.py --bi-strategy")
p.add_argument("--prompt", default=PROMPT, help="with {sentence}, for plain decoders")
p.add_argument("--tasks", default=",".join(common.TASKS), help="--degradation's tasks")
p.add_argument("--train", help="--representative-words: count the words of this csv instead of "
               "the STS-B test sentences")
p.add_argument("--data-dir", help="STS data: DIR/downstream/{STS,SICK} (else $SENTEMB_DATA)")
p.add_argument("--seed", type=common.SEED, default=42)
p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too (always on CUDA)")
p.add_argument("--quiet", action="store_true", help="no progress bars")
p.add_argument("--degradation", action="store_true", help="STS of the causal LLM cut "
               "after each layer (Fig. 4)")
p.add_argument("--dependency", action="store_true", help="Spearman of the pooled "
               "token to each token of the sentence, per --model (Figs. 2, 5)")
p.add_argument("--representative-words", action="store_true", help="the LM head's "
               "next token after the prompt, per STS-B test sentence (App. A)")
p.add_argument("--plot", metavar="FILE.png", help="--degradation / --dependency: draw the figure")
common.show_ranges(p)


def main():
    """--degradation / --dependency / --representative-words: the analysis asked for, with its
    figure (--plot)."""
    a = common.parse(p)
    device = common.pick_device()
    if sum([a.degradation, a.dependency, a.representative_words]) != 1:
        common.die("pass one of --degradation, --dependency and --representative-words")
    figures.check(a.plot)  # a bad --plot path stops before the data is looked for
    tasks = check_tasks(a.tasks)
    data = common.sts_data(a.data_dir, [] if a.degradation else ["STS-B"])
    torch.manual_seed(a.seed)
    if a.dependency:
        return dependency(a, device, data)
    if a.representative_words:
        return representative_words(a, device, data)
    check_degradation(a)
    tok, dec = load_decoder(a.model[0], 0, "convert", device)
    degradation(a, tok, dec.eval(), device, data, tasks)


def check_degradation(a):
    """--degradation takes one plain causal LLM, --prompt a sentence's: else one line, exit 2."""
    check_prompt(a.prompt, False)
    if len(a.model) > 1:
        common.die(f"--degradation cuts one decoder and --model got {len(a.model)}: run it once "
                   "per model")
    meta = eval_sts.read_meta(a.model[0]) if os.path.isdir(a.model[0]) else None
    if meta:
        base = f" (this run's base model: {meta['base_model']})" if "base_model" in meta else ""
        common.die(f"--degradation cuts a plain causal LLM and '{a.model[0]}' is a run of "
                   f"{meta['method']}.py: pass a decoder{base}")


# ================================================================ degradation (Fig. 4) ==========
def degradation(a, tok, dec, device, data, tasks):
    """STS score of the causal LLM cut after layer k, for every k: one pass keeps all hidden states
    and the final norm is applied to each (h_k -> norm(h_k), last token)."""
    encode_k = layer_encoders(a.prompt, tok, dec, device)
    n = len(dec.layers)
    print(f"degradation: the causal LLM cut after layer k (--bi-layers is not used), "
          f"prompt {a.prompt!r}")
    curve = {}
    for k in range(1, n + 1):
        r = common.evaluate(encode_k(k), data, tasks)
        curve[k] = r
        print(f"k {k:>3}  " + "  ".join(f"{t} {v:.2f}" for t, v in r.items())
              + f"  avg {np.mean([*r.values()]):.2f}")
    if a.plot:
        draw_degradation(a, curve, tasks, n)
    return curve


def layer_encoders(prompt, tok, dec, device):
    """encode_k(k) -> the encode function of the decoder cut after layer k (the final norm of h_k
    at the last token). One pass a sentence keeps every layer's vector, each sentence encoded
    once for all k."""
    memo = {}

    @torch.no_grad()
    def embed_all(batch):  # (b, n, H)
        _, hs = decoder_forward(dec, batch["input_ids"], batch["attention_mask"], 0, "parallel",
                                "convert", True)
        return torch.stack([last_token(dec.norm(hk), batch["attention_mask"]) for hk in hs[1:]], 1)

    def encode_k(k):
        def encode(sentences):
            missing = [s for s in dict.fromkeys(sentences) if s not in memo]
            if missing:
                texts, max_len = prompted(tok, {"prompt": prompt,
                                                "max_len": dec.config.max_position_embeddings},
                                          missing)  # evaluation does not cut sentences
                with common.autocast(device, common.pick_precision(device)):
                    memo.update(zip(missing, common.encode_in_batches(embed_all, tok, texts,
                                                                      max_len, device, 64)))
            return torch.stack([memo[s][k - 1] for s in sentences])
        return encode
    return encode_k


def draw_degradation(a, curve, tasks, n):
    """Fig. 4 into --plot: a line a task (and their average), the turning point marked."""
    avg = [float(np.mean([*curve[k].values()])) for k in curve]
    top = int(np.argmax(avg))  # the turning point: after it, deeper layers lose STS quality
    series = {t: (list(curve), [curve[k][t] for k in curve]) for t in tasks}
    if len(tasks) > 1:
        series["avg."] = (list(curve), avg)
    figures.draw(a.plot, [dict(kind="lines",
                               title=f"Fig. 4: the causal LLM cut after layer k ({n} layers)",
                               xlabel="layer k", ylabel="Spearman × 100", series=series,
                               marks=[(top + 1, avg[top], f"turning point: k = {top + 1}")])],
                 f"Degradation of {os.path.basename(os.path.normpath(a.model[0]))} "
                 f"({', '.join(tasks)} test)",
                 ncols=1)


# ================================================================ dependency (Fig. 2, Fig. 5) ====
def spearman_to_pivot(h, pivot, shift=0):
    """Spearman's rho over the H hidden dimensions between each token of row i and the pivot token
    of row i - shift (shift 0: its own), i.e. Pearson of ranks. h: (b, L, H), pivot: (b,) ->
    (b, L). Ranks of continuous values: ties have probability zero."""
    r = h.double().argsort(-1).argsort(-1).double()  # (b, L, H) ranks 0..H-1
    r = F.normalize(r - r.mean(-1, keepdim=True), dim=-1)
    return (r * r[torch.arange(len(r)), pivot].roll(shift, 0)[:, None]).sum(-1)


@torch.no_grad()
def dependency_scores(hidden, tok, texts, spans, pivot_last, device, batch_size=32):
    """Per text: the mean Spearman rho between the pivot's final hidden state (the last real token,
    or CLS when pivot_last is False) and that of each token of the sentence (the tokens whose
    characters lie in the sentence's span of the text; special and prompt tokens excluded, the pivot
    excluded). Also a control: the same pivot against the tokens of another sentence (the next one
    in its batch), which it cannot depend on; what the two share comes from a direction common to
    all token states. Returns (scores, controls)."""
    out, control = [None] * len(texts), [None] * len(texts)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for i in common.progress(range(0, len(order), batch_size), "dependency", unit="batch"):
        idx = order[i:i + batch_size]
        enc = tok([texts[j] for j in idx], padding=True, return_offsets_mapping=True,
                  return_special_tokens_mask=True, return_tensors="pt")
        am = enc["attention_mask"]  # (b, L)
        with common.autocast(device, common.pick_precision(device)):
            h = hidden(enc["input_ids"].to(device), am.to(device)).float().cpu()  # (b, L, H)
        pivot = ((am * torch.arange(am.shape[1])).argmax(1) if pivot_last
                 else torch.zeros(len(idx), dtype=torch.long))
        start, end = torch.tensor([spans[j] for j in idx]).T[:, :, None]  # (b, 1) each
        off = enc["offset_mapping"]  # (b, L, 2) character spans
        keep = (am.bool() & ~enc["special_tokens_mask"].bool() & (off[..., 0] < end)
                & (off[..., 1] > start))
        keep[torch.arange(len(idx)), pivot] = False
        # (b, L) each
        rho, other = spearman_to_pivot(h, pivot), spearman_to_pivot(h, pivot, 1).roll(-1, 0)
        keep_next = keep.roll(-1, 0)  # other[i]: the pivot of row i against the tokens of row i + 1
        for j, row, k, row2, k2 in zip(idx, rho, keep, other, keep_next):
            # a one-token sentence has no other token
            out[j] = row[k].mean().item() if k.any() else float("nan")
            control[j] = row2[k2].mean().item() if k2.any() and len(idx) > 1 else float("nan")
    return out, control


def dependency(a, device, data):
    """For each --model (a decoder at each --bi-layers K, a bellm.py run, or a BERT-like encoder:
    also an sscl.py or jtcse.py run, a twin's towers each alone), the distribution over STS-B test
    sentences of the pivot's mean Spearman rho with the sentence's tokens."""
    sents = sorted({s for r in common.load_sts(data, "STS-B")["test"] for s in r[:2]})
    res = {}
    labels = figures.labels(a.model)
    for name in a.model:
        meta = eval_sts.read_meta(name) if os.path.isdir(name) else None
        if is_encoder(name, meta):
            res.update(encoder_dependency(name, meta, labels[name], sents, device))
        else:
            configs = decoders(a, name, labels[name], meta, device)
            res.update(decoder_dependency(configs, sents, device))
    valid = {k: (without_nan(v), without_nan(c)) for k, (v, c) in res.items()}
    print_dependency(a.prompt, len(sents), valid)
    if a.plot:
        draw_dependency(a.plot, valid, len(sents))
    return res


def without_nan(scores):
    """The scores but NaN (a one-token sentence's), as an array."""
    return np.array([x for x in scores if x == x])


def print_dependency(prompt, n, valid):
    """The dependency table: a row a configuration of valid ({label: (scores, controls)}, NaN
    dropped): the mean and quartiles of its scores, and its controls' mean; n: the sentences."""
    print(f"dependency (Fig. 2/5): mean Spearman rho between the pivot token and the sentence's "
          f"tokens, {n} STS-B test sentences; decoders with prompt {prompt!r} "
          "(runs: their own)")
    print(f"{'model':<40} {'mean':>7} {'Q1':>7} {'median':>7} {'Q3':>7}   "
          "control: another sentence's tokens")
    for label, (v, c) in valid.items():  # NaN dropped: one-token sentences
        print(f"{label:<40} {v.mean():7.4f} "
              + " ".join(f"{q:7.4f}" for q in np.percentile(v, [25, 50, 75]))
              + f"   {c.mean():7.4f}  (difference {v.mean() - c.mean():+.4f})")


def is_encoder(name, meta):
    """Whether --dependency reads --model `name` as a BERT-like encoder (pivot: CLS): an sscl.py or
    jtcse.py run (meta: its sentemb.json), or a model whose config is a masked LM's; else it is a
    decoder (a bellm.py run, or a causal LLM)."""
    if meta:
        return meta["method"] != "bellm"
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return common.load_pretrained(AutoConfig, name).model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def decoders(a, name, short, meta, device):
    """The decoder configurations of --model `name` (labelled `short`): a bellm.py run's (meta: its
    sentemb.json; its own K, mode and prompt), else the causal LLM's at each --bi-layers K
    (zero-shot, --bi-mode, --bi-strategy, --prompt). -> [(label, decoder in eval mode, tokenizer,
    cfg, base model)]"""
    if meta:  # a trained run: its own K, mode and prompt
        dec, tok, cfg = load_adapted(eval_sts.model_folder(name), meta, device)
        return [(f"{short} (trained, K={cfg['bi_layers']})", dec, tok, cfg, meta["base_model"])]
    check_prompt(a.prompt, False)
    configs = []
    for k in a.bi_layers:  # a causal LLM, zero-shot, at each K
        tok, dec = load_decoder(name, k, a.bi_strategy, device)
        cfg = dict(bi_layers=k, bi_mode=a.bi_mode, bi_strategy=a.bi_strategy, prompt=a.prompt,
                   max_len=dec.config.max_position_embeddings)
        configs.append((f"{short} (K={k})", dec.eval(), tok, cfg, name))
    return configs


def bert_states(bert, ids, am):
    """A BERT's last hidden states (b, L, H) of ids (b, L) under the attention mask am."""
    return bert(input_ids=ids, attention_mask=am).last_hidden_state


def decoder_states(net, ids, am):
    """A BeLLM net's final-norm hidden states (b, L, H) of ids (b, L) (bellm.decoder_forward)."""
    return decoder_forward(net.dec, ids, am, *net.bi)


def encoder_dependency(name, meta, short, sents, device):
    """dependency_scores of a BERT-like --model, pivot = CLS, the bare sentence: an sscl.py or
    jtcse.py run (RUN or RUN/best; meta: its sentemb.json) as its encoder runs it, a twin's towers
    each alone. -> {label: (scores, controls)}"""
    from transformers import AutoModel, AutoTokenizer
    if meta:
        berts, tok = jtcse_analysis.load_model(name, jtcse_analysis.towers_of(name))
    else:
        berts = [common.load_pretrained(AutoModel, name)]
        tok = common.load_pretrained(AutoTokenizer, name)
    res = {}
    for i, bert in enumerate(t.to(device).eval() for t in berts):
        part = f", tower {'I' * (i + 1)}" if len(berts) > 1 else ""
        res[f"{short} (CLS{part})"] = dependency_scores(
            functools.partial(bert_states, bert), tok, sents, [(0, len(s)) for s in sents], False,
            device)
    return res


def decoder_dependency(configs, sents, device):
    """dependency_scores of each decoder configuration (decoders()), pivot = the last token of the
    prompted sentence. -> {label: (scores, controls)}"""
    res = {}
    for label, dec, tok, cfg, _ in configs:
        net = BeLLM(dec.eval(), cfg["bi_layers"], cfg["bi_mode"], cfg["bi_strategy"])
        # the sentence's first character
        lead = len(fill(cfg["prompt"].split("{sentence}")[0], ""))
        res[label] = dependency_scores(functools.partial(decoder_states, net), tok,
                                       [fill(cfg["prompt"], s) for s in sents],
                                       [(lead, lead + len(s)) for s in sents], True, device)
    return res


def draw_dependency(plot, valid, n):
    """Figs. 2 / 5 into plot: a box a configuration of valid ({label: (scores, controls)}, NaN
    dropped), its control's mean marked; n: the sentences."""
    marks = [(i + 1, c.mean(), "control: another sentence's tokens (mean)")
             for i, (_, c) in enumerate(valid.values())]
    figures.draw(plot, [dict(kind="boxes",
                             title="Fig. 2 / Fig. 5: dependency of the pivot token",
                             groups={k: v for k, (v, _) in valid.items()}, marks=marks,
                             rotate=20, xlabel="model (pivot: last token; CLS)",
                             ylabel="mean Spearman rho, pivot vs. sentence tokens")],
                 f"Backward dependency on STS-B test ({n} sentences)", ncols=1)


# ================================================================ representative words (App. A) =
WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")  # a word: letters, with one inner apostrophe
TOP_N = (10, 100, 1000)  # "high-frequency": among the N most frequent words; 100 is the headline


def word_counts(texts):
    """Counter of the lowercased words (WORD) of the texts, in order of first appearance."""
    return Counter(w for t in texts for w in WORD.findall(t.lower()))


def as_word(token_text):
    """A predicted token's text -> its word (stripped, lowercased), or None when it is no word
    (punctuation, digits, whitespace, or a mix of letters and other characters)."""
    w = token_text.strip().lower()
    return w if WORD.fullmatch(w) else None


def not_frequent(words, counts, n):
    """The share (0..1) of the predicted words that are not among the n most frequent words of
    counts (ties at the cut: the first seen, Counter.most_common's order); a prediction that is no
    word (None) is not a frequent word."""
    top = {w for w, _ in counts.most_common(n)}
    return sum(w not in top for w in words) / len(words)


def lm_head(name, dec):
    """The stock LM head's weight (V, H) of the decoder checkpoint `name`: the input embeddings
    when tied (config.tie_word_embeddings), else `lm_head.weight` read from its safetensors file
    alone (no second copy of the model). BeLLM's training never changes it: LoRA wraps the
    decoder (AutoModel), which has no LM head."""
    if dec.config.tie_word_embeddings:
        return dec.embed_tokens.weight
    from safetensors import safe_open
    from transformers.utils import cached_file

    def find(f):
        return cached_file(name, f, _raise_exceptions_for_missing_entries=False)
    key, index = "lm_head.weight", find("model.safetensors.index.json")
    path = find(json.loads(common.read_text(index))["weight_map"].get(key, "-")) if index else \
        find("model.safetensors")
    if path:
        with safe_open(path, "pt") as f:
            stored = f.keys()  # (safe_open has keys(), no `in`)
            if key in stored:
                return f.get_tensor(key).to(dec.embed_tokens.weight.device)
    common.die(f"'{name}' has no {key} in a safetensors file: --representative-words needs the LM "
               "head of a causal LM checkpoint (…ForCausalLM, saved as safetensors)")


@torch.no_grad()
def next_tokens(encode, head, sentences, chunk=256):
    """The LM head's top next token after each prompted sentence: argmax over the vocabulary of
    head @ e, e the final-norm hidden state of the last token (the embedding, encode). -> ids."""
    e = encode(sentences).float()  # (N, H)
    return torch.cat([(e[i:i + chunk] @ head.float().T).argmax(-1)  # (chunk, V) -> (chunk,)
                      for i in range(0, len(e), chunk)]).tolist()


def representative_words(a, device, data):
    """For each --model (a decoder at each --bi-layers K, or a bellm.py run folder with its own K
    and prompt), the representative word of every distinct STS-B test sentence; the share that is
    not a high-frequency word (App. A), and the most common ones. High-frequency: among the N most
    frequent words of the STS-B test sentences, or with --train of the training file's."""
    if a.plot:
        common.die("--representative-words prints a table, no figure: drop --plot")
    sents = sorted({s for r in common.load_sts(data, "STS-B")["test"] for s in r[:2]})
    if a.train:
        source = f"'{os.path.basename(a.train)}'"
        counts = word_counts([t for r in read_csv(a.train)[1] for t in r if isinstance(t, str)])
    else:
        source = "the STS-B test sentences"
        counts = word_counts(sents)
    res = predicted_tokens(a, device, sents)
    print_representative_words(a.prompt, sents, source, counts, res)
    return res, counts


def predicted_tokens(a, device, sents):
    """The LM head's top next token after each prompted sentence, for each decoder configuration
    of each --model. -> {label: [the tokens' texts]}"""
    precision = "bf16" if a.bf16 else common.pick_precision(device)
    res = {}
    labels = figures.labels(a.model)
    for name in a.model:
        meta = eval_sts.read_meta(name) if os.path.isdir(name) else None
        if meta and meta["method"] != "bellm":
            common.die(f"--representative-words reads a decoder's LM head and '{name}' is a run "
                       f"of {meta['method']}.py: pass decoders and bellm.py runs")
        for label, dec, tok, cfg, base in decoders(a, name, labels[name], meta, device):
            ids = next_tokens(make_encode(dec, tok, cfg, device, precision), lm_head(base, dec),
                              sents)
            res[label] = [tok.decode([i]) for i in ids]  # the tokens' texts
    return res


def print_representative_words(prompt, sents, source, counts, res):
    """App. A's table: per configuration of res ({label: the predicted tokens' texts}), the share
    of its words that are not among the N most frequent of counts (TOP_N), of no word at all, and
    its 20 most common."""
    total = sum(counts.values())
    cover = [sum(c for _, c in counts.most_common(n)) / total for n in TOP_N]
    print(f"representative words (App. A): the LM head's top next token after the prompt, "
          f"{len(sents)} distinct STS-B test sentences; decoders with prompt {prompt!r} "
          "(runs: their own)")
    print(f"high-frequency word: one of the N = {TOP_N[1]} most frequent words of {source} "
          f"({total:,} words, {len(counts):,} distinct; lowercased, letters only), N = "
          f"{' / '.join(map(str, TOP_N))} cover {' / '.join(f'{100 * c:.1f}' for c in cover)} % "
          "of these words")
    print(f"{'model':<40} " + " ".join(f"{'not top-' + str(n):>13}" for n in TOP_N)
          + f" {'no word':>9}")
    for label, texts in res.items():
        words = [as_word(t) for t in texts]
        print(f"{label:<40} " + " ".join(f"{100 * not_frequent(words, counts, n):11.2f} %"
                                         for n in TOP_N)
              + f" {100 * words.count(None) / len(words):7.2f} %")
        top = Counter(w or repr(t) for w, t in zip(words, texts)).most_common(20)
        print("  the 20 most common: " + ", ".join(f"{w} {c}" for w, c in top))


if __name__ == "__main__":
    main()
