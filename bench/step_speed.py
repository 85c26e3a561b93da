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
import math
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
import bellm  # noqa: E402
import common  # noqa: E402
from _inputs import env_input, env_rows  # noqa: E402
import jtcse  # noqa: E402
import sscl  # noqa: E402


def roof(dtype, device, reps=10):
    """The device's matrix-multiply roof: the best FLOP/s of an n x n torch.matmul (n = 2048 on a
    CPU, 8192 on a GPU)."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in "ab")
    torch.matmul(a, b)
    best = min(timed(lambda: torch.matmul(a, b), device) for _ in range(reps))
    return 2 * n ** 3 / best


def timed(fn, device):
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def build(name, bf16, dev, steps, earlier=False):
    """(the trained module, step(i, net): the script's train_step on batch i, run by net (the
    module, or it compiled), and its update (earlier: torch's fused AdamW alone), run(i, net): the
    train_step alone, rows a step)"""
    from transformers import AutoModel, AutoTokenizer
    cpu = dev
    if name in ("sscl", "jtcse"):
        minilm = env_input("MINILM", "sentence-transformers/all-MiniLM-L6-v2")
        sents = env_rows("WIKI", "wiki1m_head.txt", 64 * (steps + 2),
                                common.read_sentences)  # the steps' batches
        tok = common.load_pretrained(AutoTokenizer, minilm, label="MINILM")
        towers = [common.load_pretrained(AutoModel, minilm, label="MINILM")
                  for _ in ("a", "b")[:1 + (name == "jtcse")]]
        if name == "sscl":
            model = sscl.SentenceEncoder(towers[0], "cls").to(dev).train()
        else:
            model = jtcse.Twin(towers).to(dev).train()
        batches = next(sscl.micro_batches(tok, sents, [range(len(sents))], 0, 1, 64, 32))
        if name == "sscl":  # tokenised before (the scripts tokenise ahead of the step)
            run = lambda i, m: sscl.train_step(  # noqa: E731
                common.in_length_groups(m, device=dev), batches[i], [5], cpu,
                autocast=torch.bfloat16 if bf16 else None)
        else:
            run = lambda i, m: jtcse.train_step(  # noqa: E731
                common.in_length_groups(m, device=dev), batches[i], i % 2, cpu,
                autocast=torch.bfloat16 if bf16 else None)
        rows = 64
    else:
        rows_ = env_rows("NLI", "snli_devtest.csv", 16 * (steps + 2),
                                lambda f: bellm.read_csv(f)[1])
        smollm = env_input("SMOLLM", "HuggingFaceTB/SmolLM2-135M-Instruct")
        tok, dec = bellm.load_decoder(smollm, 1, "convert", cpu)
        bellm.add_lora(dec, 32, 32, 0.1, autocast=bf16 and torch.bfloat16).to(dev)  # as bellm.py
        model = bellm.BeLLM(dec, 1, "parallel", "convert").train()
        batches = next(bellm.micro_batches(tok, rows_, "nli", bellm.PROMPT, [range(len(rows_))],
                                           0, 1, 16, 32))  # tokenised before, as the script does
        run = lambda i, m: bellm.train_step(  # noqa: E731
            common.in_length_groups(functools.partial(bellm.embed, m), device=dev),
            batches[i][0], cpu, autocast=torch.bfloat16 if bf16 else None)
        rows = 16
    params = [q for q in model.parameters() if q.requires_grad]
    if earlier:  # the scripts' update before the authors': no norm, torch's weight decay 0.01
        opt, clip = torch.optim.AdamW(params, lr=1e-5, fused=True), None
    elif name == "jtcse":  # the authors': weight decay 0.01, no clipping (the norm is logged)
        opt, clip = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True), 0.0
    else:  # HF Trainer's: clipped at 1.0, weight decay 0.0 (SSCL: transformers 4.2.1's AdamW)
        groups = common.decay_groups(model, 0.0)
        opt = (sscl.AdamW421 if name == "sscl" else torch.optim.AdamW)(groups, lr=1e-5,
                                                                        eps=1e-8, fused=True)
        clip = 1.0

    def step(i, net):
        opt.zero_grad(set_to_none=True)
        run(i, net)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip or math.inf)  # 0: the norm only
        opt.step()
    return model, step, run, rows


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
    if dev.type == "cuda":
        here = f"{torch.cuda.get_device_name()} (CUDA)"
    else:
        here = f"CPU, {torch.get_num_threads()} threads; bf16 instructions: " + (
            "yes" if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
            else "no")
    top = roof(torch.bfloat16 if bf16 else torch.float32, dev)
    print(f"torch {torch.__version__}, {here}; matmul roof ({'bf16' if bf16 else 'fp32'}): "
          f"{top / 1e9:.0f} GFLOP/s; {'compiled' if a.compile else 'eager'}")
    for name in a.scripts:
        model, step, run, rows = build(name, bf16, dev, a.steps, a.earlier_update)
        flops = []
        for i in range(2, 2 + a.steps):  # each batch's matrix products, counted on an eager step
            with common.FlopCount() as counted:
                run(i, model)
            flops.append(counted.flops)
        net = common.compiled_layers(model, a.compile) if name == "bellm" else \
            torch.compile(model, dynamic=True) if a.compile else model  # as the scripts
        first = timed(lambda: step(0, net), dev)  # warm-up; with --compile, the compilation
        second = timed(lambda: step(1, net), dev)  # (CUDA: the allocator's, cuBLAS's warm-up)
        times = [timed(lambda i=i: step(i, net), dev) for i in range(2, 2 + a.steps)]
        s, rate = statistics.median(times), sum(flops) / sum(times)
        print(f"{name}: first step {first:.1f} s, second {second:.2f} s; median of {a.steps} "
              f"steps {s:.3f} s: {rows / s:.1f} rows/s, {rate / 1e9:.0f} GFLOP/s "
              f"({statistics.mean(flops) / 1e9:.0f} GFLOP a step), {100 * rate / top:.0f}% of "
              "the roof", flush=True)
        if a.profile:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda"
                                             else [])
            with profile(activities=acts) as prof:
                step(2, net)
            key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=40))


if __name__ == "__main__":
    main()
