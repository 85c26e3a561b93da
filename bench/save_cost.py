"""What a save of sscl.py costs: harness.Run.save with a new best model (written whole into
.best.new, every file synced, checkpoint.pt replaced whole, the renames of the swap, dev.jsonl),
against the same files written in place without a sync (save_pretrained, the sentence-transformers
files, torch.save of the training state). all-MiniLM-L6-v2 in SSCL's SentenceEncoder after one AdamW
step (the optimiser's moments saved). The two alternate, --reps rounds; the medians are printed.

  python bench/save_cost.py [--reps 3] [--dir FOLDER]   (MINILM: a model folder or hub name)
"""
import argparse
import functools
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
import harness
import sscl

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--reps", type=common.POS_INT, default=3)
p.add_argument("--dir", help="where the run folders go (default: a temporary folder; the disk "
               "measured is that folder's)")


def main():
    a = p.parse_args()
    from transformers import AutoModel, AutoTokenizer
    minilm = env_input("MINILM", "sentence-transformers/all-MiniLM-L6-v2")
    tok = common.load_pretrained(AutoTokenizer, minilm, label="MINILM")
    enc = sscl.SentenceEncoder(common.load_pretrained(AutoModel, minilm, label="MINILM"), "cls")
    opt = torch.optim.AdamW(enc.parameters(), lr=1e-5)
    enc(tok(["a first sentence", "a second one"], return_tensors="pt", padding=True))[0].sum() \
        .backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    root = Path(a.dir or tempfile.mkdtemp())
    root.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(**{**{x.dest: x.default for x in sscl.p._actions
                                     if x.dest != "help"}, "output_dir": str(root / "run")})
    meta = dict(method="sscl", pooler="cls", proj_dim=0, max_len=512)
    write = functools.partial(sscl.save_model, enc, tok, 512)
    times = {"harness save (synced, committed, swapped)": [], "in place, no sync": []}
    run = harness.Run(args, "sscl", sscl.RESUMABLE, sscl.check_run, [], torch.device("cpu"))
    run.start_training(model=enc, optimizer=opt, scheduler=sched,
                       scaler=torch.amp.GradScaler(enabled=False), lr=1e-5, meta=meta)
    for r in range(a.reps + 1):  # round 0: a warm-up
        t0 = time.perf_counter()
        run.save(r + 1, "stsb_dev", float(r), write)
        t1 = time.perf_counter()
        state = torch.load(root / "run" / harness.CKPT, weights_only=True)  # what it saved
        plain = root / f"plain{r}"
        t2 = time.perf_counter()
        plain.mkdir()
        write(str(plain))
        torch.save(state, plain / "checkpoint.pt")
        t3 = time.perf_counter()
        shutil.rmtree(plain)
        if r:
            times["harness save (synced, committed, swapped)"].append(t1 - t0)
            times["in place, no sync"].append(t3 - t2)
    size = sum(f.stat().st_size for f in (root / "run").rglob("*") if f.is_file())
    print(f"run folder {size / 2**20:.0f} MiB ({root}, {os.uname().machine})")
    for k, v in times.items():
        print(f"{k:<45} median {statistics.median(v):.2f} s of {len(v)}: "
              + ", ".join(f"{t:.2f}" for t in v))
    if not a.dir:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
