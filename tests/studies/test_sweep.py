"""megatok-sweep: configs at equal training bytes that all validate, sbatch lines, a real local run
of a tiny sweep, and the collected table and plot."""

import json
import os
import math

import pytest

from megatok.cli import sweep
from megatok.studies import sweep as study
from megatok.config import load_config
from tests.conftest import TINY


def test_generated_configs_validate_at_equal_bytes(tmp_path, capsys):
    out = tmp_path / "s"
    assert sweep.main(["--sizes", "100m,350m,1b", "--strategies", "policy,fixed", "--bytes", "2e9", "--out", str(out),
                       "--emit", "sbatch", "--set", "data.shards=/shared/megatok/shards"]) == 0
    printed = capsys.readouterr().out
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert [r["name"] for r in runs] == ["100m-policy", "100m-fixed", "350m-policy", "350m-fixed", "1b-policy",
                                         "1b-fixed"]
    for r in runs:
        cfg = load_config(r["config"], world_size=8)  # a complete config: validates on its own
        per_step = cfg.train.global_batch_size * cfg.data.seq_len
        assert cfg.train.max_steps == math.ceil(2e9 / per_step)
        assert 2e9 <= r["training_bytes"] < 2e9 + per_step
        assert cfg.boundary.strategy == r["strategy"] and cfg.data.shards == "/shared/megatok/shards"
        assert cfg.train.run_dir == str(out.resolve() / "runs" / r["name"])
        size = r["name"].split("-")[0]
        assert cfg.logging.wandb_group == "sweep-s" and cfg.logging.wandb_tags == [size, r["strategy"]]
        assert cfg.train.warmup_steps <= cfg.train.max_steps // 10
        if r["strategy"] == "fixed":
            assert cfg.boundary.options.model_dump() == {}
        else:
            assert cfg.boundary.options.gamma == 0.99
        assert f"launch/slurm/pretrain.sbatch --config {r['config']}" in printed
    assert (out / "submit.sh").read_text().count("sbatch --nodes=1 --gpus-per-node=8 ") == 6


def test_the_sbatch_lines_ask_for_the_ranks_the_configs_were_validated_for(tmp_path, capsys):
    assert sweep.main(["--sizes", "1b", "--strategies", "policy", "--out", str(tmp_path / "s"), "--nodes", "4",
                       "--gpus", "4", "--emit", "sbatch"]) == 0
    printed = capsys.readouterr().out
    assert "validated for 16 rank(s)" in printed and "sbatch --nodes=4 --gpus-per-node=4 " in printed


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "argument --nodes: must be > 0, got 0"),
    (["--gpus", "-8"], "argument --gpus: must be > 0, got -8"),
    (["--bytes", "-5"], "argument --bytes: must be > 0, got -5"),
    (["--set", "train.max_steps=5"], "--set train.max_steps: the sweep sets it"),
    (["--option", "hnet.ratio_loss_weight=0.1"], "--option hnet.ratio_loss_weight: hnet is not in --strategies"),
    (["--sizes", "configs/nope.json"], "--sizes configs/nope.json: no such file"),
    (["--nodes", "2"], "is not a multiple of train.micro_batch_size (16) x world size (16); for this many ranks lower"),
    (["--sizes", "350m,100m", "--nodes", "2"], "100m.json: train.global_batch_size=128"),  # 350m fits: not written
    (["--bytes", "inf"], "argument --bytes: must be > 0, got inf"),
])
def test_bad_sweep_arguments_are_one_line(args, message, tmp_path, capsys):
    try:
        code = sweep.main(["--sizes", "100m", "--strategies", "policy", "--out", str(tmp_path / "s"), *args])
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "s").exists()  # nothing written, not even an empty directory
    if args[0] != "--sizes":
        assert sweep.main(["--out", str(tmp_path / "nothing"), "--collect"]) == 2
        assert "nothing/sweep.json: no such file" in capsys.readouterr().err


def test_unknown_strategy_is_refused_with_the_available_ones(tmp_path, capsys):
    assert sweep.main(["--sizes", "1b", "--strategies", "policy,nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "policy" in err and "fixed" in err


def test_collect_table_and_plot_from_metrics(tmp_path, capsys):
    out = tmp_path / "s"
    sweep.main(["--sizes", "100m,350m", "--strategies", "policy,fixed", "--bytes", "1e8", "--out", str(out)])
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    for i, r in enumerate(runs[:3]):
        rd = (out / "runs" / r["name"])
        rd.mkdir(parents=True)
        end = r["max_steps"] if i < 2 else r["max_steps"] // 2
        rows = [{"step": s, "split": "train", "boundary_rate": 0.25} for s in (1, end)]
        rows += [{"step": s, "split": "val", "val_bpb": 2.0 - 0.1 * i - s / 1e4, "val_bytes_per_chunk": 4.0,
                  "boundary_rule": "sample(seed=1234)"} for s in (end // 2, end)]
        (rd / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert sweep.main(["--out", str(out), "--collect"]) == 0
    table = (out / "results.md").read_text().splitlines()
    assert len(table) == 2 + 4
    assert "finished" in table[2] and "finished" in table[3] and "running" in table[4] and "not started" in table[5]
    assert "0.250" in table[2] and "sample(seed=1234)" in table[2]
    assert (out / "loss_vs_flops.png").stat().st_size > 10_000


@pytest.mark.dist
def test_run_local_then_collect_a_tiny_sweep(shards, tmp_path, capsys, monkeypatch):
    out = tmp_path / "s"
    monkeypatch.chdir(tmp_path)  # relative paths are read from where the sweep runs, when checked and when run
    sets = TINY + [f"data.shards={os.path.relpath(shards, tmp_path)}", "data.num_workers=1",
                   "train.micro_batch_size=4", "train.global_batch_size=4"]
    # 2 steps of 4 sequences x 64 bytes
    assert sweep.main(["--sizes", "tiny", "--strategies", "fixed", "--bytes", str(2 * 4 * 64), "--out", str(out),
                       "--run-local", "--nproc", "1", "--set", *sets]) == 0
    assert sweep.main(["--out", str(out), "--collect"]) == 0
    row = (out / "results.md").read_text().splitlines()[2]
    assert row.startswith("| tiny-fixed |") and "finished" in row
    assert "tiny-fixed" in (out / "compare" / "compare.md").read_text()
    # Run again: finished runs are skipped.
    assert sweep.main(["--sizes", "tiny", "--strategies", "fixed", "--bytes", str(2 * 4 * 64), "--out", str(out),
                       "--run-local", "--nproc", "1", "--set", *sets]) == 0
    assert "finished already, skipped" in capsys.readouterr().out


def test_bpe_lm_runs_are_matched_token_models_at_equal_bytes(tmp_path, capsys):
    out = tmp_path / "s"
    assert sweep.main(["--sizes", "100m,1b", "--strategies", "policy,bpe-lm", "--bytes", "2e9", "--out", str(out),
                       "--bpe-vocab-size", "32000", "--bpe-bytes-per-token", "4.2",
                       "--bpe-tokenizer", "data/bpe32k/tokenizer.model"]) == 0
    runs = {r["name"]: r for r in json.loads((out / "sweep.json").read_text())["runs"]}
    assert list(runs) == ["100m-policy", "100m-bpe-lm", "1b-policy", "1b-bpe-lm"]
    for size in ("100m", "1b"):
        r, unet = runs[f"{size}-bpe-lm"], runs[f"{size}-policy"]
        cfg = load_config(r["config"], world_size=8)
        assert r["kind"] == cfg.model.kind == "bpe" and cfg.model.tokenizer == "data/bpe32k/tokenizer.model"
        assert cfg.data.seq_len == round(4096 / 4.2)
        per_step = cfg.train.global_batch_size * cfg.data.seq_len * 4.2  # bytes per step
        assert cfg.train.max_steps == math.ceil(2e9 / per_step)
        assert 2e9 <= r["training_bytes"] < 2e9 + per_step
        assert abs(r["flops_per_byte"] / unet["flops_per_byte"] - 1) <= 0.10
        assert cfg.train.run_dir == str(out.resolve() / "runs" / r["name"])
    # The realised tokens per byte of a bpe run comes from its rows' bytes_per_token.
    r = runs["1b-bpe-lm"]
    rd = out / "runs" / r["name"]
    rd.mkdir(parents=True)
    rows = [{"step": s, "split": "train", "bytes_per_token": 4.0} for s in (1, r["max_steps"])]
    rows += [{"step": r["max_steps"], "split": "val", "val_bpb": 1.0}]
    (rd / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    rows = {row["name"]: row for row in study.collect(out)}
    assert rows["1b-bpe-lm"]["realised_rate"] == pytest.approx(0.25) and rows["1b-bpe-lm"]["status"] == "finished"
    # training FLOPs are the run's own logged figure (its bytes seen at 4.0 bytes per token, not the 4.2 planned)
    rows = [{"step": s, "split": "train", "bytes_per_token": 4.0, "flops": 3e18 * s} for s in (1, r["max_steps"])]
    rows += [{"step": r["max_steps"], "split": "val", "val_bpb": 1.0}]
    (rd / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    row = {row["name"]: row for row in study.collect(out)}["1b-bpe-lm"]
    assert row["flops_done"] == 3e18 * r["max_steps"] and row["curve"] == [(3e18 * r["max_steps"], 1.0)]


def test_bpe_lm_needs_a_tokenizer_or_its_figures(tmp_path, capsys):
    assert sweep.main(["--sizes", "1b", "--strategies", "bpe-lm", "--out", str(tmp_path)]) == 2
    assert "--bpe-tokenizer" in capsys.readouterr().err



def test_the_library_takes_typed_settings_whose_defaults_are_the_commands(tmp_path, capsys, monkeypatch):
    """megatok.studies.sweep is callable without a command line, and megatok-sweep hands it a Settings
    equal to the defaults for every option it is not given."""
    settings = study.Settings(out=str(tmp_path / "s"), sizes="100m", strategies="fixed", emit="sbatch")
    assert study.sweep(settings) == 0
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["bytes"] == settings.bytes == 2e9
    assert "--gpus-per-node=8 " in capsys.readouterr().out
    got = []
    monkeypatch.setattr(study, "sweep", lambda s: got.append(s) or 0)
    assert sweep.main(["--out", str(tmp_path)]) == 0
    assert got == [study.Settings(out=str(tmp_path))]
