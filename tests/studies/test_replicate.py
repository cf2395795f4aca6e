"""megatok-replicate's toy preset end to end: it trains, evaluates and reports, the outputs parse, and a
second invocation resumes (finished runs are not trained again; a new method is added to the same table)."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from megatok.studies.replication import METHODS, aggregate, markdown, PRESETS, verdict
from tests.conftest import PARALLEL, run_tool, stdlib_texts

pytestmark = pytest.mark.dist


def replicate(*args, timeout=900):
    return run_tool("replicate", *args, timeout=timeout)


@pytest.fixture(scope="module")
def study(shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicate")
    prose = tmp / "heldout_prose.jsonl"
    texts = stdlib_texts(6, 3000)
    prose.write_text("".join(json.dumps({"text": t, "lang": "en", "domain": ("docs", "speech")[i % 2]}) + "\n"
                             for i, t in enumerate(texts)))
    parallel = tmp / "parallel.jsonl"
    parallel.write_text("".join(json.dumps({"text": s, "lang": lang, "domain": "legal"}) + "\n"
                                for lang, sents in PARALLEL.items() for s in sents))
    data = ["--shards", shards, "--heldout", prose, "--parallel", parallel]
    first = replicate("--preset", "toy", "--out", tmp / "out", "--work", tmp / "work", "--methods",
                      "policy,uniform", *data)
    second = replicate("--preset", "toy", "--out", tmp / "out", "--work", tmp / "work", "--methods",
                       "policy,uniform,fixed", *data)
    return tmp, first, second


def test_the_toy_preset_trains_evaluates_and_reports(study):
    tmp, first, second = study
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    out = tmp / "out"
    result = json.loads((out / "results.json").read_text())
    agg = result["aggregate"]
    assert list(agg) == ["policy", "uniform", "fixed"]
    for m, e in agg.items():
        assert 0 < e["bpb"]["mean"] < 12, m
        assert e["flops"]["mean"] > 0 and e["wall_s"]["mean"] > 0
        assert e["by_lang"].keys() == PARALLEL.keys()
        assert set(e["by_domain"]) == {"docs", "speech"}
    assert agg["fixed"]["bytes_per_unit"]["mean"] == pytest.approx(5, rel=0.1)  # a chunk every 5 bytes
    assert "threshold" in agg["policy"] and "threshold" not in agg["uniform"]
    runs = {r["method"]: r for r in result["runs"]}
    assert runs["policy"]["bytes_seen"] == runs["uniform"]["bytes_seen"]  # the same bytes for every method
    text = (out / "results.md").read_text()
    assert "| fixed |" in text and "## Parallel multilingual text" in text and "## Verdict" in text
    for f in ("bpb_vs_flops.png", "alignment.png", "boundaries.png", "boundaries.html", "command.txt"):
        assert (out / f).stat().st_size > 0, f


def test_a_second_invocation_resumes_without_retraining(study, shards):
    tmp, first, second = study
    assert "policy-seed0: training" in first.stdout and "uniform-seed0: training" in first.stdout
    assert "policy-seed0: finished already" in second.stdout
    assert "uniform-seed0: finished already" in second.stdout
    assert "fixed-seed0: training" in second.stdout
    assert "policy-seed0: evaluating" not in second.stdout  # its evaluations were kept
    # a fresh checkout: the run directories are gone, results.json keeps what they gave
    shutil.rmtree(tmp / "work" / "runs" / "uniform-seed0")
    before = json.loads((tmp / "out" / "results.json").read_text())
    data = ["--shards", shards, "--heldout", tmp / "heldout_prose.jsonl", "--parallel", tmp / "parallel.jsonl"]
    third = replicate("--preset", "toy", "--out", tmp / "out", "--work", tmp / "work", "--methods",
                      "policy,uniform,fixed", *data)
    assert third.returncode == 0, third.stderr[-2000:]
    assert "uniform-seed0: kept from" in third.stdout and "uniform-seed0: training" not in third.stdout
    after = json.loads((tmp / "out" / "results.json").read_text())
    assert after["aggregate"]["uniform"] == before["aggregate"]["uniform"]
    bad = replicate("--preset", "toy", "--out", tmp / "out2", "--work", tmp / "work2", "--shards", tmp / "x",
                    "--heldout", "y")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --shards") and bad.stderr.count("\n") == 1
    assert not (tmp / "work2" / "runs").exists()


def test_a_study_stopped_part_way_keeps_the_tables_of_its_finished_runs(study, shards, monkeypatch, capsys):
    """The tables are rewritten after every run: when a later run fails (or the study is killed, or its
    time runs out), results.json and results.md hold every run finished so far, and say how many."""
    from megatok.cli import replicate as cli
    from megatok.studies import replicate as runner

    def fail(run, nproc, budget=None):
        raise RuntimeError(f"{run['name']} failed with exit code 1; rerun the same command to resume it")

    tmp = study[0]
    monkeypatch.setattr(runner, "train", fail)
    data = ["--shards", str(shards), "--heldout", str(tmp / "heldout_prose.jsonl"), "--parallel",
            str(tmp / "parallel.jsonl")]
    rc = cli.main(["--preset", "toy", "--out", str(tmp / "out"), "--work", str(tmp / "work"), "--methods",
                   "policy,uniform,fixed,whitespace", *data])
    assert rc == 1 and "error: whitespace-seed0 failed" in capsys.readouterr().err
    result = json.loads((tmp / "out" / "results.json").read_text())
    assert [r["method"] for r in result["runs"]] == ["policy", "uniform", "fixed"]
    assert list(result["aggregate"]) == ["policy", "uniform", "fixed"]
    assert "3 runs in the tables; of the last command's 4, not finished yet: whitespace-seed0." in (
        tmp / "out" / "results.md").read_text()
    assert not list((tmp / "out").glob(".*.tmp"))


def test_report_only_writes_the_tables_of_the_finished_runs_and_trains_nothing(study, shards, monkeypatch,
                                                                                capsys):
    """--report-only: the finished runs (here listed after one that never ran) are in the tables at once,
    nothing trains, nothing is evaluated again, and the recorded command is the study's own."""
    from megatok.cli import replicate as cli
    from megatok.studies import replicate as runner

    def no_training(run, nproc, budget=None):
        raise AssertionError(f"{run['name']} trained")

    tmp = study[0]
    monkeypatch.setattr(runner, "train", no_training)
    out = tmp / "out3"
    out.mkdir()
    shutil.copy(tmp / "out" / "results.json", out / "results.json")  # uniform's run directory is gone: kept
    study_args = ["--preset", "toy", "--out", str(out), "--work", str(tmp / "work"), "--methods",
                  "whitespace,policy,uniform,fixed", "--shards", str(shards), "--heldout",
                  str(tmp / "heldout_prose.jsonl"), "--parallel", str(tmp / "parallel.jsonl")]
    assert cli.main([*study_args, "--report-only"]) == 0
    log = capsys.readouterr().out
    assert "whitespace-seed0: not finished (--report-only" in log and "evaluating" not in log
    result = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in result["runs"]] == ["policy", "uniform", "fixed"]
    assert "not finished yet: whitespace-seed0." in (out / "results.md").read_text()
    assert "--report-only" not in result["command"] and "whitespace,policy,uniform,fixed" in result["command"]
    narrower = [*study_args[:study_args.index("--methods") + 1], "policy", *study_args[study_args.index("--methods") + 2:]]
    assert cli.main([*narrower, "--report-only"]) == 0  # a later invocation naming fewer methods
    result = json.loads((out / "results.json").read_text())
    assert list(result["aggregate"]) == ["policy", "uniform", "fixed"]  # the others' runs stay in the tables
    assert "| uniform |" in (out / "results.md").read_text()


def test_the_verdict_says_what_the_figures_say():
    def agg(frac, bpb):
        return {"sbw_boundary_fraction": {"mean": frac}, "bpb": {"mean": sum(bpb) / len(bpb), "min": min(bpb),
                                                               "max": max(bpb), "n": len(bpb)},
                "bpb_by_seed": {str(i): v for i, v in enumerate(bpb)}}

    lines = verdict({"policy": agg(0.7, [3.0, 3.02]), "uniform": agg(0.2, [3.2, 3.21]),
                     "fixed": agg(0.2, [3.01, 3.03])})
    assert "0.70 of the spaces" in lines[0] and "reached" in lines[0] and "not reached" not in lines[0]
    assert "uniform: 0.20" in lines[0]
    assert "policy beats uniform" in lines[1] and "(policy lower by 0.1950;" in lines[1]
    assert "within the seed spread of fixed" in lines[2]
    # the same seed, the same data order: the policy is lower than fixed on both seeds
    assert "paired by seed, fixed minus policy: +0.0100, +0.0100 (seeds 0, 1; policy lower in 2 of 2)" in lines[2]
    one = verdict({"policy": agg(0.3, [3.0]), "fixed": agg(0.2, [3.1])})
    assert "not reached" in one[0] and "one seed, so no spread" in one[1] and "beats" not in one[1]
    # one seed against three: the difference on the seed both ran, not only against the others' mean
    vr = verdict({"policy-vr": agg(0.1, [3.29]), "uniform": agg(0.2, [3.30, 3.39, 3.45])})
    assert "(policy-vr lower by 0.0900; on seed 0, the one both ran: 3.2900 against 3.3000, policy-vr lower by 0.0100)" \
        in vr[1] and "one seed, so no spread" in vr[1]
    # a lag-1 policy starts its chunks at the word's first byte: its alignment is read there
    lag = verdict({"policy-lag1": {**agg(0.05, [3.3]), "wfb_boundary_fraction": {"mean": 0.9}},
                   "uniform": {**agg(0.2, [3.4]), "wfb_boundary_fraction": {"mean": 0.21}}})
    assert "0.90 of the first bytes of words after a space" in lag[0] and "uniform: 0.21" in lag[0]
    assert "not reached" not in lag[0]
    assert markdown(aggregate([], ["policy"]), PRESETS["toy"], "# t").startswith("# t")
    assert set(PRESETS["cpu-small"].methods) < set(METHODS)


def test_configs_are_written_for_the_ranks_that_train_them(tmp_path, shards):
    """cpu-small trains on 2 ranks: every config loads for 2 ranks (train.grad_accum is derived, not frozen
    at the world size of the process that wrote it), differs only where the method does, and keeps the bytes;
    the BPE token model's tokenizer is trained on the shards and its window covers the same bytes."""
    from megatok.studies.replicate import write_configs
    from megatok.config import load_config

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"text": "A held-out sentence.", "domain": "speech"}) + "\n")
    data = {"shards": str(shards), "heldout": [str(heldout)], "parallel": []}
    bpe = write_configs(PRESETS["toy"], tmp_path, data, [0], ["bpe"], [], PRESETS["toy"].nproc)[0]
    cfg = load_config(bpe["config"], world_size=PRESETS["toy"].nproc)
    assert cfg.model.kind == "bpe" and (tmp_path / "bpe-tokenizer" / "tokenizer.model").is_file()
    assert cfg.data.seq_len * cfg.model.bytes_per_token == pytest.approx(128, rel=0.05)  # toy's 128-byte window
    runs = write_configs(PRESETS["cpu-small"], tmp_path, data, [0, 1], ["policy", "policy-vr", "hnet"], [], 2)
    assert [r["name"] for r in runs] == ["policy-seed0", "policy-vr-seed0", "hnet-seed0", "policy-seed1",
                                         "policy-vr-seed1", "hnet-seed1"]
    cfgs = {r["name"]: load_config(r["config"], world_size=2) for r in runs}
    assert {c.train.grad_accum for c in cfgs.values()} == {1} and {c.train.seed for c in cfgs.values()} == {0, 1}
    assert cfgs["policy-vr-seed0"].boundary.options.samples == 2
    assert cfgs["hnet-seed1"].boundary.strategy == "hnet"
    assert len({(c.train.max_steps, c.train.global_batch_size, c.data.seq_len) for c in cfgs.values()}) == 1


def test_wall_time_counts_every_start_and_not_the_time_between():
    from megatok.studies.replication import training_seconds

    def train(step, t):
        return {"split": "train", "step": step, "time": t}

    rows = [train(10, 100), train(20, 110), {"split": "val", "step": 20, "time": 125},
            {"split": "event", "event": "stopped by signal", "step": 25, "time": 130},
            train(30, 5000), train(40, 5010),  # resumed after a stop: 4870 s between the starts
            train(30, 9000), train(40, 9010), train(50, 9020)]  # killed after step 40, resumed from step 20
    # starts 100-130, 5000-5010 and 9000-9020, each with one median interval (10 s) for its start-up
    assert training_seconds(rows) == pytest.approx(30 + 10 + 10 + 10 + 20 + 10)
    assert training_seconds([train(10, 100)]) is None


def test_a_failed_step_is_one_error_naming_its_command(tmp_path, capsys):
    """A data step the study runs in its own process (the library call of a megatok-* command) stops it
    with one line naming that command: bad input raised, or an exit status returned after its error."""
    from megatok.eval.policy_probe import probe_run
    from megatok.studies.replicate import shards_of, step

    with pytest.raises(RuntimeError, match=r"^megatok-build-shards \S+missing.jsonl --out \S+ failed: \S+missing"
                                           r".jsonl: no such file"):
        shards_of(tmp_path / "missing.jsonl", tmp_path / "shards", 4)
    assert not (tmp_path / "shards").exists()
    with pytest.raises(RuntimeError, match=r"^megatok-boundary-value --run x failed \(exit 2; its error is above\)$"):
        step("megatok-boundary-value --run x", probe_run, str(tmp_path / "no-run"))
    assert "no-run/config.json" in capsys.readouterr().err


def test_the_prose_data_step_builds_corpus_parallel_set_and_shards_once(tmp_path, monkeypatch):
    """cpu-small's data step without --shards: the prose corpus (megatok-make-corpus --preset prose --strict)
    and the parallel UDHR set built under WORK/data with the cache beside WORK, shards from the corpus, an
    evaluation file with every domain of the held-out prose; a second call builds nothing again; a corpus
    that cannot be built is one error naming its command."""
    from megatok.data import corpus
    from megatok.studies import replicate as rep
    from tests.conftest import stdlib_texts

    texts, calls = stdlib_texts(12, 4000), []

    def docs(domain_of):
        return [{"text": t, "lang": "en", "domain": domain_of(i), "source": f"s/{i}"} for i, t in enumerate(texts)]

    def make_prose(out, *, heldout_out, cache, strict):
        calls.append(("prose", Path(cache), strict))
        corpus.write_jsonl_gz(out, docs(lambda i: ("docs", "speech", "fiction")[i % 3]))
        corpus.write_jsonl_gz(heldout_out, docs(lambda i: ("docs", "speech", "fiction")[i % 3]))
        return 0

    def make_default(out, *, sources, heldout_out, cache):
        calls.append(("udhr", Path(cache), sources))
        corpus.write_jsonl_gz(heldout_out, docs(lambda i: "legal")[:2], compress=False)
        return 0

    monkeypatch.setattr(corpus, "make_prose", make_prose)
    monkeypatch.setattr(corpus, "make_default", make_default)
    preset, work = PRESETS["cpu-small"], tmp_path / "study" / "work"
    given = {"shards": None, "heldout": None, "parallel": None}
    data = rep.prepare_data(preset, work, given)
    assert calls == [("prose", tmp_path / "study" / ".cache", True), ("udhr", tmp_path / "study" / ".cache", ["udhr"])]
    assert data == {"shards": str(work / "data/prose_shards"), "heldout": [str(work / "data/eval_prose.jsonl")],
                    "parallel": [str(work / "data/heldout_udhr.jsonl")]}
    manifest = json.loads((work / "data/prose_shards/manifest.json").read_text())
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == len(texts)
    scored = [json.loads(line) for line in (work / "data/eval_prose.jsonl").read_text().splitlines()]
    assert {d["domain"] for d in scored} == {"docs", "speech", "fiction"}
    assert rep.prepare_data(preset, work, given) == data and len(calls) == 2  # built once

    def fails(out, **kw):
        print("error: --preset prose --strict: no text from source(s) pydocs", file=sys.stderr)
        return 2

    monkeypatch.setattr(corpus, "make_prose", fails)
    with pytest.raises(RuntimeError, match=r"^megatok-make-corpus --preset prose --strict --out \S+prose.jsonl.gz "
                                           r"failed \(exit 2; its error is above\)$"):
        rep.prepare_data(preset, tmp_path / "other" / "work", given)


def test_a_handover_trains_each_seeds_source_then_every_method_from_its_checkpoint(study, shards):
    """--handover whitespace:2 on toy (4 steps): the whitespace source trains the first 2 steps of the 4-step
    schedule, each method the other 2 from its checkpoint with seed + 10; the tables hold the methods only,
    a rerun trains nothing, and a study without --handover cannot write into the same --out."""
    from megatok.config import load_config

    tmp = study[0]
    args = ["--preset", "toy", "--out", tmp / "ho-out", "--work", tmp / "work", "--methods", "policy,uniform",
            "--shards", shards, "--heldout", tmp / "heldout_prose.jsonl", "--handover", "whitespace:2"]
    first = replicate(*args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "source-whitespace-seed0: training the hand-over's source" in first.stdout
    assert first.stdout.count("megatok: weights from") == 2  # each method's start line names the source
    home = tmp / "work" / "handover-whitespace2"
    source = load_config(str(home / "configs" / "source-whitespace-seed0.json"), world_size=1).train
    assert (source.max_steps, source.schedule_steps, source.seed) == (2, 4, 0)
    for m in ("policy", "uniform"):
        cfg = load_config(str(home / "configs" / f"{m}-seed0.json"), world_size=1)
        assert cfg.boundary.strategy == m and (cfg.train.max_steps, cfg.train.seed) == (2, 10)
        assert cfg.train.init_from == str(home / "runs" / "source-whitespace-seed0" / "checkpoints" / "step00000002")
    result = json.loads((tmp / "ho-out" / "results.json").read_text())
    assert result["handover"] == {"source": "whitespace", "steps": 2, "seed_offset": 10}
    assert [(r["method"], r["steps"]) for r in result["runs"]] == [("policy", 2), ("uniform", 2)]
    assert all(r["handed_over_from"].endswith("source-whitespace-seed0") for r in result["runs"])
    assert "Handed over: every method starts from the whitespace run's step-2 checkpoint" in (
        tmp / "ho-out" / "results.md").read_text()
    again = replicate(*args)
    assert again.returncode == 0 and "source-whitespace-seed0: not needed" in again.stdout
    assert "training" not in again.stdout
    mixed = replicate(*args[:-2])
    assert mixed.returncode == 2 and mixed.stderr.count("\n") == 1
    assert "records a study handed over from whitespace:2; this one has no --handover" in mixed.stderr
    elsewhere = [tmp / "ho-out2" if a == tmp / "ho-out" else a for a in args[:-1]]
    late = replicate(*elsewhere, "whitespace:4")
    assert late.returncode == 2 and "between 0 and train.max_steps (4)" in late.stderr
    assert replicate(*elsewhere, "bpe:2").returncode == 2 and not (tmp / "ho-out2").exists()


def _fake_run(tmp_path, monkeypatch):
    """train()'s command replaced by a process that ignores the stop file, ends on SIGTERM after its child
    (which it writes down: the whole group had the signal) and would otherwise sleep a minute."""
    from megatok.studies import launch as runner

    script = ("import signal, subprocess, sys, time, pathlib\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "def stop(*_):\n"
              "    asked = ' after its stop file' if pathlib.Path(sys.argv[2], 'STOP').exists() else ''\n"
              "    pathlib.Path(sys.argv[1]).write_text(str(child.wait()) + asked)\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "time.sleep(60)\n")
    marker = tmp_path / "stopped"
    monkeypatch.setattr(runner, "local_command",
                        lambda run, nproc: [sys.executable, "-c", script, str(marker), str(tmp_path / "run")])
    monkeypatch.setattr(runner.Budget, "RESERVE_S", 0.5)
    monkeypatch.setattr(runner.Budget, "GRACE_S", 11.0)  # the stop file's wait: 1 s (the SIGTERM phase's 10 taken)
    return {"name": "uniform-seed0", "run_dir": str(tmp_path / "run")}, marker


def test_a_budget_stops_the_running_run_and_starts_none_in_its_last_seconds(tmp_path, monkeypatch):
    """--budget-s: GRACE_S before the budget's end a run still going is asked to stop (its STOP file), then,
    still going GRACE_S later, gets SIGTERM in its own process group (every rank: here a child too), and the
    study stops with BudgetSpent; in the budget's last RESERVE_S seconds no run starts. (The trainer's
    checkpoint on its stop file or SIGTERM: tests/train.)"""
    from megatok.studies import launch as runner

    run, marker = _fake_run(tmp_path, monkeypatch)
    budget = runner.Budget(3)
    with pytest.raises(runner.BudgetSpent, match="spent while uniform-seed0 trained"):
        runner.train(run, 1, budget)
    # asked first, the trainer's way; then the group's SIGTERM: the child had it too, and the run saw it end
    assert marker.read_text() == "-15 after its stop file"
    assert not (tmp_path / "run" / "STOP").exists()  # the stop file does not outlive the run
    monkeypatch.setattr(runner.Budget, "RESERVE_S", 3.0)  # the budget's last seconds
    with pytest.raises(runner.BudgetSpent, match="uniform-seed0 not started"):
        runner.train(run, 1, budget)


def test_a_sigterm_to_the_study_stops_its_run_first(tmp_path, monkeypatch):
    """A SIGTERM to the study (run_study turns it into StudyStopped) ends the run's whole process group before
    the study goes, not leaving it to train on alone."""
    import signal
    import threading

    from megatok.studies import launch as runner

    run, marker = _fake_run(tmp_path, monkeypatch)

    def stopped(signum, frame):
        raise runner.StudyStopped("stopped by SIGTERM")

    previous = signal.signal(signal.SIGTERM, stopped)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        with pytest.raises(runner.StudyStopped):
            runner.train(run, 1, runner.Budget(None))
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert marker.read_text() == "-15 after its stop file"
    assert not (tmp_path / "run" / "STOP").exists()


def test_stop_signals_leave_an_ignored_sighup_alone_and_restore_the_handlers():
    """Under nohup (SIGHUP ignored) a closed terminal does not stop a study; SIGTERM does, once."""
    import signal

    from megatok.studies import launch

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN), signal.getsignal(signal.SIGTERM)
    try:
        with launch.stop_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            handler = signal.getsignal(signal.SIGTERM)
            with pytest.raises(launch.StudyStopped):
                handler(signal.SIGTERM, None)
            handler(signal.SIGTERM, None)  # a second one while the study winds down: ignored
        assert signal.getsignal(signal.SIGTERM) == before[1]
    finally:
        signal.signal(signal.SIGHUP, before[0])


def test_budget_and_prepare_only_stay_out_of_the_recorded_command(tmp_path, shards, monkeypatch, capsys):
    """--prepare-only writes the configs and trains nothing; --budget-s, as --report-only, says how much to do
    now, not what the study is: the command recorded in results.json leaves them out. A budget spent before
    any run starts: exit status 3 and the message."""
    from megatok.cli import replicate as cli
    from megatok.studies import replicate as runner

    prose = tmp_path / "prose.jsonl"
    prose.write_text(json.dumps({"text": stdlib_texts(1, 3000)[0], "lang": "en", "domain": "docs"}) + "\n")
    args = ["--preset", "toy", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--methods",
            "uniform", "--shards", str(shards), "--heldout", str(prose)]
    assert cli.main([*args, "--prepare-only"]) == 0
    assert (tmp_path / "work/configs/uniform-seed0.json").is_file() and not (tmp_path / "out").exists()
    assert "nothing trained" in capsys.readouterr().out
    from megatok.studies import launch

    monkeypatch.setattr(launch.Budget, "RESERVE_S", 1e6)
    assert cli.main([*args, "--budget-s", "600"]) == 3
    assert "uniform-seed0 not started; 0 of 1 runs finished" in capsys.readouterr().err
    result = json.loads((tmp_path / "out/results.json").read_text())
    assert "--budget-s" not in result["command"] and "600" not in result["command"]
    with pytest.raises(SystemExit):
        cli.parse_args([*args, "--budget-s", "0"])
