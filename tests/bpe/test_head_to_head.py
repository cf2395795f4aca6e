"""A BPE token model trained by launch/pretrain.py (2 ranks, ZeRO-2) and scored inside a megatok run's
periodic head-to-head (2 ranks sharing the documents) on the same bytes; exact resume of the token data stream; megatok-compare
over both runs."""

from __future__ import annotations

import json
import shutil

import pytest

from megatok import bpe
from megatok.data.documents import iter_documents
from megatok.metrics import read_metrics
from tests.conftest import PARALLEL, ROOT, TINY, pretrain, run_main, run_tool, stdlib_texts

BPE_SET = ["model.kind=bpe", "model.vocab_size=512", "model.bytes_per_token=3.0", "model.n_encoder_layers=0",
           "model.n_decoder_layers=0", "model.n_main_layers=2", "data.seq_len=24", "train.save_every=3",
           "train.max_steps=6", "train.micro_batch_size=2", "train.global_batch_size=4", "eval.every=3"]


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("h2h")
    heldout = tmp / "parallel.jsonl"
    with heldout.open("w") as f:
        for lang, texts in PARALLEL.items():
            for i, t in enumerate(texts):
                f.write(json.dumps({"text": t, "lang": lang, "domain": "legal"}, ensure_ascii=False) + "\n")
    tok = tmp / "tok"
    bpe.train_bpe([t.encode() for t in stdlib_texts(n_files=10)] + [" ".join(PARALLEL["en"]).encode()], tok, 512)
    common = [*TINY, f"data.shards={shards}"]
    bpe_run = tmp / "bpe"
    pretrain(["--config", "configs/tiny.json", "--set", *common, *BPE_SET, f"model.tokenizer={tok}",
              f"train.run_dir={bpe_run}"], nproc=2)
    unet_run = tmp / "unet"
    # 2 ranks under ZeRO-2: the head-to-head splits the documents' batches over the ranks and merges the sums
    # 64-byte sequences: 512 training bytes at step 2 and 1,024 at step 4, against the baseline's 430 and
    # 941 at its checkpoints of steps 3 and 6 (24 tokens x 4 sequences a step, about 1.6 bytes per token
    # of this small vocabulary), so the two evaluations are matched to different baseline checkpoints
    pretrain(["--config", "configs/tiny.json", "--set", *common, f"train.run_dir={unet_run}", "train.max_steps=4",
              "train.micro_batch_size=2", "train.global_batch_size=4", "eval.every=2", f"eval.heldout={heldout}",
              f"eval.baseline_run={bpe_run}", "data.seq_len=64",
              "train.log_every=3"], nproc=2)  # step 2 is logged all the same: an evaluation step
    return {"tmp": tmp, "heldout": heldout, "tok": tok, "bpe": bpe_run, "unet": unet_run, "common": common}


def test_token_model_metrics(runs):
    rows = read_metrics(runs["bpe"])
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in val] == [3, 6]
    assert all(1.0 < r["bytes_per_token"] < 6 for r in train) and "boundary_rate" not in train[0]
    assert all(1.0 < r["val_bytes_per_token"] < 6 for r in val) and "boundary_rule" not in val[0]
    # cumulative bytes and FLOPs grow every step; FLOPs per byte = the model's per-token FLOPs x tokens per byte
    assert all(b["bytes_seen"] > a["bytes_seen"] and b["flops"] > a["flops"] for a, b in zip(train, train[1:]))
    from megatok import flops
    from megatok.run.reader import run_config

    cfg = run_config(runs["bpe"])
    per_token = flops.flops_per_byte(cfg, rate=1.0)["training"]
    tokens = 6 * 4 * 24  # steps x global batch x seq_len: every position is a token the model processed
    assert train[-1]["flops"] == pytest.approx(per_token * tokens, rel=1e-9)


def test_evaluate_and_summarize_a_token_model(runs, capsys):
    ev = run_tool("evaluate", "--run", runs["bpe"], "--data", runs["heldout"])
    assert ev.returncode == 0, ev.stderr[-2000:]
    (runs["bpe"] / "eval.json").write_text(ev.stdout)
    assert json.loads(ev.stdout)["boundary_rule"] is None  # tokens, not sampled boundaries
    r = run_main(capsys, "summarize", "--run", runs["bpe"])
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((runs["bpe"] / "summary.json").read_text())
    assert summary["strategy"] == "bpe token model" and summary["target_rate"] is None
    assert summary["evaluate"]["bpb"] == json.loads(ev.stdout)["bpb"] and "bytes per token" in r.stdout
    assert "boundary rate" not in r.stdout
    r = run_main(capsys, "show_boundaries", "--run", runs["bpe"], "--text", "hi")  # no chunks to show: one line
    assert r.returncode == 2 and "a BPE token model, whose units are its tokenizer's tokens" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_run_with_relative_paths_is_read_from_anywhere_and_exports_whole(runs, tmp_path, capsys, monkeypatch):
    """A run started from directory L as `--set model.tokenizer=tok train.run_dir=runs/bpe` records those
    relative paths. The tools read it from another directory (here the repository root), and its export
    carries the tokenizer, so it loads after L is gone."""
    from megatok.data.encoding import encoding_for
    from megatok.run.export import load_exported
    from megatok.run.reader import launch_dir

    launch = tmp_path / "L"
    shutil.copytree(runs["tok"], launch / "tok")
    shutil.copytree(runs["bpe"], launch / "runs" / "bpe")
    config = launch / "runs" / "bpe" / "config.json"
    raw = json.loads(config.read_text())
    raw["model"]["tokenizer"], raw["train"]["run_dir"] = "tok", "runs/bpe"
    config.write_text(json.dumps(raw))
    assert launch_dir(launch / "runs" / "bpe", "runs/bpe") == launch
    assert launch_dir(launch / "runs" / "bpe", "elsewhere/bpe") is None
    (tmp_path / "linked").symlink_to(launch / "runs")  # a runs/ that is a symlink, as on many clusters
    assert launch_dir(tmp_path / "linked" / "bpe", "linked/bpe") == tmp_path

    moved = launch / "runs" / "bpe"
    monkeypatch.chdir(ROOT)  # the commands below run in this process, from the repository root
    ev = run_main(capsys, "evaluate", "--run", moved, "--data", runs["heldout"], "--max-bytes", 2000)
    assert ev.returncode == 0, ev.stderr[-2000:]
    same = run_main(capsys, "evaluate", "--run", runs["bpe"], "--data", runs["heldout"], "--max-bytes", 2000)
    assert json.loads(ev.stdout)["bpb"] == json.loads(same.stdout)["bpb"]

    # a file of the same relative name where the tool runs is not the run's tokenizer: the start directory's wins
    here = tmp_path / "here"
    (here / "tok").mkdir(parents=True)
    (here / "tok" / "tokenizer.model").write_bytes(b"another tokenizer")
    again = run_tool("evaluate", "--run", moved, "--data", runs["heldout"], "--max-bytes", 2000, cwd=here)  # a process there
    assert again.returncode == 0 and json.loads(again.stdout)["bpb"] == json.loads(same.stdout)["bpb"], again.stderr

    out = tmp_path / "export"
    r = run_main(capsys, "export", "--run", moved, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "tokenizer.model").read_bytes() == (runs["tok"] / "tokenizer.model").read_bytes()

    # the tokenizer replaced at its path (train_bpe.py run again): every reader refuses, naming it
    from megatok.run.reader import run_config
    from megatok.run.same_model import check_same_model
    from megatok.run import checkpoints

    original = (launch / "tok" / "tokenizer.model").read_bytes()
    r = run_main(capsys, "train_bpe", "--data", runs["heldout"], "--vocab-size", 400, "--out", tmp_path / "other")
    assert r.returncode == 0, r.stderr[-2000:]
    (launch / "tok" / "tokenizer.model").write_bytes((tmp_path / "other" / "tokenizer.model").read_bytes())
    tag = checkpoints.latest_tag(moved)
    want = f"{moved / 'checkpoints' / tag} was trained with another model.tokenizer than {launch / 'tok'}"
    for r in (run_tool("evaluate", "--run", moved, "--data", runs["heldout"]),  # a process, and in this one
              run_main(capsys, "export", "--run", moved, "--out", tmp_path / "x")):
        (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert r.returncode != 0 and want in line and "replaced since?" in line, r.stderr[-2000:]
    with pytest.raises(checkpoints.CheckpointError, match="was trained with another model.tokenizer"):
        check_same_model(moved, tag, run_config(moved))  # what a --resume checks before it starts
    (launch / "tok" / "tokenizer.model").write_bytes(original)
    shutil.rmtree(launch)
    model, cfg = load_exported(out)
    assert cfg.model.tokenizer == str((out / "tokenizer.model").resolve())
    assert encoding_for(cfg).byte_lengths is not None and model.training is False


def test_token_stream_resumes_exactly(runs):
    """Resume the BPE run from its step-3 checkpoint: steps 4-6 repeat bit for bit (data, losses, counters)."""
    copy = runs["tmp"] / "bpe-resumed"
    shutil.copytree(runs["bpe"], copy)
    pretrain(["--config", "configs/tiny.json", "--set", *runs["common"], *BPE_SET, f"model.tokenizer={runs['tok']}",
              f"train.run_dir={copy}", "--resume", "step00000003"], nproc=2)
    keys = ("step", "loss", "grad_norm", "bytes_per_token", "bytes_seen", "flops")
    again = [{k: r[k] for k in keys} for r in read_metrics(copy) if r["split"] == "train"]
    first = [{k: r[k] for k in keys} for r in read_metrics(runs["bpe"]) if r["split"] == "train"]
    assert again == first


def test_head_to_head_rows_match_the_evaluators(runs, capsys):
    rows = [r for r in read_metrics(runs["unet"]) if r["split"] == "h2h"]
    assert [r["step"] for r in rows] == [2, 4]
    last = rows[-1]
    docs = list(iter_documents([str(runs["heldout"])]))
    assert last["h2h_bytes"] == sum(len(d.text) for d in docs) and last["h2h_documents"] == 6
    assert set(last["by_lang"]) == set(PARALLEL) and set(last["by_domain"]) == {"legal"}
    assert 0 < last["h2h_cost_fraction"] < 1
    # each evaluation scores the baseline checkpoint nearest to it in training bytes (the two differ here)
    from megatok.run import checkpoints

    seen = {r["step"]: r["bytes_seen"] for r in read_metrics(runs["unet"]) if r["split"] == "train"}
    assert sorted(seen) == [2, 3, 4]  # log_every 3, and the evaluation steps 2 and 4
    base_bytes = {t: checkpoints.read_meta(runs["bpe"], t)["metrics"]["bytes_seen"]
                  for t in ("step00000003", "step00000006")}
    for r in rows:
        assert r["h2h_bytes_seen"] == seen[r["step"]]
        nearest = min(base_bytes, key=lambda t: abs(base_bytes[t] - seen[r["step"]]))
        assert r["h2h_baseline_checkpoint"] == nearest and r["h2h_baseline_bytes_seen"] == base_bytes[nearest]
    assert [r["h2h_baseline_checkpoint"] for r in rows] == ["step00000003", "step00000006"], (seen, base_bytes)
    # the BPE tokenizer's bytes per token on the same documents
    sp = bpe.load_tokenizer(runs["tok"])
    for lang, texts in PARALLEL.items():
        n = sum(len(t.encode()) for t in texts) / sum(len(bpe.encode_bytes(sp, t.encode())) for t in texts)
        assert last["by_lang"][lang]["h2h_bpe_bytes_per_token"] == pytest.approx(n)
    assert last["by_domain"]["legal"]["h2h_bpe_bytes_per_token"] > 1  # per domain too
    # the baseline's and megatok's figures are megatok-evaluate's on the same file and checkpoints
    base = json.loads(run_main(capsys, "evaluate", "--run", runs["bpe"], "--data", runs["heldout"]).stdout)
    mine = json.loads(run_main(capsys, "evaluate", "--run", runs["unet"], "--data", runs["heldout"], "--seed", "1234",
                               "--batch-size", "2").stdout)
    assert base["kind"] == "bpe" and base["strategy"] is None
    for lang in PARALLEL:
        got = last["by_lang"][lang]
        assert got["h2h_baseline_bpb"] == pytest.approx(base["by_lang"][lang]["bpb"], rel=1e-5)
        assert got["h2h_baseline_bytes_per_token"] == pytest.approx(base["by_lang"][lang]["bytes_per_token"])
        assert got["h2h_bpb"] == pytest.approx(mine["by_lang"][lang]["bpb"], rel=1e-5)
        assert got["h2h_documents"] == 2 and got["h2h_bytes"] == sum(len(t.encode()) for t in PARALLEL[lang])
        assert got["h2h_bpb_gap"] == pytest.approx(got["h2h_baseline_bpb"] - got["h2h_bpb"])
    assert last["h2h_bpb"] == pytest.approx(mine["bpb"], rel=1e-5)


def test_compare_reads_and_evaluates_both_kinds(runs, capsys):
    out = runs["tmp"] / "cmp"
    r = run_main(capsys, "compare", runs["unet"], runs["bpe"], "--out", out, "--heldout", runs["heldout"],
                 "--tokenizer", runs["tok"] / "tokenizer.model")
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "compare.json").read_text())
    unet, tok_run = result["runs"]
    assert tok_run["kind"] == "bpe" and tok_run["unit"] == "token" and tok_run["flops_source"] == "logged"
    systems = {s["name"]: s for s in result["heldout"]["systems"]}
    assert set(systems) == {"unet", "bpe", "BPE"}
    assert systems["bpe"]["unit"] == "token"
    # the trained token model's bytes per token are its tokenizer's
    for lang in PARALLEL:
        assert systems["bpe"]["by_lang"][lang]["bytes_per_unit"] == pytest.approx(
            systems["BPE"]["by_lang"][lang]["bytes_per_unit"])
    md = (out / "compare.md").read_text()
    assert "| bpe | bpe | 6 |" in md and "bpe bpb" in md and (out / "val_bpb_vs_flops.png").is_file()
    assert (out / "per_language.png").read_bytes().startswith(b"\x89PNG") and "per_language.png" in result["plots"]
    # where the two configurations differ: the model kind among them, the run directory left out
    diff = result["config_differences"]
    assert diff["model.kind"] == {"unet": "unet", "bpe": "bpe"} and "train.run_dir" not in diff
    assert "## Where the configurations differ" in md and '| `model.kind` | `"unet"` | `"bpe"` |' in md


def test_bad_head_to_head_inputs_fail_before_training(runs, tmp_path):
    r = pretrain(["--config", "configs/tiny.json", "--set", *runs["common"], f"train.run_dir={tmp_path / 'r'}",
                  f"eval.baseline_run={tmp_path / 'nope'}"], check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: eval.baseline_run: {tmp_path / 'nope'} is not a run directory (no config.json)"]
    r = pretrain(["--config", "configs/tiny.json", "--set", *runs["common"], *BPE_SET,
                  f"model.tokenizer={tmp_path / 'missing'}", f"train.run_dir={tmp_path / 'r'}"], check=False)
    assert r.returncode == 2 and "error: model.tokenizer:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()


def test_a_heldout_file_sorted_by_language_keeps_every_language(tmp_path):
    """eval.heldout_max_bytes smaller than the file: every (lang, domain) group takes its turn, so a
    file sorted by language is not cut down to its first languages; file order is kept."""
    from megatok.config import load_config
    from megatok.eval.head_to_head import heldout_documents

    heldout = tmp_path / "sorted.jsonl"
    with heldout.open("w") as f:
        for lang, n in [("en", 40), ("ru", 3), ("zh", 40)]:
            for i in range(n):
                f.write(json.dumps({"text": f"{lang} {i:02d} " + "x" * 94, "lang": lang, "domain": "d"}) + "\n")
    cfg = load_config(ROOT / "configs/tiny.json", overrides=[f"eval.heldout={heldout}", "eval.heldout_max_bytes=1500"])
    docs = heldout_documents(cfg)
    langs = [d.lang for d in docs]
    # 100 bytes each: 15 documents, ru's 3, then en and zh in turn
    assert langs.count("ru") == 3 and langs.count("en") == 6 and langs.count("zh") == 6
    assert [d.text[:5] for d in docs if d.lang == "en"] == [f"en {i:02d}".encode() for i in range(6)]
    assert [int(d.source.rsplit(":", 1)[1]) for d in docs] == sorted(int(d.source.rsplit(":", 1)[1]) for d in docs)
    # one group: the file's first documents, as before
    one = tmp_path / "en.jsonl"
    one.write_text("".join(line for line in heldout.read_text().splitlines(True) if '"lang": "en"' in line))
    cfg = load_config(ROOT / "configs/tiny.json", overrides=[f"eval.heldout={one}", "eval.heldout_max_bytes=250"])
    assert [d.text[:5] for d in heldout_documents(cfg)] == [b"en 00", b"en 01", b"en 02"]


def test_a_shard_sets_val_split_is_read_as_a_prefix(tmp_path):
    """Named as data.val_shards or eval.heldout, a shard set's val split (shuffled when it was built)
    is read only up to the budget, in order: not read whole to be balanced like a document file."""
    from megatok.config import load_config
    from megatok.data.shards import build_shards
    from megatok.data.stream import iter_shard_documents, resolve_shards
    from megatok.eval.head_to_head import balanced, heldout_documents

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{lang} {i} " + "y" * 50, "lang": lang}) + "\n"
                              for lang in ("en", "ru") for i in range(30)))
    shards = tmp_path / "shards"
    build_shards([str(corpus)], str(shards), val_fraction=0.5, num_shards=2, progress=False)
    val = list(iter_shard_documents(resolve_shards(str(shards), "val")))

    def first(k):
        return val[:k], sum(len(d.text) for d in val[:k])

    # a budget where the two rules differ
    prefix, budget = next(first(k) for k in range(1, len(val)) if balanced(val, first(k)[1]) != first(k)[0])
    for key in ("data.val_shards", "eval.heldout"):
        cfg = load_config(ROOT / "configs/tiny.json", overrides=[f"data.shards={shards}", f"{key}={shards}",
                                                                 f"eval.heldout_max_bytes={budget}"])
        assert [d.source for d in heldout_documents(cfg)] == [d.source for d in prefix], key


def test_the_baseline_checkpoint_is_the_nearest_in_training_bytes(tmp_path):
    """eval.baseline_checkpoint "matched": the checkpoint whose bytes_seen is nearest (the later on a
    tie), passing over checkpoints without the figure or with an unreadable meta; "latest" (None)."""
    from megatok.eval.head_to_head import baseline_checkpoint
    from megatok.run import checkpoints
    from megatok.train.checkpointer import set_latest

    ck = tmp_path / checkpoints.CHECKPOINTS
    fmt = {"format": checkpoints.FORMAT}
    for step, meta in {2: {**fmt, "metrics": {"bytes_seen": 100.0}}, 4: {**fmt, "metrics": {"bytes_seen": 300.0}},
                       6: fmt, 8: {"bytes_seen": 700.0},  # as written before megatok.json had parts
                       10: None}.items():
        (ck / checkpoints.tag_for(step)).mkdir(parents=True)
        (ck / checkpoints.tag_for(step) / checkpoints.META).write_text("{" if meta is None else json.dumps(meta))
    set_latest(tmp_path, checkpoints.tag_for(10))
    tag = checkpoints.tag_for
    assert baseline_checkpoint(str(tmp_path), 0.0) == (tag(2), 100.0)
    assert baseline_checkpoint(str(tmp_path), 190.0) == (tag(2), 100.0)
    assert baseline_checkpoint(str(tmp_path), 200.0) == (tag(4), 300.0)  # a tie: the later
    assert baseline_checkpoint(str(tmp_path), 1e9) == (tag(8), 700.0)
    assert baseline_checkpoint(str(tmp_path), None) == (tag(10), None)  # latest, whatever it records
    assert baseline_checkpoint(str(tmp_path / "none"), 5.0) == (None, None)


def bare_head_to_head(tmp_path, *sets):
    """(A HeadToHead with only what ``_baseline`` reads, configs/tiny.json + ``sets``, and its baseline
    run): a run directory whose one published checkpoint, step00000002, records 10 training bytes."""
    from megatok.config import load_config
    from megatok.eval.head_to_head import HeadToHead
    from megatok.run import checkpoints
    from megatok.train.checkpointer import set_latest

    run = tmp_path / "base"
    (run / checkpoints.CHECKPOINTS / "step00000002").mkdir(parents=True)
    load_config(ROOT / "configs/tiny.json", [f"train.run_dir={run}"], world_size=1).dump(run / "config.json")
    (run / checkpoints.CHECKPOINTS / "step00000002" / checkpoints.META).write_text(
        json.dumps({"format": checkpoints.FORMAT, "metrics": {"bytes_seen": 10.0}}))
    set_latest(run, "step00000002")
    h2h = object.__new__(HeadToHead)
    h2h.cfg = load_config(ROOT / "configs/tiny.json", [f"eval.baseline_run={run}", *sets], world_size=1)
    h2h.docs, h2h.baseline = [], None
    return h2h, run


def test_a_baseline_checkpoint_that_cannot_be_read_does_not_stop_the_run(tmp_path, capsys, monkeypatch):
    """A baseline still training may rotate the chosen checkpoint out between listing and loading (or
    leave it damaged): the row keeps the last baseline result, or has none, with a warning."""
    import torch

    h2h, run = bare_head_to_head(tmp_path)
    assert h2h._baseline(torch.device("cpu"), 5.0) is None
    assert "step00000002 cannot be read" in capsys.readouterr().out
    h2h.baseline = ("step00000001", {"bpb": 1.5}, 4.0)
    assert h2h._baseline(torch.device("cpu"), 5.0) == {"bpb": 1.5} and h2h.baseline[0] == "step00000001"
    assert "this row keeps step00000001" in capsys.readouterr().out

    def partitions_gone(*args, **kwargs):  # what DeepSpeed raises when files vanish as it lists them
        raise ValueError("Expected 2 of '*_optim_states.pt' files under ..., but found 1 files.")

    monkeypatch.setattr("megatok.eval.head_to_head.load_model", partitions_gone)
    assert h2h._baseline(torch.device("cpu"), 5.0) == {"bpb": 1.5}
    assert "found 1 files.); this row keeps step00000001" in capsys.readouterr().out


@pytest.mark.parametrize("bf16", [False, True])
def test_the_baseline_is_scored_in_the_runs_precision(tmp_path, monkeypatch, bf16):
    """The run is scored through its engine (bf16 weights under bf16): the baseline too, not in fp32
    beside it (a 7B baseline in fp32 is 28 GB more on rank 0)."""
    import torch

    from megatok.config import load_config
    from megatok.eval import head_to_head
    from megatok.model import build_model

    h2h, run = bare_head_to_head(tmp_path, f"deepspeed.bf16.enabled={str(bf16).lower()}")
    bcfg = load_config(ROOT / "configs/tiny.json", [f"train.run_dir={run}", *TINY], world_size=1)
    monkeypatch.setattr("megatok.eval.head_to_head.load_model",
                        lambda r, tag, device, dtype=None: (build_model(bcfg).to(dtype or torch.float32), bcfg, tag))
    scored = []
    monkeypatch.setattr(head_to_head, "evaluate_documents",
                        lambda model, docs, **kw: scored.append({p.dtype for p in model.parameters()}) or {"bpb": 1.0})
    assert h2h._baseline(torch.device("cpu"), 5.0) == {"bpb": 1.0}
    assert scored == [{torch.bfloat16 if bf16 else torch.float32}]
