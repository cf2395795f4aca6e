"""The launcher and the tools on bad input: exit code 2 and one 'error:' line that names the file,
no traceback, and for the launcher no process group (the check happens before anything starts).
Plus inputs that look odd but are fine: binary text, a document much longer than a sequence, and
a finished run started again."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import time

import pytest
import torch

from megatok.data.stream import iter_shard_documents, resolve_shards
from megatok.metrics import read_metrics
from tests.conftest import ROOT, TINY, launch_module, pretrain, run_main, run_tool, stdlib_texts


def build(*args) -> subprocess.CompletedProcess:
    return run_tool("build_shards", "--no-progress", *args, timeout=120)


def assert_one_error_line(r: subprocess.CompletedProcess, *names) -> str:
    """Exit code 2; stderr, warnings aside, is a single line starting with 'error:' naming each of names."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    lines = [line for line in r.stderr.splitlines()
             if line.strip() and "[WARNING]" not in line and not line.lower().startswith("warning")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: "), lines[0]
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    assert "Traceback" not in r.stderr
    return lines[0]


def launch_fails_as_a_process(tmp_path, *args, config="configs/tiny.json", names=()) -> str:
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    r = pretrain(["--config", str(config), "--set", *TINY, f"train.run_dir={run_dir}", *args], check=False,
                 timeout=60)
    line = assert_one_error_line(r, *names)
    out = r.stdout + r.stderr
    assert "Initializing" not in out and "process group" not in out and "megatok:" not in out, out[-2000:]
    assert not run_dir.exists()  # the checks before it is created (the last pre-start check) failed first
    assert time.monotonic() - t0 < 30
    return line


@pytest.fixture
def launch_fails(capsys, monkeypatch):
    """launch/pretrain.py's main() in this process (an interpreter start saved per case), its run() (the
    process group, the trainer) made to fail the test if reached: the error comes before anything starts."""
    launch = launch_module()
    monkeypatch.setattr(launch, "run", lambda *a: pytest.fail("training started"))
    monkeypatch.chdir(ROOT)

    def fails(tmp_path, *args, config="configs/tiny.json", names=()) -> str:
        run_dir = tmp_path / "run"
        capsys.readouterr()
        rc = launch.main(["--config", str(config), "--set", *TINY, f"train.run_dir={run_dir}", *args])
        out, err = capsys.readouterr()
        line = assert_one_error_line(subprocess.CompletedProcess("pretrain", rc, out, err), *names)
        assert "megatok:" not in out + err
        assert not run_dir.exists()  # the checks before it is created (the last pre-start check) failed first
        return line
    return fails


def tree(path) -> dict[str, tuple[int, int, str]]:
    """Every file under path: (size, mtime in ns, sha256)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            st = os.stat(p)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = (st.st_size, st.st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return out


# --------------------------------------------------------------------------- launch/pretrain.py


def test_launch_shards_missing_directory(tmp_path):
    missing = tmp_path / "no-such-shards"
    launch_fails_as_a_process(tmp_path, f"data.shards={missing}", names=["data.shards", missing])


def test_launch_shards_empty_directory(tmp_path, launch_fails):
    empty = tmp_path / "empty"
    empty.mkdir()
    launch_fails(tmp_path, f"data.shards={empty}", names=["data.shards", empty])


def test_launch_val_shards_missing_names_its_key(shards, tmp_path, launch_fails):
    missing = tmp_path / "val-typo"
    line = launch_fails(tmp_path, f"data.shards={shards}", f"data.val_shards={missing}", names=[missing])
    assert line.startswith(f"error: data.val_shards: {missing}: no such shard directory or file")


def test_launch_shard_listed_in_manifest_deleted(shards, tmp_path, launch_fails):
    copy = tmp_path / "shards"
    copy.mkdir()
    for f in shards.iterdir():
        (copy / f.name).symlink_to(f)
    gone = copy / json.loads((shards / "manifest.json").read_text())["train"][1]["name"]
    gone.unlink()
    launch_fails(tmp_path, f"data.shards={copy}", names=["data.shards", gone])


def test_launch_config_not_json(shards, tmp_path, launch_fails):
    bad = tmp_path / "bad.json"
    bad.write_text('{"extends": "base.json", "model": {"d_model": 32,}\n')
    launch_fails(tmp_path, f"data.shards={shards}", config=bad, names=[bad])


def test_launch_config_missing(shards, tmp_path, launch_fails):
    missing = tmp_path / "nope.json"
    launch_fails(tmp_path, f"data.shards={shards}", config=missing, names=[missing])


@pytest.mark.parametrize("kind", ["scheme", "braces", "betas", "seed", "run_dir", "no_val_split"])
def test_launch_values_that_would_fail_after_start_up(kind, shards, tmp_path, launch_fails):
    """Mistakes that used to get past the checks and end in a traceback once the process group was up."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    args, names = {
        "scheme": (["data.shards=htps://example.com/train-{00000..00007}.tar"], ["unknown URL scheme 'htps:'",
                                                                             "htps://example.com/train-00000.tar"]),
        "braces": (['data.shards={"a": 1, "b": 1'], ["not a shard pattern", "Unbalanced braces"]),
        "betas": ([f"data.shards={shards}", "train.betas=[0.9,1.5]"], ["train.betas", "[0, 1)", "[0.9, 1.5]"]),
        "seed": ([f"data.shards={shards}", "train.seed=-1"], ["train.seed", "greater than or equal to 0"]),
        "run_dir": ([f"data.shards={shards}", f"train.run_dir={afile}/run"],
                    [f"train.run_dir: {afile}/run cannot be created (Not a directory)"]),
        # a URL pattern has no val split: it used to validate on its own training shards, silently
        "no_val_split": ([f"data.shards=pipe:cat {shards}/train-{{00000..00003}}.tar"],
                         ["URLs and shard lists have no val split; set data.val_shards"]),
    }[kind]
    launch_fails(tmp_path, *args, names=names)


# --------------------------------------------------------------------------- megatok-build-shards


def test_build_missing_input(tmp_path):
    missing = tmp_path / "no-such.jsonl"
    assert_one_error_line(build(missing, "--out", tmp_path / "out"), missing)
    assert list(tmp_path.iterdir()) == []


def test_build_without_documents_leaves_existing_output_intact(shards, tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    for f in shards.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    before = tree(out)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    line = assert_one_error_line(build(empty, "--out", out, "--overwrite"), empty)
    assert "no documents" in line
    assert tree(out) == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("shards.")]  # no .tmp-/.old- left


def test_build_binary_text(tmp_path):
    """Not UTF-8 at all: the model reads bytes, so the bytes go into the shards unchanged."""
    rng = random.Random(0)
    blobs = [bytes(rng.randrange(256) for _ in range(3000)) + b"\xff\xfe\x80\xc3" for _ in range(3)]
    for i, blob in enumerate(blobs):
        (tmp_path / f"blob{i}.txt").write_bytes(blob)
    out = tmp_path / "out"
    r = build(*(tmp_path / f"blob{i}.txt" for i in range(3)), "--out", out, "--val-fraction", "0.3")
    assert r.returncode == 0, r.stderr
    got = [d.text for split in ("train", "val") for d in iter_shard_documents(resolve_shards(str(out), split))]
    assert sorted(got) == sorted(blobs)


@pytest.fixture(scope="module")
def long_doc_run(tmp_path_factory):
    """One 20 kB document and a few short ones; 2 steps of 2 sequences of 64 bytes. The short ones
    hold fewer bytes than one step, so whatever their order the long document is trained on."""
    tmp = tmp_path_factory.mktemp("longdoc")
    long_text = "".join(stdlib_texts(n_files=20)).encode("ascii", "ignore")[:20_000].decode()
    assert len(long_text.encode()) == 20_000
    small = [f"short document {i}." for i in range(5)]
    assert sum(len(s) + 1 for s in small) < 2 * 64
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in [long_text, *small]))
    shard_dir = tmp / "shards"
    r = build(corpus, "--out", shard_dir, "--val-fraction", "0.2")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    assert manifest["bytes"]["train"] >= 20_000, manifest  # the long document is in the train split
    assert manifest["split_documents"] == 0
    run_dir = tmp / "run"
    args = ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shard_dir}", f"train.run_dir={run_dir}",
            "train.max_steps=2", "train.micro_batch_size=2", "train.global_batch_size=2", "data.seq_len=64"]
    pretrain(args)
    return run_dir, args


def test_document_longer_than_the_sequence_trains(long_doc_run):
    run_dir, _ = long_doc_run
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(0 < r["bpb"] < 12 for r in train)
    assert [r for r in rows if r.get("split") == "val"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000002"


def test_finished_run_started_again_leaves_checkpoints_alone(long_doc_run):
    run_dir, args = long_doc_run
    ckpts = run_dir / "checkpoints"
    before, metrics_before = tree(ckpts), (run_dir / "metrics.jsonl").read_text()
    r = pretrain(args)  # same run dir, same max_steps, --resume auto
    assert "start step 2" in r.stdout, r.stdout[-2000:]
    assert "step00000002 is at step 2 and train.max_steps is 2: nothing to train" in r.stdout
    assert (ckpts / "latest").read_text().strip() == "step00000002"
    assert tree(ckpts) == before
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step00000002"]
    new_rows = (run_dir / "metrics.jsonl").read_text()[len(metrics_before):]
    assert not [r for r in map(json.loads, new_rows.splitlines()) if r.get("split") == "train"]


# --------------------------------------------------------------------------- the other commands


def assert_usage_error(r: subprocess.CompletedProcess, *names) -> str:
    """Exit code 2, no traceback, and the last line of stderr an error naming each of names (argparse's
    usage lines may come before it)."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "error: " in last, last
    for name in names:
        assert str(name) in last, (name, last)
    return last


@pytest.mark.parametrize("command, args, names", [
    ("evaluate", ["--data", "x.jsonl", "--batch-size", "0"], ["--batch-size", "must be > 0, got 0"]),
    ("evaluate", ["--data", "x.jsonl", "--seq-len", "-5"], ["--seq-len", "must be > 0, got -5"]),
    ("lm_eval", ["--tasks", "t", "--limit", "-1"], ["--limit", "must be > 0, got -1"]),
    ("bench", ["--threads", "0", "--quick"], ["--threads must be >= 1, got 0"]),
    ("gpu_check", ["--steps", "0", "--cpu-smoke", "--sections", "attention"], ["--steps", "got 0, 20 and 3"]),
    ("zero_init_check", ["--config", "configs/tiny.json", "--ranks", "0"], ["--ranks", "must be > 0, got 0"]),
    ("match_bpe", ["--config", "configs/tiny.json", "--vocab-size", "512", "--bytes-per-token", "3", "--rate", "2"],
     ["--rate", "must be > 0 and <= 1, got 2"]),
    ("show_boundaries", ["--strategy", "polcy", "--text", "hello world"], ["--strategy polcy", "need --run"]),
    ("estimator_variance", ["--variant", "bad"], ["--variant 'bad': expected NAME=KEY:VALUE,... (NAME= alone: the "
                                                  "run's own options)"]),
    ("gpu_check", ["--cpu-smoke", "--configs", "configs/tiny.json"], ["--configs is for the GPU run; --cpu-smoke "
                                                                     "runs configs/tiny.json, shrunk"]),
    ("gpu_check", ["--cpu-smoke", "--trainer-config", "configs/1b.json"], ["--trainer-config is for the GPU run; "
                                                                          "--cpu-smoke runs configs/tiny.json"]),
    ("config_reference", ["--check", "no-such.md"], ["no-such.md", "No such file or directory"]),
])
def test_a_value_out_of_range_is_a_one_line_error(command, args, names, capsys, tmp_path, monkeypatch):
    """A count, size or rate out of range (or a file that is not there) stops the command with exit 2 and
    a line naming it, before any work: not a traceback from deep inside, nor a result from a nonsense value."""
    monkeypatch.chdir(ROOT)
    where = {"evaluate": ["--run", tmp_path], "estimator_variance": ["--run", tmp_path],
             "lm_eval": ["--model", tmp_path],
             "match_bpe": ["--out", tmp_path / "bpe.json"], "config_reference": []}.get(command, [])
    if command == "config_reference":
        args = ["--check", tmp_path / "no-such.md"]
    assert_usage_error(run_main(capsys, command, *where, *args), *names)
    assert not (tmp_path / "bpe.json").exists()


def test_data_a_study_cannot_read_is_a_one_line_error(tiny_run, capsys, tmp_path):
    """The probe and the estimator-variance study on a missing file, or on too little text for a batch;
    megatok-lm-eval on a task whose data file is missing: exit 2 and one error line naming the file."""
    def one_error_line(r, name):
        assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and str(name) in errors[0], r.stderr
        return errors[0]

    missing, short = tmp_path / "missing.jsonl", tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "one short document"}) + "\n")
    small = ["--batch-size", "2", "--seq-len", "64"]
    one_error_line(run_main(capsys, "boundary_value", "--run", tiny_run, "--data", missing, "--rounds", "1", *small),
                   missing)
    line = one_error_line(run_main(capsys, "boundary_value", "--run", tiny_run, "--data", short, *small), short)
    assert "only 1 sequences of 64 bytes, need 2" in line
    one_error_line(run_main(capsys, "estimator_variance", "--run", tiny_run, "--data", missing, "--samples", "2",
                            *small), missing)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "t.yaml").write_text(
        f"task: local_missing\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {missing}\n"
        'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n")
    line = one_error_line(run_main(capsys, "lm_eval", "--model", tiny_run, "--tasks", "local_missing",
                                   "--include-path", tasks), missing)
    assert line.startswith("error: --tasks local_missing: ")


#: The commands that load a model on --device, each with the rest of a command line it would accept.
DEVICE_COMMANDS = {"evaluate": ["--run", "r", "--data", "x.jsonl"], "generate": ["--run", "r"],
                   "lm_eval": ["--model", "r", "--tasks", "t"], "compare": ["r", "--out", "o"], "bench": ["--quick"]}
WITH_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has a CUDA device")
NO_CUDA = (f"this torch has no CUDA (torch {torch.__version__}); use --device cpu" if torch.version.cuda is None
           else "no CUDA device is visible")


@pytest.mark.parametrize("command", sorted(DEVICE_COMMANDS))
@pytest.mark.parametrize("device, why", [
    ("tpu", "tpu: not a device megatok runs models on (cpu, cuda or cuda:N)"),
    ("gpu", "gpu: not a device megatok runs models on (cpu, cuda or cuda:N)"),
    pytest.param("cuda", f"cuda: {NO_CUDA}", marks=WITH_CUDA),
    pytest.param("cuda:3", f"cuda:3: {NO_CUDA}", marks=WITH_CUDA),
])
def test_a_device_this_torch_cannot_use_is_a_usage_error(command, device, why, capsys, tmp_path, monkeypatch):
    """--device is checked as the command line is read (nothing loaded, no run needed): one line naming the
    option, the value and why, instead of torch's traceback from inside the load."""
    monkeypatch.chdir(tmp_path)
    r = run_main(capsys, command, *DEVICE_COMMANDS[command], "--device", device)
    assert f"error: argument --device: {why}" in assert_usage_error(r, "--device")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--top-k", "-1"], "argument --top-k: must be >= 0 (0: no limit), got -1"),
    (["--top-p", "0"], "argument --top-p: must be > 0 and <= 1, got 0"),
    (["--top-p", "1.5"], "argument --top-p: must be > 0 and <= 1, got 1.5"),
    (["--temperature", "-0.5"], "argument --temperature: must be >= 0 (0: greedy), got -0.5"),
    (["--max-bytes", "0"], "argument --max-bytes: must be > 0, got 0"),
    (["--num", "0"], "argument --num: must be > 0, got 0"),
])
def test_generate_names_the_option_out_of_range(args, message, capsys, tmp_path):
    """megatok-generate's sampling options take the Python API's ranges, each refused on its own line."""
    r = run_main(capsys, "generate", "--run", tmp_path, *args)
    assert assert_usage_error(r).endswith(f"error: {message}")
