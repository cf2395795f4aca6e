"""Multi-node templates: the Slurm script and the torchrun script are valid bash, and rendered for
2 nodes x 8 GPUs (fake ``scontrol``/``srun``/``python`` on PATH, Slurm's variables set by hand) they
produce the expected launch line, hostfile and .deepspeed_env; the default launcher (srun + torchrun)
trains for real on one node of 2 CPU ranks through a stub srun. No GPU, no Slurm, no network."""

import json
import os
import shlex
import signal
import stat
import subprocess
import time

import pytest

from megatok.size_report import dry_run
from tests.conftest import ROOT

SBATCH = ROOT / "launch/slurm/pretrain.sbatch"
TORCHRUN = ROOT / "launch/torchrun_multinode.sh"
ARGS = ["--config", "configs/1b.json", "--set", "data.shards=/shared/megatok/shards"]

FAKE_SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames ]] || { echo "unexpected: $*" >&2; exit 1; }
case $3 in "gpu-a[01-02]") printf 'gpu-a01\\ngpu-a02\\n';; gpu-a01) echo gpu-a01;; localhost) echo localhost;; *) exit 1;; esac
"""
# srun: run the command once per task, locally, with the variables Slurm gives each task.
FAKE_SRUN = """#!/bin/bash
nodes=1; per=1
while [[ $1 == -* ]]; do
    case $1 in --nodes) nodes=$2; shift 2;; --ntasks-per-node) per=$2; shift 2;; --cpus-per-task) shift 2;; *) shift;; esac
done
for ((i = 0; i < nodes * per; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$((i % per)) SLURM_NODEID=$((i / per)) SLURM_NTASKS=$((nodes * per)) "$@"
done
"""
FAKE_PYTHON = """#!/bin/bash
echo "TASK RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE ARGS=$*"
"""
# torchrun: report the environment a task gets (through srun) and the arguments
FAKE_TORCHRUN = """#!/bin/bash
echo "TORCHRUN node=$SLURM_NODEID NCCL_IB_TIMEOUT=$NCCL_IB_TIMEOUT NCCL_IB_HCA=$NCCL_IB_HCA AWS_PROFILE=$AWS_PROFILE \
MEGATOK_STOP_FILE=$MEGATOK_STOP_FILE OMP_NUM_THREADS=$OMP_NUM_THREADS ARGS=$*"
"""


def fake_bin(tmp_path):
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("python", FAKE_PYTHON),
                       ("torchrun", FAKE_TORCHRUN)):
        (b / name).write_text(text)
        (b / name).chmod((b / name).stat().st_mode | stat.S_IEXEC)
    return b


def slurm_env(tmp_path, launcher):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NCCL_", "OMP_", "MEGATOK_"))}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (home / ".deepspeed_env").write_text("NCCL_IB_TIMEOUT=22\nNCCL_NET_GDR_LEVEL=PHB\nNCCL_IB_HCA=from-file\n")
    env["HOME"] = str(home)
    env.update(PATH=f"{fake_bin(tmp_path)}:{env['PATH']}", VIRTUAL_ENV="/fake/venv", LAUNCHER=launcher,
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-a[01-02]", SLURM_JOB_NUM_NODES="2",
               SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="96", JOB_DIR=str(tmp_path / "job"),
               NCCL_SOCKET_IFNAME="ib0", NCCL_IB_HCA="mlx5", GLOO_SOCKET_IFNAME="ib0", WANDB_MODE="offline",
               AWS_PROFILE="shards",
               FORWARD_ENV="AWS_PROFILE UNSET_VARIABLE")
    return env


def render(tmp_path, launcher, print_only=True):
    env = slurm_env(tmp_path, launcher)
    if launcher is None:  # the default
        del env["LAUNCHER"]
    if print_only:
        env["MEGATOK_PRINT_ONLY"] = "1"
    r = subprocess.run(["bash", str(SBATCH), *ARGS], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def launch_line(out: str) -> list[str]:
    lines = [ln for ln in out.splitlines() if ln.startswith("LAUNCH:")]
    assert len(lines) == 1, out
    return shlex.split(lines[0][len("LAUNCH:"):])


@pytest.mark.parametrize("script", [SBATCH, TORCHRUN])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(script, os.X_OK)


def test_sbatch_one_node_launches_without_a_hostfile(tmp_path):
    env = {**slurm_env(tmp_path, "deepspeed"), "SLURM_JOB_NODELIST": "gpu-a01", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_ID": "39999", "MEGATOK_PRINT_ONLY": "1"}
    r = subprocess.run(["bash", str(SBATCH), *ARGS], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert launch_line(r.stdout) == ["deepspeed", "--num_gpus", "8", "--master_port", str(20000 + 9999),
                                     "launch/pretrain.py", *ARGS]  # a port below the kernel's ephemeral range


def test_sbatch_deepspeed_launch_for_2_nodes_x_8_gpus(tmp_path, capsys):
    cmd = launch_line(render(tmp_path, "deepspeed"))
    job = tmp_path / "job"
    assert cmd == ["deepspeed", "--hostfile", str(job / "hostfile"), "--num_nodes", "2", "--num_gpus", "8",
                   "--master_addr", "gpu-a01", "--master_port", str(20000 + 4242), "launch/pretrain.py", *ARGS]
    assert (job / "hostfile").read_text() == "gpu-a01 slots=8\ngpu-a02 slots=8\n"
    envfile = dict(line.split("=", 1) for line in (job / ".deepspeed_env").read_text().splitlines())
    assert envfile["NCCL_SOCKET_IFNAME"] == "ib0" and envfile["NCCL_IB_HCA"] == "mlx5"
    assert envfile["GLOO_SOCKET_IFNAME"] == "ib0"  # torch's start-up uses gloo too; DeepSpeed does not pass it on
    assert envfile["WANDB_MODE"] == "offline" and envfile["OMP_NUM_THREADS"] == "12"  # 96 cores / 8 GPUs
    assert envfile["AWS_PROFILE"] == "shards" and "UNSET_VARIABLE" not in envfile
    assert envfile["PYTHONPATH"].split(":")[0] == str(ROOT) and "MEGATOK_PRINT_ONLY" not in envfile
    assert envfile["MEGATOK_STOP_FILE"] == str(job / "STOP")
    # the user's own ~/.deepspeed_env comes along (DS_ENV_FILE replaces it for DeepSpeed's runner)
    assert envfile["NCCL_IB_TIMEOUT"] == "22" and envfile["NCCL_NET_GDR_LEVEL"] == "PHB"
    # The arguments it passes resolve to a valid job of 16 ranks.
    assert dry_run(cmd[cmd.index("--config") + 1], [ARGS[-1]], world=16) == 0
    assert '"train_batch_size": 512' in capsys.readouterr().out


def test_sbatch_forwards_no_secret_to_the_other_nodes(tmp_path):
    """Keys and tokens stay out of .deepspeed_env (DeepSpeed's runner puts its lines on every node's ssh
    command line), whether from the environment, the user's env files or FORWARD_ENV; the file is 0600 and
    the job's output names what it dropped, never the values."""
    env = {**slurm_env(tmp_path, "deepspeed"), "MEGATOK_PRINT_ONLY": "1", "WANDB_API_KEY": "wandb-VALUE1",
           "HF_TOKEN": "hf-VALUE2", "AWS_SECRET_ACCESS_KEY": "aws-VALUE3", "DB_PASSWORD": "pw-VALUE4",
           "FORWARD_ENV": "AWS_PROFILE AWS_SECRET_ACCESS_KEY DB_PASSWORD", "WANDB_PROJECT": "kept"}
    (tmp_path / "home" / ".deepspeed_env").write_text("NCCL_IB_TIMEOUT=22\nMY_SERVICE_TOKEN=file-VALUE5\n")
    r = subprocess.run(["bash", str(SBATCH), *ARGS], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    path = tmp_path / "job" / ".deepspeed_env"
    text = path.read_text()
    assert "VALUE" not in text and "WANDB_PROJECT=kept" in text and "AWS_PROFILE=shards" in text
    assert "NCCL_IB_TIMEOUT=22" in text and stat.S_IMODE(path.stat().st_mode) == 0o600
    line = next(ln for ln in r.stderr.splitlines() if "not forwarded" in ln)
    assert line.split("(secrets): ")[1].split(";")[0].split() == sorted(
        ["AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "HF_TOKEN", "MY_SERVICE_TOKEN", "WANDB_API_KEY"])
    assert "VALUE" not in r.stdout + r.stderr


# A launcher that runs until the stop file appears, like the trainer's rank 0 (which removes it).
FAKE_DEEPSPEED = """#!/bin/bash
echo started > "$JOB_DIR/started"
for i in $(seq 300); do
    if [[ -f $MEGATOK_STOP_FILE ]]; then rm "$MEGATOK_STOP_FILE"; echo "LAUNCHER saw $MEGATOK_STOP_FILE"; exit 0; fi
    sleep 0.1
done
exit 3
"""


@pytest.mark.parametrize("sig, launcher", [("USR1", "deepspeed"), ("TERM", "deepspeed"), ("USR1", "torchrun"),
                                           ("TERM", "torchrun")])
def test_sbatch_time_limit_warning_asks_the_run_to_stop(tmp_path, sig, launcher):
    """Slurm's --signal=B:USR1@300 reaches the batch shell: it touches MEGATOK_STOP_FILE (which the
    trainer watches besides RUN_DIR/STOP) and waits for the launcher, whose exit status it returns.
    A SIGTERM to the batch shell is passed on to the launcher (srun, which passes it on to its tasks)."""
    assert "#SBATCH --signal=B:USR1@" in SBATCH.read_text()
    env = slurm_env(tmp_path, launcher)
    if launcher == "torchrun":  # one node: the fake srun runs its tasks one after the other
        env.update(SLURM_JOB_NODELIST="gpu-a01", SLURM_JOB_NUM_NODES="1")
    fake = tmp_path / "bin" / launcher  # next to slurm_env's fake scontrol, on its PATH
    fake.write_text(FAKE_DEEPSPEED)
    fake.chmod(0o755)
    job = tmp_path / "job"
    with open(tmp_path / "out", "w") as out:
        proc = subprocess.Popen(["bash", str(SBATCH), *ARGS], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        for _ in range(300):
            if (job / "started").exists():
                break
            time.sleep(0.05)
        time.sleep(0.3)
        assert proc.poll() is None, (tmp_path / "out").read_text()  # the launcher runs, the script waits
        proc.send_signal(getattr(signal, f"SIG{sig}"))
        rc = proc.wait(timeout=30)
    text = (tmp_path / "out").read_text()
    if sig == "TERM":
        assert rc == 128 + signal.SIGTERM and "LAUNCHER saw" not in text, text
        return
    assert rc == 0, text
    assert f"LAUNCHER saw {job / 'STOP'}" in text and "time limit near" in text
    assert not (job / "STOP").exists()


def test_stop_request_watches_megatok_stop_file(tmp_path, monkeypatch):
    from megatok.train.callbacks import StopRequest

    monkeypatch.setenv("MEGATOK_STOP_FILE", str(tmp_path / "job" / "STOP"))
    stop = StopRequest(tmp_path / "run", rank=0)
    try:
        assert not stop.requested
        (tmp_path / "job").mkdir()
        (tmp_path / "job" / "STOP").touch()
        assert stop.requested and stop.reason() == f"stopped by {tmp_path / 'job' / 'STOP'}"
        assert not StopRequest(tmp_path / "run", rank=1).requested  # rank 0 alone looks
        stop.remove_files()
        assert not stop.requested
    finally:
        stop.restore()


def test_a_stop_file_older_than_the_run_is_removed_with_a_line_and_a_new_one_counts(tmp_path, capsys):
    from megatok.train import callbacks
    from megatok.train.callbacks import StopRequest

    run = tmp_path / "run"
    run.mkdir()
    (run / "STOP").touch()  # left by a run killed before it could remove it: older than this process's start
    os.utime(run / "STOP", (callbacks.STARTED - 60, callbacks.STARTED - 60))
    stop = StopRequest(run, rank=0)
    try:
        stop.on_fit_start(None)
        assert not stop.requested and not (run / "STOP").exists()
        assert f"megatok: removed {run / 'STOP'}, a stop file older than this run's start" in capsys.readouterr().out
        (run / "STOP").touch()  # one touched while the run trains stops it
        assert stop.requested and stop.reason() == f"stopped by {run / 'STOP'}"
    finally:
        stop.restore()


def test_a_stop_file_touched_by_the_jobs_trap_before_the_trainer_started_counts(tmp_path, monkeypatch):
    """The Slurm template records the job's start (MEGATOK_JOB_STARTED): a stop file its time-limit trap
    touched after that, before this process started, stops the run; one older than the job is stale."""
    import time

    from megatok.train import callbacks
    from megatok.train.callbacks import StopRequest

    now = time.time()
    for value, want in (("nan", now), ("soon", now), (str(now + 3600), now), (str(now - 30), now - 30)):
        monkeypatch.setenv("MEGATOK_JOB_STARTED", value)
        assert callbacks._started() == pytest.approx(want, abs=5)
    monkeypatch.setattr(callbacks, "STARTED", callbacks._started())  # the job began 30 s before this process
    run = tmp_path / "run"
    run.mkdir()
    (run / "STOP").touch()
    os.utime(run / "STOP", (now - 10, now - 10))  # the trap's, 20 s into the job
    stop = StopRequest(run, rank=0)
    try:
        stop.on_fit_start(None)
        assert stop.requested and (run / "STOP").exists()
    finally:
        stop.restore()
    os.utime(run / "STOP", (now - 60, now - 60))  # from before the job: stale
    assert StopRequest(run, rank=0).stale


def test_sbatch_default_launch_is_srun_and_torchrun_without_ssh(tmp_path):
    cmd = launch_line(render(tmp_path, None))
    assert cmd[:cmd.index("torchrun")] == ["srun", "--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "96",
                                           "--export=ALL", "--kill-on-bad-exit=1",  # all the node's CPUs
                                           "bash", "-c", 'torchrun_node "$@"', "megatok"]  # names a failed rendezvous
    tr = cmd[cmd.index("torchrun"):]
    assert tr == ["torchrun", "--nnodes", "2", "--nproc_per_node", "8", "--rdzv_id", "4242", "--rdzv_backend",
                  "c10d", "--rdzv_endpoint", f"gpu-a01:{20000 + 4242}", "--rdzv_conf",
                  "join_timeout=600,read_timeout=630", "launch/pretrain.py", *ARGS]
    job = tmp_path / "job"
    assert not (job / "hostfile").exists() and not (job / ".deepspeed_env").exists()  # no pdsh, no ssh


def test_sbatch_torchrun_tasks_get_the_deepspeed_env_files_and_the_environment(tmp_path):
    """The fake srun runs one task per node with this environment (as srun --export=ALL does): the
    lines of ~/.deepspeed_env that the environment does not set arrive, the environment wins over
    them, FORWARD_ENV's names and the stop file come along."""
    out = render(tmp_path, "torchrun", print_only=False)
    tasks = [ln for ln in out.splitlines() if ln.startswith("TORCHRUN")]
    assert len(tasks) == 2, out
    for node, line in enumerate(tasks):
        assert line.startswith(f"TORCHRUN node={node} NCCL_IB_TIMEOUT=22 NCCL_IB_HCA=mlx5 AWS_PROFILE=shards "
                               f"MEGATOK_STOP_FILE={tmp_path / 'job' / 'STOP'} OMP_NUM_THREADS=12 "), line
        assert line.endswith("launch/pretrain.py " + " ".join(ARGS))
    # a file's variable counts before the script's own defaults (OMP_NUM_THREADS from the CPUs otherwise)
    env = slurm_env(tmp_path, "torchrun")
    (tmp_path / "home" / ".deepspeed_env").write_text("OMP_NUM_THREADS=3\nNCCL_IB_TIMEOUT=23")  # no final newline
    r = subprocess.run(["bash", str(SBATCH), *ARGS], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "NCCL_IB_TIMEOUT=23" in r.stdout and "OMP_NUM_THREADS=3 " in r.stdout, r.stdout


def test_sbatch_runs_the_script_named_and_takes_a_rendezvous_timeout(tmp_path):
    """MEGATOK_SCRIPT in place of launch/pretrain.py for every launcher; RDZV_TIMEOUT bounds torchrun's
    rendezvous (the other nodes wait 30 s longer to connect, so the first node's line comes first)."""
    script = "tests/train/faulty_pretrain.py"
    for launcher in ("torchrun", "srun", "deepspeed"):
        env = {**slurm_env(tmp_path, launcher), "MEGATOK_SCRIPT": script, "RDZV_TIMEOUT": "45",
               "MEGATOK_PRINT_ONLY": "1"}
        r = subprocess.run(["bash", str(SBATCH), *ARGS], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
        assert r.returncode == 0, r.stderr
        cmd = launch_line(r.stdout)
        assert cmd[-len(ARGS) - 1:] == [script, *ARGS] and "launch/pretrain.py" not in cmd, (launcher, cmd)
        if launcher == "torchrun":
            assert cmd[cmd.index("--rdzv_conf") + 1] == "join_timeout=45,read_timeout=75"


def test_sbatch_unknown_launcher_is_one_line(tmp_path):
    env = slurm_env(tmp_path, "pdsh")
    r = subprocess.run(["bash", str(SBATCH), *ARGS], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "error: LAUNCHER=pdsh: expected torchrun, srun or deepspeed"


def test_sbatch_srun_gives_every_task_its_rank(tmp_path):
    cmd = launch_line(render(tmp_path, "srun"))
    assert cmd[:9] == ["srun", "--nodes", "2", "--ntasks-per-node", "8", "--cpus-per-task", "12", "--export=ALL",
                       "--kill-on-bad-exit=1"]
    out = render(tmp_path, "srun", print_only=False)  # fake srun runs 16 tasks, fake python reports
    tasks = [ln for ln in out.splitlines() if ln.startswith("TASK")]
    assert len(tasks) == 16
    for i, line in enumerate(tasks):
        assert f"RANK={i} LOCAL_RANK={i % 8} WORLD_SIZE=16 LOCAL_WORLD_SIZE=8 " in line
        assert line.endswith("ARGS=-u launch/pretrain.py " + " ".join(ARGS))


def test_torchrun_multinode_script(tmp_path):
    env = {**os.environ, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node-001", "GPUS_PER_NODE": "8",
           "MEGATOK_PRINT_ONLY": "1", "VIRTUAL_ENV": "/fake/venv"}
    r = subprocess.run(["bash", str(TORCHRUN), *ARGS], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert launch_line(r.stdout) == ["torchrun", "--nnodes", "2", "--nproc_per_node", "8", "--node_rank", "1",
                                     "--master_addr", "node-001", "--master_port", "29500", "launch/pretrain.py",
                                     *ARGS]


# srun for one node: record the arguments, then run the command once, as Slurm's task 0 of 1
RECORDING_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$JOB_DIR/srun-args"
while [[ $1 == -* ]]; do
    case $1 in --nodes|--ntasks-per-node|--cpus-per-task) shift 2;; *) shift;; esac
done
SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_NTASKS=1 exec "$@"
"""


@pytest.mark.dist
def test_sbatch_default_launcher_trains_through_srun_and_torchrun(tmp_path, shards):
    """The template as submitted, on one node of 2 CPU "GPUs": a stub srun records its arguments and
    runs the real torchrun, whose c10d rendezvous starts 2 ranks of launch/pretrain.py for 2 steps and
    a checkpoint. No pdsh, no ssh, no hostfile."""
    import sys

    from megatok.train.dist import free_port
    from tests.conftest import TINY

    env = slurm_env(tmp_path, "torchrun")
    del env["LAUNCHER"]
    (tmp_path / "bin" / "srun").write_text(RECORDING_SRUN)
    (tmp_path / "bin" / "torchrun").unlink()  # the real one, next to this interpreter
    run_dir = tmp_path / "run"
    env.update(SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", SLURM_GPUS_ON_NODE="2",
               SLURM_CPUS_ON_NODE="2", MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu", WANDB_MODE="disabled",
               PATH=f"{tmp_path / 'bin'}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    env.pop("NCCL_SOCKET_IFNAME")
    env.pop("GLOO_SOCKET_IFNAME")  # "ib0" from slurm_env: no such interface here
    args = ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run_dir}",
            "train.max_steps=2", "train.micro_batch_size=2", "train.global_batch_size=4"]
    r = subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
                       start_new_session=True)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    srun = (tmp_path / "job" / "srun-args").read_text().splitlines()
    assert srun[:srun.index("torchrun")] == ["--nodes", "1", "--ntasks-per-node", "1", "--cpus-per-task", "2",
                                             "--export=ALL", "--kill-on-bad-exit=1", "bash", "-c",
                                             'torchrun_node "$@"', "megatok"]
    assert srun[srun.index("torchrun"):srun.index("launch/pretrain.py")] == [
        "torchrun", "--nnodes", "1", "--nproc_per_node", "2", "--rdzv_id", "4242", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", f"localhost:{env['MASTER_PORT']}", "--rdzv_conf", "join_timeout=600,read_timeout=630"]
    assert (run_dir / "metrics.jsonl").exists(), (r.stdout[-3000:], r.stderr[-3000:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row.get("split") == "train"] == [1, 2]
    meta = json.loads((run_dir / "checkpoints" / "step00000002" / "megatok.json").read_text())
    assert meta["data"]["layout"]["world_size"] == 2
    assert not (tmp_path / "job" / "hostfile").exists()
