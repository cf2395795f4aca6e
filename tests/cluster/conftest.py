"""A two-node Slurm cluster on this machine (tools/cluster.sh), made once for the tests of tests/cluster and
removed after them. Where it cannot be made (not root, no network namespaces, no Slurm and no apt-get to
install it) the tests skip with the reason; under CI (CI=true) that is a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

CLUSTER = ROOT / "tools/cluster.sh"
STATE = Path(os.environ.get("MEGATOK_CLUSTER_DIR", "/run/megatok-cluster"))
NEEDED = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "munged", "mariadbd", "sshd", "pdsh")


def missing() -> str | None:
    """Why no cluster can be made here, or None."""
    if not Path("/proc/self/ns/net").exists():
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, Slurm's daemons); deselect with -m 'not cluster'"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, util-linux)"
    probe = subprocess.run(["ip", "netns", "add", "mtk-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "mtk-probe"], check=True)
    absent = [t for t in NEEDED if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    if absent and shutil.which("apt-get") is None:
        return (f"needs {', '.join(absent)} (Slurm, munge, MariaDB, openssh-server, pdsh), and there is no apt-get to "
                f"install them")
    return in_use(STATE)


def in_use(state: Path) -> str | None:
    """Why the cluster of the state directory ``state`` is in use, or None: none there, or a leftover that
    the fixture's `up` cleans first, as after a crash (its daemons all gone, or outliving the test process
    that made them, whose pid is in ``owner``). A cluster made by hand, or by tests still running, is in use."""
    running = live_daemons(state)
    owner = alive(state / "owner")
    if running and owner is not False:
        return (f"a cluster of tools/cluster.sh is up already ({state}; {', '.join(running)} running"
                f"{f', made by the tests of process {owner}' if owner else ''}); the tests make their own: bash "
                f"{CLUSTER} down")
    return None


def alive(pid_file: Path) -> str | None | bool:
    """The pid in ``pid_file`` if that process still runs, False if it is gone, None without the file."""
    try:
        pid = pid_file.read_text().strip()
        os.kill(int(pid), 0)
        return pid
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return False


def live_daemons(state: Path) -> list[str]:
    """The daemons of the cluster of ``state`` that still run: name (pid), by the pids tools/cluster.sh keeps."""
    running = []
    for f in sorted((state / "pids").glob("*")):
        try:
            # /proc/PID/stat: "pid (comm) state ..."; a zombie is gone, a pid reused by another program is not ours
            stat = Path(f"/proc/{int(f.read_text())}/stat").read_text()
        except (OSError, ValueError):
            continue
        comm, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if state != "Z" and f.name.startswith(comm):
            running.append(f"{f.name} ({f.read_text().strip()})")
    return running


def cluster_env() -> dict:
    """The environment for Slurm's commands and the cluster's jobs: none of an enclosing Slurm job's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["SLURM_CONF"] = str(STATE / "slurm.conf")
    return env


@pytest.fixture(scope="session")
def cluster():
    """node1 and node2 (2 nodes; KillWait 10 s), the state directory; down at the end."""
    why = missing()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the cluster tests cannot run here, and CI must run them: {why}")
        pytest.skip(why)
    env = {**cluster_env(), "MEGATOK_CLUSTER_KILL_WAIT": "10"}
    r = subprocess.run(["bash", str(CLUSTER), "up", "2"], capture_output=True, text=True, env=env, timeout=900)
    try:
        assert r.returncode == 0, f"tools/cluster.sh up failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        (STATE / "owner").write_text(str(os.getpid()))  # (a later session tells a leftover from a cluster in use)
        yield STATE
    finally:
        subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, env=env, timeout=300)
