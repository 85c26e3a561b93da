"""All tests: `python -m pytest test_all.py -q`. Three kinds (STYLE.md 11): subprocess smoke runs of each
script on tiny random-weight models, equivalence tests (patch off = stock model, loss = the paper's
equation), determinism. Tiny models and tokenisers are built here, offline. The SentEval-parity test
needs the real data and MiniLM checkpoint (../shared; `bash ../shared/bench/setup_models.sh`)."""
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import common

ROOT = Path(__file__).resolve().parent
SHARED = ROOT.parent / "shared"
REAL_STS = SHARED / "data" / "senteval"
MODELS = Path(os.environ.get("SENTEMB_MODELS", Path.home() / ".cache" / "sentemb-models"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONHASHSEED": "0"}
WORDS = ("a man woman dog cat is are the on in with playing eating running riding sitting red blue big small "
         "guitar horse car ball grass street water bread piano bike table two three people child girl boy").split()


def run(script, *args, env=None):
    """Run one of our scripts; returns the CompletedProcess (stdout + stderr as text)."""
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, cwd=ROOT, timeout=600)


def assert_bad_input(proc, *words):
    """Exit code 2, one `error:` line naming the fix, no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    err = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(err) == 1, proc.stderr
    for w in words:
        assert w in err[0], err[0]


def sentence(rng, n=None):
    return " ".join(rng.choice(WORDS) for _ in range(n or rng.randint(3, 12)))


# ---------------------------------------------------------------- fixtures ----------------------
@pytest.fixture(scope="session")
def bert_tokenizer_dir(tmp_path_factory):
    """A real WordPiece tokenizer, built offline from a word list."""
    from transformers import BertTokenizerFast
    d = tmp_path_factory.mktemp("bert_tok")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab += list("abcdefghijklmnopqrstuvwxyz0123456789.,")
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(d / "vocab.txt"), do_lower_case=True).save_pretrained(d)
    return d


def tiny_bert(path, tok_dir, seed=0, layers=4, hidden=32):
    """A random-weight BertModel (with pooler) and its tokenizer, saved as a plain HF folder."""
    from transformers import AutoTokenizer, BertConfig, BertModel
    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=2 * hidden, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory, bert_tokenizer_dir):
    return tiny_bert(tmp_path_factory.mktemp("bert"), bert_tokenizer_dir)


def write_sts(root, n=24, seed=0):
    """A synthetic folder in SentEval's layout, every task and subset, some unscored STS pairs."""
    rng = random.Random(seed)
    d = Path(root) / "downstream"
    for task, subsets in common.STS_SUBSETS.items():
        (d / "STS" / f"{task}-en-test").mkdir(parents=True, exist_ok=True)
        for s in subsets:
            pairs = [(sentence(rng), sentence(rng)) for _ in range(n)]
            gold = [f"{rng.uniform(0, 5):.2f}" if i % 7 else "" for i in range(n)]  # every 7th pair unscored
            (d / "STS" / f"{task}-en-test" / f"STS.input.{s}.txt").write_text("".join(f"{a}\t{b}\n" for a, b in pairs))
            (d / "STS" / f"{task}-en-test" / f"STS.gs.{s}.txt").write_text("".join(g + "\n" for g in gold))
    (d / "STS" / "STSBenchmark").mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev", "test"):
        rows = [f"genre\tfile\tyear\t{i}\t{rng.uniform(0, 5):.3f}\t{sentence(rng)}\t{sentence(rng)}\n" for i in range(n)]
        (d / "STS" / "STSBenchmark" / f"sts-{split}.csv").write_text("".join(rows))
    (d / "SICK").mkdir(parents=True, exist_ok=True)
    for name in ("SICK_train", "SICK_trial", "SICK_test_annotated"):
        rows = [f"{i}\t{sentence(rng)}\t{sentence(rng)}\t{rng.uniform(1, 5):.1f}\tNEUTRAL\n" for i in range(n)]
        (d / "SICK" / f"{name}.txt").write_text("pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n"
                                               + "".join(rows))
    return Path(root)


@pytest.fixture(scope="session")
def sts_dir(tmp_path_factory):
    return write_sts(tmp_path_factory.mktemp("sts"))


@pytest.fixture(scope="session")
def train_txt(tmp_path_factory):
    """Training text with blank lines and sentences longer than any max_len used here."""
    rng = random.Random(1)
    p = tmp_path_factory.mktemp("train") / "train.txt"
    lines = [sentence(rng, 40) if i % 5 == 0 else sentence(rng) for i in range(64)]
    p.write_text("\n".join(l + ("\n" if i % 9 == 0 else "") for i, l in enumerate(lines)) + "\n")
    return p


# ---------------------------------------------------------------- common.py / eval_sts.py -------
def hashed_encode(sentences):
    """A fixed random vector per sentence: any evaluator bug changes the numbers."""
    return torch.stack([torch.randn(8, generator=torch.Generator().manual_seed(sum(map(ord, s)) * 7919 + len(s)))
                        for s in sentences])


def test_evaluate_equals_scipy_on_pooled_subsets(sts_dir):
    from scipy.stats import spearmanr
    data = common.senteval_dir(str(sts_dir))
    results = common.evaluate(hashed_encode, data)
    for task in common.TASKS:
        sims, gold = [], []
        for rows in common.load_sts(data, task).values():  # the "all" setting: subsets pooled
            for a, b, g in rows:
                sims.append(F.cosine_similarity(hashed_encode([a]), hashed_encode([b])).item())
                gold.append(g)
        assert results[task] == pytest.approx(100 * spearmanr(sims, gold).statistic, abs=1e-4), task
    exact = common.evaluate(hashed_encode, data, exact=True, batch_size=5)  # SentEval's batches: same numbers
    assert exact == pytest.approx(results, abs=1e-4)


def test_load_sts_drops_unscored_pairs_and_rejoins_whitespace(tmp_path):
    write_sts(tmp_path, n=14)
    f = tmp_path / "downstream" / "STS" / "STS12-en-test" / "STS.input.MSRpar.txt"
    f.write_text(f.read_text().replace("\t", "  \t ", 1))
    rows = common.load_sts(str(tmp_path / "downstream"), "STS12")["MSRpar"]
    assert len(rows) == 12  # pairs 0 and 7 have an empty gold line
    assert all("  " not in s and s == s.strip() for r in rows for s in r[:2])


def test_eval_sts_on_plain_model_json(bert_dir, sts_dir, tmp_path):
    out = tmp_path / "r.json"
    proc = run("eval_sts.py", "--model", bert_dir, "--pooler", "avg_first_last", "--data-dir", sts_dir,
               "--tasks", "STS12,SICK-R", "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"STS12\s+SICK-R\s+Avg\.", proc.stdout)
    assert set(json.loads(out.read_text())["results"]) == {"STS12", "SICK-R"}


def test_malformed_sts_line_names_file_and_line(bert_dir, tmp_path):
    write_sts(tmp_path)
    f = tmp_path / "downstream" / "STS" / "STS14-en-test" / "STS.input.images.txt"
    lines = f.read_text().splitlines()
    lines[4] = lines[4].replace("\t", " ")
    f.write_text("\n".join(lines) + "\n")
    assert_bad_input(run("eval_sts.py", "--model", bert_dir, "--data-dir", tmp_path), "STS.input.images.txt", "line 5")


def test_missing_data_folder(bert_dir, tmp_path):
    proc = run("eval_sts.py", "--model", bert_dir, "--data-dir", tmp_path / "nowhere")
    assert_bad_input(proc, "--data-dir", "SENTEMB_DATA")
    write_sts(tmp_path / "partial")
    shutil.rmtree(tmp_path / "partial" / "downstream" / "SICK")  # incomplete
    assert_bad_input(run("eval_sts.py", "--model", bert_dir, "--data-dir", tmp_path / "partial"), "--data-dir")
    write_sts(tmp_path / "gap")
    (tmp_path / "gap" / "downstream" / "STS" / "STS16-en-test" / "STS.gs.plagiarism.txt").unlink()
    assert_bad_input(run("eval_sts.py", "--model", bert_dir, "--data-dir", tmp_path / "gap"), "STS.gs.plagiarism.txt")


def test_unknown_model_offline(sts_dir):
    assert_bad_input(run("eval_sts.py", "--model", "no-such-org/no-such-model", "--data-dir", sts_dir), "local model folder")


def test_senteval_parity_minilm_avg(tmp_path):
    """SentEval's own numbers for all-MiniLM-L6-v2 with avg pooling, each within ±0.02."""
    minilm = MODELS / "minilm"
    assert (minilm / "model.safetensors").exists(), "run: bash ../shared/bench/setup_models.sh"
    out = tmp_path / "r.json"
    proc = run("eval_sts.py", "--model", minilm, "--pooler", "avg", "--data-dir", REAL_STS, "--json", out)
    assert proc.returncode == 0, proc.stderr
    senteval = {"STS12": 72.37, "STS13": 80.60, "STS14": 75.59, "STS15": 85.39, "STS16": 78.99,
                "STS-B": 82.03, "SICK-R": 77.15}
    assert json.loads(out.read_text())["results"] == pytest.approx(senteval, abs=0.02)


# ---------------------------------------------------------------- SSCL ---------------------------
def sscl_args(model, train, data, out, *extra, steps=4, layer=2, eval_steps=2):
    return ["--model", model, "--train", train, "--data-dir", data, "--output-dir", out, "--batch-size", 8,
            "--max-len", 16, "--layer", layer, "--eval-steps", eval_steps, "--max-steps", steps, "--log-steps", 1,
            *extra]


def test_sscl_loss_equals_transcription():
    """Row i: -log e^{cos(h_i,h_i⁺)/τ} / (Σ_j e^{cos(h_i,h_j⁺)/τ} + Σ_M Σ_j e^{cos(h_i,h_j^M)/τ})."""
    import sscl
    torch.manual_seed(0)
    B, D, tau = 5, 7, 0.05
    h, h_pos, n1, n2 = (torch.randn(B, D, dtype=torch.float64) for _ in range(4))
    cos = lambda x, y: (x @ y / (x.norm() * y.norm())).item()  # noqa: E731
    for negs in ([], [n1], [n1, n2]):
        want = 0.0
        for i in range(B):
            num = math.exp(cos(h[i], h_pos[i]) / tau)
            den = sum(math.exp(cos(h[i], h_pos[j]) / tau) for j in range(B))
            den += sum(math.exp(cos(h[i], n[j]) / tau) for n in negs for j in range(B))
            want += -math.log(num / den) / B
        assert sscl.sscl_loss(h, h_pos, negs, tau).item() == pytest.approx(want, rel=1e-9)


def test_layer_zero_is_simcse():
    """--layer 0 adds no negative, and the loss is SimCSE's (its Similarity + CrossEntropy, written out)."""
    import sscl
    assert sscl.parse_layers("0", 12) == []
    torch.manual_seed(1)
    z1, z2 = torch.randn(6, 16), torch.randn(6, 16)
    simcse = F.cross_entropy(F.cosine_similarity(z1.unsqueeze(1), z2.unsqueeze(0), dim=-1) / 0.05, torch.arange(6))
    assert sscl.sscl_loss(z1, z2, [], 0.05).item() == pytest.approx(simcse.item(), rel=1e-6)
    assert sscl.parse_layers("11,10", 12) == [10, 11]


@pytest.mark.parametrize("pooler", ["cls", "avg"])
def test_layer_m_reads_hidden_states_m(bert_dir, pooler):
    """The negatives are hidden_states[M] of the stock model, pooled like the last layer."""
    import sscl
    from transformers import AutoModel, AutoTokenizer
    tok, stock = AutoTokenizer.from_pretrained(bert_dir), AutoModel.from_pretrained(bert_dir).eval()
    enc = sscl.SentenceEncoder(AutoModel.from_pretrained(bert_dir), pooler).eval()
    batch = common.tokenize(tok, ["a man is playing a guitar", "two dogs"], 16, torch.device("cpu"))
    with torch.no_grad():
        z, (z1, z3) = enc(batch, [1, 3])
        hs = stock(**batch, output_hidden_states=True).hidden_states
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pool = (lambda h: h[:, 0]) if pooler == "cls" else (lambda h: (h * mask).sum(1) / mask.sum(1))
    torch.testing.assert_close(z1, pool(hs[1]))
    torch.testing.assert_close(z3, pool(hs[3]))
    torch.testing.assert_close(z, pool(hs[4]))  # the last layer, = last_hidden_state


def test_sscl_end_to_end_resume_and_eval(bert_dir, train_txt, sts_dir, tmp_path):
    out = tmp_path / "run"
    proc = run("sscl.py", *sscl_args(bert_dir, train_txt, sts_dir, out, "--proj-dim", 8))
    assert proc.returncode == 0, proc.stderr
    assert "stsb_dev" in proc.stdout and re.search(r"STS12 .* SICK-R\s+Avg\.", proc.stdout)
    meta = json.loads((out / "sentemb.json").read_text())
    assert meta["method"] == "sscl" and meta["proj_dim"] == 8 and meta["layers"] == [2]
    from transformers import AutoModel
    AutoModel.from_pretrained(out)  # a plain HF folder
    ev = run("eval_sts.py", "--model", out, "--data-dir", sts_dir, "--tasks", "STS-B", "--split", "dev")
    assert ev.returncode == 0, ev.stderr
    best = re.findall(r"best (\d+\.\d+)", proc.stdout)[-1]
    assert f"{float(ev.stdout.split()[2]):.2f}" == best  # eval_sts.py reproduces the dev score of the best step
    # resume: continue the same run to 6 steps
    again = run("sscl.py", *sscl_args(bert_dir, train_txt, sts_dir, out, "--proj-dim", 8, "--resume",
                                      "--no-final-eval", steps=6))
    assert again.returncode == 0, again.stderr
    assert "step     6" in again.stdout and "step     0" not in again.stdout


def losses(stdout):
    return re.findall(r"loss (\S+)", stdout)


def test_sscl_same_seed_same_losses(bert_dir, train_txt, sts_dir, tmp_path):
    kw = dict(steps=10, eval_steps=0, layer="1,2")
    a = run("sscl.py", *sscl_args(bert_dir, train_txt, sts_dir, tmp_path / "a", "--no-final-eval", **kw))
    b = run("sscl.py", *sscl_args(bert_dir, train_txt, sts_dir, tmp_path / "b", "--no-final-eval", **kw))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert len(losses(a.stdout)) == 10 and losses(a.stdout) == losses(b.stdout)
    c = run("sscl.py", *sscl_args(bert_dir, train_txt, sts_dir, tmp_path / "c", "--no-final-eval", "--seed", 7, **kw))
    assert losses(c.stdout) != losses(a.stdout)


def test_sscl_no_aug_and_analyze(bert_dir, train_txt, sts_dir, tmp_path):
    proc = run("sscl.py", *sscl_args(bert_dir, train_txt, sts_dir, tmp_path / "r", "--no-aug", "--pooler", "avg",
                                     "--loss-mix", "--no-final-eval"))
    assert proc.returncode == 0, proc.stderr
    an = run("sscl.py", "--analyze", "--model", tmp_path / "r", "--data-dir", sts_dir)
    assert an.returncode == 0, an.stderr
    rows = [l.split() for l in an.stdout.splitlines() if re.match(r"\s+\d+\s", l)]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3, 4]  # embeddings + 4 layers
    assert all(-1 <= float(x) <= 1 for r in rows for x in r[1:])


@pytest.mark.parametrize("bad,words", [
    (["--layer", "4"], ["--layer 4", "1..3"]),   # the tiny model has 4 layers
    (["--layer", "eleven"], ["--layer", "integers"]),
    (["--batch-size", "1"], ["--batch-size"]),
])
def test_sscl_bad_arguments(bert_dir, train_txt, sts_dir, tmp_path, bad, words):
    assert_bad_input(run("sscl.py", *sscl_args(bert_dir, train_txt, sts_dir, tmp_path / "r"), *bad), *words)
    assert not (tmp_path / "r" / "sentemb.json").exists()


def test_sscl_bad_files(bert_dir, train_txt, sts_dir, tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    assert_bad_input(run("sscl.py", *sscl_args(bert_dir, blank, sts_dir, tmp_path / "r")), "--train")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores permissions: a path under a regular file is unwritable for all
        ro = train_txt / "sub"
    assert_bad_input(run("sscl.py", *sscl_args(bert_dir, train_txt, sts_dir, ro)), "--output-dir")
    assert_bad_input(run("sscl.py", *sscl_args("no-such-org/no-such-model", train_txt, sts_dir, tmp_path / "r")),
                     "local model folder")


def test_sscl_nan_keeps_best_checkpoint(bert_dir, train_txt, sts_dir, tmp_path):
    out = tmp_path / "r"
    proc = run("sscl.py", *sscl_args(bert_dir, train_txt, sts_dir, out, "--lr", "1e30"))
    assert_bad_input(proc, "--lr", "kept")
    meta = json.loads((out / "sentemb.json").read_text())
    assert meta["step"] == 0  # the step-0 checkpoint, the last good one
    ev = run("eval_sts.py", "--model", out, "--data-dir", sts_dir, "--tasks", "STS-B")
    assert ev.returncode == 0, ev.stderr
    # and a second run into the same folder refuses to overwrite it
    assert_bad_input(run("sscl.py", *sscl_args(bert_dir, train_txt, sts_dir, out)), "--resume")


# ---------------------------------------------------------------- multi-GPU (torchrun, gloo on CPU)
def torchrun(script, nproc, *args):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(29500 + random.randint(0, 999)), str(ROOT / script), *map(str, args)],
                          capture_output=True, text=True, env={**ENV, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=600)


@pytest.fixture(scope="session")
def bert_nodrop_dir(tmp_path_factory, bert_tokenizer_dir):
    """Dropout off, so that 2 ranks × B and 1 rank × 2B see the same computation."""
    from transformers import AutoConfig
    d = tiny_bert(tmp_path_factory.mktemp("bert_nodrop"), bert_tokenizer_dir, seed=3)
    cfg = AutoConfig.from_pretrained(d)
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.0
    cfg.save_pretrained(d)
    return d


def test_sscl_two_ranks_equal_one_rank_double_batch(bert_nodrop_dir, train_txt, sts_dir, tmp_path):
    """In-batch negatives gathered across ranks: 2 × B gives the loss and the updated weights of 1 × 2B."""
    args = lambda out, bs: sscl_args(bert_nodrop_dir, train_txt, sts_dir, out, "--no-final-eval",  # noqa: E731
                                     "--batch-size", bs, steps=3, eval_steps=0, layer="1,3")
    one = run("sscl.py", *args(tmp_path / "one", 8), env={"OMP_NUM_THREADS": "1"})
    two = torchrun("sscl.py", 2, *args(tmp_path / "two", 4))
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr[-3000:]
    assert len(losses(one.stdout)) == 3
    for x, y in zip(losses(one.stdout), losses(two.stdout), strict=True):
        assert float(x) == pytest.approx(float(y), abs=2e-4)
    w1 = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)["encoder"]
    w2 = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=False)["encoder"]
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=1e-4, msg=k)
