"""Multi-node templates: the Slurm script and the torchrun script are valid bash, and rendered for
2 nodes x 8 GPUs (fake ``scontrol``/``srun``/``python`` on PATH, Slurm's variables set by hand) they
produce the expected launch line, hostfile and .deepspeed_env. No GPU, no Slurm, no network."""

import os
import shlex
import stat
import subprocess

import pytest

from megatok.sizing import dry_run
from tests.conftest import ROOT

SBATCH = ROOT / "launch/slurm/pretrain.sbatch"
TORCHRUN = ROOT / "launch/torchrun_multinode.sh"
ARGS = ["--config", "configs/1b.json", "--set", "data.shards=/shared/megatok/shards"]

FAKE_SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames && $3 == "gpu-a[01-02]" ]] || { echo "unexpected: $*" >&2; exit 1; }
printf 'gpu-a01\\ngpu-a02\\n'
"""
# srun: run the command once per task, locally, with the variables Slurm gives each task.
FAKE_SRUN = """#!/bin/bash
nodes=1; per=1
while [[ $1 == -* ]]; do
    case $1 in --nodes) nodes=$2; shift 2;; --ntasks-per-node) per=$2; shift 2;; *) shift;; esac
done
for ((i = 0; i < nodes * per; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$((i % per)) SLURM_NODEID=$((i / per)) SLURM_NTASKS=$((nodes * per)) "$@"
done
"""
FAKE_PYTHON = """#!/bin/bash
echo "TASK RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE ARGS=$*"
"""


def fake_bin(tmp_path):
    b = tmp_path / "bin"
    b.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("python", FAKE_PYTHON)):
        (b / name).write_text(text)
        (b / name).chmod((b / name).stat().st_mode | stat.S_IEXEC)
    return b


def render(tmp_path, launcher, print_only=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NCCL_", "OMP_"))}
    env.update(PATH=f"{fake_bin(tmp_path)}:{env['PATH']}", VIRTUAL_ENV="/fake/venv", LAUNCHER=launcher,
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-a[01-02]", SLURM_JOB_NUM_NODES="2",
               SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="96", JOB_DIR=str(tmp_path / "job"),
               NCCL_SOCKET_IFNAME="ib0", NCCL_IB_HCA="mlx5", WANDB_MODE="offline", AWS_PROFILE="shards",
               FORWARD_ENV="AWS_PROFILE UNSET_VARIABLE")
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


def test_sbatch_deepspeed_launch_for_2_nodes_x_8_gpus(tmp_path, capsys):
    cmd = launch_line(render(tmp_path, "deepspeed"))
    job = tmp_path / "job"
    assert cmd == ["deepspeed", "--hostfile", str(job / "hostfile"), "--num_nodes", "2", "--num_gpus", "8",
                   "--master_addr", "gpu-a01", "--master_port", str(20000 + 4242), "launch/pretrain.py", *ARGS]
    assert (job / "hostfile").read_text() == "gpu-a01 slots=8\ngpu-a02 slots=8\n"
    envfile = dict(line.split("=", 1) for line in (job / ".deepspeed_env").read_text().splitlines())
    assert envfile["NCCL_SOCKET_IFNAME"] == "ib0" and envfile["NCCL_IB_HCA"] == "mlx5"
    assert envfile["WANDB_MODE"] == "offline" and envfile["OMP_NUM_THREADS"] == "12"  # 96 cores / 8 GPUs
    assert envfile["AWS_PROFILE"] == "shards" and "UNSET_VARIABLE" not in envfile
    assert envfile["PYTHONPATH"].split(":")[0] == str(ROOT) and "MEGATOK_PRINT_ONLY" not in envfile
    # The arguments it passes resolve to a valid job of 16 ranks.
    assert dry_run(cmd[cmd.index("--config") + 1], [ARGS[-1]], world=16) == 0
    assert '"train_batch_size": 512' in capsys.readouterr().out


def test_sbatch_torchrun_launch(tmp_path):
    cmd = launch_line(render(tmp_path, "torchrun"))
    assert cmd[:cmd.index("torchrun")] == ["srun", "--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    tr = cmd[cmd.index("torchrun"):]
    assert tr == ["torchrun", "--nnodes", "2", "--nproc_per_node", "8", "--rdzv_id", "4242", "--rdzv_backend",
                  "c10d", "--rdzv_endpoint", f"gpu-a01:{20000 + 4242}", "launch/pretrain.py", *ARGS]


def test_sbatch_srun_gives_every_task_its_rank(tmp_path):
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
