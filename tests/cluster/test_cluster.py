"""The multi-node templates and the faults of a cluster, on a real two-node Slurm cluster (tools/cluster.sh:
network namespaces, slurmctld, slurmd and sshd per node, munge), CPU ranks on gloo, one rank per node.

Every launch path (launch/slurm/pretrain.sbatch with LAUNCHER torchrun, srun and deepspeed through a
hostfile (pdsh over ssh), and launch/torchrun_multinode.sh) trains to exit 0 with metrics rows equal, bit
for bit, to one node's with the same world size (2), seed and data; each fault ends in a clear line within
its stated time, keeps the newest complete checkpoint, and the next job resumes bit-exactly. The measured
times are printed (pytest -s) and quoted in docs/reliability.md."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatok.metrics import read_metrics
from megatok.run.checkpoints import damage, latest_tag
from tests.cluster.conftest import CLUSTER, cluster_env
from tests.conftest import ROOT, TINY, pretrain

pytestmark = [pytest.mark.cluster, pytest.mark.dist]

SBATCH = "launch/slurm/pretrain.sbatch"
FAULTY = "tests/train/faulty_pretrain.py"
STEPS, EVERY = 100, 10
TIMING = ("bytes_per_s", "tflops_per_device", "mfu", "time")
DIST_TIMEOUT_S, MARGIN_S = 10, 10  # a lost rank: every other ends within dist_timeout_s + this margin
KILL_WAIT_S = 10  # the cluster's KillWait (conftest)


def args(shards, run, *extra) -> list[str]:
    """tiny.json, 2 ranks of micro-batch 2, a constant learning rate (so a shorter run is a prefix of a longer)."""
    return ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
            "train.micro_batch_size=2", "train.global_batch_size=4", "data.num_workers=1",
            "train.lr_schedule=constant", f"train.max_steps={STEPS}", f"train.save_every={EVERY}", *extra]


def rows(run) -> list[dict]:
    """The training rows without what measures time or memory."""
    return [{k: v for k, v in r.items() if k not in TIMING and "_peak_" not in k}
            for r in read_metrics(run) if r.get("split") == "train"]


def measured(what: str, seconds: float) -> None:
    print(f"\nMEASURED {what}: {seconds:.1f} s", flush=True)


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """One node, 2 ranks, STEPS steps: what every cluster run must equal."""
    run = tmp_path_factory.mktemp("reference") / "run"
    pretrain(args(shards, run), nproc=2)
    out = rows(run)
    assert [r["step"] for r in out] == list(range(1, STEPS + 1))
    return out


def env_for(tmp_path, **extra) -> dict:
    """A job's environment: CPU ranks, one per node, the test's interpreter, the job's files under tmp_path."""
    bin_dir = os.path.dirname(sys.executable)
    return {**cluster_env(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled",
            "CUDA_VISIBLE_DEVICES": "", "GPUS_PER_NODE": "1", "VIRTUAL_ENV": os.path.dirname(bin_dir),
            "PATH": f"{bin_dir}:{os.environ['PATH']}", "JOB_DIR": str(tmp_path / "job"), **extra}


def submit(env, script_args, out, *options) -> str:
    r = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", f"--output={out}", *options,
                        SBATCH, *script_args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def run_job(env, script_args, out, *options, timeout: float = 600) -> tuple[dict, float]:
    """Submit, wait for the job to end (polling: sbatch --wait looks every few seconds); its final state and
    how long it took from submission."""
    t = time.monotonic()
    job_id = submit(env, script_args, out, *options)
    return wait_ended(job_id, timeout), time.monotonic() - t


def job(job_id) -> dict:
    r = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=cluster_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)


def scontrol(*argv) -> None:
    subprocess.run(["scontrol", *argv], env=cluster_env(), check=True, capture_output=True, timeout=60)


def sacct(*argv) -> list[str]:
    """sacct's lines for the jobs (not their steps), no header."""
    r = subprocess.run(["sacct", "-n", "-X", *argv], env=cluster_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def node_state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], env=cluster_env(), capture_output=True,
                          text=True, timeout=60).stdout.strip()


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if got := predicate():
            return got
        time.sleep(poll)
    raise AssertionError(f"not within {timeout} s: {what}")


def wait_ended(job_id, timeout: float = 300) -> dict:
    return wait_for(lambda: (j := job(job_id))["JobState"] in ENDED and j, timeout, f"job {job_id} ended")


def cluster_sh(*argv, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), *argv], capture_output=True, text=True, env=cluster_env(),
                          timeout=120, check=check)


def processes(node: str) -> dict[int, tuple[int, str]]:
    """The processes on a node: {pid: (parent pid, command line)}, its daemons (slurmd, sshd) left out."""
    pids = subprocess.run(["ip", "netns", "pids", f"mtk-{node}"], capture_output=True, text=True).stdout.split()
    out = {}
    for pid in map(int, pids):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        if cmd and not cmd.startswith(("slurmd ", "sshd:", "/usr/sbin/sshd")):
            out[pid] = (ppid, cmd)
    return out


def ranks(node: str, script: str = "launch/pretrain.py") -> list[int]:
    """The rank processes on a node (not their data workers, forked from them with the same command line)."""
    procs = {pid: p for pid, p in processes(node).items()
             if script in p[1] and "torchrun" not in p[1] and "deepspeed.launcher" not in p[1]}
    return sorted(pid for pid, (ppid, _) in procs.items() if ppid not in procs)


def nothing_left(timeout: float = 60) -> None:
    """No process of any job on either node (only slurmd and sshd)."""
    wait_for(lambda: not processes("node1") and not processes("node2"), timeout,
             "no job process left on the nodes")


def train_steps(run) -> int:
    path = Path(run) / "metrics.jsonl"
    return sum('"split": "train"' in line for line in path.read_text().splitlines()) if path.is_file() else 0


def test_the_nodes_are_hosts_of_a_slurm_cluster(cluster):
    """Own hostnames and addresses, names that resolve, Slurm's two nodes, ssh between them as DeepSpeed's
    runner needs it."""
    r = subprocess.run(["srun", "--nodes=2", "--gpus-per-node=0", "--job-name=hosts", "hostname"],
                       env=cluster_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and sorted(r.stdout.split()) == ["node1", "node2"], r.stderr
    wait_for(lambda: ["hosts", "COMPLETED", "0:0", "node[1-2]"] in [
        line.split() for line in sacct("-o", "JobName,State,ExitCode,NodeList")], 30, "the job in sacct")
    r = cluster_sh("exec", "node1", "bash", "-c", "ssh node2 hostname; getent ahostsv4 node2 | head -1; pwd")
    assert r.stdout.split() == ["node2", "10.213.47.12", "STREAM", "node2", str(ROOT)]
    assert cluster_sh("status").returncode == 0
    # ssh's settings for the nodes live on the cluster's hosts only: the machine's own are untouched
    assert not Path("/etc/ssh/ssh_config.d/megatok-cluster.conf").exists()
    assert "megatok" not in Path("/etc/ssh/ssh_config").read_text()


def test_torchrun_multinode_script_on_two_nodes_equals_one_node(cluster, shards, reference, tmp_path):
    """launch/torchrun_multinode.sh, run on each node as the user would (NODE_RANK 0 and 1)."""
    run = tmp_path / "run"
    env = {**env_for(tmp_path), "NNODES": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29411"}
    argv = args(shards, run, "train.max_steps=10")
    t = time.monotonic()
    nodes = [subprocess.Popen(["bash", str(CLUSTER), "exec", f"node{n + 1}", "bash", "launch/torchrun_multinode.sh",
                               *argv], cwd=ROOT, env={**env, "NODE_RANK": str(n)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for n in range(2)]
    out = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], out[0][-3000:] + out[1][-3000:]
    measured("torchrun_multinode.sh, 2 nodes, 10 steps", time.monotonic() - t)
    assert rows(run) == reference[:10]


@pytest.mark.parametrize("launcher", ["torchrun", "srun", "deepspeed"])
def test_each_launcher_of_the_template_on_two_nodes_equals_one_node(cluster, shards, reference, tmp_path, launcher):
    """launch/slurm/pretrain.sbatch on 2 nodes with each LAUNCHER, from an empty run directory: exit 0, and
    the rows one node gives. The default launcher through ``sbatch --wait`` as a user runs it (it polls the
    job every few seconds, up to half a minute: about 40 s here), the others through run_job's faster poll."""
    run, out = tmp_path / "run", tmp_path / "job.out"
    env, argv = env_for(tmp_path, LAUNCHER=launcher), args(shards, run, "train.max_steps=10")
    t = time.monotonic()
    if launcher == "torchrun":
        r = subprocess.run(["sbatch", "--wait", "--nodes=2", "--gpus-per-node=0", f"--output={out}", SBATCH, *argv],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (out.read_text() if out.is_file() else r.stderr)[-4000:]
    else:
        state, _ = run_job(env, argv, out, timeout=300)
        assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", out.read_text()[-4000:]
    measured(f"LAUNCHER={launcher}, 2 nodes, 10 steps, submitted to ended", time.monotonic() - t)
    log = out.read_text()
    assert f"launcher {launcher}," in log and "start step 0," in log
    assert rows(run) == reference[:10]
    nothing_left()


def test_sigkill_of_a_rank_on_node2_then_the_rerun_resumes_bit_exactly(cluster, shards, reference, tmp_path):
    """The default launcher (srun + torchrun). While it trains, a second launch on its run directory fails at
    once naming the holder. A rank on node2 SIGKILLed: the job ends with torchrun's report naming the lost
    rank and host; the rerun (LAUNCHER=srun) takes over the lock the killed run left and resumes bit-exactly."""
    run = tmp_path / "run"
    env = env_for(tmp_path, MEGATOK_SCRIPT=FAULTY, MEGATOK_FAULT_STEP_SLEEP="0.2")
    job_id = submit(env, args(shards, run), tmp_path / "first.out")
    wait_for(lambda: train_steps(run) >= 5, 240, "step 5")
    (holder,) = ranks("node1", FAULTY)

    # a user's second launch on the live run directory, on node1
    t = time.monotonic()
    second = cluster_sh("exec", "node1", sys.executable, "launch/pretrain.py", *args(shards, run), check=False)
    measured("a second launch on a live run directory fails (start-up included)", time.monotonic() - t)
    line = second.stderr.strip().splitlines()[-1]
    assert second.returncode == 5 and line.startswith(
        f"error: train.run_dir: {run} is in use by another run: host node1, pid {holder}, Slurm job {job_id}, "), line
    wait_for(lambda: train_steps(run) >= 25, 240, "step 25")
    assert train_steps(run) < STEPS - 10

    (victim,) = ranks("node2", FAULTY)
    os.kill(victim, signal.SIGKILL)
    t = time.monotonic()
    state = wait_ended(job_id, 120)
    nothing_left()
    measured("SIGKILL of rank 1 on node2 to no process left", time.monotonic() - t)
    out = (tmp_path / "first.out").read_text()
    assert state["JobState"] == "FAILED"
    # node2's torchrun names the lost rank and its host (the survivor, blocked in a collective until the
    # dead rank's data worker lets its sockets go, is usually ended by Slurm before it can say more)
    assert (f"  host      : node2\n  rank      : 1 (local_rank: 0)\n  exitcode  : -9 (pid: {victim})  (SIGKILL)"
            in out), out[-4000:]
    tag = latest_tag(run)
    assert tag and damage(run, tag) is None

    state, seconds = run_job(env_for(tmp_path, LAUNCHER="srun"), args(shards, run), tmp_path / "rerun.out",
                             "--ntasks-per-node=1")
    measured("the rerun (LAUNCHER=srun) from the last checkpoint, submitted to ended", seconds)
    out = (tmp_path / "rerun.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", out[-4000:]
    assert f"start step {int(tag.removeprefix('step'))} from {tag}" in out
    assert (f"took over the lock of a run that ended without releasing it (host node1, pid {holder}, "
            f"Slurm job {job_id}, since ") in out
    assert rows(run) == reference


def test_a_node_cut_off_mid_step_then_the_requeued_job_resumes_bit_exactly(cluster, shards, reference, tmp_path):
    """node2's link down while the job trains: each side's rank ends within train.dist_timeout_s + MARGIN_S
    with one line naming the rank it lost, exit 4, the newest complete checkpoint intact. node2's launcher
    waits for the link; once it is back (before Slurm's SlurmdTimeout, 60 s, would mark node2 down), Slurm
    ends what is left and the job fails; requeued (scontrol requeue), it resumes bit-exactly and leaves no
    process on any node. Each node writes its own output (srun's output file from the environment: node2's
    lines cannot reach the batch script's output while it is cut off)."""
    run = tmp_path / "run"
    env = env_for(tmp_path, MEGATOK_SCRIPT=FAULTY, MEGATOK_FAULT_STEP_SLEEP="0.1",
                  SLURM_STDOUTMODE=str(tmp_path / "%N.out"))
    job_id = submit(env, args(shards, run, f"train.dist_timeout_s={DIST_TIMEOUT_S}"), tmp_path / "job.out",
                    "--open-mode=append")  # the requeued job's lines after the first's
    wait_for(lambda: train_steps(run) >= 60, 240, "step 60")
    pids = {node: ranks(node, FAULTY)[0] for node in ("node1", "node2")}
    cluster_sh("partition", "node2")
    t = time.monotonic()
    try:
        ended = {}
        while len(ended) < 2 and time.monotonic() - t < 120:
            for node in pids:
                if node not in ended and not ranks(node, FAULTY):
                    ended[node] = time.monotonic() - t
            time.sleep(0.2)
    finally:
        cluster_sh("heal", "node2")
    for node, seconds in sorted(ended.items()):
        measured(f"{node}'s rank ended after node2 was cut off (train.dist_timeout_s={DIST_TIMEOUT_S})", seconds)
    assert sorted(ended) == ["node1", "node2"] and max(ended.values()) < DIST_TIMEOUT_S + MARGIN_S, ended
    for node, rank, other, peer in (("node1", 0, "node2", 1), ("node2", 1, "node1", 0)):
        text = (tmp_path / f"{node}.out").read_text()
        lines = [x for x in text.splitlines() if x.startswith(f"error: rank {rank}:")]
        assert len(lines) == 1, text[-4000:]
        assert f"rank {peer} ({other}, pid {pids[other]}) does not answer (host {other} cut off or down)" in lines[0]
    assert "exitcode  : 4" in (tmp_path / "node1.out").read_text()  # torchrun's report of the rank's exit
    tag = latest_tag(run)
    assert tag and damage(run, tag) is None
    state = wait_ended(job_id, 120)
    nothing_left()  # node2's launcher and slurmstepd waited for the link; then Slurm ended them
    measured("node2 cut off to nothing left on any node (healed once the ranks had ended)", time.monotonic() - t)
    assert state["JobState"] == "FAILED" and "down" not in node_state("node2")
    scontrol("requeue", job_id)
    scontrol("update", f"jobid={job_id}", "starttime=now")  # Slurm holds a requeued job 2 minutes; nothing is left
    t = time.monotonic()
    state = wait_ended(job_id, 600)
    measured("the requeued job, resumed to the end", time.monotonic() - t)
    text = (tmp_path / "node1.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", text[-4000:]
    assert f"start step {int(tag.removeprefix('step'))} from {tag}" in text
    assert rows(run) == reference
    nothing_left()


def test_a_time_limit_checkpoints_and_the_dependent_job_resumes_bit_exactly(cluster, shards, reference, tmp_path):
    """--time=1 with the warning 30 s ahead (the template asks 300): Slurm sends SIGUSR1 to the batch shell
    (at a check, up to 30 s later), the run checkpoints and exits 0 before the limit; a job submitted with
    --dependency=afterany resumes it to the end, bit-exactly."""
    run = tmp_path / "run"
    env = env_for(tmp_path, MEGATOK_SCRIPT=FAULTY, MEGATOK_FAULT_STEP_SLEEP="0.3", JOB_DIR=str(tmp_path / "job1"))
    t = time.monotonic()
    first = submit(env, args(shards, run), tmp_path / "first.out", "--time=1", "--signal=B:USR1@30")
    then = submit(env_for(tmp_path, JOB_DIR=str(tmp_path / "job2")), args(shards, run), tmp_path / "then.out",
                  f"--dependency=afterany:{first}")
    state = wait_ended(first, 120)
    measured("a job with --time=1 to its clean stop", time.monotonic() - t)
    out = (tmp_path / "first.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", out[-4000:]
    stopped = [line for line in out.splitlines() if line.startswith("megatok: stopped by ")]
    assert "time limit near (SIGUSR1)" in out and len(stopped) == 1, out[-4000:]
    step = int(stopped[0].split(" at step ")[1].split(";")[0])
    assert 0 < step < STEPS and latest_tag(run) == f"step{step:08d}"
    assert stopped[0] == (f"megatok: stopped by {tmp_path / 'job1' / 'STOP'} at step {step}; checkpoint written; "
                          f"run the same command to resume")
    print(f"\nMEASURED the time-limit stop came at step {step} of {STEPS}", flush=True)
    t = time.monotonic()
    state = wait_ended(then, 600)
    measured("the dependent job, resumed to the end", time.monotonic() - t)
    assert state["JobState"] == "COMPLETED", (tmp_path / "then.out").read_text()[-4000:]
    wait_for(lambda: [line.split() for line in sacct("-j", f"{first},{then}", "-o", "JobID,State,ExitCode")] == [
        [first, "COMPLETED", "0:0"], [then, "COMPLETED", "0:0"]], 30, "both jobs COMPLETED in sacct")
    assert rows(run) == reference


def test_scancel_during_a_checkpoint_write_keeps_the_last_one_and_deepspeed_resumes(cluster, shards, reference,
                                                                                  tmp_path):
    """scancel while the step-30 checkpoint is written (rank 0 takes 60 s over it): SIGTERM, then SIGKILL after
    KillWait; step 20 stays the newest complete checkpoint, and the next job (LAUNCHER=deepspeed: a hostfile,
    pdsh over ssh) resumes from it bit-exactly."""
    run = tmp_path / "run"
    env = env_for(tmp_path, MEGATOK_SCRIPT=FAULTY, MEGATOK_FAULT_SLOW_SAVE="30:60")
    job_id = submit(env, args(shards, run), tmp_path / "first.out")
    tmp = run / "checkpoints" / "step00000030.tmp"
    wait_for(lambda: tmp.is_dir() and any(tmp.glob("*model_states.pt")), 240, "the step-30 checkpoint written")
    subprocess.run(["scancel", job_id], env=cluster_env(), check=True, timeout=60)
    t = time.monotonic()
    nothing_left(120)
    measured(f"scancel during a checkpoint write to no process left (KillWait={KILL_WAIT_S})", time.monotonic() - t)
    assert time.monotonic() - t < KILL_WAIT_S + MARGIN_S
    assert wait_ended(job_id, 60)["JobState"] == "CANCELLED"
    assert latest_tag(run) == "step00000020" and damage(run, "step00000020") is None
    assert not (run / "checkpoints" / "step00000030").exists()
    state, seconds = run_job(env_for(tmp_path, LAUNCHER="deepspeed"), args(shards, run), tmp_path / "rerun.out")
    measured("the next job (LAUNCHER=deepspeed) from the step-20 checkpoint, submitted to ended", seconds)
    out = (tmp_path / "rerun.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", out[-4000:]
    assert "node2: " in out and "start step 20 from step00000020" in out  # pdsh ran node2's ranks
    assert rows(run) == reference
    nothing_left()


def test_a_node_that_cannot_reach_the_rendezvous_ends_with_one_line_per_node(cluster, shards, tmp_path):
    """node2 cannot reach node1's rendezvous port (a route that refuses it, as a firewall would): within
    RDZV_TIMEOUT both nodes end, each with one line saying why; nothing is left running."""
    port, timeout_s = 29455, 10
    rule = ["ip", "rule", "add", "to", "10.213.47.11", "ipproto", "tcp", "dport", str(port), "table", "213"]
    cluster_sh("exec", "node2", *rule)
    cluster_sh("exec", "node2", "ip", "route", "add", "unreachable", "10.213.47.11", "table", "213")
    try:
        env = env_for(tmp_path, MASTER_PORT=str(port), RDZV_TIMEOUT=str(timeout_s),
                      SLURM_STDOUTMODE=str(tmp_path / "%N.out"))
        state, seconds = run_job(env, args(shards, tmp_path / "run"), tmp_path / "job.out", timeout=300)
        measured(f"a rendezvous node2 cannot reach, submitted to ended (RDZV_TIMEOUT={timeout_s})", seconds)
    finally:
        cluster_sh("exec", "node2", "ip", "rule", "del", "table", "213")
        cluster_sh("exec", "node2", "ip", "route", "flush", "table", "213")
    assert state["JobState"] == "FAILED"
    node1 = [x for x in (tmp_path / "node1.out").read_text().splitlines() if x.startswith("error: node1:")]
    node2 = [x for x in (tmp_path / "node2.out").read_text().splitlines() if x.startswith("error: node2:")]
    assert node1 == [f"error: node1: the rendezvous at node1:{port} timed out after RDZV_TIMEOUT={timeout_s} s: "
                     "not every node joined (a node that cannot reach it says so in its own line)"]
    assert node2 == [f"error: node2: cannot reach the rendezvous at node1:{port} (errno: 113 - No route to host): "
                     "check that every node reaches it (a firewall, MASTER_ADDR, the network interface)"]
    assert seconds < timeout_s + 60  # start-up (torchrun's imports), the timeout, srun ending the other node
    nothing_left()


def test_up_after_a_crash_cleans_first_and_down_leaves_nothing(cluster):
    """Every daemon SIGKILLed (a crash): up cleans what is left and makes the cluster again. down: no
    namespace, bridge, daemon, listening port, mount or file of the cluster is left. (The last test: the
    cluster stays down.)"""
    env = {**cluster_env(), "MEGATOK_CLUSTER_SLURMD_TIMEOUT": "20", "MEGATOK_CLUSTER_KILL_WAIT": "10"}
    crashed = [int(p.read_text()) for p in (cluster / "pids").iterdir()]
    for pid in crashed:
        os.kill(pid, signal.SIGKILL)
    r = subprocess.run(["bash", str(CLUSTER), "up", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "cleaning up what an earlier up left" in r.stdout, r.stderr
    r = subprocess.run(["srun", "--nodes=2", "--gpus-per-node=0", "hostname"], env=cluster_env(),
                       capture_output=True, text=True, timeout=60)
    assert sorted(r.stdout.split()) == ["node1", "node2"], r.stderr
    daemons = crashed + [int(p.read_text()) for p in (cluster / "pids").iterdir()]
    t = time.monotonic()
    subprocess.run(["bash", str(CLUSTER), "down"], check=True, capture_output=True, env=env, timeout=300)
    measured("tools/cluster.sh down", time.monotonic() - t)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mtk-" not in netns
    assert subprocess.run(["ip", "link", "show", "mtkbr0"], capture_output=True).returncode != 0
    for pid in daemons:  # gone, or a zombie of init's waiting to be reaped
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", pid
    assert str(cluster) not in Path("/proc/mounts").read_text() and not cluster.exists()
    listening = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
    assert not any("10.213.47." in line for line in listening.splitlines()), listening
    assert not Path("/etc/ssh/ssh_config.d/megatok-cluster.conf").exists()
    slurm_conf = Path("/etc/slurm/slurm.conf")
    assert not slurm_conf.exists() or "tools/cluster.sh" not in slurm_conf.read_text()
