"""BeLLM: "Backward Dependency Enhanced Large Language Model for Sentence Embeddings".
Xianming Li & Jing Li. NAACL 2024. arXiv:2311.05296.

A decoder LLM reads a prompt, `The representative word for {sentence} is:"`, and the final-norm
hidden state of the last token is the sentence embedding. BeLLM makes the last K decoder layers
bidirectional (eq. 4: the causal mask goes; padding stays masked) and, in the wiring of eq. 5 that
the authors trained, runs them beside the causal stack on the token embeddings x and sums the two:
h = LLM->(x) + BiLLM<->(x). Training: LoRA on NLI triplets with the contrastive loss of eq. 6.
`--bi-mode sequential` is the later BiLLM wiring (the last K layers bidirectional in place); with
last-token pooling its K = 1 cannot change the embedding (docs/bellm.md, detail 1).

  §3.3, the prompt                            PROMPT, fill, prompted
  eqs. 3-4, causal / bidirectional masks      attn_mask
  eq. 5, h = LLM->(x) + BiLLM<->(x)           forward, BeLLM (last_token pooling)
  eq. 6, the contrastive loss; one step       bellm_loss, train_step (C-STS: cosent_loss)
  Figs. 2, 4, 5, App. A (no training)         bellm_analysis.py

  torchrun --nproc_per_node 4 bellm.py --batch-size 16 --output-dir runs/bellm_7b  # paper: 4 GPUs
  python bellm.py --model HuggingFaceTB/SmolLM2-135M-Instruct --train snli_devtest.csv --bf16 \\
      --batch-size 16 --max-len 32 --lr 5e-4 --max-steps 100 --eval-steps 50 --no-eval-first \\
      --no-final-eval --output-dir runs/bellm                      # CPU (docs/bellm.md)
"""
import argparse
import copy
import functools
import math
import os
import warnings

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr

import common
import runs

PROMPT = 'The representative word for {sentence} is:"'  # §3.3; C-STS, §5.1:
CSTS_PROMPT = 'Given the context {condition}, summarize the sentence {sentence} in one word:"'
# peft on transformers 5
warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)

p = common.parser(__doc__)
# --- general: the paper's values as defaults (the shared flags: common.training_flags) ---
p.add_argument("--model", nargs="+", default=["meta-llama/Llama-2-7b-hf"], help="a decoder LLM "
               "(LLaMA, Mistral, Qwen2, ...; paper: LLaMA-2-7B); the analyses take several")
p.add_argument("--train", help="csv with sent0,sent1,hard_neg (default: SimCSE's "
               "nli_for_simcse.csv) or C-STS's sentence1,sentence2,condition,label; "
               "--representative-words: the word counts")
common.training_flags(p, output_dir="runs/bellm", lr=2e-4, max_len=64, batch_size=64,
                      eval_steps=100, lr_note=" (batch: one of 16, 32, 64, 128)")
p.add_argument("--eval-first", action=argparse.BooleanOptionalAction, default=True,
               help="evaluate step 0 (zero-shot); --no-eval-first saves one evaluation")
p.add_argument("--dtype", choices=["float32", "bfloat16"], help="the base LLM's weights (LoRA and "
               "AdamW stay float32): default bfloat16 on CUDA (the paper's), float32 on CPU")
p.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction,
               help="gradient checkpointing: default on with CUDA, off on CPU")
p.add_argument("--tasks", default=",".join(common.TASKS), help="the final table's tasks")
# --- BeLLM ---
p.add_argument("--bi-layers", type=common.NONNEG_INT, nargs="+", default=[1], help="K, the last "
               "layers made bidirectional (paper: 1; 0 = the causal LLM); the analyses: several")
p.add_argument("--bi-mode", default="parallel", choices=["parallel", "sequential"],
               help="parallel = eq. 5 (the authors' code); sequential = BiLLM")
p.add_argument("--bi-strategy", default="convert", choices=["convert", "add"], help="convert the "
               "last K layers, or add K bidirectional copies of them on top (Table 4)")
p.add_argument("--prompt", default=PROMPT, help="with {sentence}; may contain {condition} (C-STS, "
               f"§5.1: '{CSTS_PROMPT}')")
p.add_argument("--temp", type=common.POS_FLOAT, default=0.05, help="tau of eq. 6 (paper: 0.05)")
p.add_argument("--lora-r", type=common.POS_INT, default=32, help="paper: 32")
p.add_argument("--lora-alpha", type=common.POS_INT, default=32, help="paper: 32")
p.add_argument("--lora-dropout", type=common.PROB, default=0.1, help="paper: 0.1")
p.add_argument("--csts", help="a C-STS dev csv, scored at every evaluation: selects the checkpoint")
p.add_argument("--degradation", action="store_true", help="no training: STS of the causal LLM cut "
               "after each layer (Fig. 4; bellm_analysis.py)")
p.add_argument("--dependency", action="store_true", help="no training: Spearman of the pooled "
               "token to each token of the sentence, per --model (Figs. 2, 5; bellm_analysis.py)")
p.add_argument("--representative-words", action="store_true", help="no training: the LM head's "
               "next token after the prompt, per STS-B test sentence (App. A; bellm_analysis.py)")
p.add_argument("--plot", metavar="FILE.png", help="--degradation / --dependency: draw the figure")
common.show_ranges(p)


# ---------------------------------------------------------------- the loss ----------------------
def bellm_loss(h, h_pos, h_neg, temp):
    """eq. 6: -log e^{cos(h_i,h_i+)/t} / Σ_j (e^{cos(h_i,h_j+)/t} + e^{cos(h_i,h_j-)/t});
    h, h_pos, h_neg: (B, H)."""
    h = F.normalize(h, dim=-1)
    sim = h @ F.normalize(torch.cat([h_pos, h_neg]), dim=-1).T / temp  # (B, 2B)
    return F.cross_entropy(sim, torch.arange(len(h), device=h.device))


def cosent_loss(a, b, labels, scale=20.0):
    """C-STS training (not in the paper's text; AnglE's cosine objective, by the same authors):
    log(1 + Σ_{y_i > y_j} e^{scale (cos_j - cos_i)}); a, b: (B, H), labels: (B,)."""
    cos = F.cosine_similarity(a, b) * scale  # (B,)
    diff = cos[None, :] - cos[:, None]  # [i, j] = cos_j - cos_i
    diff = diff[labels[:, None] > labels[None, :]]
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff]), 0)


# ---------------------------------------------------------------- the model patch ---------------
def attn_mask(attention_mask, causal, dtype):
    """(b, L) 1 = real token -> (b, 1, L, L) additive mask, 0 where query i may read key j."""
    L = attention_mask.shape[1]
    keep = attention_mask[:, None, None, :].bool()  # keys: real tokens only (eq. 4 too)
    if causal:  # eq. 3: j <= i
        keep = keep & torch.ones(L, L, dtype=torch.bool, device=keep.device).tril()
    keep = keep | torch.eye(L, dtype=torch.bool, device=keep.device)  # no empty row (padding)
    zeros = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return zeros.masked_fill(~keep, torch.finfo(dtype).min)


def forward(dec, input_ids, attention_mask, bi_layers, bi_mode, bi_strategy, all_hidden=False):
    """Final-norm hidden states (b, L, H); all_hidden: also the causal stack's per-layer outputs."""
    x = dec.embed_tokens(input_ids)  # (b, L, H)
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # real tokens only (left padding)
    kw = dict(position_embeddings=dec.rotary_emb(x, pos), position_ids=pos)
    n = len(dec.layers)
    if bi_strategy == "add":
        causal_layers, bi = dec.layers, (dec.bellm_added if bi_layers else [])
    else:
        causal_layers, bi = dec.layers[:n - bi_layers], dec.layers[n - bi_layers:]
    h, hs = x, [x]
    m = attn_mask(attention_mask, True, x.dtype)  # (b, 1, L, L)
    for layer in causal_layers:  # LLM->: causal
        h = layer(h, attention_mask=m, **kw)
        hs.append(h)
    if bi_layers:
        m = attn_mask(attention_mask, False, x.dtype)  # eq. 4: no causal mask, padding masked
        g = x if bi_mode == "parallel" else h  # eq. 5 reads x; BiLLM continues the causal stack
        for layer in bi:  # BiLLM<->: bidirectional
            g = layer(g, attention_mask=m, **kw)
        # eq. 5: h = LLM->(x) + BiLLM<->(x)
        # NOTE(authors' code): with no causal layer left (K = n), h = BiLLM(x)
        h = g if bi_mode == "sequential" or len(causal_layers) == 0 else h + g
    return (dec.norm(h), hs) if all_hidden else dec.norm(h)


def last_token(h, attention_mask):
    """h (b, L, H) -> (b, H) at the last real token, for left or right padding."""
    idx = (attention_mask * torch.arange(attention_mask.shape[1], device=h.device)).argmax(1)
    return h[torch.arange(h.shape[0], device=h.device), idx]


class BeLLM(torch.nn.Module):
    """The embedding model as one module (what DDP wraps): input_ids, attention_mask -> (b, H)."""

    def __init__(self, dec, bi_layers, bi_mode, bi_strategy):
        super().__init__()
        self.dec, self.bi = dec, (bi_layers, bi_mode, bi_strategy)

    def forward(self, input_ids, attention_mask):
        return last_token(forward(self.dec, input_ids, attention_mask, *self.bi), attention_mask)


# ---------------------------------------------------------------- one training step -------------
def embed(model, batch):
    """The model on a tokenised batch: (b, H)."""
    return model(batch["input_ids"], batch["attention_mask"])


def train_step(model, tok, rows, kind, a, world, device):
    """One micro-batch of B rows on this rank -> (the loss over the global batch of world·B rows,
    its real tokens); gradients accumulated. NLI: eq. 6 over (anchor, entailment, contradiction);
    C-STS: cosent_loss over pairs, each sentence under its condition."""
    conditions = None if kind == "nli" else [r[2] for r in rows for _ in range(2)]
    texts = [s for r in rows for s in (r if kind == "nli" else r[:2])]  # 3 texts a row, or 2
    cfg = {"prompt": a.prompt, "max_len": a.max_len}
    batch = common.tokenize(tok, *prompted(tok, cfg, texts, conditions), device)
    with common.autocast(device, a.bf16):  # (B·3, H) or (B·2, H), in length groups
        h = common.run_batch(functools.partial(embed, model), batch, a.length_grouping).float()
    h = h.view(len(rows), -1, h.shape[-1])  # (B, 3, H): anchor, entailment, contradiction
    cols = [common.gather(h[:, i]) for i in range(h.shape[1])]  # each (world·B, H), ranks in order
    if kind == "nli":
        loss = bellm_loss(*cols, a.temp)  # eq. 6 over the global batch
    else:
        labels = common.gather(torch.tensor([r[3] for r in rows], device=device))
        loss = cosent_loss(*cols, labels)
    # every rank holds the same global loss; DDP averages gradients over ranks, hence × world
    (loss * world / a.grad_accum).backward()
    return loss, int(batch["attention_mask"].sum())


# ---------------------------------------------------------------- load, encode, data ------------
def load_decoder(name, bi_layers, bi_strategy, device, dtype=None):
    """tokenizer, decoder (embed_tokens, layers, rotary_emb, norm) in `dtype` (default fp32 on CPU,
    bf16 on CUDA); for bi_strategy 'add', copies of the last K layers as `dec.bellm_added`."""
    from transformers import AutoModel, AutoTokenizer
    tok = common.load_pretrained(AutoTokenizer, name)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    dec = common.load_pretrained(AutoModel, name, dtype=dtype)
    if device.type == "cpu":  # PyTorch's CPU SDPA backward with a mask is slow (docs/operations.md)
        dec.set_attn_implementation("eager")
    if not all(hasattr(dec, m) for m in ("embed_tokens", "layers", "rotary_emb", "norm")):
        common.die(f"'{name}' ({type(dec).__name__}) is not a decoder LLM with embed_tokens, "
                   "layers, rotary_emb and norm: pass a LLaMA / Mistral / Qwen2-style model")
    n = len(dec.layers)
    if not 0 <= bi_layers <= n:
        common.die(f"--bi-layers {bi_layers} is outside 0..{n} ('{name}' has {n} layers)")
    if bi_strategy == "add":  # Table 4 "addition": new layers, copies of the last K
        dec.bellm_added = torch.nn.ModuleList(copy.deepcopy(m) for m in dec.layers[n - bi_layers:])
    if tok.pad_token is None:  # padding is masked everywhere, so any id will do
        tok.pad_token = tok.eos_token
    return tok, dec.to(device)


def base_checksum(dec):
    """The base model's fingerprint (float64 sum of |weights| of the token embeddings and the final
    norm): an adapter is applied only to the base it was trained on, not to another of its shape."""
    w = [dec.embed_tokens.weight.detach(), dec.norm.weight.detach()]
    return float(sum(x.double().abs().sum() for x in w))


def check_base(checksum, recorded, name, where):
    if recorded is not None and not math.isclose(checksum, recorded, rel_tol=1e-6):
        common.die(f"'{name}' is not the base model the adapter was trained on (its weights' "
                   f"checksum is {checksum:.6g}, {where} records {recorded:.6g}): name the model "
                   "bellm.py --model trained it on")


def cast_frozen_linears(dec, dtype=torch.bfloat16):
    """Under bf16 autocast with float32 base weights: each frozen Linear stored in bf16 once.
    Autocast would cast them at every pass (it caches only trainable weights' casts): the same
    numbers, without the casts' time, and half those weights' memory. Norms and embeddings stay
    float32, as autocast runs them."""
    for m in dec.modules():
        if isinstance(m, torch.nn.Linear) and not any(q.requires_grad for q in m.parameters()):
            m.to(dtype)


def fill(prompt, sentence, condition=None):
    """The prompted text (§3.3); str.replace leaves braces inside a sentence alone."""
    return prompt.replace("{sentence}", sentence).replace("{condition}", condition or "")


def prompted(tok, cfg, sentences, conditions=None):
    """Sentences -> prompted texts; max_len applies to the sentence, cut before it enters the
    prompt, so the prompt's end (`is:"`, read by the pooled last token) is never cut.
    -> texts, their token limit."""
    def cut(s):
        ids = tok(s, add_special_tokens=False)["input_ids"]
        return s if len(ids) <= cfg["max_len"] else tok.decode(ids[:cfg["max_len"]])
    conditions = conditions or [None] * len(sentences)
    texts = [fill(cfg["prompt"], cut(s), c) for s, c in zip(sentences, conditions)]
    return texts, cfg["max_len"] + len(tok(fill(cfg["prompt"], "", ""))["input_ids"]) + 8


def make_encoder(dec, tok, cfg, device, cpu_bf16=False):
    """encode(list[str], conditions=None) -> (N, H): the one encode function (dev evaluation in
    training, eval_sts.py)."""
    net = BeLLM(dec, cfg["bi_layers"], cfg["bi_mode"], cfg["bi_strategy"])

    @torch.no_grad()
    def encode(sentences, conditions=None):
        texts, max_len = prompted(tok, cfg, sentences, conditions)
        with common.autocast(device, cpu_bf16):
            return common.encode_in_batches(functools.partial(embed, net), tok, texts, max_len,
                                            device, 64)
    encode.tokenizer, encode.max_len = tok, cfg["max_len"]  # what it reads (eval_sts.py --ensemble)
    return encode


def load_encoder(run_dir, meta, device):
    """For eval_sts.py. meta: base_model, bi_layers, bi_mode, prompt [, bi_strategy, max_len];
    run_dir None = zero-shot, no LoRA (a run folder without its adapter is refused by
    runs.read_meta, never run as the base model)."""
    return make_encoder(*load_run(run_dir, meta, device), device)


def load_run(run_dir, meta, device):
    """The decoder of a run (base + LoRA adapter, in eval mode), its tokenizer and config dict."""
    cfg = {"bi_strategy": "convert", **meta}
    dtype = getattr(torch, cfg["dtype"]) if cfg.get("dtype") else None  # the base as trained
    tok, dec = load_decoder(cfg["base_model"], cfg["bi_layers"], cfg["bi_strategy"], device, dtype)
    cfg.setdefault("max_len", dec.config.max_position_embeddings)  # evaluation does not cut
    check_base(base_checksum(dec), cfg.get("base_checksum"), cfg["base_model"],
               f"{run_dir}/sentemb.json")
    if run_dir:  # wraps the LoRA layers into dec in place; a damaged adapter file stops here
        runs.load_adapter(dec, run_dir)
    check_prompt(cfg["prompt"], "{condition}" in cfg["prompt"])
    if "{condition}" in cfg["prompt"]:  # a C-STS run: STS pairs come without a condition
        print("note: the prompt has {condition} (C-STS): left empty for sentences without one")
    return dec.eval(), tok, cfg


def dev_score(encode, data, csts_dev=None):
    """The score that selects the checkpoint: STS-B dev, or with --csts C-STS (§5.1; each sentence
    embedded with its condition; Spearman x 100 of cosine vs label)."""
    if not csts_dev:
        return common.stsb_dev(encode, data)
    a = encode([r[0] for r in csts_dev], [r[2] for r in csts_dev])
    b = encode([r[1] for r in csts_dev], [r[2] for r in csts_dev])
    return 100 * spearmanr(F.cosine_similarity(a, b).numpy(), [r[3] for r in csts_dev]).statistic


# ---------------------------------------------------------------- main --------------------------
def main():
    a = common.parse(p)
    if a.degradation or a.dependency or a.representative_words:  # the analyses, no training
        import bellm_analysis
        return bellm_analysis.main(a, common.pick_device())
    run = runs.Run(a, "bellm", p)  # torchrun: this process's rank, the world size, its device
    tasks = check_args(a, run.world)

    # data: NLI triplets (or C-STS pairs); every step's rows drawn from the seed
    kind, rows = common.read_csv(common.train_file(a.train, "nli_for_simcse.csv"))
    csts_dev = common.read_csv(a.csts)[1] if a.csts else None
    check_prompt(a.prompt, kind == "csts" or csts_dev is not None)
    data = common.check_sts(common.senteval_dir(a.data_dir), tasks if a.final_eval else [])
    per_step = a.batch_size * run.world * a.grad_accum  # rows a step, all ranks together
    steps = common.step_rows(len(rows), per_step, a.epochs, a.max_steps, a.seed)
    lr = run.open([a.model], len(steps))  # the run folder, locked; --resume: its state

    # the model: the decoder patched (forward), LoRA on every Linear (peft)
    from peft import LoraConfig, get_peft_model
    common.seed_everything(a.seed)  # the same added layers, LoRA and dropout stream on every rank
    dtype = getattr(torch, a.dtype or ("bfloat16" if run.device.type == "cuda" else "float32"))
    tok, dec = load_decoder(a.model, a.bi_layers, a.bi_strategy, run.device, dtype)
    checksum = base_checksum(dec)  # recorded: the adapter goes with this base only
    prompt_len = len(tok(fill(a.prompt, "", ""))["input_ids"])
    common.check_max_len(a.max_len, dec.config, a.model, extra=prompt_len)
    longest = a.max_len + prompt_len  # a prompted training text, at most
    grad_ckpt = run.device.type == "cuda" if a.grad_ckpt is None else a.grad_ckpt
    if grad_ckpt:  # with bf16 weights, LLaMA-2-7B fits one 80 GB GPU (docs/operations.md)
        dec.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout,
                      target_modules="all-linear")  # every Linear; AutoModel has no LM head
    model = get_peft_model(dec, lora)
    if a.bf16 or run.device.type == "cuda":  # autocast on: the frozen Linears cast once
        cast_frozen_linears(dec)
    net = run.wrap(BeLLM(dec, a.bi_layers, a.bi_mode, a.bi_strategy))  # DDP under torchrun
    meta = dict(base_model=a.model, bi_mode=a.bi_mode, bi_layers=a.bi_layers,
                bi_strategy=a.bi_strategy, prompt=a.prompt, dtype=str(dtype).removeprefix("torch."),
                max_len=dec.config.max_position_embeddings,  # evaluation does not cut sentences
                lora_r=a.lora_r, lora_alpha=a.lora_alpha,  # as adapter_config.json says
                base_checksum=checksum)
    encode = make_encoder(dec, tok, meta, run.device, a.bf16)

    # the optimiser: AdamW with linear decay (the authors' HF Trainer)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / len(steps))
    run.resume(f"'{a.model}' with these LoRA settings", trainable=params, opt=opt, sched=sched)
    check_base(checksum, (run.state or {}).get("base_checksum"), a.model, "the checkpoint")
    run.start(f"{a.model}: {len(dec.layers)} layers, K={a.bi_layers} {a.bi_mode}/{a.bi_strategy}, "
              f"{sum(q.numel() for q in params):,} LoRA parameters, {len(rows)} {kind} rows, "
              f"{len(steps)} steps of {per_step} rows, lr {lr:g}")
    texts = a.batch_size * (3 if kind == "nli" else 2)  # a micro-batch
    run.log(common.memory_line(dec, params, a, texts, longest, dtype, grad_ckpt, run.device))

    model.train()
    tokens = 0  # real tokens since the last log line, for tok/s
    for step in run.steps(len(steps)):  # 0 (zero-shot), 1, ..., len(steps)
        if step > 0:  # optimisation step `step`: grad_accum micro-batches of B rows per rank
            opt.zero_grad(set_to_none=True)
            for k in range(a.grad_accum):
                batch = [rows[i] for i in run.rows(steps[step - 1], k, a.batch_size)]
                with run.sync(net, k, a.grad_accum):
                    loss, n_tok = train_step(net, tok, batch, kind, a, run.world, run.device)
                run.check_finite(loss)  # NaN guard, before the weights change
                tokens += n_tok
            opt.step()
            sched.step()
            if step % a.log_steps == 0 or step == len(steps):
                run.log_step(f"loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}", per_step,
                             unit="rows", tokens=tokens)
                tokens = 0
        halt = run.stopping()  # SIGINT/SIGTERM on any rank: save this step, then stop
        evaluate = step % a.eval_steps == 0 and (step or a.eval_first) or step == len(steps)
        if evaluate or halt:  # the state; with a new best dev score, the adapter too (as one)
            dev = run.evaluate(model, dev_score, encode, data, csts_dev) if evaluate else None
            state = {"trainable": [q.detach().clone() for q in params], "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "base_checksum": checksum}
            run.save(state, params, dev, write=model.save_pretrained,
                     metric="csts_dev" if csts_dev else "stsb_dev", **meta)
        if halt:
            break
    run.end()  # the peak memory; after a signal: exit, saying how to resume
    run.final_eval(data, tasks, a.bf16)  # the best adapter on the test sets


# ---------------------------------------------------------------- argument checks ---------------
def check_prompt(prompt, conditional):
    if "{sentence}" not in prompt:
        common.die(f"--prompt '{prompt}' has no {{sentence}}: write where the sentence goes, e.g. "
                   f"'{PROMPT}'")
    if ("{condition}" in prompt) != conditional:
        common.die("--prompt has {condition} but the data has no condition column"
                   if not conditional else "C-STS data needs a --prompt with {condition}, e.g. "
                   f"'{CSTS_PROMPT}'")


def check_tasks(spec):
    """--tasks 'STS12,STS-B' -> ['STS12', 'STS-B']; an unknown name stops with one line."""
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    if unknown := [t for t in tasks if t not in common.TASKS]:
        common.die(f"unknown task(s) {', '.join(unknown)}: --tasks takes {','.join(common.TASKS)}")
    return tasks


def check_args(a, world):
    """Every check of the command line that stops training (one error line, exit 2). -> the tasks
    of the final table."""
    tasks = check_tasks(a.tasks)
    if a.batch_size * world < 2:
        common.die(f"--batch-size {a.batch_size}: eq. 6 needs in-batch negatives, pass 2 or more")
    if a.plot:
        common.die("--plot draws an analysis: add --degradation or --dependency (no training)")
    if len(a.model) > 1 or len(a.bi_layers) > 1:
        common.die("--model and --bi-layers take one value for training (several: the analyses)")
    a.model, a.bi_layers = a.model[0], a.bi_layers[0]
    if a.csts and (not os.path.isfile(a.csts) or common.read_csv(a.csts)[0] != "csts"):
        common.die(f"--csts '{a.csts}' is not a C-STS csv (sentence1,sentence2,condition,label)")
    return tasks


if __name__ == "__main__":
    main()
