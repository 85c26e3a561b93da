"""Evaluate any checkpoint on the 7 STS tasks and print the papers' table
(STS12-16 in SentEval's "all" setting, STS-B test, SICK-R test; Spearman x 100).

  python eval_sts.py --model bert-base-uncased --pooler cls       # a plain Hugging Face model
  python eval_sts.py --model runs/sscl                            # a run of sscl.py / jtcse.py / bellm.py
  python eval_sts.py --model DIR --tasks STS-B --split dev --json out.json

A run folder written by our scripts holds `sentemb.json`, which names the method; that script's own
`load_encoder` builds the encode function, the same one used for its dev evaluation while training.
"""
import argparse
import importlib
import json
import os
import time

import torch
import transformers

import common

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", required=True, help="hub name or local folder: plain HF model, or one of our runs")
p.add_argument("--pooler", default="cls", choices=["cls", "avg", "avg_first_last", "pooler", "last"],
               help="pooling for a plain HF model: cls = CLS of the last layer, avg = masked mean of the "
                    "last layer, avg_first_last = mean of layer 1 and the last layer, pooler = BERT's "
                    "pooler output, last = a decoder's last token after --prompt (BeLLM, zero-shot); "
                    "ignored for our runs, whose sentemb.json decides")
p.add_argument("--prompt", default='The representative word for {sentence} is:"',
               help="with --pooler last: the prompt around each sentence (BeLLM §3.3)")
p.add_argument("--data-dir", default=None, help="folder with downstream/STS and downstream/SICK "
                                                "(else $SENTEMB_DATA, else ~/.cache/sentemb/senteval)")
p.add_argument("--tasks", default=",".join(common.TASKS), help="comma-separated subset of the 7 tasks")
p.add_argument("--split", default="test", choices=["test", "dev"], help="split for STS-B and SICK-R")
p.add_argument("--batch-size", type=int, default=128)
p.add_argument("--max-len", type=int, default=512, help="truncation, in tokens")
p.add_argument("--exact", action="store_true", help="SentEval's own batches (slower; for parity checks)")
p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU as well (about 2x faster where "
                                                    "the CPU has bf16 instructions; numbers move by ~0.01)")
p.add_argument("--json", default=None, help="also write the results to this JSON file")


def hf_encoder(name, pooler, max_len, device):
    """encode(list[str]) -> (N, H) for a plain Hugging Face encoder with the usual poolings (SimCSE's names)."""
    from transformers import AutoModel, AutoTokenizer
    tok = common.load_pretrained(AutoTokenizer, name)
    model = common.load_pretrained(AutoModel, name).to(device).eval()
    max_len = min(max_len, getattr(model.config, "max_position_embeddings", max_len))

    def embed(batch):  # batch: input_ids, attention_mask (b, L)
        with common.autocast(device):
            out = model(**batch, output_hidden_states=pooler == "avg_first_last")
        mask = batch["attention_mask"].unsqueeze(-1).float()  # (b, L, 1)
        avg = lambda h: (h * mask).sum(1) / mask.sum(1)  # noqa: E731
        if pooler == "cls":
            return out.last_hidden_state[:, 0]
        if pooler == "avg":
            return avg(out.last_hidden_state)
        if pooler == "avg_first_last":  # SimCSE: hidden_states[1] is the first Transformer layer's output
            return avg((out.hidden_states[1] + out.hidden_states[-1]) / 2)
        if out.pooler_output is None:
            common.die(f"'{name}' has no pooler: choose --pooler cls, avg or avg_first_last")
        return out.pooler_output

    def encode(sentences):
        return common.encode_in_batches(embed, tok, sentences, max_len, device)

    return encode


def load_encoder(name, pooler="cls", max_len=512, device=None, prompt=None):
    """Our run folder (sentemb.json) -> its method's encoder; anything else -> a plain HF encoder."""
    device = device or common.pick_device()
    if pooler == "last":  # a plain decoder, zero-shot: BeLLM's encoder with no bidirectional layer, no LoRA
        meta = {"method": "bellm", "base_model": name, "bi_layers": 0, "bi_mode": "parallel", "prompt": prompt}
        return importlib.import_module("bellm").load_encoder(None, meta, device)
    meta_path = os.path.join(name, common.META)
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("method") not in ("sscl", "jtcse", "bellm"):
            common.die(f"{meta_path} names no known method (sscl, jtcse, bellm): re-save the run or remove the file")
        return importlib.import_module(meta["method"]).load_encoder(name, meta, device)
    return hf_encoder(name, pooler, max_len, device)


def main():
    a = p.parse_args()
    transformers.logging.disable_progress_bar()
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if unknown := [t for t in tasks if t not in common.TASKS]:
        common.die(f"unknown task(s) {', '.join(unknown)}: --tasks takes {','.join(common.TASKS)}")
    data = common.senteval_dir(a.data_dir)
    t0 = time.perf_counter()
    encode = load_encoder(a.model, a.pooler, a.max_len, prompt=a.prompt)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
        results = common.evaluate(encode, data, tasks, a.split, a.batch_size, a.exact)
    seconds = time.perf_counter() - t0
    print(common.format_table(results))
    print(f"({a.model}, split {a.split}, {seconds:.1f} s including model load)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "split": a.split, "results": results, "seconds": seconds}, f, indent=2)


if __name__ == "__main__":
    main()
