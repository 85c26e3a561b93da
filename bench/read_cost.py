"""What the weight files' fingerprints cost a reader: eval_sts.py's read of an SSCL run folder of
BERT-base's size, with the fingerprints that sentemb.json records verified (one CRC-32 pass over
each weight file), against the same files with no fingerprints recorded (an earlier run's folder).
Timed: load_model (every file checked; transformers maps the weights, read at their first use),
then the STS-B dev score (the weights read: what a reader does next). BERT-base is built from its
config with random weights (110M parameters, 418 MiB of model.safetensors) and saved by
harness.Run.save as sscl.py saves its best model; MINILM's tokenizer (bert-base-uncased's
vocabulary). The two reads alternate, --reps rounds after a warm-up, the page cache warm for both;
the medians and their ratios are printed.

  python bench/read_cost.py [--reps 5] [--dir FOLDER]   (MINILM: a model folder or hub name)
"""
import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import common
from _inputs import env_input
import eval_sts
import harness
import sscl

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--reps", type=common.POS_INT, default=5)
p.add_argument("--dir", help="where the run folder goes (default: a temporary folder)")
common.show_ranges(p)


def main():
    a = p.parse_args()
    from transformers import AutoTokenizer, BertConfig, BertModel
    tok = common.load_pretrained(AutoTokenizer, env_input("MINILM", "sentence-transformers/"
                                                          "all-MiniLM-L6-v2"), label="MINILM")
    torch.manual_seed(0)
    enc = sscl.SentenceEncoder(BertModel(BertConfig(vocab_size=len(tok))), "cls")
    root = Path(a.dir or tempfile.mkdtemp())
    root.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(**{**{x.dest: x.default for x in sscl.p._actions
                                     if x.dest != "help"}, "output_dir": str(root / "run")})
    run = harness.Run(args, "sscl", sscl.RESUMABLE, sscl.check_run, [], torch.device("cpu"))
    opt = torch.optim.AdamW(enc.parameters())
    run.start_training(model=enc, optimizer=opt,
                       scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       scaler=torch.amp.GradScaler(enabled=False), lr=1e-5,
                       meta=dict(method="sscl", pooler="cls", proj_dim=0, max_len=512))
    run.save(1, "stsb_dev", 1.0, functools.partial(sscl.save_model, enc, tok, 512))
    del enc, opt
    printed, plain = root / "run" / harness.BEST, root / "plain"
    shutil.copytree(printed, plain)
    meta = json.loads((plain / common.META).read_text())
    prints = meta.pop("fingerprints")
    (plain / common.META).write_text(json.dumps(meta))
    size = sum(os.path.getsize(printed / f) for f in prints)
    data, times = common.sts_data(None, []), {}
    for r in range(a.reps + 1):  # round 0: a warm-up (the page cache, the imports)
        for name, folder in (("with fingerprints", printed), ("without", plain)):
            common._crc.cache_clear()  # each read a new process's: every file read again
            t0 = time.perf_counter()
            encode = eval_sts.load_model(str(folder), device=torch.device("cpu"))
            t1 = time.perf_counter()
            common.stsb_dev(encode, data)
            if r:
                times.setdefault(f"load_model, {name}", []).append(t1 - t0)
                times.setdefault(f"+ STS-B dev, {name}", []).append(time.perf_counter() - t0)
    common._crc.cache_clear()
    t0 = time.perf_counter()
    for f in prints:
        common.fingerprint(printed / f)
    crc = time.perf_counter() - t0
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"BERT-base run folder: {len(prints)} weight file(s), {size / 2**20:.0f} MiB; the "
          f"fingerprints alone {crc:.3f} s ({size / 2**20 / crc:.0f} MiB/s)")
    for k, v in times.items():
        print(f"{k:<34} median {med[k]:.3f} s of {len(v)}: " + ", ".join(f"{t:.3f}" for t in v))
    for what in ("load_model", "+ STS-B dev"):
        grow = med[f"{what}, with fingerprints"] / med[f"{what}, without"] - 1
        print(f"{what}: {100 * grow:+.1f} % with the fingerprints")
    if not a.dir:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
