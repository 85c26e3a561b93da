"""Tests for jtcse.py: tiny random BERT towers, a WordPiece tokenizer trained here, the real STS data."""
import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, BertConfig, BertModel, PreTrainedTokenizerFast

import jtcse

torch.set_num_threads(1)  # tiny models on a shared 2-core CPU: a second thread only spins (~50x slower linears)
ROOT = Path(__file__).resolve().parent
DATA = ROOT.parent / "shared" / "data"
SENTEVAL = DATA / "senteval"
WORDS = ("a man is playing a guitar . the cat sits on the mat . two dogs run in the park . "
         "a woman slices an onion . children play football outside . the sky is blue today").split(" . ")


def make_tokenizer(path, sentences):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizers.BertNormalizer(), pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(sentences, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    fast.save_pretrained(path)
    return fast


def tiny_bert(tok, seed, layers=4):
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=128)
    return BertModel(cfg)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("jtcse")
    train = d / "train.txt"
    lines = [f"{w} number {i}" for i in range(40) for w in WORDS]
    train.write_text("\n".join(lines) + "\n")
    tok = make_tokenizer(d / "tok", lines)
    for name, seed in (("a", 0), ("b", 1)):
        m = tiny_bert(tok, seed)
        m.save_pretrained(d / name), tok.save_pretrained(d / name)
    other = make_tokenizer(d / "other_tok", ["completely different words here", "zebra xylophone quartz"])
    m = tiny_bert(other, 2)
    m.save_pretrained(d / "other"), other.save_pretrained(d / "other")
    (d / "llama").mkdir()
    (d / "llama" / "config.json").write_text('{"model_type": "llama"}')
    return d, tok


def run(*args, ok=True):
    """A real subprocess: python SCRIPT ARGS (import cost ~5-10 s on a loaded 2-core machine)."""
    e = dict(os.environ, SENTEMB_DATA=str(SENTEVAL), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
             OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=e, timeout=300)
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def main(capsys, monkeypatch, *args, ok=True):
    """jtcse.main() in this process (same code path as the command line, without the import cost)."""
    monkeypatch.setenv("SENTEMB_DATA", str(SENTEVAL))
    monkeypatch.setattr(sys, "argv", ["jtcse.py", *map(str, args)])
    capsys.readouterr()
    code = 0
    try:
        jtcse.main()
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    if ok:
        assert code == 0, err[-3000:]
    return code, out, err


def train(env, out, capsys, monkeypatch, *extra):
    d, _ = env
    return main(capsys, monkeypatch, "--model-a", d / "a", "--model-b", d / "b", "--train", d / "train.txt",
                "--output-dir", out, "--batch-size", "8", "--max-len", "16", "--max-steps", "3",
                "--eval-steps", "2", "--lr", "1e-3", "--no-add-sick", "--no-final-eval", *extra)[1]


def batch_of(tok, sents):
    return dict(tok(sents, padding=True, return_tensors="pt"))


# ---------------------------------------------------------------- model equivalences -------------
def test_towers_without_cross_attention_equal_stock_bert(env):
    d, tok = env
    a, b = BertModel.from_pretrained(d / "a").eval(), BertModel.from_pretrained(d / "b").eval()
    batch = batch_of(tok, ["a man is playing a guitar", "the cat", "two dogs run in the park today"])
    ref = [copy.deepcopy(m)(**batch) for m in (a, b)]
    h, hP, c = jtcse.Twin([a, b], 0).eval()(batch)
    assert c is None
    for t in range(2):  # primitive streams are the stock model: bit-identical
        assert torch.equal(h[t], ref[t].last_hidden_state[:, 0]) and torch.equal(hP[t], ref[t].pooler_output)
    # our layer-by-layer path (used by the cross stream) without CAELs reproduces stock BERT per token
    xs = [m.embeddings(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"]) for m in (a, b)]
    mask = jtcse.additive_mask(batch["attention_mask"], xs[0].dtype)
    for j in range(4):
        xs = jtcse.layer_forward([m.encoder.layer[j] for m in (a, b)], xs, mask, cael=False)
    real = batch["attention_mask"].bool()
    for t in range(2):
        torch.testing.assert_close(xs[t][real], ref[t].last_hidden_state[real], atol=1e-5, rtol=1e-5)
    # a tower twinned with an exact copy of itself: swapping values changes nothing, c = stock CLS
    h, hP, c = jtcse.Twin([a, copy.deepcopy(a)], 2).eval()(batch)
    torch.testing.assert_close(c[0], ref[0].last_hidden_state[:, 0], atol=1e-5, rtol=1e-5)


def test_cael_cact_equals_hand_computation_of_eq10(env):
    d, tok = env
    a, b = BertModel.from_pretrained(d / "a").eval(), BertModel.from_pretrained(d / "b").eval()
    batch = batch_of(tok, ["a woman slices an onion", "the sky"])
    x = [torch.randn(2, batch["input_ids"].shape[1], 32) for _ in range(2)]
    la, lb = a.encoder.layer[1], b.encoder.layer[1]
    ctxs = []
    out = jtcse.layer_forward([la, lb], x, jtcse.additive_mask(batch["attention_mask"], torch.float32), True,
                              ctxs=ctxs)

    def qkv(layer, h):  # per head: (N, 4, L, 8)
        s = layer.attention.self
        lin = lambda m: (h @ m.weight.T + m.bias).view(2, -1, 4, 8).transpose(1, 2)  # noqa: E731
        return lin(s.query), lin(s.key), lin(s.value)

    (qa, ka, va), (qb, kb, vb) = qkv(la, x[0]), qkv(lb, x[1])
    pad = (batch["attention_mask"] == 0)[:, None, None, :]
    sa = lambda q, k: torch.softmax((q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(pad, -1e30), -1)  # noqa: E731
    cact_a = (sa(qa, ka) @ vb).transpose(1, 2).reshape(2, -1, 32)  # eq. 10: SA_I · V_II
    cact_b = (sa(qb, kb) @ va).transpose(1, 2).reshape(2, -1, 32)  # SA_II · V_I
    torch.testing.assert_close(ctxs[0], cact_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ctxs[1], cact_b, atol=1e-5, rtol=1e-5)
    o = la.attention.output  # then tower I's own W_O, residual + LayerNorm, FFN
    att = F.layer_norm(cact_a @ o.dense.weight.T + o.dense.bias + x[0], (32,), o.LayerNorm.weight, o.LayerNorm.bias,
                       o.LayerNorm.eps)
    torch.testing.assert_close(out[0], la.output(la.intermediate(att), att), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ctxs[0], (sa(qa, ka) @ va).transpose(1, 2).reshape(2, -1, 32), atol=1e-3)


# ---------------------------------------------------------------- losses = equations -------------
def nce_by_hand(z, zp, tau=0.05):
    total = 0.0
    for i in range(len(z)):
        cos = [float(F.cosine_similarity(z[i], zp[j], dim=0)) for j in range(len(z))]
        total += -torch.log(torch.exp(torch.tensor(cos[i] / tau)) / torch.exp(torch.tensor(cos) / tau).sum())
    return total / len(z)


def tmc_by_hand(h, hp, P, Pp, half=False):
    total = 0.0
    for i in range(len(h)):
        cos = max(float(h[i] @ hp[i] / (h[i].norm() * hp[i].norm())), 1e-4)
        total += -torch.log(torch.tensor(cos)) * (P[i] - Pp[i]).norm() / (P[i].norm() + Pp[i].norm()) / (2 if half else 1)
    return total / len(h)


def test_each_loss_term_equals_its_equation():
    torch.manual_seed(0)
    B, H = 6, 16
    h, hP, c = ([torch.randn(2 * B, H) for _ in range(2)] for _ in range(3))
    h[1][B:] = h[0][:B] + 0.3 * torch.randn(B, H)  # some positive cosines, some clamped negatives elsewhere
    z, zp = torch.randn(B, H), torch.randn(B, H)
    torch.testing.assert_close(jtcse.nce(z, zp, 0.05), nce_by_hand(z, zp), atol=1e-4, rtol=1e-5)  # eq. 11
    for half in (False, True):  # eq. 13, with and without the authors' /2
        torch.testing.assert_close(jtcse.tmc(z, zp, h[0][:B], h[1][:B], half),
                                   tmc_by_hand(z, zp, h[0][:B], h[1][:B], half), atol=1e-5, rtol=1e-5)
    a = jtcse.p.parse_args([])
    for R in (0, 1):
        loss, t = jtcse.jtcse_loss(h, hP, c, R, a)
        v1, v2 = lambda x: x[:B], lambda x: x[B:]  # noqa: E731
        nce = nce_by_hand(v1(h[0]), v2(h[0])) + nce_by_hand(v1(h[1]), v2(h[1]))  # eq. 11, both towers
        I_II = nce_by_hand(v1(h[0]), v2(h[1])) + nce_by_hand(v1(c[0]), v2(c[1]))
        II_I = nce_by_hand(v1(h[1]), v2(h[0])) + nce_by_hand(v1(c[1]), v2(c[0]))
        icnce = R * I_II + (1 - R) * II_I  # eq. 12
        ictm = (tmc_by_hand(v1(h[0]), v2(h[1]), v1(hP[0]), v2(hP[1]))  # eq. 14
                + tmc_by_hand(v1(h[1]), v2(h[0]), v1(hP[1]), v2(hP[0])))
        for got, want in ((t["nce"], nce), (t["icnce"], icnce), (t["ictm"], ictm), (loss, nce + icnce + ictm)):
            torch.testing.assert_close(got, torch.as_tensor(want, dtype=torch.float32), atol=1e-4, rtol=1e-5)
    a = jtcse.p.parse_args(["--no-nce", "--no-ictm"])
    r1, r0 = jtcse.jtcse_loss(h, hP, c, 1, a)[0], jtcse.jtcse_loss(h, hP, c, 0, a)[0]
    assert not torch.allclose(r1, r0)  # R flips the direction of ICNCE
    torch.testing.assert_close(r1, jtcse.nce(h[0][:B], h[1][B:], 0.05) + jtcse.nce(c[0][:B], c[1][B:], 0.05))
    torch.testing.assert_close(r0, jtcse.nce(h[1][:B], h[0][B:], 0.05) + jtcse.nce(c[1][:B], c[0][B:], 0.05))
    _, t = jtcse.jtcse_loss(h, hP, None, 1, jtcse.p.parse_args(["--no-icnce"]))
    assert set(t) == {"nce", "ictm"}


def test_modulus_factor_is_eq5_and_zero_only_for_equal_vectors():
    torch.manual_seed(1)
    a, b = torch.randn(100, 8), torch.randn(100, 8) * torch.rand(100, 1) * 3
    k, t = b.norm(dim=-1) / a.norm(dim=-1), F.cosine_similarity(a, b, dim=-1)
    torch.testing.assert_close(jtcse.modulus_ratio(a, b), (1 + k ** 2 - 2 * k * t).sqrt() / (1 + k))  # eq. 5
    assert jtcse.modulus_ratio(a, a.clone()).abs().max() < 1e-6  # equal norm, same direction: 0
    assert (jtcse.modulus_ratio(a, 1.5 * a) > 0.1).all()  # same direction, other norm: > 0
    rot = torch.stack([a[:, 1], -a[:, 0], *a[:, 2:].T], 1)  # same norm, other direction: > 0
    assert (jtcse.modulus_ratio(a, rot) > 0.01).all()
    kk = torch.linspace(0.2, 3, 57)  # over k and t the eq. 5 form is minimal (0) only at k = 1, t = 1
    f = lambda k, t: (1 + k ** 2 - 2 * k * t).sqrt() / (1 + k)  # noqa: E731
    assert f(kk, torch.ones_like(kk)).argmin() == (kk - 1).abs().argmin() and f(torch.tensor(1.), torch.tensor(1.)) == 0


# ---------------------------------------------------------------- end to end ---------------------
def test_train_save_eval_distill_and_determinism(env, tmp_path, capsys, monkeypatch):
    d, _ = env
    o1, o2 = train(env, tmp_path / "run1", capsys, monkeypatch), train(env, tmp_path / "run2", capsys, monkeypatch)
    strip = lambda s: re.sub(r"sent/s \S+", "", s)  # noqa: E731
    assert "step     3  loss" in o1 and "icnce" in o1 and "stsb_dev" in o1
    assert strip(o1.replace("run1", "run")) == strip(o2.replace("run2", "run"))  # same seed, same losses
    run_dir = tmp_path / "run1"
    assert (run_dir / "tower_a" / "config.json").is_file() and (run_dir / "tower_b" / "tokenizer.json").is_file()
    e = run("eval_sts.py", "--model", str(run_dir), "--tasks", "STS-B", "--split", "dev")  # a separate process
    dev = re.findall(r"stsb_dev (\S+)", o1)
    assert e.stdout.split()[:2] == ["STS-B", "Avg."] and e.stdout.split()[2] in dev  # same encode as in training
    # the saved twin = CLS(I) + CLS(II) of two plain AutoModel folders
    import common
    meta = __import__("json").loads((run_dir / "sentemb.json").read_text())
    assert meta["method"] == "jtcse" and meta["towers"] == ["tower_a", "tower_b"]
    enc = jtcse.load_encoder(str(run_dir), meta, torch.device("cpu"))
    tok = PreTrainedTokenizerFast.from_pretrained(run_dir / "tower_a")
    towers = [AutoModel.from_pretrained(run_dir / t).eval() for t in meta["towers"]]
    b = common.tokenize(tok, ["a man is playing a guitar"], 16, "cpu")
    with torch.no_grad():
        torch.testing.assert_close(enc(["a man is playing a guitar"]),
                                   sum(t(**b).last_hidden_state[:, 0] for t in towers), atol=1e-5, rtol=1e-5)
    code, _, err = main(capsys, monkeypatch, "--model-a", d / "a", "--model-b", d / "b", "--train", d / "train.txt",
                        "--output-dir", run_dir, "--no-add-sick", ok=False)
    assert code == 2 and "already holds a run" in err
    # resume: 2 steps, then --resume to 3, ends where the uninterrupted run ended
    train(env, tmp_path / "res", capsys, monkeypatch, "--max-steps", "2")
    o3 = train(env, tmp_path / "res", capsys, monkeypatch, "--resume")
    assert re.findall(r"step +3 .*", strip(o3)) == re.findall(r"step +3 .*", strip(o1))
    # distillation into one tower, saved as a plain AutoModel folder that eval_sts.py reads
    dd = tmp_path / "distilled"
    _, o, _ = main(capsys, monkeypatch, "--distill", run_dir, "--model-a", d / "a", "--train", d / "train.txt",
                   "--output-dir", dd, "--batch-size", "8", "--max-len", "16", "--max-steps", "2", "--no-add-sick",
                   "--no-final-eval")
    assert "step     2  loss" in o and "lr 1e-05" in o
    assert isinstance(AutoModel.from_pretrained(dd), BertModel)
    monkeypatch.setattr(sys, "argv", ["eval_sts.py", "--model", str(dd), "--tasks", "STS-B"])
    import eval_sts
    eval_sts.main()
    assert "STS-B" in capsys.readouterr().out


def test_analyze_prints_e_cls_table(env, capsys, monkeypatch):
    d, _ = env
    _, out, _ = main(capsys, monkeypatch, "--analyze", "--model-a", d / "a", "--model-b", d / "b", "--num-cael", "2",
                     "--max-len", "16")
    assert re.search(r"layer +single +I +II +I\+CA +II\+CA", out)
    rows = [line.split() for line in out.splitlines() if re.match(r" +\d ", line)]
    assert len(rows) == 4
    assert all(row[1] == row[2] for row in rows)  # single = --model-a = tower I without cross-attention
    assert rows[0][2:4] == rows[0][4:6] and rows[1][2:4] != rows[1][4:6]  # layer 1 ordinary, layer 2 a CAEL


@pytest.mark.parametrize("args, needle", [
    (["--model-b", "{d}/other"], "different tokenizers"),
    (["--num-cael", "3"], "does not divide"),
    (["--distill", "{d}/nowhere"], "--distill"),
    (["--distill", "{d}/a"], "--distill"),
    (["--batch-size", "1"], "--batch-size"),
    (["--train", "{d}/missing.txt"], "--train"),
    (["--model-b", "{d}/llama"], "BERT"),
    (["--no-nce", "--no-icnce", "--no-ictm"], "no loss"),
    (["--resume"], "--resume"),
])
def test_bad_inputs_exit_2_with_one_error_line(env, tmp_path, capsys, monkeypatch, args, needle):
    d, _ = env
    base = ["--model-a", d / "a", "--model-b", d / "b", "--train", d / "train.txt", "--output-dir", tmp_path / "out",
            "--no-add-sick"]
    code, _, err = main(capsys, monkeypatch, *base, *[x.format(d=d) for x in args], ok=False)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and needle in errors[0], err


def test_bad_input_in_a_real_process(env):
    d, _ = env
    r = run("jtcse.py", "--model-a", str(d / "a"), "--model-b", str(d / "other"), ok=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.strip()][-1].startswith("error: ")
