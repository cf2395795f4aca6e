"""tools/cluster.sh touches only what it made: a directory it did not make is refused by up and by down,
a recorded pid now held by another process is not killed, and a subnet that overlaps the machine's routes
is refused before anything is made. (No cluster is made here: every case ends before one would be.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.cluster.conftest import CLUSTER

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="tools/cluster.sh down and up need root")


def cluster_sh(state: Path, *argv, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), *argv], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MEGATOK_CLUSTER_DIR": str(state), **env})


def start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def test_a_directory_it_did_not_make_is_refused_by_down_and_up_and_left_whole(tmp_path):
    state = tmp_path / "mine"
    state.mkdir()
    (state / "notes.txt").write_text("keep me")
    r = cluster_sh(state, "down")
    assert r.returncode == 1 and r.stderr == (f"cluster: error: {state} was not made by tools/cluster.sh up (no "
                                              f".megatok-cluster in it): not touching it\n")
    if os.geteuid() == 0:
        r = cluster_sh(state, "up", "2")
        assert r.returncode == 1 and f"{state} is there and was not made by tools/cluster.sh up" in r.stderr
    assert (state / "notes.txt").read_text() == "keep me"
    assert cluster_sh(tmp_path / "absent", "down").returncode == 0  # nothing there: nothing to do


@root_only
def test_down_ends_its_own_daemons_but_not_a_process_that_took_a_recorded_pid(tmp_path):
    state = tmp_path / "state"
    for d in ("pids", "starts"):
        (state / d).mkdir(parents=True)
    (state / ".megatok-cluster").touch()
    ours, other = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    try:
        (state / "pids" / "slurmd-node1").write_text(str(ours.pid))
        (state / "starts" / "slurmd-node1").write_text(start_time(ours.pid))
        (state / "pids" / "munged").write_text(str(other.pid))  # the pid of a daemon that died, now reused
        (state / "starts" / "munged").write_text(str(int(start_time(other.pid)) - 100))
        r = cluster_sh(state, "down")
        assert r.returncode == 0, r.stderr
        assert ours.wait(timeout=10) == -15 and other.poll() is None
        assert f"not ending pid {other.pid} (munged): it is another process now" in r.stdout
        assert not state.exists()
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


@root_only
def test_a_subnet_overlapping_the_machines_routes_is_refused_before_anything_is_made(tmp_path):
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    subnet = next((m.group(1) for m in re.finditer(r"^(\d+\.\d+\.\d+)\.\d+/(\d+) ", routes, re.M)
                   if int(m.group(2)) <= 24), None)
    if subnet is None:
        pytest.skip(f"no route of this machine to overlap: {routes!r}")
    r = cluster_sh(tmp_path / "state", "up", "2", MEGATOK_CLUSTER_NET=subnet)
    assert r.returncode == 1 and f"the subnet {subnet}.0/24 overlaps this machine's routes" in r.stderr, r.stderr
    assert not (tmp_path / "state").exists()
    assert cluster_sh(tmp_path / "state", "up", "2", MEGATOK_CLUSTER_NET="10.2x.1").returncode == 1
