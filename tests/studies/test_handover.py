"""The hand-over's answer from replicate studies: rows by arm/source/seed, paired tests, Holm, detectable size."""

import json
import math
import random

import pytest

from megatok.studies import handover


def _study(path, source, steps, arms):
    """A replicate --out directory: ``arms`` maps method -> {seed: bpb}."""
    path.mkdir(parents=True)
    runs = [{"method": m, "seed": s, "steps": 200 if source else 400, "prose-sample": {"bpb": b, "wfb_boundary_fraction": 0.5}}
            for m, by_seed in arms.items() for s, b in by_seed.items()]
    runs.append({"method": "fixed", "seed": 99, "steps": 10})  # unfinished: no held-out score, not a row
    record = {"source": source, "steps": steps} if source else None
    (path / "results.json").write_text(json.dumps({"handover": record, "runs": runs}))
    return path


def test_holm_matches_the_step_down_by_hand():
    assert handover.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert handover.holm([0.5, 0.2]) == pytest.approx([0.5, 0.4])
    got = handover.holm([0.01, math.nan])
    assert got[0] == pytest.approx(0.01) and math.isnan(got[1])


def test_detectable_difference_is_the_t_tests_and_shrinks_with_seeds():
    from scipy import stats

    big = handover.detectable(1.0, 400, 0.05, 0.8)
    normal = (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) / math.sqrt(400)
    assert big == pytest.approx(normal, rel=0.02)
    five, ten = handover.detectable(0.02, 5, 0.05 / 6, 0.8), handover.detectable(0.02, 10, 0.05 / 6, 0.8)
    assert five > ten > 0.02 * (stats.norm.ppf(1 - 0.05 / 12) + stats.norm.ppf(0.8)) / math.sqrt(10)
    assert handover.detectable(0.0, 5, 0.05, 0.8) is None and handover.detectable(1.0, 1, 0.05, 0.8) is None


def test_rows_comparisons_and_files(tmp_path):
    rng = random.Random(0)
    seeds = range(5, 10)
    base = {s: 2.0 + 0.1 * rng.random() for s in seeds}  # the seed's own effect, shared by its arms
    noise = lambda: rng.gauss(0, 0.002)  # noqa: E731
    ws = _study(tmp_path / "from-whitespace", "whitespace", 200, {
        "policy": {s: base[s] - 0.05 + noise() for s in seeds}, "uniform": {s: base[s] + noise() for s in seeds},
        "fixed": {s: base[s] + 0.01 + noise() for s in seeds}, "whitespace": {s: base[s] - 0.02 + noise() for s in seeds}})
    un = _study(tmp_path / "from-uniform", "uniform", 200, {"policy": {s: base[s] + noise() for s in seeds}})
    scratch = _study(tmp_path / "scratch", None, 0, {"uniform": {s: base[s] + noise() for s in seeds}})
    out = tmp_path / "answer"
    assert handover.main([str(ws), str(un), str(scratch), "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert len(data["rows"]) == 6 * 5
    row = next(r for r in data["rows"] if r["arm"] == "policy" and r["source"] == "whitespace" and r["seed"] == 7)
    assert row["heldout_bpb"] == pytest.approx(ws_bpb(ws, "policy", 7)) and row["steps"] == 400
    by = {(c["a"]["arm"], c["a"]["source"], c["b"]["arm"], c["b"]["source"]): c for c in data["comparisons"]}
    assert len(by) == len(handover.COMPARISONS)
    win = by[("policy", "whitespace", "uniform", "whitespace")]
    assert win["a_lower"] == 5 and win["p_holm"] < 0.05 and "policy (from whitespace) lower" in win["verdict"]
    assert win["mean_diff"] == pytest.approx(0.05, abs=0.005)
    placebo = by[("uniform", "whitespace", "uniform", "none")]
    assert placebo["p_holm"] >= 0.05 and placebo["verdict"].startswith("no difference found")
    assert 0 < placebo["detectable"] < 0.02
    assert sorted(c["p_holm"] for c in data["comparisons"]) == sorted(handover.holm([c["p"] for c in data["comparisons"]]))
    assert "| policy | whitespace |" in (out / "results.md").read_text()
    assert (out / "handover_pairs.png").stat().st_size > 0


def ws_bpb(study, method, seed):
    runs = json.loads((study / "results.json").read_text())["runs"]
    return next(r["prose-sample"]["bpb"] for r in runs if r["method"] == method and r["seed"] == seed)


def test_clear_errors(tmp_path, capsys):
    assert handover.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nowhere: no results.json" in err
    a = _study(tmp_path / "a", "whitespace", 200, {"policy": {1: 2.0}})
    b = _study(tmp_path / "b", "whitespace", 200, {"policy": {1: 2.1}})
    assert handover.main([str(a), str(b), "--out", str(tmp_path / "o")]) == 2
    assert "arm policy from whitespace, seed 1 is in two studies" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_scratch_family_compares_the_policy_with_each_other_arm(tmp_path):
    """--family scratch: a study from scratch (cpu-small) has its own comparisons, the policy against uniform,
    fixed and whitespace chunks and the published estimator; a study with none of them yet says so."""
    study = _study(tmp_path / "cpu-small", None, 0, {m: {0: 3.3 + d, 1: 3.4 + d, 2: 3.35 + d + 0.001 * (m == "fixed")}
                                                     for m, d in (("policy", 0.0), ("uniform", 0.02), ("fixed", 0.03),
                                                                  ("whitespace", -0.1), ("hnet", 0.0))})
    out = tmp_path / "paired"
    assert handover.main([str(study), "--family", "scratch", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert [c["b"]["arm"] for c in data["comparisons"]] == ["uniform", "fixed", "whitespace"]
    assert data["comparisons"][0]["verdict"].startswith("the same difference on every seed (+0.0200)")
    assert data["comparisons"][2]["a_lower"] == 0
    empty = _study(tmp_path / "empty", None, 0, {"hnet": {0: 3.3}})
    assert handover.main([str(empty), "--family", "scratch", "--out", str(tmp_path / "e")]) == 0
    assert "No comparison has rows for both of its arms yet." in (tmp_path / "e" / "results.md").read_text()
