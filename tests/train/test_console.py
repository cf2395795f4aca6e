"""What a cluster job's log gets from the trainer: a console line per training row when the output is
not a terminal, peak memory in every training row, and an opt-in torch.profiler window."""

import json
import re

import pytest

from megatok.config import ConfigError, load_config
from megatok.metrics import read_metrics
from tests.conftest import TINY, pretrain


def test_a_redirected_log_gets_a_line_per_row_with_memory_and_a_profiler_trace(shards, tmp_path):
    run = tmp_path / "run"
    # stdout and stderr are pipes here, as in a batch job's log: no progress bar, a line per row instead
    r = pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
                  "train.max_steps=4", "train.micro_batch_size=2", "train.global_batch_size=2",
                  "logging.progress=true", "logging.profile_steps=[2,4]"])
    rows = [row for row in read_metrics(run) if row["split"] == "train"]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ") and "/4 (" in ln]
    assert len(lines) == len(rows), r.stdout[-3000:]
    for line, row in zip(lines, rows):
        shown = line.split(": ", 1)[1].split("  ")
        # the time, the time trained and an estimate of what is left
        assert re.match(rf"step {row['step']}/4 \(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d, \d\d:\d\d elapsed, "
                        rf"~(\d\d:\d\d|\?) left\): ", line), line
        assert [s.split(" ")[0] for s in shown] == ["loss", "bpb", "rate", "lr", "bytes/s", "tflops/device",
                                                    "host_peak_rss_gib"], line  # no peak known on a CPU: no MFU
        figures = dict(s.split(" ") for s in shown)
        assert figures["loss"] == f"{row['loss']:.4g}" and figures["bpb"] == f"{row['bpb']:.4g}"
        assert figures["host_peak_rss_gib"] == f"{row['host_peak_rss_gib']:.4g}"
    # peak memory in every training row: on the CPU the process's peak RSS, at least a model's worth of torch
    assert all(0.05 < row["host_peak_rss_gib"] < 64 for row in rows)
    assert all("gpu_peak_allocated_gib" not in row for row in rows)
    assert rows == sorted(rows, key=lambda row: row["host_peak_rss_gib"])  # a peak since the start never falls
    assert "Traceback" not in r.stderr and "train:" not in r.stderr  # no progress bar in the log

    # the profiler window: steps 2 and 3, one Chrome trace (rank 0's, the only rank here)
    (trace,) = (run / "profile").iterdir()
    assert trace.name == "steps2-4-rank0.json"
    assert f"megatok: profiler trace of steps 2 to 3: {trace}" in r.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names) and any("backward" in n.lower() for n in names)


def test_a_terminal_gets_the_bar_not_the_lines(tmp_path, monkeypatch, capsys):
    """The console line is for logs: with a terminal the progress bar shows the same figures."""
    from megatok.metrics import MetricsLogger

    class Terminal:
        def isatty(self):
            return True

        def write(self, text):
            pass

        def flush(self):
            pass

    monkeypatch.setattr("sys.stderr", Terminal())
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=10, wandb_mode="disabled")
    assert logger.bar is not None and not logger.lines
    logger.progress(1, loss=5.0)
    logger.close()
    assert "step 1/10" not in capsys.readouterr().out


@pytest.mark.parametrize("window", ["[4,4]", "[5,3]", "[0,2]", "[2]"])
def test_a_profiler_window_must_be_start_before_stop(window):
    with pytest.raises(ConfigError, match=r"logging\.profile_steps: expected \[start, stop\] with 1 <= start < stop"):
        load_config("configs/tiny.json", [f"logging.profile_steps={window}"])
