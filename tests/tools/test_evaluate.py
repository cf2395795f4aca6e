"""End to end: a tiny real training run, then the tools users run on it.

megatok-evaluate's figure is checked against a by-hand computation with the checkpoint loaded through
megatok.run.reader.load_model. The commands run as processes where the process is what is checked (stdout
is one strict JSON object; the same result from another process; an error's exit); elsewhere their
main() runs in this process (conftest.run_main), which saves an interpreter start per call. The run itself
is checked for what the tools rely on: config.json, metrics.jsonl, checkpoints/latest, wandb offline files.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import math
import shutil
import subprocess
import warnings

import pytest
import torch

from megatok.config import load_config
from megatok.data.stream import iter_shard_documents, resolve_shards
from megatok.metrics import read_metrics
from megatok.run import checkpoints
from megatok.vocab import SEP
from tests.conftest import TINY, pretrain, run_main, stdlib_texts
from tests.conftest import run_tool as tool

STEPS = 4
TRAIN_KEYS = ("step", "loss", "lm_loss", "policy_loss", "rate_loss", "bpb", "boundary_rate", "bytes_per_chunk",
              "lr", "grad_norm", "bytes_per_s", "tflops_per_device", "mfu")
PEAK_TFLOPS = 0.002  # train.peak_tflops: a CPU has no known peak, so the run is given one
FIGURES = ("bpb", "bpb_doc_mean", "bytes_per_chunk", "boundary_rate", "whitespace_boundary_fraction")
# A short document (fewer bytes than data.seq_len = 64, so a single window) with whitespace in it.
SHORT_DOC = "def f(x):\n    return x + 1  # café\n"


def evaluate(run, *args, capsys=None) -> dict:
    """megatok-evaluate's result: a process, or with ``capsys`` its main() in this process."""
    r = run_main(capsys, "evaluate", "--run", run, *args) if capsys else tool("evaluate", "--run", run, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout, parse_constant=_not_json)  # the whole stdout is one strict JSON object


def _not_json(name):
    raise ValueError(f"{name} is not JSON (strict parsers such as jq refuse it)")


def assert_clean_error(r: subprocess.CompletedProcess, path) -> None:
    """Exit code 2, exactly one 'error:' line naming the path, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert str(path) in errors[0], errors[0]
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip() == ""


@pytest.fixture(scope="module")
def run(shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluate")
    run_dir = tmp / "run"
    wandb_dir = tmp / "wandb-home"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_CONFIG_DIR": str(wandb_dir / "config"),
           "WANDB_CACHE_DIR": str(wandb_dir / "cache"), "WANDB_DATA_DIR": str(wandb_dir / "data")}
    r = pretrain(["--config", "configs/tiny.json", "--set", *TINY, "logging.wandb_mode=offline",
                  f"train.peak_tflops={PEAK_TFLOPS}",
                  f"data.shards={shards}", f"train.run_dir={run_dir}", f"train.max_steps={STEPS}",
                  "train.micro_batch_size=2", "train.global_batch_size=2"], env=env)
    (run_dir.parent / "output.txt").write_text(r.stdout + r.stderr)  # read by the wandb test below
    return run_dir


def test_a_run_whose_wandb_cannot_start_still_ends(shards, tmp_path):
    """wandb.init failing (here RUN_DIR/wandb is a file) is a warning; the run ends with exit 0. It used
    to hang at exit: wandb kept the exception and, through its frames, the data loader, whose worker
    (which ignores SIGTERM) the interpreter then waited for."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb").write_text("not a directory")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "config"),
           "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data")}
    r = pretrain(["--config", "configs/tiny.json", "--set", *TINY, "logging.wandb_mode=offline",
                  f"data.shards={shards}", f"train.run_dir={run_dir}", "train.max_steps=2", "data.num_workers=1",
                  "train.micro_batch_size=2", "train.global_batch_size=2"], env=env, timeout=150, check=False)
    assert r.returncode == 0 and "wandb disabled" in r.stderr, r.stderr[-2000:]
    assert [row["step"] for row in read_metrics(run_dir) if row.get("split") == "train"] == [1, 2]


def test_wandb_takes_a_run_directory_named_like_a_sweep_point(tmp_path, monkeypatch):
    """wandb refuses ':' and '/' (and more) in a run id; the id is made from the directory's name."""
    from megatok.metrics import MetricsLogger

    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "config"),
                 "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data"),
                 "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(k, v)
    run_dir = tmp_path / "lr:1e-3,wd#0.1"
    run_dir.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "wandb disabled: ..." would fail here
        logger = MetricsLogger(run_dir, enabled=True, total_steps=1, wandb_mode="offline", progress=False)
    assert logger.wandb is not None and logger.wandb.id.startswith("lr-1e-3-wd-0.1-")
    assert logger.wandb.name == "lr:1e-3,wd#0.1"
    logger.log({"step": 1, "split": "train", "loss": 1.0})
    logger.close()


def test_wandb_runs_get_the_configs_group_and_tags(tmp_path, monkeypatch):
    """logging.wandb_group and wandb_tags reach the wandb run (megatok-replicate and megatok-sweep set them);
    a study's runs get them in their configs without changing what makes them one experiment (the digest)."""
    from megatok.config import load_config
    from megatok.metrics import MetricsLogger
    from megatok.studies.replicate import config_digest, write_configs
    from megatok.studies.replication import PRESETS

    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "config"),
                 "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data"),
                 "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(k, v)
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=1, wandb_mode="offline", progress=False,
                           wandb_group="replicate-control", wandb_tags=["policy", "seed3"])
    assert logger.wandb.group == "replicate-control" and set(logger.wandb.tags) == {"policy", "seed3"}
    logger.close()
    (run,) = write_configs(PRESETS["control"], tmp_path / "w", {"shards": "data/x"}, [3], ["policy"], [], 1, 0.5)
    cfg = load_config(run["config"], world_size=1)
    assert cfg.logging.wandb_group == "replicate-control" and cfg.logging.wandb_tags == ["policy", "seed3", "level0.5"]
    bare = load_config(run["config"], ["logging.wandb_group=null", "logging.wandb_tags=[]"], world_size=1)
    assert config_digest(cfg) == config_digest(bare) == run["digest"]


def test_the_progress_bar_stays_out_of_a_log_file(tmp_path, capsys):
    """Output that is not a terminal (a job's log; pytest's capture) gets a line per training row and the
    evaluation lines, not a bar redrawn into one endless line."""
    from megatok.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, enabled=True, total_steps=5, wandb_mode="disabled", progress=True)
    for step in range(1, 6):
        logger.log({"step": step, "split": "train", "loss": 1.0})
        logger.progress(step, loss=1.0)
    logger.log({"step": 5, "split": "val", "val_bpb": 3.25})
    logger.close()
    out = capsys.readouterr()
    assert out.err == "" and re.fullmatch("".join(rf"step {s}/5 \([-\d]+ [:\d]+, \d\d:\d\d elapsed, ~\d\d:\d\d "
                                                  rf"left\): loss 1\n" for s in range(1, 6)) + "step 5: val_bpb 3.25\n",
                                          out.out), out.out


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    """Six documents, two languages x two domains (unevenly mixed), one with non-ASCII text."""
    texts = [t[:700 + 300 * i] for i, t in enumerate(stdlib_texts(n_files=6))]
    texts[2] = "Ceci n'est pas une pipe. Déjà vu, naïve café — 日本語. " * 10
    langs = ["en", "en", "fr", "en", "fr", "fr"]
    domains = ["code", "prose", "prose", "code", "code", "code"]
    return [{"text": t, "lang": lang, "domain": dom} for t, lang, dom in zip(texts, langs, domains)]


@pytest.fixture(scope="module")
def data_file(docs, tmp_path_factory):
    path = tmp_path_factory.mktemp("evaldata") / "held_out.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def result(run, data_file):
    return evaluate(run, "--data", data_file)


# --------------------------------------------------------------------------- the run directory


def test_run_dir_holds_resolved_config_metrics_checkpoint_and_wandb(run, shards):
    cfg = load_config(run / "config.json")
    assert cfg.train.max_steps == STEPS and cfg.data.seq_len == 64 and cfg.data.shards == str(shards)
    assert "extends" not in json.loads((run / "config.json").read_text())  # resolved, not a reference

    rows = read_metrics(run)
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # log_every=1
    for r in train:
        missing = [k for k in TRAIN_KEYS if k not in r]
        assert not missing, (missing, r)
        assert all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) for k in TRAIN_KEYS), r
        assert 0 < r["bpb"] < 12 and 0 < r["boundary_rate"] <= 1 and r["bytes_per_chunk"] >= 1
    # model FLOP/s per device over each row's interval (the interval's seconds from bytes / bytes_per_s)
    for before, r in zip([{"flops": 0, "bytes_seen": 0}, *train], train):
        seconds = (r["bytes_seen"] - before["bytes_seen"]) / r["bytes_per_s"]
        assert r["tflops_per_device"] == pytest.approx((r["flops"] - before["flops"]) / seconds / 1e12, rel=1e-6)
        assert r["tflops_per_device"] > 0 and r["mfu"] == pytest.approx(r["tflops_per_device"] / PEAK_TFLOPS)
    val = [r for r in rows if r.get("split") == "val"]
    assert val and val[-1]["step"] == STEPS
    assert 0 < val[-1]["val_bpb"] < 12 and val[-1]["val_bytes_per_chunk"] >= 1

    assert (run / "checkpoints" / "latest").read_text().strip() == f"step{STEPS:08d}"
    assert (run / "checkpoints" / f"step{STEPS:08d}").is_dir()

    wandb_lines = [line for line in (run.parent / "output.txt").read_text().splitlines() if line.startswith("wandb:")]
    assert len(wandb_lines) <= 4 and not any("Run history" in line for line in wandb_lines), wandb_lines  # quiet
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run / "wandb").iterdir()) if (run / "wandb").exists() else "no wandb dir"
    assert list(offline[0].glob("*.wandb")), list(offline[0].iterdir())


def test_no_mfu_where_the_peak_is_unknown(tiny_run):
    """A CPU run without train.peak_tflops logs its FLOP/s but no MFU (there is no peak to divide by)."""
    train = [r for r in read_metrics(tiny_run) if r.get("split") == "train"]
    assert train and all(r["tflops_per_device"] > 0 and "mfu" not in r for r in train)


# --------------------------------------------------------------------------- evaluate.py


def test_evaluate_prints_one_json_object_with_the_figures(result, run, docs):
    assert result["boundary_rule"] == "sample(seed=0)"
    assert result["checkpoint"] == f"step{STEPS:08d}" and result["run"] == str(run)
    assert result["documents"] == len(docs)
    assert result["bytes"] == sum(len(d["text"].encode()) for d in docs)
    for k in FIGURES:
        assert isinstance(result[k], float) and math.isfinite(result[k]), (k, result[k])
    assert 0 < result["bpb"] < 12
    assert 0 < result["boundary_rate"] <= 1
    assert result["bytes_per_chunk"] == pytest.approx(1 / result["boundary_rate"])
    assert 0 <= result["whitespace_boundary_fraction"] <= 1


@pytest.mark.parametrize("kind", ["lang", "domain"])
def test_groups_add_up_to_the_corpus(result, docs, kind):
    groups = result[f"by_{kind}"]
    assert sorted(groups) == sorted({d[kind] for d in docs})
    for name, g in groups.items():
        mine = [d for d in docs if d[kind] == name]
        assert g["documents"] == len(mine)
        assert g["bytes"] == sum(len(d["text"].encode()) for d in mine)
    total = result["bytes"]
    assert sum(g["bytes"] for g in groups.values()) == total
    # Corpus bpb is total NLL over total bytes, so it is the byte-weighted mean of the groups' bpb ...
    assert result["bpb"] == pytest.approx(sum(g["bpb"] * g["bytes"] for g in groups.values()) / total, rel=1e-9)
    # ... and the per-document mean is the document-weighted mean of the groups' per-document means.
    assert result["bpb_doc_mean"] == pytest.approx(
        sum(g["bpb_doc_mean"] * g["documents"] for g in groups.values()) / result["documents"], rel=1e-9)


def test_bpb_matches_a_by_hand_computation(run, tmp_path, capsys):
    """NLL of each byte given [SEP] + the bytes before it, one prefix at a time, with threshold
    boundaries; against evaluate.py --boundary threshold on the same single document."""
    from megatok.run.reader import load_model

    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"text": SHORT_DOC}) + "\n")
    text = SHORT_DOC.encode()
    assert len(text) < 64  # one window
    # The seed must not matter for a deterministic rule.
    got = evaluate(run, "--data", path, "--boundary", "threshold", "--seed", "7", capsys=capsys)
    assert got["boundary_rule"] == "threshold" and got["documents"] == 1 and got["bytes"] == len(text)
    assert "by_lang" not in got and "by_domain" not in got  # the document carries neither

    model, cfg, tag = load_model(run)
    assert tag == f"step{STEPS:08d}" and not model.training
    model.boundary.eval_mode = "threshold"
    nll = 0.0
    with torch.no_grad():
        for t in range(len(text)):
            context = torch.tensor([[SEP, *text[:t]]])
            logp = torch.log_softmax(model(context).logits[0, -1].double(), -1)
            nll -= logp[text[t]].item()
        x = torch.tensor([[SEP, *text[:-1]]])
        starts = model(x).boundaries.starts[0]
    assert got["bpb"] == pytest.approx(nll / len(text) / math.log(2), rel=1e-6)  # fp32 model, float64 sums
    assert got["bpb_doc_mean"] == pytest.approx(got["bpb"], rel=1e-12)
    assert got["boundary_rate"] == pytest.approx(starts.sum().item() / len(text), rel=1e-12)
    ws = torch.isin(x[0], torch.tensor([ord(c) for c in " \t\n\r"]))
    assert got["whitespace_boundary_fraction"] == pytest.approx((ws & starts).sum().item() / ws.sum().item(),
                                                                rel=1e-12)


def test_same_seed_same_result_other_seed_other_sample(run, data_file, result, capsys):
    assert evaluate(run, "--data", data_file) == result  # another process: the same sample
    other = evaluate(run, "--data", data_file, "--seed", "1", capsys=capsys)
    assert other["boundary_rule"] == "sample(seed=1)"
    assert other["bytes"] == result["bytes"]
    assert other["bpb"] != result["bpb"]  # boundaries are sampled: a different seed, a different sample


def test_max_bytes_and_seq_len_change_what_is_scored(run, data_file, result, docs, capsys):
    """--max-bytes stops after the document that reaches it; --seq-len sets the windows (the same
    bytes scored, with less context each)."""
    first = len(docs[0]["text"].encode())
    short = evaluate(run, "--data", data_file, "--max-bytes", first, capsys=capsys)
    assert short["documents"] == 1 and short["bytes"] == first
    narrow = evaluate(run, "--data", data_file, "--seq-len", "16", capsys=capsys)
    assert narrow["bytes"] == result["bytes"] and narrow["bpb"] != pytest.approx(result["bpb"], rel=1e-4)


def test_threshold_output_is_strict_json_with_null_for_empty_ratios(run, data_file, tmp_path):
    """Few or no decided boundaries under p > 0.5: a ratio with nothing to count is null, not NaN;
    summarize.py shows it as n/a."""
    r = tool("evaluate", "--run", run, "--data", data_file, "--boundary", "threshold")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "NaN" not in r.stdout
    got = json.loads(r.stdout, parse_constant=_not_json)
    assert got["boundary_rule"] == "threshold"


def test_topk_rule_is_refused(run, data_file, capsys):
    """The top-rho-per-window rule was dropped (it looks at later bytes: not causal); asking for it
    is a usage error, not a silently different rule."""
    r = run_main(capsys, "evaluate", "--run", run, "--data", data_file, "--boundary", "topk")
    assert r.returncode == 2 and "invalid choice: 'topk'" in r.stderr, r.stderr[-2000:]
    assert r.stdout == "" and "Traceback" not in r.stderr


def test_input_formats(run, docs, tmp_path, capsys):
    texts = [d["text"] for d in docs[:3]]
    (tmp_path / "a.txt").write_bytes(texts[0].encode())
    with gzip.open(tmp_path / "b.txt.gz", "wb") as f:
        f.write(texts[1].encode())
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": texts[2], "lang": "fr"}) + "\n")
    # One call; the groups tell the files apart.
    got = evaluate(run, "--data", tmp_path / "a.txt", tmp_path / "b.txt.gz", tmp_path / "c.jsonl.gz",
                   "--boundary", "threshold", capsys=capsys)
    assert got["documents"] == 3 and got["bytes"] == sum(len(t.encode()) for t in texts)
    assert {k: (v["documents"], v["bytes"]) for k, v in got["by_lang"].items()} == {
        "fr": (1, len(texts[2].encode())), "unknown": (2, len(texts[0].encode()) + len(texts[1].encode()))}
    assert 0 < got["bpb"] < 12


def test_shard_directory_means_its_val_split(run, shards, capsys):
    manifest = json.loads((shards / "manifest.json").read_text())
    got = evaluate(run, "--data", shards, "--boundary", "threshold", capsys=capsys)
    assert got["documents"] == manifest["documents"]["val"]
    assert got["bytes"] == manifest["bytes"]["val"]
    assert sum(g["bytes"] for g in got["by_domain"].values()) == got["bytes"]


def test_errors_are_one_line(run, data_file, tmp_path, capsys):
    missing_run = tmp_path / "no-such-run"
    assert_clean_error(tool("evaluate", "--run", missing_run, "--data", data_file), missing_run)  # the process

    missing_data = tmp_path / "no-such-file.jsonl"
    assert_clean_error(run_main(capsys, "evaluate", "--run", run, "--data", missing_data), missing_data)

    bare = tmp_path / "bare-run"
    bare.mkdir()
    (bare / "config.json").write_text((run / "config.json").read_text())
    assert_clean_error(run_main(capsys, "evaluate", "--run", bare, "--data", data_file), bare)

    damaged = tmp_path / "damaged-run"  # a checkpoint file cut short: named, not a torch traceback
    shutil.copytree(run, damaged)
    (model_file,) = (damaged / "checkpoints" / checkpoints.latest_tag(damaged)).glob("mp_rank_00_model_states.pt")
    model_file.write_bytes(model_file.read_bytes()[:4096])
    assert_clean_error(run_main(capsys, "evaluate", "--run", damaged, "--data", data_file), model_file.name)
    assert_clean_error(run_main(capsys, "export", "--run", damaged, "--out", tmp_path / "export"), model_file.name)


def test_a_checkpoint_the_tools_cannot_find_is_explained(run, tmp_path):
    from megatok.run.reader import load_model

    aside = tmp_path / "run"
    shutil.copytree(run, aside)
    tag = checkpoints.latest_tag(aside)
    (aside / "checkpoints" / "latest").write_text("")
    with pytest.raises(FileNotFoundError, match=rf"its 'latest' file is empty; its checkpoints: {tag} \(name one\)"):
        load_model(aside)
    (aside / "checkpoints" / tag).rename(aside / "checkpoints" / f"{tag}.old-123.tmp")
    with pytest.raises(checkpoints.CheckpointError, match=f"moved aside to {tag}.old-123.tmp by a save that was "
                                                         f"killed; the next training start puts it back"):
        load_model(aside, tag)


# --------------------------------------------------------------------------- summarize.py


def test_summarize(run, shards):
    r = tool("summarize", "--run", run, "--data", shards)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "byte-unigram entropy" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    last_val = [row for row in read_metrics(run) if row.get("split") == "val"][-1]
    assert summary["final_val_bpb"] == last_val["val_bpb"]
    assert summary["steps"] == STEPS
    counts = collections.Counter()
    for d in iter_shard_documents(resolve_shards(str(shards), "train")):
        counts.update(d.text)
    n = sum(counts.values())
    entropy = -sum(c / n * math.log2(c / n) for c in counts.values())
    assert summary["byte_unigram_entropy"] == pytest.approx(entropy, rel=1e-9)
    assert f"{entropy:.4f}" in next(line for line in r.stdout.splitlines() if "byte-unigram entropy" in line)
    val = b"\n".join(d.text for d in iter_shard_documents(resolve_shards(str(shards), "val")))
    import bz2
    import gzip

    assert summary["gzip -9"] == pytest.approx(8 * len(gzip.compress(val, 9)) / len(val))  # bits, not bytes
    assert summary["bzip2 -9"] == pytest.approx(8 * len(bz2.compress(val, 9)) / len(val))


def test_summarize_bad_inputs_are_one_line(run, shards, tmp_path, capsys):
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(run / name, copy / name)
    missing = tmp_path / "nope.json"
    assert_clean_error(tool("summarize", "--run", copy, "--data", shards, "--eval", missing), missing)
    (copy / "eval.json").write_text("")  # what `evaluate.py ... > RUN/eval.json` leaves when it fails
    r = run_main(capsys, "summarize", "--run", copy, "--data", shards)
    assert_clean_error(r, copy / "eval.json")
    assert "not megatok-evaluate output" in r.stderr
    (copy / "eval.json").write_text("[1, 2]")
    assert_clean_error(run_main(capsys, "summarize", "--run", copy, "--data", shards), copy / "eval.json")
    (copy / "eval.json").unlink()
    assert_clean_error(run_main(capsys, "summarize", "--run", copy, "--data", tmp_path / "missing"),
                       tmp_path / "missing")
    assert not (copy / "summary.json").exists()
    (copy / "config.json").write_text('{"model": ')  # cut short
    assert_clean_error(run_main(capsys, "summarize", "--run", copy, "--data", shards), copy / "config.json")


def test_summarize_names_an_eval_json_of_another_checkpoint(run, shards, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    latest = (copy / "checkpoints" / "latest").read_text().strip()
    ev = run_main(capsys, "evaluate", "--run", copy, "--data", shards, "--max-bytes", 3000)
    assert ev.returncode == 0, ev.stderr[-2000:]
    # as if written for an earlier checkpoint, and the run trained on since
    (copy / "eval.json").write_text(json.dumps({**json.loads(ev.stdout), "checkpoint": "step00000001", "bpb": 3.25}))
    r = run_main(capsys, "summarize", "--run", copy, "--data", shards)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"scored checkpoint step00000001, the run's latest is {latest}" in r.stderr
    (row,) = [ln for ln in r.stdout.splitlines() if ln.startswith("| held-out bits per byte")]
    assert "3.2500" in row and f"step00000001 (not the latest, {latest})" in row
    assert json.loads((copy / "summary.json").read_text())["evaluate"]["checkpoint"] == "step00000001"


def test_metrics_with_a_last_row_cut_short_still_read(tmp_path):
    """A run killed (or out of disk) while writing a row leaves it half written: the tools read the rest,
    warn, and a damaged row elsewhere is an error naming the file and line."""
    rows = [{"step": 1, "split": "train", "loss": 2.0}, {"step": 2, "split": "train", "loss": 1.5}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 3, "split": "tr')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3: the last row was cut short"):
        assert read_metrics(tmp_path) == rows
    (tmp_path / "metrics.jsonl").write_text('\n{"step": 1, "spl\n' + text)  # line numbers count blank lines
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON row"):
        read_metrics(tmp_path)


def test_the_evaluation_bar_knows_its_total_where_the_inputs_say(shards, tmp_path):
    """A shard set's manifest gives its split's bytes, a plain file its size; a compressed file leaves the
    total unknown (the bar then counts without one)."""
    from megatok.eval.evaluate import _known_bytes

    manifest = json.loads((shards / "manifest.json").read_text())
    assert _known_bytes([str(shards)], "val") == manifest["bytes"]["val"] > 0
    doc = tmp_path / "a.jsonl"
    doc.write_text(json.dumps({"text": "déjà vu"}) + "\n")
    assert _known_bytes([str(shards), str(doc)], "val") == manifest["bytes"]["val"] + doc.stat().st_size
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(doc.read_bytes()))
    assert _known_bytes([str(tmp_path)], "val") is None
