"""The three scripts' training steps on this machine, at the quick-run settings of their docs pages,
against its matrix-multiply roof: each step's seconds, sentences (rows) a second and FLOP/s (the
matrix products, counted by common.FlopCount: forward, loss and backward), fp32 or --bf16, eager or
--compile; --profile prints torch.profiler's top rows (self CPU time) of one step.

  SSCL:   MiniLM, --layer 5, batch 64, --max-len 32 (README's quick run)
  JTCSE:  MiniLM twin (a CAEL every 2nd layer), batch 64, --max-len 32
  BeLLM:  SmolLM2-135M, K = 1 parallel, LoRA r 32, 16 NLI triplets, --max-len 32

The same batches in every configuration (the first --steps + 1 of the training file, in order,
tokenised before the steps, as the scripts tokenise ahead of them); the first step is a warm-up (and
with --compile, the compilation: timed apart). Each step is the script's own train_step with its
length groups, then its update as the script runs it: the gradient norm (clipped: SSCL, BeLLM) and
its AdamW step (fused; SSCL's AdamW421). --earlier-update: torch's fused AdamW alone, the scripts'
update before they ran the authors'.

  python bench/step_speed.py sscl jtcse bellm              # fp32, eager
  python bench/step_speed.py sscl --bf16 --compile
  python bench/step_speed.py sscl --profile
  python bench/step_speed.py sscl --earlier-update
  (MINILM, SMOLLM: model folders or hub names; WIKI, NLI: the training files; defaults: the hub's
  all-MiniLM-L6-v2, SmolLM2-135M-Instruct, wiki1m_head.txt, snli_devtest.csv)
"""
import argparse
import functools
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import bellm
import common
from _inputs import env_input, env_rows
import jtcse
import sscl


def roof(dtype, device, reps=10):
    """The device's matrix-multiply roof: the best FLOP/s of an n x n torch.matmul (n = 2048 on a
    CPU, 8192 on a GPU)."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in "ab")
    torch.matmul(a, b)
    best = min(timed(device, torch.matmul, a, b) for _ in range(reps))
    return 2 * n ** 3 / best


def timed(device, fn, *args):
    """The seconds of fn(*args), the device's queue waited for."""
    t = time.perf_counter()
    fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def build(name, bf16, dev, steps, earlier=False):
    """(the trained module, step(i, net): the script's train_step on batch i, run by net (the
    module, or it compiled), and its update (earlier: torch's fused AdamW alone), run(i, net): the
    train_step alone, rows a step)"""
    if name == "sscl":
        model, run, rows = build_sscl(bf16, dev, steps)
    elif name == "jtcse":
        model, run, rows = build_jtcse(bf16, dev, steps)
    else:
        model, run, rows = build_bellm(bf16, dev, steps)
    params = [q for q in model.parameters() if q.requires_grad]
    opt, clip = update(name, model, params, earlier)

    def step(i, net):
        opt.zero_grad(set_to_none=True)
        run(i, net)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip or math.inf)  # 0: the norm only
        opt.step()
    return model, step, run, rows


def minilm_inputs(steps):
    """MINILM's name and tokenizer, and the WIKI sentences of the steps' batches of 64."""
    from transformers import AutoTokenizer
    minilm = env_input("MINILM", "sentence-transformers/all-MiniLM-L6-v2")
    sents = env_rows("WIKI", "wiki1m_head.txt", 64 * (steps + 2),
                     common.read_sentences)  # the steps' batches
    tok = common.load_pretrained(AutoTokenizer, minilm, label="MINILM")
    return minilm, tok, sents


def build_sscl(bf16, dev, steps):
    """SSCL on MiniLM: (the SentenceEncoder, run(i, net): sscl.train_step on batch i with
    --layer 5, rows a step)"""
    from transformers import AutoModel
    minilm, tok, sents = minilm_inputs(steps)
    tower = common.load_pretrained(AutoModel, minilm, label="MINILM")
    model = sscl.SentenceEncoder(tower, "cls").to(dev).train()
    # tokenised before (the scripts tokenise ahead of the step)
    batches = next(sscl.micro_batches(tok, sents, [range(len(sents))], 0, 1, 64, 32))

    def run(i, m):
        return sscl.train_step(common.in_length_groups(m, device=dev), batches[i], [5], dev,
                               autocast=torch.bfloat16 if bf16 else None)
    return model, run, 64


def build_jtcse(bf16, dev, steps):
    """JTCSE's MiniLM twin: (the Twin, run(i, net): jtcse.train_step on batch i, rows a step)"""
    from transformers import AutoModel
    minilm, tok, sents = minilm_inputs(steps)
    towers = [common.load_pretrained(AutoModel, minilm, label="MINILM") for _ in ("a", "b")]
    model = jtcse.Twin(towers).to(dev).train()
    # tokenised before (the scripts tokenise ahead of the step)
    batches = next(sscl.micro_batches(tok, sents, [range(len(sents))], 0, 1, 64, 32))

    def run(i, m):
        return jtcse.train_step(common.in_length_groups(m, device=dev), batches[i], i % 2, dev,
                                autocast=torch.bfloat16 if bf16 else None)
    return model, run, 64


def build_bellm(bf16, dev, steps):
    """BeLLM on SmolLM2-135M, K = 1 parallel, LoRA r 32: (the BeLLM net, run(i, net):
    bellm.train_step on batch i, rows a step)"""
    rows = env_rows("NLI", "snli_devtest.csv", 16 * (steps + 2), lambda f: bellm.read_csv(f)[1])
    smollm = env_input("SMOLLM", "HuggingFaceTB/SmolLM2-135M-Instruct")
    tok, dec = bellm.load_decoder(smollm, 1, "convert", dev)
    autocast = torch.bfloat16 if bf16 else None
    bellm.add_lora(dec, 32, 32, 0.1).to(dev)  # as bellm.py
    if autocast:
        bellm.cast_frozen_linears(dec, autocast)
    model = bellm.BeLLM(dec, 1, "parallel", "convert").train()
    batches = next(bellm.micro_batches(tok, rows, "nli", bellm.PROMPT, [range(len(rows))],
                                       0, 1, 16, 32))  # tokenised before, as the script does

    def run(i, m):
        return bellm.train_step(
            common.in_length_groups(functools.partial(bellm.embed, m), device=dev),
            batches[i][0], dev, autocast=autocast)
    return model, run, 16


def update(name, model, params, earlier):
    """The script's optimiser and its clipping: (AdamW, the norm clipped at: None no norm, 0.0
    the norm only)."""
    if earlier:  # the scripts' update before the authors': no norm, torch's weight decay 0.01
        return torch.optim.AdamW(params, lr=1e-5, fused=True), None
    if name == "jtcse":  # the authors': weight decay 0.01, no clipping (the norm is logged)
        return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True), 0.0
    # HF Trainer's: clipped at 1.0, weight decay 0.0 (SSCL: transformers 4.2.1's AdamW)
    groups = common.decay_groups(model, 0.0)
    adamw = sscl.AdamW421 if name == "sscl" else torch.optim.AdamW
    return adamw(groups, lr=1e-5, eps=1e-8, fused=True), 1.0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scripts", nargs="+", choices=["sscl", "jtcse", "bellm"])
    p.add_argument("--bf16", action="store_true", help="bf16 autocast, as the scripts' --bf16 "
                   "(always on CUDA, as in the scripts)")
    p.add_argument("--compile", action="store_true",
                   help="as the scripts' --compile: torch.compile(dynamic=True) of the model "
                   "(bellm: of each decoder layer)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=common.POS_INT, default=5, help="timed steps (default 5)")
    p.add_argument("--profile", action="store_true", help="torch.profiler's top rows of a step")
    p.add_argument("--earlier-update", action="store_true", help="torch's fused AdamW alone (the "
                   "scripts' update before the authors': no gradient norm, no clipping)")
    common.show_ranges(p)
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        common.die(f"--device cuda: torch {torch.__version__} sees no CUDA device here: drop "
                   "--device cuda (the CPU is the default)")
    if a.compile:
        common.check_compile()
    import transformers
    transformers.logging.set_verbosity_error()
    dev = torch.device(a.device)
    bf16 = a.bf16 or dev.type == "cuda"
    top = roof(torch.bfloat16 if bf16 else torch.float32, dev)
    print(f"torch {torch.__version__}, {device_name(dev)}; matmul roof "
          f"({'bf16' if bf16 else 'fp32'}): {top / 1e9:.0f} GFLOP/s; "
          f"{'compiled' if a.compile else 'eager'}")
    for name in a.scripts:
        model, step, run, rows = build(name, bf16, dev, a.steps, a.earlier_update)
        flops = []
        for i in range(2, 2 + a.steps):  # each batch's matrix products, counted on an eager step
            with common.FlopCount() as counted:
                run(i, model)
            flops.append(counted.flops)
        net = as_the_scripts_run(name, model, a.compile)
        first = timed(dev, step, 0, net)  # warm-up; with --compile, the compilation
        second = timed(dev, step, 1, net)  # (CUDA: the allocator's, cuBLAS's warm-up)
        times = [timed(dev, step, i, net) for i in range(2, 2 + a.steps)]
        s = statistics.median(times)
        rate = sum(flops) / sum(times)
        print(f"{name}: first step {first:.1f} s, second {second:.2f} s; median of {a.steps} "
              f"steps {s:.3f} s: {rows / s:.1f} rows/s, {rate / 1e9:.0f} GFLOP/s "
              f"({statistics.mean(flops) / 1e9:.0f} GFLOP a step), {100 * rate / top:.0f}% of "
              "the roof", flush=True)
        if a.profile:
            print_profile(step, net, dev)


def as_the_scripts_run(name, model, compiled):
    """The model as the scripts run it: with --compile, torch.compile of the whole model (bellm:
    of each decoder layer, in place), else itself."""
    if name == "bellm":
        return common.compiled_layers(model, compiled)
    if compiled:
        return torch.compile(model, dynamic=True)
    return model


def device_name(dev):
    """The device in words; a CPU's threads and whether it has bf16 instructions."""
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name()} (CUDA)"
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        bf16 = "yes"
    else:
        bf16 = "no"
    return f"CPU, {torch.get_num_threads()} threads; bf16 instructions: " + bf16


def print_profile(step, net, dev):
    """torch.profiler's top 15 rows (self time on the device) of one step (batch 2)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        step(2, net)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=40))


if __name__ == "__main__":
    main()
