"""megatok-show-boundaries and megatok-estimator-variance on a tiny real policy run (CLI, subprocess);
the run (``policy_run``, tests/boundaries/conftest.py) is trained by 2 DeepSpeed ranks under ZeRO-2."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from tests.conftest import run_tool as tool

TEXT = "Héllo wörld, 日本!\n    return self.x  # café"


def load_tool(name: str):
    return importlib.import_module(f"megatok.cli.{name}")


def test_show_boundaries_terminal_html_png(policy_run, tmp_path):
    out = tmp_path / "pic"
    r = tool("show_boundaries", "--run", policy_run, "--run", policy_run, "--strategy", "whitespace",
             "--text", TEXT, "--out", out, "--width", 20)
    assert r.returncode == 0, r.stderr[-2000:]
    blocks = r.stdout.split("== ")[1:]
    assert len(blocks) == 3 and blocks[0].startswith("run (policy, step00000003)")
    assert blocks[0] == blocks[1]  # same seed, same samples
    # the whitespace rule, hand-checked, with the separator before every chunk but the first
    ws = blocks[2].split("\n", 1)[1]
    assert ws == "Héllo │wörld,│ │日本!│↵\n│    │return │self.│x  │#│ │café\n"
    assert ws.replace("│", "").replace("↵\n", "\n").rstrip("\n") == TEXT
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = out.with_suffix(".html").read_text()
    assert "run (policy, step00000003)" in page and "whitespace (rule)" in page
    # every run's row is printed per wrapped line: 20-character lines of a 40-character text
    assert page.count("whitespace (rule)") >= 4


def test_show_boundaries_marks_a_start_inside_a_character():
    from megatok.display import char_marks, characters, terminal
    from megatok.eval.segments import Row

    chars = characters("aé".encode())
    assert chars == [(0, 1, "a"), (1, 2, "é")]
    assert char_marks(chars, [True, False, True]) == ["start", "inside"]
    row = Row("r", [True, True, True], {"boundary_rate": 1.0, "bytes_per_chunk": 1.0,
                                         "word_start_precision": 0.0, "word_start_recall": 0.0})
    assert terminal([row], "aé".encode(), "|").splitlines()[1] == "a|é"
    row.starts = [True, False, True]
    assert terminal([row], "aé".encode(), "|").splitlines()[1] == "a¦é"


def test_show_boundaries_refuses_learned_strategies_without_a_run():
    r = tool("show_boundaries", "--strategy", "hnet", "--text", "abc")
    assert r.returncode != 0 and "need --run" in r.stderr


@pytest.mark.parametrize("args, want", [
    (["--strategy", "whitespace", "--data", "nope.txt"], "error: [Errno 2] No such file or directory: 'nope.txt'"),
    (["--strategy", "fixed:bogus=1", "--text", "hi"], "error: --strategy fixed:bogus=1: bogus: Extra inputs are not "
                                                      "permitted"),
    (["--strategy", "bpe", "--text", "hi"], "error: --strategy bpe: model_path: Value error, the bpe strategy needs "
                                            "a sentencepiece model"),
    (["--run", "no/such/run", "--text", "hi"], "error: no/such/run/config.json: no config.json here"),
])
def test_show_boundaries_bad_input_is_one_line(args, want, capsys):
    assert load_tool("show_boundaries").main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(want), err


def test_estimator_variance_reports_every_gamma(policy_run, tmp_path):
    out = tmp_path / "ev"
    r = tool("estimator_variance", "--run", policy_run, "--samples", 3, "--batch-size", 2,
             "--gammas", "0.99,1.0", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert json.loads(r.stdout[:r.stdout.rindex("}") + 1]) == result
    assert list(result["variants"]) == ["0.99", "1"] and result["batch"] == [2, 64]
    for gamma in ("0.99", "1"):
        groups = result["variants"][gamma]
        assert set(groups) == {"boundary", "encoder", "embed", "all"}
        assert groups["boundary"]["parameters"] == 33 + 33  # the linear head and the window head (w = 2)
        for g in groups.values():
            assert g["variance"] > 0 and g["mean_norm"] > 0
        # "all" sums the groups' traces
        assert groups["all"]["variance"] == pytest.approx(sum(groups[k]["variance"] for k in
                                                              ("boundary", "encoder", "embed")), rel=1e-9)
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_estimator_variance_compares_estimator_variants(policy_run, tmp_path):
    out = tmp_path / "ev"
    r = tool("estimator_variance", "--run", policy_run, "--samples", 3, "--batch-size", 2, "--variant", "published=",
             "--variant", "pairs=samples:2,batch_baseline:true", "--variant", "loo=leave_one_out:true,gamma:0.9", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    v = json.loads(out.with_suffix(".json").read_text())["variants"]
    assert list(v) == ["published", "pairs", "loo"]
    assert v["pairs"]["all"]["forwards"] == 2 and v["published"]["all"]["forwards"] == 1
    assert v["pairs"]["all"]["snr_per_forward"] == pytest.approx(v["pairs"]["all"]["snr"] / math.sqrt(2))
    # the same draws, another estimator: the gradients differ
    assert v["loo"]["boundary"]["mean_norm"] != pytest.approx(v["published"]["boundary"]["mean_norm"], rel=1e-6)
    bad = tool("estimator_variance", "--run", policy_run, "--variant", "x=samples:0")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --variant: samples")


def test_estimator_moments_by_hand():
    from megatok.studies import estimator_variance as ev

    m = ev.Moments()
    for g in ([1.0, 0.0], [3.0, 0.0], [2.0, 3.0]):
        m.add({"a": torch.tensor(g)})
    r = m.report("a")
    # mean (2, 1); unbiased variances 1 and 3 -> trace 4
    assert r["mean_norm"] == pytest.approx(math.sqrt(5))
    assert r["variance"] == pytest.approx(4.0) and r["variance_per_param"] == pytest.approx(2.0)
    assert r["snr"] == pytest.approx(math.sqrt(5 - 4 / 3) / 2)
