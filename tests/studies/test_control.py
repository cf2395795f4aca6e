"""The positive control and its study: the generated corpus is what megatok/data/control.py says (the
separator announces the next ending with probability ``level``, the valuable positions are exactly those
space_before_word marks), megatok-make-corpus builds it deterministically, the map's tables count
aligned seeds and thresholds as documented, megatok-replicate --preset control trains, probes and merges
invocations, and the recorded prose study keeps its identity when config keys are added."""

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from megatok.data import control
from megatok.stats import space_before_word
from megatok.studies import control as study
from tests.conftest import ROOT, run_main, run_tool


def pairs(level, seed=0, n=200_000, signal=4):
    """(separator, the next word's ending) over a stretch of the process."""
    gen = control.Generator(control.Control(level, seed=seed, signal=signal))
    text = "".join(d["text"] + "\n" for d in gen.documents(n))  # the newline between documents: a separator too
    words, seps, out = [], [], []
    word = ""
    for ch in text:
        if ch in control.SEPARATORS:
            words.append(word)
            seps.append(ch)
            word = ""
        else:
            word += ch
    return gen, [(sep, nxt[3:]) for sep, nxt in zip(seps, words[1:])]


def test_the_separator_announces_the_ending_as_often_as_the_level_says():
    gen, at_one = pairs(1.0)
    _, at_zero = pairs(0.0)
    # level 1: within a document every ending is the one the pairing gives its separator (the first word of
    # each document, after the newline that joins documents here, is the only exception)
    hits = sum(gen.pairing[s] == e for s, e in at_one) / len(at_one)
    assert hits > 0.99
    # level 0: the ending is independent of the separator (each 1/4, whatever the separator)
    counts = Counter(at_zero)
    for sep in control.SEPARATORS:
        row = [counts[(sep, e)] for e in control.ENDINGS]
        assert max(row) / sum(row) < 0.27 and min(row) / sum(row) > 0.23, (repr(sep), row)
    assert control.ending_bits(1.0) == {"given_separator": 0.0, "without": 2.0}
    assert control.ending_bits(0.0)["given_separator"] == pytest.approx(2.0)


def test_the_harder_control_lets_the_space_alone_announce_the_ending():
    """signal 1: after a space the ending is the pairing's at level 1; after a tab, newline or carriage return
    it is uniform whatever the level; the text's bytes are drawn as in the control (the same rates)."""
    gen, at_one = pairs(1.0, signal=1)
    space = [e for s, e in at_one if s == " "]
    assert sum(e == gen.pairing[" "] for e in space) / len(space) > 0.99
    counts = Counter((s, e) for s, e in at_one if s != " ")
    for sep in control.SEPARATORS[1:]:
        row = [counts[(sep, e)] for e in control.ENDINGS]
        assert max(row) / sum(row) < 0.28 and min(row) / sum(row) > 0.22, (repr(sep), row)
    x = torch.tensor([list(b"ab cd\tef gh")])
    starts = torch.zeros_like(x, dtype=torch.bool)
    starts[0, [0, 2]] = True  # the first space before a word starts a chunk, the tab does not
    from megatok.stats import ratios, row_stats

    sums = {k: v.sum() for k, v in row_stats(x, x, starts, torch.zeros(x.shape), torch.zeros(x.shape)).items()}
    got = ratios(sums)
    assert got["space_boundary_fraction"] == 0.5 and got["sbw_boundary_fraction"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="signal 5"):
        control.Control(1.0, signal=5)
    from megatok.studies.replication import PRESETS

    one = PRESETS["control-one"]
    assert one.signal == 1 and one.aligned_key == "space_boundary_fraction" and one.data == "control"
    summary = {"prose-sample": {"sbw_boundary_fraction": 0.95, "space_boundary_fraction": 0.5},
               "curve": [{"step": 10, "sbw_boundary_fraction": 0.95, "space_boundary_fraction": 0.5}]}
    assert study.run_figures(summary)["aligned_fraction"] == 0.95
    assert study.run_figures(summary, one.aligned_key)["aligned_fraction"] == 0.5
    assert study.run_figures(summary, one.aligned_key)["steps_to_align"] is None


def test_the_valuable_positions_are_the_spaces_before_words():
    gen = control.Generator(control.Control(0.5))
    text = gen.document().encode()
    x = torch.tensor([list(text)])
    marked = space_before_word(x)[0]
    seps = torch.tensor([b in b" \t\n\r" for b in text])
    assert torch.equal(marked[1:-1], seps[1:-1]) and seps.sum() > 100
    # every letter, length and rate the same at every level: only what the separator tells changes
    a = "".join(d["text"] for d in control.Generator(control.Control(0.0)).documents(300_000))
    b = "".join(d["text"] for d in control.Generator(control.Control(1.0)).documents(300_000))
    fa, fb = Counter(a), Counter(b)
    for ch in set(fa) | set(fb):
        assert fa[ch] / len(a) == pytest.approx(fb[ch] / len(b), abs=0.004), repr(ch)


def test_make_corpus_builds_the_control_deterministically(tmp_path, capsys):
    args = ["--preset", "control", "--level", "0.75", "--max-mb", "0.05"]
    run_main(capsys, "make_corpus", *args, "--out", tmp_path / "a.jsonl.gz", "--heldout-out", tmp_path / "h.jsonl.gz")
    run_main(capsys, "make_corpus", *args, "--out", tmp_path / "b.jsonl.gz")
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()
    docs = [json.loads(line) for line in gzip.open(tmp_path / "a.jsonl.gz", "rt")]
    held = [json.loads(line) for line in gzip.open(tmp_path / "h.jsonl.gz", "rt")]
    assert sum(len(d["text"]) for d in docs) >= 50_000 and {d["domain"] for d in docs + held} == {"control"}
    assert not {d["text"] for d in docs} & {d["text"] for d in held}
    other = tmp_path / "c.jsonl.gz"
    run_main(capsys, "make_corpus", *args[:-2], "--max-mb", "0.05", "--seed", "1", "--out", other)
    assert other.read_bytes() != (tmp_path / "b.jsonl.gz").read_bytes()


@pytest.mark.parametrize("args, message", [
    (["--preset", "control"], "--preset control needs --level"),
    (["--preset", "control", "--level", "1.5"], "--level must be in [0, 1]"),
    (["--level", "1"], "--level goes with --preset control"),
])
def test_make_corpus_refuses_a_control_without_a_level(tmp_path, capsys, args, message):
    r = run_main(capsys, "make_corpus", *args, "--out", tmp_path / "x.jsonl.gz")
    assert r.returncode == 2 and message in r.stderr


def test_seeds_and_levels_on_the_command_line():
    from megatok.cli.replicate import parse_levels, parse_seeds

    assert parse_seeds("3") == [0, 1, 2] and parse_seeds("5,11,17") == [5, 11, 17] and parse_seeds("7,") == [7]
    assert parse_seeds("20-23") == [20, 21, 22, 23] and parse_seeds("4-4") == [4]
    assert parse_levels("1,0,0.5") == [0.0, 0.5, 1.0]
    for bad in ("0", "x", "1,1", "-1,2", "5-3", "2-x"):
        with pytest.raises(Exception):
            parse_seeds(bad)
    with pytest.raises(Exception):
        parse_levels("2")


def summary(method, level, seed, held, steps_at):
    """A run as results.json records it: its held-out evaluation and training curve."""
    curve = [{"step": s, "sbw_boundary_fraction": f} for s, f in steps_at]
    return {"method": method, "level": level, "seed": seed, "curve": curve, "realised_rate": 0.2, "wall_s": 100.0,
            "prose-sample": {"bpb": 1.0 + level, "sbw_boundary_fraction": held}}


def test_the_map_counts_aligned_seeds_and_finds_the_threshold():
    runs = []
    for seed in range(5):  # policy: aligns at levels 0.5 and 1 (4 of 5 at 0.5), not at 0 or 0.25
        runs.append(summary("policy", 1.0, seed, 0.99, [(100, 0.5), (200, 0.95)]))
        runs.append(summary("policy", 0.5, seed, 0.95 if seed else 0.3, [(100, 0.2), (300, 0.92 if seed else 0.3)]))
        runs.append(summary("policy", 0.25, seed, 0.95 if seed < 2 else 0.2, [(100, 0.2)]))
        runs.append(summary("policy", 0.0, seed, 0.2, [(100, 0.2)]))
        runs.append(summary("uniform", 1.0, seed, 0.2, [(100, 0.2)]))
    runs = [{**r, **study.run_figures(r)} for r in runs]
    assert runs[0]["aligned_fraction"] == 0.99 and runs[0]["steps_to_align"] == 200
    probe = {"classes": {"space_before_word": {"n": 256, "value": 0.5, "stderr": 0.05},
                         "word_start": {"n": 256, "value": 0.1, "stderr": 0.02},
                         "inside_word": {"n": 256, "value": 0.0, "stderr": 0.01},
                         "other": {"n": 16, "value": 3.0, "stderr": 0.0}}, "return_std": 2.0}
    agg = study.aggregate(runs, {0.25: probe, 0.5: {**probe, "return_std": 1.0}})
    cell = agg["methods"]["policy"]["0.5"]
    assert (cell["aligned"], cell["n"], cell["median_steps"]) == (4, 5, 300)
    assert agg["methods"]["policy"]["0.25"]["aligned"] == 2 and agg["methods"]["uniform"]["1"]["aligned"] == 0
    p = agg["probes"]["0.5"]
    assert p["z"] == pytest.approx(10) and p["ratio"] == pytest.approx(0.5) and p["best_other"] == "word_start"
    t = agg["thresholds"]["policy"]
    assert (t["level"], t["ratio"], t["highest_unreliable"], t["ratio_below"]) == ("0.5", 0.5, "0.25", 0.25)
    assert agg["thresholds"]["uniform"]["level"] is None
    text = study.markdown(agg, "# t")
    assert "| policy | 0/5" in text and "4/5 (300;" in text and "from level 0.5 on" in text


def test_recorded_study_configs_keep_their_digests(tmp_path):
    """Every run recorded in docs/replication/cpu-small/results.json gets the same config digest from today's
    code (a key added to the config since must not make a finished run a new experiment: ADDED_KEYS)."""
    from megatok.studies.replicate import write_configs
    from megatok.studies.replication import PRESETS

    recorded = json.loads((ROOT / "docs/replication/cpu-small/results.json").read_text())["runs"]
    want = {(r["method"], r["seed"]): r["config_digest"] for r in recorded if r["method"] != "bpe"}
    methods = sorted({m for m, _ in want})
    runs = write_configs(PRESETS["cpu-small"], tmp_path, {"shards": "data/x"}, sorted({s for _, s in want}), methods,
                         [], 2)
    got = {(r["method"], r["seed"]): r["digest"] for r in runs}
    assert got == want


def test_recorded_control_runs_keep_their_digests(tmp_path):
    """Every run recorded in docs/replication/control/results.json gets the same config digest from today's
    code: the published estimator's rows, relabelled policy-published when megatok's default changed, are
    the same experiments, and no key added since makes a recorded run a new one."""
    from megatok.studies.replicate import write_configs
    from megatok.studies.replication import PRESETS

    recorded = json.loads((ROOT / "docs/replication/control/results.json").read_text())["runs"]
    got = {}
    for level in sorted({r["level"] for r in recorded}):
        at = [r for r in recorded if r["level"] == level]
        for r in write_configs(PRESETS["control"], tmp_path / f"l{level}", {"shards": "data/x"},
                               sorted({r["seed"] for r in at}), sorted({r["method"] for r in at}), [], 1, level):
            got[(r["method"], r["seed"], level)] = r["digest"]
    assert {(r["method"], r["seed"], r["level"]): r["config_digest"] for r in recorded} == {
        k: got[k] for k in ((r["method"], r["seed"], r["level"]) for r in recorded)}


@pytest.mark.dist
def test_the_control_preset_trains_probes_and_merges_invocations(tmp_path):
    tiny = ["--set", "train.max_steps=4", "train.log_every=2", "model.d_main=64", "model.n_main_heads=2",
            "data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=4", "train.warmup_steps=1"]
    common = ["--preset", "control", "--out", tmp_path / "out", "--work", tmp_path / "work", *tiny]
    first = run_tool("replicate", *common, "--level", "0,1", "--methods", "uniform", "--seeds", "1", timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = run_tool("replicate", *common, "--level", "1", "--methods", "policy-disarm", "--seeds", "3,", timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    out = tmp_path / "out"
    result = json.loads((out / "results.json").read_text())
    got = {(r["method"], r["level"], r["seed"]) for r in result["runs"]}
    assert got == {("uniform", 0.0, 0), ("uniform", 1.0, 0), ("policy-disarm", 1.0, 3)}  # the first invocation's kept
    for r in result["runs"]:
        assert 0 <= r["aligned_fraction"] <= 1 and "steps_to_align" in r
    assert len(result["commands"]) == 2 and set(result["aggregate"]["probes"]) == {"0", "1"}
    probe = json.loads((out / "boundary_value-level1.json").read_text())
    assert probe["return_std"] > 0 and set(probe["classes"]) >= {"space_before_word", "word_start"}
    for f in ("results.md", "map.png", "alignment.png", "command.txt"):
        assert (out / f).stat().st_size > 0, f
    assert (tmp_path / "work/level1/data/control.jsonl.gz").is_file()
    cfg = json.loads((tmp_path / "work/level1/configs/policy-disarm-seed3.json").read_text())
    assert cfg["boundary"]["estimator"] == "disarm" and cfg["model"]["byte_window"] == 1


def test_the_alignment_fit_says_nothing_when_every_seed_aligns_where_nothing_pays():
    """A method aligned on every seed at level 0 (the oracle: chunks at every separator) has a floor of 1:
    P(align) does not depend on the ratio, and the fit is None rather than a division by zero."""
    from megatok.studies.control import fit_alignment

    assert fit_alignment([(0.0, True), (0.2, True), (0.7, True)], floor=1.0) is None
    fit = fit_alignment([(0.0, False), (0.2, False), (0.35, True), (0.7, True)], floor=0.0)
    assert fit is not None and 0.2 <= fit["r50_mode"] <= 0.35
