"""Tests of bellm.py (merged into test_all.py by the lead): tiny random LLaMA / Qwen2 decoders with an
offline byte-level BPE tokenizer; equivalences to the stock HF model, eq. 5 and eq. 6 written out,
padding invariance, LoRA save/reload, degradation, end-to-end runs and bad inputs."""
import csv
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

import bellm
import common

ROOT = Path(__file__).resolve().parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(ROOT),
       "OMP_NUM_THREADS": "1"}
CPU = torch.device("cpu")
torch.set_num_threads(1)  # tiny models: one thread is fastest, and much faster on a shared CPU
SENTS = ["a man is playing a guitar .", "two dogs run in the park", "the cat sleeps", "a woman cuts an onion .",
         "kids are playing football outside on a sunny day", "nobody is here", "a plane takes off",
         "the sun is shining brightly over the quiet sea"]


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator(SENTS * 3 + [bellm.PROMPT], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<s>", eos_token="</s>").save_pretrained(d)
    return d


def make_model(tok_dir, tmp, family="llama", layers=4):
    """A tiny random decoder saved with the tokenizer; returns its folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = cfg_cls(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    d = tmp / f"{family}-{layers}"
    model_cls(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def batch(tok, sents, side="right", prompt=bellm.PROMPT):
    tok.padding_side = side
    texts, n = bellm.prompted(tok, {"prompt": prompt, "max_len": 64}, sents)
    return common.tokenize(tok, texts, n, CPU)


def pad_mask(am):  # (b, L) -> (b, 1, L, L): padding-only additive mask, written independently of bellm.attn_mask
    return (1.0 - am[:, None, None, :].float()) * torch.finfo(torch.float32).min


def stock(dec, b):
    """Stock HF decoder: all hidden states (embeddings, layer 1..n outputs before the final norm)."""
    pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return dec(**b, position_ids=pos, output_hidden_states=True), pos


def real(h, am):  # the real positions of (b, L, H), flattened
    return h[am.bool()]


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen2", "eager")])
def test_k0_equals_stock_and_eq5(tok_dir, tmp_path, family, attn):
    tok, dec = bellm.load_decoder(str(make_model(tok_dir, tmp_path, family)), 1, "convert", CPU)
    dec.set_attn_implementation(attn)
    dec.eval()
    assert dec.config._attn_implementation == attn
    b = batch(tok, SENTS[:4])
    am = b["attention_mask"]
    with torch.no_grad():
        out, pos = stock(dec, b)
        hs, n = out.hidden_states, len(dec.layers)
        # --bi-layers 0 is the stock model, exactly
        ours = bellm.forward(dec, b["input_ids"], am, 0, "parallel", "convert")
        assert torch.equal(real(ours, am), real(out.last_hidden_state, am))
        # sequential K = 1: the last layer run by hand on the causal stack's output with a padding-only mask
        pe = dec.rotary_emb(hs[0], pos)
        last = dec.layers[-1](hs[n - 1], attention_mask=pad_mask(am), position_embeddings=pe, position_ids=pos)
        ours = bellm.forward(dec, b["input_ids"], am, 1, "sequential", "convert")
        torch.testing.assert_close(real(ours, am), real(dec.norm(last), am))
        # parallel K = 1, eq. 5: h = LLM->^{1:n-1}(x) + BiLLM<->^{n}(x), then the final norm
        bi = dec.layers[-1](hs[0], attention_mask=pad_mask(am), position_embeddings=pe, position_ids=pos)
        ours = bellm.forward(dec, b["input_ids"], am, 1, "parallel", "convert")
        torch.testing.assert_close(real(ours, am), real(dec.norm(hs[n - 1] + bi), am))
        # K = n (every layer bidirectional): both wirings are the bidirectional stack on x
        g = hs[0]
        for layer in dec.layers:
            g = layer(g, attention_mask=pad_mask(am), position_embeddings=pe, position_ids=pos)
        for mode in ("parallel", "sequential"):
            torch.testing.assert_close(real(bellm.forward(dec, b["input_ids"], am, n, mode, "convert"), am),
                                       real(dec.norm(g), am))
        # the bidirectional layer does read the right context: non-last positions change
        assert not torch.allclose(real(ours, am), real(out.last_hidden_state, am))


def test_add_strategy_is_a_copy_on_top(tok_dir, tmp_path):
    tok, dec = bellm.load_decoder(str(make_model(tok_dir, tmp_path)), 2, "add", CPU)
    dec.eval()
    assert len(dec.layers) == 4 and len(dec.bellm_added) == 2
    for new, old in zip(dec.bellm_added, dec.layers[2:]):
        assert new is not old and all(torch.equal(a, b) for a, b in zip(new.parameters(), old.parameters()))
    b = batch(tok, SENTS[:3])
    am = b["attention_mask"]
    with torch.no_grad():
        out, pos = stock(dec, b)
        pe = dec.rotary_emb(out.hidden_states[0], pos)
        g = out.hidden_states[0]
        for layer in dec.bellm_added:
            g = layer(g, attention_mask=pad_mask(am), position_embeddings=pe, position_ids=pos)
        L = am.shape[1]  # hidden_states[n] is after the final norm: run layer n by hand, causal + padding mask
        causal = pad_mask(am) + torch.full((L, L), torch.finfo(torch.float32).min).triu(1)
        h4 = dec.layers[3](out.hidden_states[3], attention_mask=causal, position_embeddings=pe, position_ids=pos)
        torch.testing.assert_close(real(dec.norm(h4), am), real(out.last_hidden_state, am))
        ours = bellm.forward(dec, b["input_ids"], am, 2, "parallel", "add")  # all 4 causal layers + 2 new on x
        torch.testing.assert_close(real(ours, am), real(dec.norm(h4 + g), am))


def test_last_token_k1_sequential_equals_k0(tok_dir, tmp_path):
    """The README's property: with last-token pooling, only the final layer bidirectional changes nothing."""
    tok, dec = bellm.load_decoder(str(make_model(tok_dir, tmp_path)), 1, "convert", CPU)
    dec.eval()
    b = batch(tok, SENTS)
    with torch.no_grad():
        e = {(k, m): bellm.last_token(bellm.forward(dec, b["input_ids"], b["attention_mask"], k, m, "convert"),
                                      b["attention_mask"]) for k in (0, 1, 2) for m in ("parallel", "sequential")}
    torch.testing.assert_close(e[1, "sequential"], e[0, "sequential"])
    assert not torch.allclose(e[2, "sequential"], e[0, "sequential"], atol=1e-4)  # K = 2 reaches the last token
    assert not torch.allclose(e[1, "parallel"], e[0, "parallel"], atol=1e-4)  # eq. 5's wiring changes it


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("qwen2", "eager")])
def test_padding_invariance(tok_dir, tmp_path, family, attn):
    path = str(make_model(tok_dir, tmp_path, family))
    for strategy in ("convert", "add"):
        tok, dec = bellm.load_decoder(path, 2, strategy, CPU)
        dec.set_attn_implementation(attn)
        dec.eval()
        for k in (0, 1, 2):
            for mode in ("parallel", "sequential"):
                cfg = dict(bi_layers=k, bi_mode=mode, bi_strategy=strategy, prompt=bellm.PROMPT, max_len=64)
                enc = bellm.make_encoder(dec, tok, cfg, CPU)
                for side in ("right", "left"):
                    tok.padding_side = side
                    alone = torch.cat([enc([s]) for s in SENTS[:3]])
                    together = enc(SENTS)[:3]  # batched with longer sentences: padded
                    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)


def test_last_token_position():
    h = torch.arange(2 * 5, dtype=torch.float).view(2, 5, 1)
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    assert bellm.last_token(h, right).flatten().tolist() == [2, 9]
    assert bellm.last_token(h, left).flatten().tolist() == [4, 9]


def test_mask_is_padding_only_or_causal():
    am = torch.tensor([[1, 1, 0]])
    neg = torch.finfo(torch.float32).min
    assert bellm.attn_mask(am, False, torch.float32)[0, 0].tolist() == [[0, 0, neg], [0, 0, neg], [0, 0, 0]]
    assert bellm.attn_mask(am, True, torch.float32)[0, 0].tolist() == [[0, neg, neg], [0, 0, neg], [0, 0, 0]]


def test_loss_is_eq6():
    torch.manual_seed(0)
    h, hp, hn = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    cos, t = torch.nn.functional.cosine_similarity, 0.05
    want = 0
    for i in range(4):  # eq. 6, term by term
        num = torch.exp(cos(h[i], hp[i], dim=0) / t)
        den = sum(torch.exp(cos(h[i], hp[j], dim=0) / t) + torch.exp(cos(h[i], hn[j], dim=0) / t) for j in range(4))
        want = want - torch.log(num / den) / 4
    torch.testing.assert_close(bellm.bellm_loss(h, hp, hn, t), want)
    # C-STS (CoSENT): log(1 + sum over pairs with y_i > y_j of e^{20 (cos_j - cos_i)})
    y = torch.tensor([1.0, 3.0, 2.0, 3.0])
    c = cos(h, hp) * 20
    want = torch.log(1 + sum(torch.exp(c[j] - c[i]) for i in range(4) for j in range(4) if y[i] > y[j]))
    torch.testing.assert_close(bellm.cosent_loss(h, hp, y), want)


def test_lora_save_reload_and_zero_shot_meta(tok_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    path = str(make_model(tok_dir, tmp_path))
    for strategy in ("convert", "add"):
        meta = dict(method="bellm", base_model=path, bi_mode="parallel", bi_layers=1, bi_strategy=strategy,
                    prompt=bellm.PROMPT, max_len=64)
        tok, dec = bellm.load_decoder(path, 1, strategy, CPU)
        model = get_peft_model(dec, LoraConfig(r=4, lora_alpha=4, target_modules="all-linear"))
        torch.manual_seed(1)
        for name, q in model.named_parameters():
            if "lora_B" in name:
                q.data.normal_()  # LoRA starts as a no-op; make it count
        model.eval()
        want = bellm.make_encoder(dec, tok, meta, CPU)(SENTS)
        run = tmp_path / f"run-{strategy}"
        model.save_pretrained(run)
        common.save_meta(run, **meta)
        torch.testing.assert_close(bellm.load_encoder(str(run), meta, CPU)(SENTS), want)
        zero_shot = bellm.load_encoder(None, {k: meta[k] for k in ("method", "base_model", "bi_layers", "bi_mode",
                                                                   "prompt")}, CPU)(SENTS)
        assert not torch.allclose(zero_shot, want)


def sts_dir(tmp):
    """A synthetic STS folder: STS-B dev and test with 16 pairs each."""
    d = tmp / "senteval"
    (d / "SICK").mkdir(parents=True)
    (d / "STS" / "STSBenchmark").mkdir(parents=True)
    for split in ("dev", "test"):
        with open(d / "STS" / "STSBenchmark" / f"sts-{split}.csv", "w") as f:
            for i in range(16):
                f.write(f"g\tf\t2012\t{i}\t{i % 5 + 0.5}\t{SENTS[i % 8]}\t{SENTS[(i * 3 + 1) % 8]}\n")
    return d


def test_degradation_k_n_equals_embedding(tok_dir, tmp_path):
    tok, dec = bellm.load_decoder(str(make_model(tok_dir, tmp_path)), 0, "convert", CPU)
    dec.eval()
    data = common.senteval_dir(str(sts_dir(tmp_path)))
    a = Namespace(prompt=bellm.PROMPT, max_len=64)
    curve = bellm.degradation(a, tok, dec, CPU, data, ["STS-B"])
    meta = dict(bi_layers=0, bi_mode="parallel", bi_strategy="convert", prompt=bellm.PROMPT, max_len=64)
    normal = common.evaluate(bellm.make_encoder(dec, tok, meta, CPU), data, ["STS-B"])
    assert len(curve) == 4 and curve[4] == pytest.approx(normal, abs=1e-6)
    assert curve[1] != curve[4]


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def main(capsys, monkeypatch, *args):
    """bellm.main() in this process (no interpreter start-up): exit code, stdout, stderr."""
    monkeypatch.setattr(sys, "argv", ["bellm.py", *map(str, args)])
    capsys.readouterr()
    try:
        bellm.main()
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def nli_csv(tmp, rows=12, cols=("sent0", "sent1", "hard_neg")):
    path = tmp / f"nli-{len(cols)}.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for i in range(rows):
            w.writerow([SENTS[i % 8], SENTS[(i + 1) % 8], SENTS[(i + 4) % 8]][:len(cols)])
    return path


def test_end_to_end_deterministic_and_eval_sts(tok_dir, tmp_path, capsys, monkeypatch):
    model, data, train = make_model(tok_dir, tmp_path), sts_dir(tmp_path), nli_csv(tmp_path)
    logs = []
    for i in range(2):
        code, out, err = main(capsys, monkeypatch, "--model", model, "--train", train, "--data-dir", data,
                              "--output-dir", tmp_path / f"run{i}", "--batch-size", 4, "--max-steps", 3,
                              "--eval-steps", 2, "--log-steps", 1, "--bi-layers", 2, "--tasks", "STS-B",
                              "--lora-r", 4, *(["--no-final-eval"] if i == 0 else []))
        assert code == 0, err
        logs.append([line.split("sent/s")[0] for line in out.splitlines() if " loss " in line])
    assert len(logs[0]) == 3 and logs[0] == logs[1]  # same seed, same losses
    assert out.splitlines()[-2].split() == ["STS-B", "Avg."]  # the final table
    meta = common.json.load(open(tmp_path / "run1" / "sentemb.json"))
    assert meta["method"] == "bellm" and meta["bi_layers"] == 2 and meta["bi_mode"] == "parallel"
    e = run("eval_sts.py", "--model", str(tmp_path / "run1"), "--data-dir", str(data), "--tasks", "STS-B")
    assert e.returncode == 0, e.stderr
    assert e.stdout.splitlines()[:2] == out.splitlines()[-2:]  # eval_sts.py = the script's final table


def test_resume_continues_the_same_run(tok_dir, tmp_path, capsys, monkeypatch):
    model, data, train = make_model(tok_dir, tmp_path), sts_dir(tmp_path), nli_csv(tmp_path, rows=20)
    args = ["--model", model, "--train", train, "--data-dir", data, "--batch-size", 4, "--eval-steps", 2,
            "--log-steps", 1, "--lora-r", 4, "--no-final-eval", "--no-eval-first"]
    losses = lambda out: [line.split("sent/s")[0] for line in out.splitlines() if " loss " in line]  # noqa: E731
    code, whole, err = main(capsys, monkeypatch, *args, "--output-dir", tmp_path / "a", "--max-steps", 4)
    assert code == 0, err
    code, first, err = main(capsys, monkeypatch, *args, "--output-dir", tmp_path / "b", "--max-steps", 2)
    code, rest, err = main(capsys, monkeypatch, *args, "--output-dir", tmp_path / "b", "--max-steps", 4, "--resume")
    assert code == 0, err
    assert len(losses(whole)) == 4 and losses(first) + losses(rest) == losses(whole)


def test_csts_training(tok_dir, tmp_path, capsys, monkeypatch):
    path = tmp_path / "csts.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sentence1", "sentence2", "condition", "label"])
        for i in range(8):
            w.writerow([SENTS[i], SENTS[(i + 1) % 8], "the number of people", i % 5 + 1])
    code, out, err = main(capsys, monkeypatch, "--model", make_model(tok_dir, tmp_path), "--train", path,
                          "--csts", path, "--data-dir", sts_dir(tmp_path), "--output-dir", tmp_path / "run",
                          "--batch-size", 4, "--max-steps", 2, "--no-final-eval", "--lora-r", 4, "--prompt",
                          "Given the context {condition}, summarize the sentence {sentence} in one word:\"")
    assert code == 0, err
    assert "csts_dev" in out


def test_bad_inputs(tok_dir, tmp_path, capsys, monkeypatch):
    from transformers import BertConfig, BertModel
    model, data, train = make_model(tok_dir, tmp_path), sts_dir(tmp_path), nli_csv(tmp_path)
    bert = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=400, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(bert)
    for f in os.listdir(tok_dir):
        os.link(tok_dir / f, bert / f)
    (tmp_path / "empty").mkdir()
    base = ["bellm.py", "--train", str(train), "--data-dir", str(data), "--output-dir", str(tmp_path / "o"),
            "--batch-size", "4", "--max-steps", "1", "--no-final-eval"]
    cases = {
        "not a decoder": ["--model", str(bert)],
        "outside 0..4": ["--model", str(model), "--bi-layers", "5"],
        "has no {sentence}": ["--model", str(model), "--prompt", "The representative word is:"],
        "sent0,sent1,hard_neg": ["--model", str(model), "--train", str(nli_csv(tmp_path, cols=("sent0", "sent1")))],
        "needs in-batch negatives": ["--model", str(model), "--batch-size", "1"],
        "training file": ["--model", str(model), "--train", str(tmp_path / "missing.csv")],
        "unknown task": ["--model", str(model), "--tasks", "STS99"],
        "cannot load": ["--model", str(tmp_path / "empty")],
        "no STS data": ["--model", str(model), "--data-dir", str(tmp_path / "empty")],
        "is not a C-STS csv": ["--model", str(model), "--csts", str(train)],
        "has {condition} but": ["--model", str(model), "--prompt", "In {condition}, {sentence} means:"],
    }
    for want, extra in cases.items():
        code, _, err = main(capsys, monkeypatch, *base[1:], *extra)
        lines = [line for line in err.splitlines() if line.startswith("error:")]  # (+ progress bars)
        assert code == 2 and len(lines) == 1 and want in lines[0], (want, err)
    r = run(*base, "--model", str(bert))  # and once as a user sees it: exit code 2, one line, no traceback
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("error:") == 1, r.stderr
