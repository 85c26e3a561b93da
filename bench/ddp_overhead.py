"""DDP overhead on CPU (gloo): training throughput of one process with the global batch vs
`torchrun` with 2 processes x half the batch, same sentences, for sscl.py, jtcse.py and bellm.py on
small random-weight models (BERT-like and LLaMA-like, 4 layers, hidden 256) with the real MiniLM /
SmolLM2 tokenisers.

It shows what DDP plus gathered negatives cost, not a speed-up: on a 2-core CPU two ranks share the
cores that one process with 2 threads uses. Figures are the scripts' own training throughput over
all steps after the step-0 evaluation (sentences/s; BeLLM: triplets/s).

  python bench/ddp_overhead.py [--steps 20]
  (MINILM, SMOLLM: the tokenisers' model names or folders; WIKI, NLI: the README's wiki1m head and
  NLI csv)
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, BertConfig, BertModel, LlamaConfig, LlamaModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import bellm
import common
from _inputs import env_input, env_rows

SCRIPTS = ("sscl", "jtcse", "bellm")


def scripts(s):
    """--scripts: a comma list of SCRIPTS, checked before the models are built."""
    bad = [x for x in s.split(",") if x not in SCRIPTS]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(SCRIPTS)}")
    return s.split(",")


p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=common.POS_INT, default=20, help="training steps of each run "
               "(default 20)")
p.add_argument("--scripts", type=scripts, default=",".join(SCRIPTS),
               help="the scripts to run, comma-separated (default: all three)")
common.show_ranges(p)
a = p.parse_args()
MINILM = env_input("MINILM", "sentence-transformers/all-MiniLM-L6-v2")  # their tokenizers
SMOLLM = env_input("SMOLLM", "HuggingFaceTB/SmolLM2-135M-Instruct")
if {"sscl", "jtcse"} & {*a.scripts}:  # a step's rows, at least (the scripts run the epochs)
    env_rows("WIKI", "wiki1m_head.txt", 64, common.read_sentences)
if "bellm" in a.scripts:
    env_rows("NLI", "snli_devtest.csv", 16, lambda f: bellm.read_csv(f)[1])
WIKI = os.environ.get("WIKI", "wiki1m_head.txt")
NLI = os.environ.get("NLI", "snli_devtest.csv")
tmp = Path(tempfile.mkdtemp(prefix="ddp_overhead_"))
transformers.logging.disable_progress_bar()

torch.manual_seed(0)
bert_tok = common.load_pretrained(AutoTokenizer, MINILM, label="MINILM")
for name in ("bert_a", "bert_b"):
    BertModel(BertConfig(vocab_size=len(bert_tok), hidden_size=256, num_hidden_layers=4,
                         num_attention_heads=4, intermediate_size=1024)).save_pretrained(tmp / name)
    bert_tok.save_pretrained(tmp / name)
llama_tok = common.load_pretrained(AutoTokenizer, SMOLLM, label="SMOLLM")
LlamaModel(LlamaConfig(vocab_size=len(llama_tok), hidden_size=256, intermediate_size=688,
                       num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2)).save_pretrained(tmp / "llama")
llama_tok.save_pretrained(tmp / "llama")

shared = ["--max-steps", a.steps, "--log-steps", a.steps,  # every run has them
          "--eval-steps", 10 * a.steps, "--no-final-eval"]
runs = {  # script: (arguments, global batch, unit)
    "sscl": (["--model", tmp / "bert_a", "--train", WIKI, "--layer", 2,
              "--max-len", 32], 64, "sent/s"),
    "jtcse": (["--model-a", tmp / "bert_a", "--model-b", tmp / "bert_b", "--train",
               WIKI, "--no-add-sick", "--max-len", 32], 64, "sent/s"),
    "bellm": (["--model", tmp / "llama", "--train", NLI,
               "--max-len", 32, "--no-eval-first", "--bi-layers", 1], 16, "rows/s"),
}


def throughput(script, nproc, threads, batch):
    args, _, unit = runs[script]
    cmd = [sys.executable,
           *(["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else []),
           str(ROOT / f"{script}.py"), *map(str, args + shared), "--batch-size", str(batch),
           "--output-dir", str(tmp / f"{script}_{nproc}_{threads}")]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:  # its own error line, else its last
        said = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        if not said:
            said = r.stderr.splitlines()
        common.die(f"{script}.py ({nproc} process(es)) failed: "
                   f"{(said or ['?'])[-1].removeprefix('error: ')}")
    return float(re.findall(rf"{unit} (\S+)", r.stdout)[-1])


print(f"{'script':6} {'global batch':>12} {'1 proc x 1 thread':>18} {'1 proc x 2 threads':>19} "
      f"{'2 procs x 1 thread (DDP)':>25} {'DDP / 1x2':>9}")
for script in a.scripts:
    _, batch, unit = runs[script]
    one1 = throughput(script, 1, 1, batch)
    one2 = throughput(script, 1, 2, batch)
    two = throughput(script, 2, 1, batch // 2)
    print(f"{script:6} {batch:>12} {one1:>14.1f} {unit[:4]:>3} {one2:>15.1f} {unit[:4]:>3} "
          f"{two:>21.1f} {unit[:4]:>3} {two / one2:>9.2f}", flush=True)
