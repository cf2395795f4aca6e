"""The benchmark command (python -m megatok.cli.bench) runs end to end on the CPU and writes every figure,
each a median with its spread and, where the bench sets one, its target; bad input is one clear line.
(Its figures are measurements, not asserted here: a benchmark is a tool.)"""

import json
import math

import pytest

from tests.conftest import run_tool


def bench(*args, timeout=600):
    return run_tool("bench", *args, timeout=timeout)


def test_the_bench_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    r = bench("--quick", "--shapes", "tiny", "--reps", 1, "--steps", 1, "--hot-path", "--json-out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    figures = report["figures"]
    want = {"policy_share/tiny", "policy_w3_share/tiny", "megatok_vs_every_byte/tiny", "mfu/tiny", "data_vs_step",
            "eval_vs_train", "generate_vs_train", "generate_w3_vs_train", "h2h_share", "docmask_cost/tiny",
            "docmask_dense_cost/tiny", "sync_share/tiny"}
    assert want <= set(figures)
    for key, f in figures.items():
        assert f["n"] == 1 and f["min"] <= f["median"] <= f["max"] and math.isfinite(f["median"]), key
    assert figures["policy_share/tiny"]["target"] == "<= 0.02" and isinstance(figures["policy_share/tiny"]["met"], bool)
    assert report["measured"]["tiny"]["every-byte"]["realised_rate"] == 1.0  # a chunk at every byte indeed
    assert report["environment"]["clock"] == "process CPU time"
    check = report["checks"]["flex_attention"]
    assert check["flex_usable"] is False and check["loss_abs_diff"] == 0.0  # the CPU: the dense mask both times
    assert "megatok_vs_every_byte/tiny" in r.stdout and "eval_vs_train" in r.stdout  # the table


def test_sigterm_before_the_first_round_still_leaves_the_json(tmp_path):
    """A bench ended by SIGTERM (`timeout`, a job's time limit) while it builds its variants, before any
    round: --json-out already holds the environment and settings, and says how far it got; exit 143."""
    import sys

    from tests.conftest import sigterm_when

    out = tmp_path / "bench.json"
    rc, output, _ = sigterm_when([sys.executable, "-m", "megatok.cli.bench", "--quick", "--shapes", "tiny",
                                  "--json-out", out], out.exists)
    assert rc == 143, output[-3000:]
    report = json.loads(out.read_text())
    assert report["stopped"].startswith("SIGTERM while ") and report["environment"]["device"] == "cpu"
    assert report["settings"]["shapes"] == ["tiny"] and "rounds" not in report["measured"]


def test_a_bad_profile_name_is_one_clear_line():
    r = bench("--profile", "tiny/nonsense", timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "[WARNING]" not in ln]
    assert len(lines) == 1 and "--profile tiny/nonsense" in lines[0]


def test_the_profile_gives_the_step_by_part_and_a_trace(tmp_path):
    """--profile: every part that runs in a policy step takes time, the parts and host time make the step, and
    the JSON and the Chrome trace are written."""
    out = tmp_path / "profile.json"
    r = bench("--profile", "tiny/policy", "--steps", 2, "--json-out", out, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    parts = result["parts"]
    assert list(parts) == ["byte layers", "main network", "attention", "policy", "heads and losses", "optimizer",
                           "communication", "host and idle"]
    for part in ("byte layers", "main network", "attention", "policy", "heads and losses", "optimizer"):
        assert parts[part]["ms_per_step"] > 0, part
    assert parts["communication"]["ms_per_step"] == 0  # one process
    assert sum(p["share"] for p in parts.values()) == pytest.approx(1.0, abs=0.02)
    assert json.loads(out.with_suffix(".trace.json").read_text())["traceEvents"]
    assert "main network" in r.stdout and result["steps"] == 2


def test_the_inference_section_writes_its_figures(tmp_path):
    out = tmp_path / "inference.json"
    r = bench("--inference", "--quick", "--shapes", "tiny", "--reps", 1, "--vocab", 512, "--json-out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    figures, measured = report["figures"], report["measured"]
    want = {"gen_b8_vs_b1/byte/tiny", "gen_b8_vs_b1/bpe/tiny", "gen_byte_vs_bpe_b8/tiny"} | {
        f"gen_{what}/tiny/{kind}/b{b}" for what in ("mfu", "overhead_ms") for kind in ("byte", "bpe") for b in (1, 8)}
    assert want == set(figures)
    for key, f in figures.items():
        assert f["n"] == 1 and math.isfinite(f["median"]), key
    assert figures["gen_byte_vs_bpe_b8/tiny"]["target"] == ">= 0.8"
    assert measured["tiny/bpe/b8"]["bytes_per_id"] == measured["bpe"]["bytes_per_token"] > 1
    assert 0.05 < measured["tiny/byte/b1"]["chunks_per_byte"] < 0.5  # sampled at the target rate, 0.2
    assert "gen_byte_vs_bpe_b8/tiny" in r.stdout
    assert report["settings"]["generation_step"] == "cached"


def test_settings_defaults_are_the_commands_and_bad_counts_are_refused(monkeypatch):
    """megatok-bench hands megatok.perf.bench a Settings (the defaults of every option not given; --quick
    cuts rounds, steps and bytes); a count below 1 is the command's one-line usage error."""
    import pytest

    from megatok.cli import bench as command
    from megatok.perf import bench as study

    got = []
    monkeypatch.setattr(study, "run", lambda s: got.append(s) or 0)
    assert command.main(["--device", "cpu"]) == 0 and command.main(["--device", "cpu", "--quick"]) == 0
    assert got[0] == study.Settings()
    assert (got[1].reps, got[1].steps, got[1].gen_bytes) == (3, 2, 32)
    with pytest.raises(SystemExit) as e:
        command.main(["--reps", "0"])
    assert e.value.code == 2
    assert command.main(["--device", "cpu", "--generation-step", "compile"]) == 0
    assert got[2].generation_step == "compile"
    assert study.GENERATION_STEPS[got[2].generation_step] == {"compile": True}
    with pytest.raises(ValueError, match="--generation-step must be one of cached, static, compile, got 'jit'"):
        study.Settings(generation_step="jit")
    with pytest.raises(ValueError, match="--reps and --steps must be >= 1"):
        study.Settings(steps=0)
