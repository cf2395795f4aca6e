"""Shared fixtures: a small real-text shard set, a tiny byte-model run and a BPE token-model run trained on it,
and a helper that runs launch/pretrain.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import pytest

from tests import preloaded
from tests.preloaded import Ranks  # noqa: F401 - the tests start ranks through conftest

ROOT = Path(__file__).resolve().parents[1]
# The suite runs on the CPU, also on a machine with GPUs: its figures are CPU figures, and DeepSpeed's
# accelerator is the CPU (DS_ACCELERATOR=cpu below). Set before torch first looks for a GPU; every
# process the tests start inherits it.
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def stdlib_texts(n_files: int = 80, max_bytes: int = 40_000) -> list[str]:
    """Real text that is on every machine: the interpreter's own standard library sources."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out = []
    for f in files:
        text = f.read_text(errors="replace")[:max_bytes]
        if len(text) > 2000:
            out.append(text)
        if len(out) == n_files:
            break
    return out


def pytest_configure(config):
    """One torch thread in the test processes, as in every process they start (OMP_NUM_THREADS=1): two
    workers on two cores, each running its own tests' kernels and processes, and more threads than cores
    make OpenMP's waiting threads spin against each other (an evaluation in a worker took 7x longer)."""
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """tools/test.sh gives each file to one of two workers (pytest-xdist --dist loadfile
    --no-loadscope-reorder), in this order; a long file handed out last runs alone at the end. So the
    files with the most multi-process runs (tests marked dist) go first, the cluster's (the longest) before
    them; the order inside a file is kept."""
    runs = Counter(item.path for item in items if item.get_closest_marker("dist"))
    runs.update({item.path: 1000 for item in items if item.get_closest_marker("cluster")})
    items.sort(key=lambda item: -runs[item.path])


@pytest.fixture(autouse=True)
def _signals_as_they_were():
    """A test that runs launch code in this process (which ignores SIGTERM before its last line) gets the
    worker's signal handlers back: an ignored signal is inherited by every process started later, and a
    shell cannot trap what it was started ignoring (the launch template's SIGTERM tests then hang)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for sig, handler in before.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> Path:
    """4 train shards + a validation shard built by the real build_shards."""
    from megatok.data.shards import build_shards

    tmp = tmp_path_factory.mktemp("corpus")
    corpus = tmp / "corpus.jsonl"
    with corpus.open("w") as f:
        for i, text in enumerate(stdlib_texts()):
            f.write(json.dumps({"text": text, "lang": "en", "domain": "code" if i % 3 else "prose"}) + "\n")
    out = tmp / "shards"
    build_shards([str(corpus)], str(out), val_fraction=0.1, num_shards=4, progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_run(shards, tmp_path_factory) -> Path:
    """A run directory named "tiny": 3 steps of configs/tiny.json (TINY) on one rank, checkpoint at the
    end. Shared by the tools' tests that only read a trained run."""
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run_dir}",
              "train.max_steps=3", "train.micro_batch_size=2", "train.global_batch_size=2"])
    return run_dir


# The same two sentences in three languages and scripts: a tiny parallel held-out set.
PARALLEL = {
    "en": ["All human beings are born free and equal in dignity and rights.",
           "Everyone has the right to life, liberty and security of person."],
    "ru": ["Все люди рождаются свободными и равными в своем достоинстве и правах.",
           "Каждый человек имеет право на жизнь, на свободу и на личную неприкосновенность."],
    "zh": ["人人生而自由，在尊严和权利上一律平等。", "人人有权享有生命、自由和人身安全。"],
}


@pytest.fixture(scope="session")
def bpe_run(shards, tmp_path_factory):
    """3 steps of a BPE token model (vocabulary 512, 2 layers of width 32) on one rank."""
    from megatok import bpe

    tmp = tmp_path_factory.mktemp("bpe-run")
    texts = [t.encode() for t in stdlib_texts(n_files=10)] + [" ".join(s for v in PARALLEL.values() for s in v).encode()]
    bpe.train_bpe(texts, tmp / "tok", 512)
    run = tmp / "bpe"
    pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
              "model.kind=bpe", f"model.tokenizer={tmp / 'tok'}", "model.vocab_size=512", "model.bytes_per_token=3.0",
              "model.n_encoder_layers=0", "model.n_decoder_layers=0", "model.n_main_layers=2", "data.seq_len=32",
              "train.max_steps=3", "train.micro_batch_size=2", "train.global_batch_size=2"])
    return run


TOOL_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled",
            "PYTHONPATH": str(ROOT)}


def python(*argv, env: dict | None = None, cwd=ROOT, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` (str() of each) in its own process, output captured,
    with TOOL_ENV updated by ``env``: a fork of tests/preloaded.py's server (no interpreter start-up)."""
    return preloaded.run([str(a) for a in argv], env={**TOOL_ENV, **(env or {})}, cwd=cwd, timeout=timeout,
                         forked=preloaded.enabled())


def run_tool(name: str, *args, **kw) -> subprocess.CompletedProcess:
    """The command megatok.cli.NAME with the arguments in its own process: :func:`python` ``-m``."""
    return python("-m", f"megatok.cli.{name}", *args, **kw)


def sigterm_when(cmd: list, ready, *, env: dict | None = None, timeout: float = 150) -> tuple[int, str, int]:
    """Start ``cmd`` (in ROOT, a session of its own), send it SIGTERM as soon as ``ready()`` is true (polled;
    an assertion error with its output if it never is), and wait for it: (exit status, its stdout and
    stderr, its pid, which is also its session's id). What is left of the session is killed."""
    import time

    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env or TOOL_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not ready() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert ready(), proc.communicate(timeout=60)[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output, proc.pid


def launch_module():
    """launch/pretrain.py as a module, to call its main() and run() in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_main", ROOT / "launch/pretrain.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    return launch


def run_main(capsys, name: str, *args) -> subprocess.CompletedProcess:
    """megatok.cli.NAME's ``main(argv)`` in this process, its output taken from ``capsys``: what
    :func:`run_tool` gives, without starting an interpreter (seconds each). Keep a real process where the
    test is about the process (its exit, or stdout holding nothing but the result)."""
    import importlib

    main = importlib.import_module(f"megatok.cli.{name}").main
    capsys.readouterr()
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([name, *map(str, args)], rc, out, err)


def decisive(strategy, std: float = 1.0, generator=None):
    """A learned strategy's ``head`` and ``window_head`` (those it has) set to weights N(0, std^2) and bias 0,
    so its decisions depend on h: at initialisation a policy's p sits near the target rate whatever it
    reads (and its window head is zero). Returns ``strategy``."""
    import torch

    with torch.no_grad():
        for head in filter(None, (getattr(strategy, "head", None), getattr(strategy, "window_head", None))):
            head.weight.normal_(std=std, generator=generator)
            head.bias.zero_()
    return strategy


def two_gloo_ranks(tmp_path: Path, worker: str) -> list:
    """Run ``worker`` (Python source; argv: rank, a file-store path, an output path, and it torch.saves its
    result there) as two gloo ranks; each rank's result."""
    import torch

    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, script, str(rank), tmp_path / "store", tmp_path / f"{rank}.pt"],
                              env=env) for rank in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    return [torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1)]


def write_flat_meta(path: Path, without: tuple[str, ...] = ()) -> dict:
    """Rewrite the megatok.json at ``path`` as megatok wrote it before the file had one key per component:
    one flat dict (megatok.run.checkpoints.PARTS, read backwards), less the keys ``without``. Returns it."""
    from megatok.run.checkpoints import PARTS, parse_meta

    meta = parse_meta(path.read_text())
    flat = {k: v for k, v in meta.items() if k not in {"format", "world_size", *PARTS}}
    for part, keys in PARTS.items():
        flat.update({old: meta[part][key] for old, key in keys.items() if key in meta[part]})
    flat = {k: v for k, v in flat.items() if k not in without}
    path.write_text(json.dumps(flat, indent=2))
    return flat


TINY = [
    "model.d_model=32", "model.n_heads=2", "model.n_encoder_layers=1", "model.n_main_layers=1",
    "model.n_decoder_layers=1", "data.seq_len=64", "train.log_every=1", "train.warmup_steps=2",
    "eval.every=0", "eval.max_sequences=8", "logging.wandb_mode=disabled", "logging.progress=false",
    "train.dist_timeout_s=120",
]


def pretrain(args: list[str], *, nproc: int = 1, timeout: float = 300, check: bool = True,
             env: dict | None = None, launcher: str = "env", faults: dict | None = None) -> subprocess.CompletedProcess:
    """Run launch/pretrain.py: one plain process, or ``nproc`` ranks. ``faults`` (MEGATOK_FAULT_* variables,
    see tests/train/faults.py) runs it through tests/train/faulty_pretrain.py, which installs them.

    ``launcher`` "deepspeed" starts the ranks with the deepspeed launcher, as users do; "env" starts
    them directly with the variables a launcher sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...,
    as Slurm's srun path does), the same trainer and DeepSpeed engine without the launcher's two
    extra Python processes, each a fork of tests/preloaded.py's server (no interpreter start-up) unless
    ``env`` is given (variables torch may read when imported: fresh interpreters). Tests of how a job
    ends when a rank fails or hangs use "deepspeed"."""
    base = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(ROOT), **(env or {}), **(faults or {})}
    script = [str(ROOT / ("tests/train/faulty_pretrain.py" if faults else "launch/pretrain.py"))]
    if launcher == "env" and env is None and preloaded.enabled():
        r = _ranks(script[0], args, nproc, base, timeout, forked=True)
    elif nproc > 1 and launcher == "env":
        r = _ranks(script[0], args, nproc, base, timeout)
    else:
        r = _one_command(script, args, nproc, base, timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"pretrain failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r


def _one_command(script: list[str], args: list[str], nproc: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """One plain process, or the deepspeed launcher with ``nproc`` ranks."""
    from megatok.train.dist import free_port

    if nproc == 1:
        cmd = [sys.executable] + script
    else:
        deepspeed = str(Path(sys.executable).parent / "deepspeed")
        cmd = [deepspeed, "--num_gpus", str(nproc), "--master_port", str(free_port())] + script
    # A new session, so a timeout kills the launcher's whole process tree, not just the launcher.
    proc = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"pretrain timed out after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _ranks(script: str, args: list[str], nproc: int, env: dict, timeout: float, forked: bool = False):
    job = Ranks(script, args, nproc, env, forked)
    try:
        job.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"pretrain timed out after {timeout} s:\n{job.output()[0][-3000:]}") from None
    finally:
        stdout, stderr = job.output()
        job.close()
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def without_cursors(ckpt: Path) -> None:
    """Checkpoint directory ``ckpt`` as megatok wrote checkpoints before the data readers' cursors: no
    stream_rank*.json, and (older than those too) no file sums or own digest in its megatok.json."""
    for p in ckpt.glob("stream_rank*.json"):
        p.unlink()
    meta = json.loads((ckpt / "megatok.json").read_text())
    meta.pop("files", None)
    meta.pop("self_sha256", None)
    (ckpt / "megatok.json").write_text(json.dumps(meta, indent=2))
