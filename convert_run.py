"""A run folder of an earlier version, made readable: its checkpoint.pt (whose NumPy RNG state is an
ndarray and whose dev scores are NumPy floats) rewritten as the scripts save it now, so that
torch.load(weights_only=True) reads it. This one reads the old file as a pickle, which can run
code: use it only on a run folder you trust.

  python convert_run.py runs/sscl_minilm
"""
import argparse
import io
import os
import pickle

import numpy as np
import torch

import common
import harness

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("run", metavar="RUN", help="a run folder of sscl.py, jtcse.py or bellm.py (one you "
               "trust: its checkpoint.pt is read as a pickle)")


def plain(value):
    """value with NumPy's scalars as Python numbers and its arrays as int64 tensors (an earlier
    version's NumPy RNG keys and dev scores), in tuples, lists and dicts too."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.astype(np.int64))
    return value


def convert(run_dir):
    """RUN/checkpoint.pt rewritten whole (the run's lock held), once what is written reads with
    weights_only; or one line."""
    path = os.path.join(run_dir, harness.CKPT)
    if not os.path.isfile(path):
        common.die(f"no {path}: pass a run folder of sscl.py, jtcse.py or bellm.py")
    with open(os.path.join(run_dir, harness.LOCK), "a+") as lock:
        if not harness.flock(lock, "EX", "NB"):
            common.die(f"'{run_dir}' is in use by a training run: wait for it to end")
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # truncated, empty, not a torch file: torch raises many types
            common.die(f"{path} cannot be read ({type(e).__name__}); it is damaged: "
                       f"{harness.RECOPY}")
        written = io.BytesIO()
        torch.save(plain(state), written)
        written.seek(0)
        try:  # what is written is what a reader reads
            torch.load(written, weights_only=True)
        except pickle.UnpicklingError:
            common.die(f"{path} holds objects that no run of ours saves: not converted")
        common.write_whole(path, lambda f: f.write(written.getvalue()))
    print(f"{path}: converted; readers and --resume read it as it is now")


if __name__ == "__main__":
    convert(p.parse_args().run)
