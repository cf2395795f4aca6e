"""Runs die; megatok must not lose or corrupt anything, and must resume exactly.

Every test runs the real trainer on CPU (plain python for 1 rank; for 2, ranks started from launcher
variables, or the deepspeed launcher where a test is about how a job ends).
Faults are injected by tests/train/faults.py's callbacks, which tests/train/faulty_pretrain.py installs.
"""

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from megatok.metrics import read_metrics
from megatok.run import checkpoints
from megatok.run.export import load_exported
from megatok.run.reader import load_model
from megatok.train import checkpointer
from tests import preloaded
from tests.conftest import ROOT, TINY, Ranks, launch_module, pretrain, python, run_tool, write_flat_meta

pytestmark = pytest.mark.dist


def args(shards, run, *extra):
    return ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
            "train.micro_batch_size=4", "data.num_workers=1", *extra]


def train_rows(run):
    return {r["step"]: r for r in read_metrics(run) if r.get("split") == "train"}


def wait_for(predicate, timeout=120, proc=None):
    """Until ``predicate()``; fails at once if ``proc`` (a background_run) has ended."""
    t = time.time()
    while time.time() - t < timeout:
        if predicate():
            return
        if proc is not None and proc.poll() is not None and not predicate():
            raise TimeoutError(f"the run ended (exit {proc.returncode}) before the condition was reached")
        time.sleep(0.2)
    raise TimeoutError("condition not reached")


@contextlib.contextmanager
def background_run(argv, nproc, faults, launcher="deepspeed"):
    """The trainer in its own process group (``launcher`` "env": each rank in its own, forked as
    tests.conftest.pretrain's are), with ``faults`` (MEGATOK_FAULT_* variables) injected; whatever is still
    running at the end is SIGKILLed."""
    from megatok.train.dist import free_port

    script = str(ROOT / ("tests/train/faulty_pretrain.py" if faults else "launch/pretrain.py"))
    full_env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **faults}
    if launcher == "env":
        proc = Ranks(script, argv, nproc, full_env, forked=preloaded.enabled())
    else:
        deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        cmd = [deepspeed, "--num_gpus", str(nproc), "--master_port", str(free_port())] if nproc > 1 else [sys.executable]
        proc = subprocess.Popen(cmd + [script] + argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        yield proc
    except (TimeoutError, subprocess.TimeoutExpired) as e:  # say what the run printed
        if launcher == "env":
            proc.kill()
        elif proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0]
        raise AssertionError(f"{e}; the run printed:\n{output[-5000:]}") from None
    finally:
        if launcher == "env":
            proc.close()
        elif proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def export(run, out, dtype="fp32"):
    r = run_tool("export", "--run", run, "--out", out, "--dtype", dtype)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def live_engine_logits(run, tmp_path):
    """{"x", "logits"} from a live DeepSpeed engine that loaded the run's latest checkpoint."""
    live = tmp_path / "live.safetensors"
    r = python(ROOT / "tests/train/live_logits.py", run, live, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(str(live))


def exported_logits(out, x):
    model, _ = load_exported(out)  # computes in fp32 whatever the stored dtype
    model.boundary.eval_mode = "threshold"
    with torch.no_grad():
        return model(x).logits


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """An uninterrupted 2-rank ZeRO-2 run of 8 steps, checkpoint every 2."""
    run = tmp_path_factory.mktemp("ref") / "run"
    pretrain(args(shards, run, "train.max_steps=8", "train.save_every=2", "train.global_batch_size=8"), nproc=2)
    return run


def test_sigkill_mid_run_then_resume_is_bit_exact(shards, reference, tmp_path):
    run = tmp_path / "run"
    argv = args(shards, run, "train.max_steps=8", "train.save_every=2", "train.global_batch_size=8")
    # rank 0 stops responding at step 6: by then step 5 is logged and step 4 is checkpointed
    with background_run(argv, 2, {"MEGATOK_FAULT_HANG": "0:6"}, launcher="env") as proc:
        wait_for(lambda: (run / "metrics.jsonl").is_file() and 5 in train_rows(run), proc=proc)
    # leaving the block SIGKILLs both ranks: no chance to clean up
    assert checkpoints.latest_tag(run) == "step00000004"
    pretrain(argv, nproc=2)
    got, want = train_rows(run), train_rows(reference)
    assert sorted(got) == list(range(1, 9))  # steps replayed after the checkpoint appear once
    for step in range(5, 9):
        assert got[step]["loss"] == want[step]["loss"], step  # bit-exact in fp32 on CPU
        assert got[step]["grad_norm"] == want[step]["grad_norm"], step


def test_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(shards, tmp_path):
    base = ["train.max_steps=6", "train.save_every=2", "deepspeed.zero_optimization.stage=1"]
    ref = tmp_path / "ref"
    pretrain(args(shards, ref, *base))
    run = tmp_path / "run"
    r = pretrain(args(shards, run, *base), faults={"MEGATOK_FAULT_DIE_IN_SAVE": "4"}, check=False)
    assert r.returncode == -signal.SIGKILL
    assert checkpoints.latest_tag(run) == "step00000002"
    assert (run / "checkpoints" / "step00000004.tmp").is_dir()  # the half-written one, never published
    (run / "checkpoints" / "universal-step00000002").mkdir()  # as left by a run killed after converting
    # and a later checkpoint, published, whose optimizer file was then cut short (a node lost before the
    # filesystem had the data): resuming skips it with a warning and keeps it aside with its trajectory
    damaged = run / "checkpoints" / "step00000003"
    shutil.copytree(run / "checkpoints" / "step00000002", damaged)
    optim = damaged / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:1000])
    checkpointer.set_latest(run, "step00000003")
    # asked for by name: refused before any process group, by local rank 0; the launcher ends rank 1
    t = time.monotonic()
    r = pretrain(args(shards, run, *base, "--resume", "step00000003"), nproc=2, launcher="deepspeed", check=False)
    error = f"error: --resume step00000003: {damaged}: cannot be resumed: {optim.name}"
    assert r.returncode == 2 and r.stderr.count(error) == 1, r.stderr[-3000:]
    assert time.monotonic() - t < 60 and "Initializing" not in r.stdout + r.stderr
    r = pretrain(args(shards, run, *base))
    assert f"skipping damaged checkpoint(s) step00000003 ({optim.name} is damaged" in r.stdout
    (aside,) = run.glob("superseded-*")
    assert (aside / "checkpoints" / "step00000003").is_dir()
    assert not list((run / "checkpoints").glob("*.tmp")) and not list((run / "checkpoints").glob("universal-*"))
    got, want = train_rows(run), train_rows(ref)
    assert [got[s]["loss"] for s in range(3, 7)] == [want[s]["loss"] for s in range(3, 7)]


GLOO_LOST = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:20915"
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 600000ms for recv"
TORCH_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
TORCH_READ = "[enforce fail at inline_container.cc:340] . file in archive is not in a subdirectory archive/: data.pkl"


@pytest.mark.parametrize("error, code, line", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "RUN/eval.json"), 3,
     f"error: rank 0: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: 'RUN/eval.json'; last good checkpoint: "
     f"step00000002"),
    (OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), 3,  # a write through an open file: no name
     f"error: rank 0: [Errno {errno.EDQUOT}] {os.strerror(errno.EDQUOT)} (writing under <run>; "),
    (RuntimeError(TORCH_WRITE), 3, f"error: rank 0: a write failed (torch.save: {TORCH_WRITE}; "),
    (RuntimeError(GLOO_LOST), 4, "error: rank 0: lost contact with another rank, which died, hung or was killed "
                                 f"({GLOO_LOST})"),  # closed at once: no timeout to name
    (RuntimeError(GLOO_TIMEOUT), 4, "error: rank 0: lost contact with another rank, which died, hung or was killed "
                                    f"(no answer within train.dist_timeout_s=600 s: {GLOO_TIMEOUT})"),
    (RuntimeError("a bug"), 1, "error: rank 0: RuntimeError: a bug"),
    # torch's reader: a damaged archive is not a full disk
    (RuntimeError(TORCH_READ), 1, f"error: rank 0: RuntimeError: {TORCH_READ.splitlines()[0]}"),
    (FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "a/missing/file"), 1,
     "error: rank 0: FileNotFoundError: [Errno 2] No such file or directory: 'a/missing/file'"),
    (KeyboardInterrupt(), 130, "error: rank 0: interrupted"),
])
def test_how_a_failed_run_ends(tmp_path, monkeypatch, capsys, error, code, line):
    """The storage failing anywhere is one line and exit 3 (a write of a checkpoint is named in more
    detail by checkpoint.save), a lost rank exit 4; anything else is a bug: its traceback, one line, exit 1."""
    from megatok.config import load_config
    from megatok.train import trainer

    launch = launch_module()
    (tmp_path / "checkpoints").mkdir()
    checkpointer.set_latest(tmp_path, "step00000002")
    cfg = load_config(ROOT / "configs/tiny.json", [f"train.run_dir={tmp_path}"])

    def fail(cfg, resume, lock_wait_s):
        raise error

    monkeypatch.setattr(trainer, "train", fail)
    monkeypatch.setattr(launch, "_die", lambda c, message: print(message, file=sys.stderr) or c)  # not os._exit
    assert launch.run(cfg, "auto") == code
    err = capsys.readouterr().err.splitlines()
    assert (code == 1) == (err[0] == "Traceback (most recent call last):")  # the traceback, for a bug
    got = err[-1]
    assert len(err) == 1 or code == 1
    assert got.startswith(line.replace("<run>", str(tmp_path))), got
    assert got.endswith("; last good checkpoint: step00000002"), got
    assert code != 3 or "GiB free on its filesystem)" in got or error.filename


def test_a_taken_rendezvous_port_is_named_as_such(tmp_path, shards):
    """A process group that cannot listen on MASTER_PORT (another job holds it) ends with one line naming
    the port and EADDRINUSE, exit 2, not as a rank lost in a collective."""
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        r = pretrain(args(shards, tmp_path / "run"), check=False, env={
            "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)})
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(err) == 1, r.stderr[-3000:]
    assert err[0].startswith(f"error: rank 0: the rendezvous port {port} is in use (EADDRINUSE"), err
    assert "lost contact" not in r.stderr and r.stderr.rstrip().endswith(err[0])


def test_a_failed_run_leaves_no_data_worker_behind():
    """_die leaves with os._exit, which skips the DataLoader's shutdown, and the workers ignore SIGTERM:
    a worker blocked at that moment would outlive the run (seen twice in a user review). _die kills them,
    before it prints the error, which therefore stays the last line."""
    code = ("import importlib.util, multiprocessing, os, signal, time\n"
            "def worker():\n"
            "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)\n"
            "    for _ in range(600000):  # a worker that keeps warning, as one skipping bad shards does\n"
            "        os.write(2, b'BadShardWarning: skipped a shard\\n')\n"
            "        time.sleep(0.001)\n"
            "if __name__ == '__main__':\n"
            f"    spec = importlib.util.spec_from_file_location('p', {str(ROOT / 'launch/pretrain.py')!r})\n"
            "    launch = importlib.util.module_from_spec(spec)\n"
            "    spec.loader.exec_module(launch)\n"
            "    child = multiprocessing.get_context('fork').Process(target=worker)\n"
            "    child.start()\n"
            "    print(child.pid, flush=True)\n"
            "    time.sleep(0.5)\n"
            "    launch._die(3, 'error: rank 0: a bad shard')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 3 and r.stderr.splitlines()[-1] == "error: rank 0: a bad shard", r.stderr[-2000:]
    pid = int(r.stdout.split()[0])
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"worker {pid} outlived the run")


def test_one_process_per_machine_checks_the_checkpoint_before_the_process_group(shards, tmp_path, monkeypatch,
                                                                                capsys):
    """The pre-start check of --resume reads every file of a checkpoint: once per machine (LOCAL_RANK 0,
    or a process no launcher started), not once per rank, which on a shared filesystem would be ranks x
    files reads. The launchers end the other ranks when that one exits 2."""
    launch = launch_module()
    run = tmp_path / "run"
    damaged = run / "checkpoints" / "step00000003"
    damaged.mkdir(parents=True)
    (damaged / checkpoints.META).write_text("{not json")
    checks, started = [], []
    real_damage = checkpoints.damage
    monkeypatch.setattr(checkpoints, "damage", lambda *a: checks.append(a) or real_damage(*a))
    monkeypatch.setattr(launch, "run", lambda cfg, resume, lock_wait_s: started.append(resume) or 0)
    argv = args(shards, run, "--resume", "step00000003")
    for local_rank, want_rc, want_checks, want_started in [(None, 2, 1, []), ("0", 2, 1, []),
                                                             ("1", 0, 0, ["step00000003"]), ("7", 0, 0, ["step00000003"])]:
        checks.clear(), started.clear()
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert launch.main(argv) == want_rc, local_rank
        assert (len(checks), started) == (want_checks, want_started), local_rank
        err = capsys.readouterr().err
        assert (f"error: --resume step00000003: {damaged}: cannot be resumed: megatok.json" in err) == (want_rc == 2)


def with_file_size_limit(limit, argv):
    """launch/pretrain.py ARGV in one process whose files cannot grow past LIMIT bytes (RLIMIT_FSIZE;
    CPython ignores SIGXFSZ, so such a write fails with EFBIG, as one on a full disk fails with ENOSPC)."""
    limited = (f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
               "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", limited, str(ROOT / "launch/pretrain.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=240,
                          env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


def test_a_checkpoint_the_disk_cannot_hold_ends_the_run_with_one_line(shards, tmp_path):
    """DeepSpeed's torch.save fails as on a full disk or a quota: a RuntimeError from torch's zip writer,
    which the trainer names in one line."""
    run = tmp_path / "run"
    r = with_file_size_limit(64_000, args(shards, run, "train.max_steps=2", "train.save_every=2"))  # metrics fit
    assert r.returncode == 3, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: rank 0: {run / 'checkpoints' / 'step00000002.tmp'}: the step-2 checkpoint "
                           f"could not be written (torch.save: ") and "Traceback" not in r.stderr
    assert line.endswith("and there is no earlier checkpoint; the next start deletes the partial copy")
    assert sorted(train_rows(run)) == [1, 2] and checkpoints.latest_tag(run) is None


def test_a_full_disk_outside_a_checkpoint_ends_the_run_with_one_line(shards, tmp_path):
    run = tmp_path / "run"  # config.json (2 KB) fits, metrics.jsonl outgrows 4 KB within a few steps
    r = with_file_size_limit(4_000, args(shards, run, "train.max_steps=12", "train.save_every=100",
                                         "data.num_workers=0"))
    assert r.returncode == 3, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert line == (f"error: rank 0: [Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}: '{run / 'metrics.jsonl'}'; "
                    f"last good checkpoint: none yet") and "Traceback" not in r.stderr
    with pytest.warns(UserWarning, match="the last row was cut short"):  # the row being written when it failed
        rows = train_rows(run)
    assert 0 < len(rows) < 12 and sorted(rows) == list(range(1, len(rows) + 1))


def test_nan_loss_on_one_rank_is_skipped_counted_and_bounded(shards, tmp_path):
    run = tmp_path / "run"
    pretrain(args(shards, run, "train.max_steps=5", "train.global_batch_size=8", "train.save_every=5"), nproc=2,
             faults={"MEGATOK_FAULT_NAN_STEPS": "3", "MEGATOK_FAULT_NAN_RANK": "1"})
    rows = train_rows(run)
    assert rows[3]["nonfinite_losses"] == 1 and rows[3]["skipped_steps"] == 1
    assert all(rows[s]["skipped_steps"] == 0 for s in (1, 2, 4, 5))
    model, _, _ = load_model(run)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    # NaN every step from 2 on: after max_skipped_steps in a row the run stops, the last checkpoint intact
    run2 = tmp_path / "run2"
    r = pretrain(args(shards, run2, "train.max_steps=8", "train.global_batch_size=8", "train.save_every=1",
                      "train.max_skipped_steps=2"), nproc=2, check=False,
                 faults={"MEGATOK_FAULT_NAN_STEPS": "2,3,4,5,6,7,8"})
    assert r.returncode != 0
    assert "3 optimizer steps in a row skipped" in r.stdout + r.stderr
    rows2 = train_rows(run2)
    assert rows2[1]["loss"] > 0 and rows2[2]["loss"] == "nan" == rows2[2]["lm_loss"]  # not 0.0: no finite loss
    tag = checkpoints.latest_tag(run2)
    assert tag == "step00000003"  # skipped steps leave the weights as they were: still finite, still saved
    model, _, _ = load_model(run2, tag)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the same command again resumes step 3, inside the streak (2 skipped in a row): the third is step 4 again
    r = pretrain(args(shards, run2, "train.max_steps=8", "train.global_batch_size=8", "train.save_every=1",
                      "train.max_skipped_steps=2"), nproc=2, check=False,
                 faults={"MEGATOK_FAULT_NAN_STEPS": "2,3,4,5,6,7,8"})
    assert r.returncode != 0 and "3 optimizer steps in a row skipped" in r.stderr and "at step 4;" in r.stderr
    assert checkpoints.latest_tag(run2) == "step00000003"


def test_corrupt_shard_is_skipped_with_a_warning_and_counted(shards, tmp_path):
    from megatok.data.stream import PackedByteStream, resolve_shards

    bad = tmp_path / "shards"
    shutil.copytree(shards, bad)
    urls = resolve_shards(str(bad), "train")
    first = PackedByteStream(urls, seq_len=64, batch_size=4, world_size=2).epoch_shards(0, 0, 2)[0]
    with open(first, "r+b") as f:
        f.truncate(1500)  # rank 0 reads this shard first: its first document is cut
    run = tmp_path / "run"
    r = pretrain(args(bad, run, "train.max_steps=4", "train.global_batch_size=8"), nproc=2)
    assert first in r.stdout + r.stderr
    rows = train_rows(run)
    assert rows[4]["bad_shards"] >= 1 and sorted(rows) == [1, 2, 3, 4]
    assert checkpoints.latest_tag(run) == "step00000004"
    r = pretrain(args(bad, tmp_path / "strict", "train.max_steps=4", "train.global_batch_size=8",
                      "data.on_bad_shard=error"), nproc=2, check=False, launcher="deepspeed")
    assert r.returncode != 0 and f"{first}: bad shard" in r.stdout + r.stderr
    # the worker's error (data.num_workers=1) is its one line, not the traceback torch wraps it in
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error: rank 0")]
    assert lines and all(ln.startswith(f"error: rank 0: {first}: bad shard: ") for ln in lines), lines
    assert "Original Traceback" not in r.stdout + r.stderr


def test_a_hung_rank_makes_the_job_exit_within_the_timeout(shards, tmp_path):
    run = tmp_path / "run"
    t = time.time()
    r = pretrain(args(shards, run, "train.max_steps=6", "train.global_batch_size=8", "train.dist_timeout_s=8"),
                 nproc=2, check=False, faults={"MEGATOK_FAULT_HANG": "1:3"}, timeout=240, launcher="deepspeed")
    assert r.returncode != 0
    assert time.time() - t < 90
    assert "no training progress" in r.stdout + r.stderr and "a rank died, hung or was killed" in r.stderr
    assert checkpoints.latest_tag(run) is None or checkpoints.read_meta(run, checkpoints.latest_tag(run))


def test_an_unexpected_error_ends_the_job_at_once_with_its_traceback_and_one_line(shards, tmp_path):
    """Rank 1 runs out of GPU memory (an error megatok has no name for) at step 2, with a data worker
    running: the traceback, one error line, exit 1, and the job ends without waiting for the watchdog
    (train.dist_timeout_s is 120 s here: its line must not appear). A bare re-raise waited at exit for
    the workers, which ignore SIGTERM, until the watchdog blamed a lost rank (exit 4 after 2 min)."""
    run = tmp_path / "run"
    r = pretrain(args(shards, run, "train.max_steps=4", "train.global_batch_size=8", "train.save_every=1"),
                 nproc=2, check=False, faults={"MEGATOK_FAULT_OOM": "1:2"}, timeout=150, launcher="deepspeed")
    assert r.returncode != 0 and "Traceback" in r.stderr and "no training progress" not in r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: rank 1")]
    assert line.startswith("error: rank 1: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
                           "(injected) (out of device memory: lower train.micro_batch_size"), line
    assert line.endswith("; last good checkpoint: step00000001"), line


def test_a_checkpoint_slower_than_the_timeout_is_waited_for_with_save_timeout_s(shards, tmp_path):
    """Rank 0 takes 14 s to write the last checkpoint, beyond train.dist_timeout_s (8 s): rank 1 waits in
    the save's barrier and neither watchdog ends the run, since train.save_timeout_s allows 90 s."""
    run = tmp_path / "run"
    t = time.monotonic()
    r = pretrain(args(shards, run, "train.max_steps=4", "train.global_batch_size=8", "train.save_every=4",
                      "train.dist_timeout_s=8", "train.save_timeout_s=90"),
                 nproc=2, check=False, faults={"MEGATOK_FAULT_SLOW_SAVE": "4:14"}, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert time.monotonic() - t >= 14  # the slow save did happen
    assert checkpoints.latest_tag(run) == "step00000004"


def test_sigterm_checkpoints_and_exits_cleanly(shards, tmp_path):
    run = tmp_path / "run"
    argv = args(shards, run, "train.max_steps=100000", "train.global_batch_size=8", "train.save_every=100000")
    with background_run(argv, 2, {}) as proc:
        wait_for(lambda: (run / "metrics.jsonl").is_file() and len(train_rows(run)) >= 3, proc=proc)
        # As Slurm or Kubernetes do: every process of the job gets SIGTERM (the single-node deepspeed
        # runner does not forward signals itself)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    events = [r for r in read_metrics(run) if r.get("split") == "event"]
    assert events and events[-1]["event"] == "stopped by signal", out[-3000:]
    tag = checkpoints.latest_tag(run)
    assert tag == events[-1]["checkpoint"]
    assert checkpoints.read_meta(run, tag)["step"] == events[-1]["step"] >= 3


def test_a_stop_file_checkpoints_and_exits_cleanly(shards, tmp_path):
    """RUN_DIR/STOP stops a run like SIGTERM does, with any launcher; it is removed, so the same
    command resumes and runs on."""
    run = tmp_path / "run"
    argv = args(shards, run, "train.max_steps=100000", "train.global_batch_size=8", "train.save_every=100000")
    with background_run(argv, 2, {}, launcher="env") as proc:
        wait_for(lambda: (run / "metrics.jsonl").is_file() and len(train_rows(run)) >= 2, proc=proc)
        (run / "STOP").touch()
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    event = [r for r in read_metrics(run) if r.get("split") == "event"][-1]
    assert event["event"] == f"stopped by {run / 'STOP'}" and not (run / "STOP").exists()
    assert checkpoints.latest_tag(run) == event["checkpoint"] and f"stopped by {run / 'STOP'} at step" in out


def test_an_evaluation_skipped_by_a_stop_runs_when_the_run_resumes(shards, tmp_path):
    """A stop request at an evaluation step checkpoints without evaluating; the resumed run evaluates
    that step first, so no validation row is lost (not even the final one). Resumed here on a copy of
    the shards elsewhere: other shard URLs than the checkpoint's, which the resume warns about."""
    run, moved = tmp_path / "run", tmp_path / "moved"
    run.mkdir()
    (run / "STOP").touch()  # seen at the first step, which is an evaluation step
    common = ["train.max_steps=2", "train.global_batch_size=4", "eval.every=1"]
    pretrain(args(shards, run, *common))
    assert checkpoints.latest_tag(run) == "step00000001"
    assert checkpoints.read_meta(run, "step00000001")["evaluation"]["pending"]
    assert not [r for r in read_metrics(run) if r.get("split") == "val"]
    shutil.copytree(shards, moved)
    r = pretrain(args(moved, run, *common))
    assert [r["step"] for r in read_metrics(run) if r.get("split") == "val"] == [1, 2]
    assert checkpoints.read_meta(run, "step00000001")["evaluation"]["pending"] is False  # done once, not at every rerun
    assert "step00000001 was trained on other shards or another tokenizer" in r.stdout


def test_two_ranks_to_one_rank_and_export_matches_the_live_engine(shards, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "metrics.jsonl").unlink()
    # one rank, same global batch (accumulation 2): ZeRO-2 states re-partitioned via the universal format,
    # from step 6 while a step-8 checkpoint exists (a rollback: step 8 is set aside).
    # A negligible learning rate for the one step makes the step-7 weights the loaded step-6 weights.
    # and keep_checkpoints 1 with keep_every 4: step 6 is rotated out after step 7, step 4 is kept for good
    r = pretrain(args(shards, run, "train.max_steps=7", "train.save_every=2", "train.global_batch_size=8",
                      "train.lr=1e-12", "train.keep_checkpoints=1", "train.keep_every=4", "--resume", "step00000006"))
    assert "the data stream finishes epoch 0 with what the earlier layout had not read" in r.stdout
    assert checkpoints.read_meta(run, "step00000007")["data"]["stream_origin"]["unread"]
    assert sorted(train_rows(run)) == [7]
    (aside,) = run.glob("superseded-*")
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step00000008"]
    live = sorted(p.name for p in (run / "checkpoints").glob("step*"))
    assert live == ["step00000004", "step00000007"]
    assert checkpoints.read_meta(run, "step00000007")["data"]["layout"]["world_size"] == 1
    before = load_model(reference, "step00000006")[0].state_dict()
    after = load_model(run, "step00000007")[0].state_dict()
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=1e-7, msg=name)

    # export the 1-rank checkpoint and compare with a live engine that loaded it
    out = export(run, tmp_path / "export")
    ref = live_engine_logits(run, tmp_path)
    torch.testing.assert_close(exported_logits(out, ref["x"]), ref["logits"], rtol=0, atol=1e-5)
    assert json.loads((out / "export.json").read_text())["step"] == 7


def test_a_killed_rank_ends_the_job_within_the_timeout(shards, tmp_path):
    import psutil

    run = tmp_path / "run"
    argv = args(shards, run, "train.max_steps=100000", "train.global_batch_size=8", "train.dist_timeout_s=20")
    with background_run(argv, 2, {}) as proc:
        wait_for(lambda: (run / "metrics.jsonl").is_file() and len(train_rows(run)) >= 2, proc=proc)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "--local_rank=1" in " ".join(p.cmdline()) and "pretrain.py" in " ".join(p.cmdline())]
        victim = min(ranks, key=lambda p: p.create_time())  # the rank, not its dataloader worker
        t = time.time()
        victim.kill()
        proc.wait(timeout=60)
        assert time.time() - t < 45  # the timeout (20 s) plus teardown, never an endless wait
        assert proc.returncode != 0
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers


def test_export_from_zero3_matches_the_live_engine(shards, tmp_path):
    """A ZeRO-3 run (built partitioned, the default; tests/train/test_zero_init.py checks that build
    against the whole one) exported in fp32 and bf16 (in-process: the CLI is exercised above)."""
    from megatok.run.export import export as export_run

    run = tmp_path / "run"
    r = pretrain(args(shards, run, "train.max_steps=3", "deepspeed.zero_optimization.stage=3"))
    assert "ZeRO stage 3 (built partitioned), fp32" in r.stdout
    ref = live_engine_logits(run, tmp_path)
    for dtype, tol in (("fp32", 1e-5), ("bf16", 0.1)):
        out = export_run(run, tmp_path / f"export-{dtype}", dtype=dtype)
        stored = load_file(str(out / "model.safetensors"))["head.weight"].dtype
        assert stored == (torch.float32 if dtype == "fp32" else torch.bfloat16)
        torch.testing.assert_close(exported_logits(out, ref["x"]), ref["logits"], rtol=0, atol=tol, msg=dtype)


def test_an_abandoned_trajectory_is_set_aside_not_lost(shards, tmp_path):
    """Resuming from an earlier checkpoint, or --resume none, abandons the later checkpoints and metrics
    rows: they move to RUN_DIR/superseded-<time>/, and the live directory holds one trajectory."""
    run = tmp_path / "run"
    args = ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
            "train.micro_batch_size=2", "train.global_batch_size=2", "train.save_every=2"]
    tags = lambda d: sorted(p.name for p in (d / "checkpoints").glob("step*"))  # noqa: E731
    steps = lambda rows: [r["step"] for r in rows if r["split"] == "train"]  # noqa: E731
    pretrain(args + ["train.max_steps=6"])
    first = read_metrics(run)
    assert tags(run) == ["step00000002", "step00000004", "step00000006"] and steps(first) == [1, 2, 3, 4, 5, 6]

    r = pretrain(args + ["train.max_steps=4", "--resume", "step00000002"])  # roll back to step 2
    (aside,) = run.glob("superseded-*")
    assert f"resuming from step 2; the later checkpoints and metrics are kept in {aside}" in r.stdout
    assert tags(aside) == ["step00000004", "step00000006"]
    assert read_metrics(aside) == [row for row in first if row["step"] > 2]
    again = read_metrics(run)
    assert tags(run) == ["step00000002", "step00000004"] and steps(again) == [1, 2, 3, 4]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000004"
    assert again[:2] == first[:2] and again[2]["loss"] == first[2]["loss"]  # the same step 3, redone

    old_config = (run / "config.json").read_text()
    r = pretrain(args + ["train.max_steps=2", "train.lr=0.002", "--resume", "none"])  # start over in the used directory
    (fresh,) = set(run.glob("superseded-*")) - {aside}
    assert f"starting from step 0; the later checkpoints and metrics are kept in {fresh}" in r.stdout
    assert tags(fresh) == ["step00000002", "step00000004"] and read_metrics(fresh) == again
    assert tags(run) == ["step00000002"] and steps(read_metrics(run)) == [1, 2]
    assert (fresh / "config.json").read_text() == old_config  # the set-aside run keeps the config it ran with
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 0.002


def test_resuming_with_another_model_is_refused_before_anything_changes(reference, shards, tmp_path, capsys):
    """A config that builds another model than the checkpoint holds: one line naming the parameters and the
    config keys, before any process group, and the run directory (its config.json too) untouched."""
    launch = launch_module()
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for extra, rc in ([], 2), (["--resume", "step00000004"], 2):
        assert launch.main(args(shards, run, "train.max_steps=10", "train.global_batch_size=8",
                                "model.d_model=64", *extra)) == rc
        (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
        assert "holds another model than the config builds: " in line and "model.d_model: 32 -> 64" in line, line
        assert line.endswith("or --resume none to start over (the old run is set aside)")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

    # a tag that is not there lists those that are; a rank's missing RNG file makes a checkpoint damaged
    assert launch.main(args(shards, run, "train.global_batch_size=8", "--resume", "step00000099")) == 2
    err = capsys.readouterr().err
    assert "no checkpoint step00000099; its checkpoints: step00000004, step00000006, step00000008" in err, err
    # ... and a fresh run directory (and the directories made for it) is not left behind, empty
    fresh = tmp_path / "new" / "run"
    assert launch.main(args(shards, fresh, "train.global_batch_size=8", "--resume", "step00000004")) == 2
    assert "no checkpoint step00000004; it holds none" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    # a checkpoint a killed re-save had moved aside (the next start puts it back) is checked where it is
    ck = run / "checkpoints"
    os.replace(ck / "step00000008", ck / "step00000008.old-1.tmp")
    assert launch.main(args(shards, run, "train.max_steps=10", "train.global_batch_size=8", "model.d_model=64")) == 2
    assert "step00000008 holds another model than the config builds" in capsys.readouterr().err
    os.replace(ck / "step00000008.old-1.tmp", ck / "step00000008")
    (run / "checkpoints" / "step00000008" / "rng_rank1.json").unlink()
    assert launch.main(args(shards, run, "train.global_batch_size=8", "--resume", "step00000008")) == 2
    assert "cannot be resumed: rng_rank1.json missing (written by 2 ranks)" in capsys.readouterr().err


def test_resuming_under_another_zero_stage_or_precision_is_refused_before_anything_changes(reference, shards,
                                                                                         tmp_path, capsys,
                                                                                         monkeypatch):
    """DeepSpeed cannot load a checkpoint's states under another ZeRO stage or precision, and failed late
    (after the process group started) with errors that read like damage or a bug. The checkpoint records
    both; a changed one is one line naming the key and both values, exit 2, before any process group,
    nothing in the run directory changed. A checkpoint written before the precision was recorded is read
    from DeepSpeed's own files. ZeRO-1 writes ZeRO-2's files: it resumes (shown for real below). So is a
    changed number of optimizer groups (the policy's own learning rate, boundary.lr_scale)."""
    launch = launch_module()
    started = []
    monkeypatch.setattr(launch, "run", lambda cfg, resume, lock_wait_s: started.append(resume) or 0)
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    assert checkpoints.read_meta(run, "step00000008")["engine"]["precision"] == "fp32"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    stage, bf16 = "deepspeed.zero_optimization.stage", "deepspeed.bf16.enabled"
    cases = [([f"{stage}=3"], f"({stage}: 2 in the checkpoint, 3 now), "),
             ([f"{stage}=0"], f"({stage}: 2 in the checkpoint, 0 now), "),
             ([f"{bf16}=true"], f"({bf16}: false in the checkpoint, true now), "),
             ([f"{stage}=3", f"{bf16}=true"], f"({stage}: 2 in the checkpoint, 3 now; {bf16}: false in the "
                                              f"checkpoint, true now), ")]

    def refused(extra, want, resume="auto", tag="step00000008"):
        assert launch.main(args(shards, run, "train.max_steps=10", "train.global_batch_size=8", *extra,
                                "--resume", resume)) == 2
        (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
        assert line.startswith(f"error: --resume {resume}: {run / 'checkpoints' / tag} was written under "), line
        assert want in line and line.endswith("which DeepSpeed cannot resume; set the config back, or use another "
                                              "train.run_dir, or --resume none to start over (the old run is set "
                                              "aside)"), line

    for extra, want in cases:
        refused(extra, want)
    refused([f"{bf16}=true"], f"({bf16}: false in the checkpoint, true now), ", "step00000004", "step00000004")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before and started == []
    # the policy's own learning rate puts its parameters in optimizer groups of their own: the other setting is
    # refused the same way, naming the keys
    own = checkpoints.read_meta(run, "step00000008")["engine"].get("optimizer_groups", 2) == 4
    other = ["boundary.lr_scale=1.0", "boundary.start_step=0", "boundary.lr_hold=false"] if own else ["boundary.lr_scale=0.5"]
    assert launch.main(args(shards, run, "train.max_steps=10", "train.global_batch_size=8", *other)) == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert line.startswith(f"error: --resume auto: {run / 'checkpoints' / 'step00000008'} was trained with the "
                           f"boundary policy's "), line
    assert "boundary.lr_scale" in line and "which DeepSpeed cannot resume" in line, line
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before and started == []

    for meta in run.glob("checkpoints/step*/megatok.json"):  # as written before the precision was recorded
        write_flat_meta(meta, without=("precision",))
    for extra, want in cases:
        refused(extra, want)
    for extra in [], [f"{stage}=1"]:
        assert launch.main(args(shards, run, "train.max_steps=10", "train.global_batch_size=8", *extra)) == 0
    assert started == ["auto", "auto"]


def test_checkpoints_as_earlier_versions_wrote_them_resume_bit_for_bit_and_zero2_resumes_under_zero1(
        tiny_run, shards, tmp_path):
    """A checkpoint whose megatok.json is flat (as written before it had one key per component) and has
    no precision (as written before that was recorded) resumes as before; one of ZeRO-2 resumes under
    ZeRO-1 (the same DeepSpeed files), bit for bit. Each resume takes the same checkpoint from step 3 to 5
    and has the losses of the resume from it as written now; the flat one's step-5 checkpoint is the
    current one's, in the current layout."""
    runs = {}
    for name, flat, extra in (("now", False, []), ("zero2", True, []),
                              ("zero1", True, ["deepspeed.zero_optimization.stage=1"])):
        run = runs[name] = tmp_path / name
        shutil.copytree(tiny_run, run)
        if flat:
            write_flat_meta(run / "checkpoints" / "step00000003" / "megatok.json", without=("precision",))
        r = pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
                      "train.max_steps=5", "train.micro_batch_size=2", "train.global_batch_size=2", *extra])
        assert "start step 3 from step00000003" in r.stdout
        assert checkpoints.read_meta(run, "step00000005")["engine"]["precision"] == "fp32"
    now = train_rows(runs["now"])
    for name in ("zero2", "zero1"):
        got = train_rows(runs[name])
        for step in (4, 5):
            assert [got[step][k] for k in ("loss", "grad_norm", "bytes_seen", "flops")] == [
                now[step][k] for k in ("loss", "grad_norm", "bytes_seen", "flops")], (name, step)
    written = json.loads((runs["zero2"] / "checkpoints" / "step00000005" / "megatok.json").read_text())
    assert written == checkpoints.read_meta(runs["now"], "step00000005") and written["format"] == checkpoints.FORMAT
