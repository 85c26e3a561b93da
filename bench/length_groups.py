"""Length-grouped training steps (the scripts' default) against one padded forward
(--no-length-grouping), on the real checkpoints: token slots, padded fraction and the median time of
a whole step (forward, the method's loss, backward, AdamW) for each method's quick-run batch; also
for other values of common.GROUP_COST (the fixed cost of one forward pass, in token slots, that
decides where a batch is cut). Configurations alternate, one step each, on the same batch; 1 warm-up
round, then median of --reps rounds.

  # MiniLM, 64 wiki1m sentences x 2 views, max_len 32, layer 5
  python bench/length_groups.py sscl [--bf16]
  # two MiniLM towers, 64 sentences x 2 views, max_len 32
  python bench/length_groups.py jtcse
  # SmolLM2-135M, 16 SNLI triplets, max_len 32, K = 1, LoRA r 32
  python bench/length_groups.py bellm [--bf16]
  # what bellm.py --bf16 does
  python bench/length_groups.py bellm --bf16 --attn sdpa,eager --frozen float32,bfloat16
  # on a GPU, where a forward's fixed cost is larger: which GROUP_COST pays there
  python bench/length_groups.py sscl --device cuda --bf16 --costs 64,256,1024,4096
  (MINILM, SMOLLM: model names or folders; WIKI, NLI: the data files; --costs 16,64,256 --reps 5)
"""
import argparse
import copy
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


def costs(s):
    """--costs: GROUP_COST values, each an integer >= 0 (common.length_groups' cost)."""
    return [common.NONNEG_INT(c) for c in s.split(",")]


costs.range = "integers >= 0"  # for show_ranges


def one_of(*allowed):
    """A comma-separated list of the allowed words (another would be ignored silently)."""
    def parse(s):
        bad = [w for w in s.split(",") if w not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not {' or '.join(allowed)}")
        return s.split(",")
    return parse


def bellm_forward(net):
    """forward(batch) of a BeLLM net (bellm.BeLLM): its embeddings of a tokenised batch."""
    def forward(b):
        return net(b["input_ids"], b["attention_mask"])
    return forward


def token_slots(lengths, cost):
    """The token slots a step computes: one padded forward (cost None), else length groups at
    GROUP_COST cost, each padded to its own longest."""
    if cost is None:
        return len(lengths) * max(lengths)
    return sum(len(g) * max(lengths[i] for i in g) for g in common.length_groups(lengths, cost))


p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("method", choices=["sscl", "jtcse", "bellm"])
p.add_argument("--bf16", action="store_true", help="bf16 autocast, as the scripts' --bf16")
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the steps run "
               "(default: cpu); the batch is tokenised on the host and copied as the scripts do")
p.add_argument("--costs", type=costs, default=str(common.GROUP_COST),
               help="GROUP_COST values to compare, comma-separated")
p.add_argument("--reps", type=common.POS_INT, default=5, help="timed rounds (default 5)")
p.add_argument("--attn", type=one_of("eager", "sdpa"), default="eager",
               help="bellm: attention implementation(s) to compare, e.g. sdpa,eager "
                    "(bellm.py uses eager on CPU)")
p.add_argument("--frozen", type=one_of("float32", "bfloat16"), default="float32",
               help="bellm: dtype(s) of the frozen base Linears to compare; with --bf16, "
                    "bellm.py casts them to bfloat16 once (bellm.cast_frozen_linears) instead "
                    "of at every pass")
common.show_ranges(p)
a = p.parse_args()
if a.device == "cuda" and not torch.cuda.is_available():
    common.die(f"--device cuda: torch {torch.__version__} sees no CUDA device here: drop "
               "--device cuda (the CPU is the default)")
torch.manual_seed(42)
dev = torch.device(a.device)
if a.method == "bellm":
    from peft import LoraConfig, get_peft_model
    rows = env_rows("NLI", "snli_devtest.csv", 16, lambda f: bellm.read_csv(f)[1])
    tok, dec = bellm.load_decoder(env_input("SMOLLM", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                                  1, "convert", dev)
    model = get_peft_model(dec, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.1,
                                           target_modules="all-linear"))
    models = {f: model if i == 0 else copy.deepcopy(model)
              for i, f in enumerate(a.frozen)}
    forwards = {}
    for f, m in models.items():  # f: the dtype of the frozen base Linears
        if f == "bfloat16":
            bellm.cast_frozen_linears(m.base_model.model)
        forwards[f] = bellm_forward(bellm.BeLLM(m.base_model.model, 1, "parallel", "convert"))
    texts = [s for r in rows[:16] for s in r]  # 16 triplets: 48 texts
    texts, n = bellm.prompted(tok, {"prompt": bellm.PROMPT, "max_len": 32}, texts)
    batch = tok(texts, padding=True, truncation=True, max_length=n, return_tensors="pt")

    def loss_of(h):  # eq. 6 over (anchor, entailment, contradiction) rows
        h = h.float()
        return bellm.bellm_loss(h[0::3], h[1::3], h[2::3], 0.05)
else:
    from transformers import AutoModel, AutoTokenizer, BertModel
    minilm = env_input("MINILM", "sentence-transformers/all-MiniLM-L6-v2")
    sents = env_rows("WIKI", "wiki1m_head.txt", 64, common.read_sentences)
    tok = common.load_pretrained(AutoTokenizer, minilm, label="MINILM")
    batch = tok(sents, padding=True, truncation=True, max_length=32, return_tensors="pt")
    batch = {k: torch.cat([v, v]) for k, v in batch.items()}  # two dropout views: (128, L)
    if a.method == "sscl":
        model = sscl.SentenceEncoder(common.load_pretrained(AutoModel, minilm, label="MINILM"),
                                     "cls").to(dev)
        forwards = {None: lambda b: model(b, (5,))}

        def loss_of(out):
            z, (zm,) = out
            return sscl.sscl_loss(z[:64].float(), z[64:].float(), [zm[:64].float()], 0.05)
    else:
        model = jtcse.Twin([common.load_pretrained(BertModel, minilm, label="MINILM")
                            for _ in "ab"], 2).to(dev)
        forwards = {None: model}

        def loss_of(out):
            return jtcse.jtcse_loss(*[None if z is None else [t.float() for t in z] for z in out],
                                    1, 0.05)[0]
    models = {None: model}
params = [q for m in models.values() for q in m.train().parameters() if q.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-9)  # a step's cost, ~no change

lengths = batch["attention_mask"].sum(1).tolist()
real = sum(lengths)
attns = a.attn if a.method == "bellm" else [None]
configs = [(c, at, f) for f in forwards for at in attns for c in [None, *a.costs]]
slots = {c: token_slots(lengths, c) for c, _, _ in configs}  # c None: one padded forward
times = {k: [] for k in configs}
for rep in range(a.reps + 1):
    for c, at, f in configs:
        if at:
            models[f].base_model.model.set_attn_implementation(at)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with common.autocast(dev, "bf16" if a.bf16 else common.pick_precision(dev)):
            out = common.in_length_groups(forwards[f], c is not None, dev, c)(batch)
        loss_of(out).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if rep:
            times[c, at, f].append(time.perf_counter() - t)
where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else \
    f"CPU, {torch.get_num_threads()} threads"
print(f"{a.method}, {'bf16 autocast' if a.bf16 else 'fp32'}, {where}, "
      f"{len(lengths)} texts, {real} real tokens, median of {a.reps} steps")
base = statistics.median(times[configs[0]])
for c, at, f in configs:
    m = statistics.median(times[c, at, f])
    if c is None:
        name = "padded (--no-length-grouping)"
    else:
        name = f"grouped, GROUP_COST {c}: {len(common.length_groups(lengths, c))} groups"
    if at:
        name += f", {at}"
    if f:
        name += f", frozen {f}"
    print(f"{name:<68} {slots[c]:>5} slots, {1 - real / slots[c]:5.1%} padding  {m:6.2f} s/step  "
          f"{real / m:7.0f} real tok/s  x{base / m:.2f}")
