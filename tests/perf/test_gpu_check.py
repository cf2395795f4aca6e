"""megatok-gpu-check in its CPU smoke mode: the code paths the GPU check runs (attention comparison,
DeepSpeed and plain-torch training steps, FLOPs, memory, the trainer with a resume and generation,
generation's step modes compared), on a tiny config, without a GPU; and tools/gpu_bench.sh, which runs it on a GPU within a time budget: its
plan (order and budget) and what a SIGTERM leaves."""

import json
import math
from pathlib import Path

import pytest

from tests.conftest import run_tool


def test_cpu_smoke_deepspeed_engine(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = run_tool("gpu_check", "--cpu-smoke", "--json-out", out, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "attention: flash-attn vs SDPA" in r.stdout and "training (one micro-batch per step" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["environment"]["device"] == "cpu"
    assert all(a["sdpa_ms"] > 0 and "note" in a for a in rep["attention"])  # no flash-attn on a CPU
    row, masked = rep["training"]  # the config, then the same with model.document_mask
    assert masked["config"] == "configs/tiny.json + document_mask" and masked["bytes_per_s"] > 0
    assert math.isfinite(masked["loss_last"])
    assert row["engine"] == "deepspeed" and row["precision"] == "fp32" and row["zero_stage"] == 1
    assert row["bytes_per_s"] > 0 and 0 < row["realised_rate"] < 1 and math.isfinite(row["loss_last"])
    assert row["mfu"] is None and row["estimate_gib"] > 0  # no peak known for a CPU
    # section 3: the real trainer under ZeRO-3, resumed in a new process, then generation
    t = rep["trainer"]
    assert "error" not in t, t
    assert t["built_partitioned"] and t["resume_exact"] and t["generate_bytes"] == 64  # fp32 on a CPU: exact
    assert "resumed losses: max relative difference 0.00e+00 (bit-exact)" in r.stdout
    assert math.isfinite(t["zero2_loss_last"]) and "ZeRO-2 (built on the device): 2 steps" in r.stdout
    # generation: the static step gives the cached step's texts, boundaries and log-probabilities, both model
    # kinds, batch 1 and 8 (the CUDA graph needs a GPU: not run here)
    gen = rep["generation"]
    assert [(g["model"], g["batch"]) for g in gen] == [("byte", 1), ("byte", 8), ("bpe", 1), ("bpe", 8)]
    for g in gen:
        assert "cuda_graph" not in g and g["cached"]["bytes"] > 0 and g["cached"]["bytes_per_s"] > 0
        static = g["static"]
        assert static["equal"] and static["identical_rows"] == g["batch"] and static["identical_bytes"] == 1.0, g
        assert static["bytes"] == g["cached"]["bytes"] and static["logprob_max_diff"] <= 1e-4
    assert max(gen[1]["prompt_bytes"]) > gen[1]["seq_len"] > min(gen[1]["prompt_bytes"])  # one past the window
    assert "| byte | 8 | static | " in r.stdout and "(cuda_graph: on a GPU only)" in r.stdout


def test_cpu_smoke_torch_engine(capsys):
    from megatok.cli import gpu_check as mod

    assert mod.main(["--cpu-smoke", "--engine", "torch", "--peak-tflops", "1.0", "--attn-iters", "2",
                     "--sections", "training", "attention"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| configs/tiny.json")][0]
    assert "torch (fp32)" in line and "%" in line  # MFU against the given peak


def test_a_config_mistake_stops_the_check_before_any_section(capsys):
    """A key misspelt in --set: exit 2 and one line naming it, before any section spends (GPU) time."""
    from megatok.cli import gpu_check as mod

    capsys.readouterr()
    assert mod.main(["--cpu-smoke", "--set", "model.d_modle=4", "--sections", "training", "attention"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: configs/tiny.json (with --set ") and err.count("\n") == 1, err
    assert "model.d_modle: unknown key (did you mean 'model.d_model'?)" in err
    assert "gpu_check:" not in out and "Traceback" not in err  # no section ran


def test_the_library_takes_settings_whose_defaults_are_the_commands(monkeypatch):
    """megatok-gpu-check hands megatok.perf.gpu_check a Settings equal to the defaults of every option it
    is not given; the library runs from a Settings alone (no command line)."""
    from megatok.cli import gpu_check as command
    from megatok.perf import gpu_check as study

    got = []
    monkeypatch.setattr(study, "run", lambda s: got.append(s) or 0)
    assert command.main([]) == 0 and command.main(["--cpu-smoke", "--sections", "attention"]) == 0
    assert got[0] == study.Settings() and got[0].sections == ["trainer", "generation", "training", "attention"]
    assert got[1] == study.Settings(cpu_smoke=True, sections=["attention"])
    monkeypatch.undo()
    assert study.run(study.Settings(cpu_smoke=True, engine="torch", attn_iters=1, sections=["attention"])) == 0


def test_generation_agreement_counts_rows_bytes_and_log_probabilities():
    """The generation section's comparison of two modes: a row that goes its own way after a flipped draw
    counts as different, with the bytes before the flip shared and the log-probabilities compared up to it."""
    from megatok.generate import Generation
    from megatok.perf.gpu_generation import agreement

    def gen(text, logprobs, starts=None):
        return Generation(text=text, ids=list(text), logprobs=logprobs, starts=starts or [False] * len(text))

    ref = [gen(b"abcd", [-1.0, -2.0, -3.0, -4.0]), gen(b"xy", [-1.0, -1.0])]
    assert agreement(ref, ref, True) == {"identical_rows": 2, "identical_bytes": 1.0, "logprob_max_diff": 0.0,
                                         "equal": True}
    flipped = [gen(b"abzz", [-1.0, -2.00002, -9.0, -9.0]), ref[1]]  # the third draw flipped
    got = agreement(ref, flipped, True)
    assert got == {"identical_rows": 1, "identical_bytes": 0.6667, "logprob_max_diff": 2e-5, "equal": False}  # 4 of 6
    other_chunks = [ref[0], gen(b"xy", [-1.0, -1.0], [True, False])]
    assert not agreement(ref, other_chunks, True)["equal"] and agreement(ref, other_chunks, False)["equal"]
    assert not agreement(ref, [ref[0], gen(b"xy", [-1.0, -1.01])], True)["equal"]  # past the tolerance


def test_the_peak_for_mfu_is_found_by_whole_words_of_the_device_name():
    from megatok.flops import peak_tflops_for

    assert peak_tflops_for("NVIDIA H100 80GB HBM3") == peak_tflops_for("NVIDIA H200") == 989.0
    assert peak_tflops_for("NVIDIA GH200 480GB") == 989.0
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.0 and peak_tflops_for("NVIDIA H100 NVL") == 835.0
    assert peak_tflops_for("NVIDIA H200 NVL") == 835.0  # the PCIe card, not the SXM one's 989
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0 and peak_tflops_for("NVIDIA A10") == 125.0
    for unknown in ("NVIDIA RTX A1000", "NVIDIA A10G", "Tesla V100-SXM2-16GB"):  # not an A100 / A10
        assert peak_tflops_for(unknown) is None, unknown


def test_a_spent_budget_skips_what_is_left_and_still_reports(tmp_path, capsys):
    """A check cut short by its budget must keep what it measured: past --budget-s the rest is skipped and
    reported as such, section by section (the trainer first), and the JSON is written after each."""
    from megatok.cli import gpu_check as mod

    out = tmp_path / "r.json"
    assert mod.main(["--cpu-smoke", "--attn-iters", "1", "--budget-s", "0", "--json-out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["sections"] == ["trainer", "generation", "training", "attention"]
    assert rep["trainer"]["error"].startswith("skipped: --budget-s spent")
    assert rep["generation"] == [{"error": "skipped: --budget-s spent"}]
    assert [r["error"] for r in rep["training"]] == ["skipped: --budget-s spent"] * 2
    assert rep["attention"] == [{"error": "skipped: --budget-s spent"}]
    printed = capsys.readouterr().out
    assert (printed.index("gpu_check: trainer done") < printed.index("gpu_check: generation done")
            < printed.index("gpu_check: training configs/tiny.json skipped") < printed.index("gpu_check: attention done"))
    assert "error: skipped: --budget-s spent" in printed


def _plan(*args) -> tuple[int, list[dict]]:
    """tools/gpu_bench.sh --plan: (budget, [{part, end, share, command}]) as it prints them."""
    import re
    import subprocess

    from tests.conftest import ROOT

    r = subprocess.run(["bash", str(ROOT / "tools/gpu_bench.sh"), *args, "--plan"], capture_output=True, text=True,
                       timeout=30, env={"PATH": "/usr/bin:/bin", "OUT": "out"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    budget = int(re.match(r"gpu_bench: budget (\d+) s", lines[0]).group(1))
    parts = []
    for line in lines[1:]:
        m = re.match(r"part \d+ (\w+): until (\d+) s \((\d+) s at most, [^)]*\): (.*)$", line)
        parts.append({"part": m.group(1), "end": int(m.group(2)), "share": int(m.group(3)),
                      "command": m.group(4).split()})
    return budget, parts


@pytest.mark.parametrize("smoke", [False, True], ids=["gpu", "cpu-smoke"])
@pytest.mark.parametrize("mode, slot", [((), 600), (("--quick",), 300)])
def test_the_gpu_bench_runs_the_trainer_first_and_fits_its_slot(mode, slot, smoke, monkeypatch):
    """tools/gpu_bench.sh's plan: the trainer check first; every part's command ends its own work 20 s before
    the part's time is up (room for its report) and is killed 10 s after at most, and the last part's
    time ends with at least 5% of the budget to spare, the budget within the slot (10 minutes; --quick: 5).
    Each command is one the tool accepts, its settings included, on the machine it is for (--device cuda: a
    CUDA torch, one GPU; --cpu-smoke: this one, where a training part once passed --configs and failed)."""
    import torch

    from megatok.cli import bench, gpu_check
    from megatok.perf import bench as bench_study, gpu_check as gpu_check_study

    if not smoke:
        monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.8")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    budget, parts = _plan(*mode, *(["--cpu-smoke"] if smoke else []))
    assert budget <= slot and [p["part"] for p in parts][0] == "trainer"
    assert [p["part"] for p in parts] == (["trainer", "training"] if mode else ["trainer", "training", "bench"])
    assert parts[-1]["end"] + 10 <= budget * 0.95 and sum(p["share"] for p in parts) == parts[-1]["end"] - 20
    for p in parts:
        command = p["command"]
        assert command[:2] == ["python3", "-m"] and command[command.index("--budget-s") + 1] == str(p["share"] - 20)
        tool, study = {"megatok.cli.gpu_check": (gpu_check, gpu_check_study),
                       "megatok.cli.bench": (bench, bench_study)}[command[2]]
        args = tool.build_parser().parse_args(command[3:])
        assert args.json_out == f"out/{p['part']}.json"
        assert (str(args.device).startswith("cpu") if tool is bench else args.cpu_smoke) == smoke
        study.Settings(**vars(args))  # what main() checks before it runs anything
    first = parts[0]["command"]
    assert first[first.index("--sections") + 1:first.index("--sections") + 3] == ["trainer", "--trainer-steps"]
    second = gpu_check.build_parser().parse_args(parts[1]["command"][3:])  # generation's step modes there
    assert "generation" in second.sections and second.sections[0] == ("training" if mode else "generation")


def test_the_gpu_bench_refuses_a_budget_too_small_for_its_parts():
    import subprocess

    from tests.conftest import ROOT

    r = subprocess.run(["bash", str(ROOT / "tools/gpu_bench.sh"), "--quick", "--budget-s", "100", "--plan"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip().startswith("gpu_bench: --budget-s 100 leaves")


def test_the_gpu_bench_runs_every_part_and_exits_1_when_one_failed(tmp_path):
    """A part that fails (here every part: a Python that exits 3) leaves the later parts their turn, and the
    script's status and its last line say which failed."""
    import subprocess

    from tests.conftest import ROOT

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho failing on purpose >&2\nexit 3\n")
    python.chmod(0o755)
    r = subprocess.run(["bash", str(ROOT / "tools/gpu_bench.sh"), "--cpu-smoke", "--quick"], capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                                                   "PYTHON": str(python)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "trainer exit 3" in r.stdout and "training exit 3" in r.stdout
    assert r.stderr.strip().splitlines()[-1].startswith("gpu_bench: failed: trainer (exit 3) training (exit 3)")


@pytest.mark.dist
def test_sigterm_to_the_gpu_bench_reaches_the_running_part_and_starts_no_other(tmp_path):
    """The script ended by SIGTERM while its first part (the trainer check, here in its CPU smoke mode) runs:
    that part writes what it finished and is marked stopped, no later part starts, and the script ends
    with 143."""
    import subprocess
    import sys

    from tests.conftest import ROOT, TOOL_ENV, sigterm_when

    out = tmp_path / "out"

    def trained() -> bool:  # the trainer check's first part is in its JSON
        try:
            return "loss_last" in json.loads((out / "trainer.json").read_text()).get("trainer", {})
        except (OSError, ValueError):  # not written yet, or being written
            return False

    rc, output, pid = sigterm_when(["bash", ROOT / "tools/gpu_bench.sh", "--cpu-smoke", "--quick"], trained,
                                   env={**TOOL_ENV, "PYTHON": sys.executable, "OUT": str(out)})
    assert rc == 143, output[-3000:]
    rep = json.loads((out / "trainer.json").read_text())
    assert rep["stopped"] == "SIGTERM" and rep["trainer"]["built_partitioned"]
    assert math.isfinite(rep["trainer"]["loss_last"]) and "stopped early: SIGTERM" in (out / "trainer.log").read_text()
    assert not (out / "training.json").exists() and "== training" not in output
    assert (out / "plan.txt").read_text().startswith("gpu_bench: budget 270 s")
    left = subprocess.run(["pgrep", "-s", str(pid)], capture_output=True, text=True).stdout.split()
    assert left == [], left  # no trainer process outlives it


def test_a_training_row_runs_in_a_process_of_its_own_whose_failure_or_time_limit_is_reported_here():
    """Each training row is measured in a spawned process (a CUDA context of its own on a GPU, where one
    row's misaligned address broke every row after it): its row comes back, its exception is raised in
    the check's process, and past its time the process is ended."""
    import multiprocessing

    import torch

    from megatok.errors import ConfigError
    from megatok.perf.gpu_check import SMOKE_SETS, isolated_train_check

    kw = dict(device=torch.device("cpu"), engine="torch", steps=1, warmup=0, micro=2, peak=None)
    row = isolated_train_check(120, "configs/tiny.json", SMOKE_SETS, **kw)
    assert row["steps_timed"] == 1 and math.isfinite(row["loss_last"])
    with pytest.raises(ConfigError, match="no_such_key"):
        isolated_train_check(120, "configs/tiny.json", SMOKE_SETS + ["model.no_such_key=1"], **kw)
    with pytest.raises(multiprocessing.TimeoutError):  # a spawned process needs more than a second to import
        isolated_train_check(0, "configs/tiny.json", SMOKE_SETS, **kw)
    assert not multiprocessing.active_children()


def test_the_gpu_bench_installs_carried_wheels_into_a_directory_of_its_own(tmp_path):
    """The wheels carried to a GPU machine (.whl/) go into a new directory under TMPDIR (not a fixed /tmp
    path another user could hold), removed when the bench ends, also when the install fails."""
    import shutil
    import subprocess

    from tests.conftest import ROOT

    (tmp_path / "tools").mkdir()
    for name in ("gpu_bench.sh", "gpu_site.sh"):
        shutil.copy(ROOT / "tools" / name, tmp_path / "tools" / name)
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "x-1.0-py3-none-any.whl").write_bytes(b"not a wheel")
    fake = tmp_path / "python"  # records pip's --target, and the install fails
    fake.write_text('#!/bin/bash\nwhile [ $# -gt 0 ]; do [ "$1" = --target ] && echo "$2" > "$RECORD"; shift; done\n'
                    'exit 1\n')
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "PYTHON": str(fake), "TMPDIR": str(tmp_path / "t"),
           "RECORD": str(tmp_path / "target")}
    (tmp_path / "t").mkdir()
    r = subprocess.run(["bash", str(tmp_path / "tools/gpu_bench.sh"), "--quick"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 1 and "gpu_bench: installing .whl/ failed" in r.stderr, r.stderr
    target = Path((tmp_path / "target").read_text().strip())
    assert target.parent == tmp_path / "t" and target.name.startswith("megatok-site.") and not target.exists()


def test_a_trainer_that_fails_or_resumes_inexactly_fails_the_check(tmp_path, monkeypatch):
    """The trainer section's error (a failure, or a resume under train.deterministic whose losses are not the
    first run's) makes megatok-gpu-check exit 1; its other sections still run and report."""
    from megatok.cli import gpu_check as mod
    from megatok.perf import gpu_check

    def inexact(*args, row, **kw):
        row.update(resume_exact=False, resume_max_rel_diff=1e-6, error="the resumed run's losses are not the first run's under "
                                              "train.deterministic (max relative difference 1.00e-06)")
        return row

    monkeypatch.setattr(gpu_check, "trainer_check", inexact)
    out = tmp_path / "r.json"
    assert mod.main(["--cpu-smoke", "--sections", "trainer", "attention", "--attn-iters", "1", "--json-out", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert "not the first run's" in rep["trainer"]["error"] and rep["attention"]
