"""megatok-gpu-check in its CPU smoke mode: the code paths the GPU check runs (attention comparison,
DeepSpeed and plain-torch training steps, FLOPs, memory, the trainer with a resume and generation), on
a tiny config, without a GPU."""

import json
import math

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


def test_cpu_smoke_torch_engine(capsys):
    from megatok.cli import gpu_check as mod

    assert mod.main(["--cpu-smoke", "--engine", "torch", "--peak-tflops", "1.0", "--attn-iters", "2"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| configs/tiny.json")][0]
    assert "torch (fp32)" in line and "%" in line  # MFU against the given peak


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
    """On a lent GPU a check cut short must keep what it measured: past --budget-s the rest is skipped and
    reported as such, and the JSON is written after every section (and on SIGTERM, by the same finally)."""
    from megatok.cli import gpu_check as mod

    out = tmp_path / "r.json"
    assert mod.main(["--cpu-smoke", "--attn-iters", "1", "--budget-s", "0", "--json-out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["attention"] and all(a["sdpa_ms"] > 0 for a in rep["attention"])
    assert [r["error"] for r in rep["training"]] == ["skipped: --budget-s spent"] * 2
    assert rep["trainer"]["error"].startswith("skipped: --budget-s spent")
    printed = capsys.readouterr().out
    assert "gpu_check: attention done" in printed and "error: skipped: --budget-s spent" in printed
