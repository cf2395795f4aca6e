"""The cluster fixture tells a cluster in use from what a killed run left: only the first one stops the tests."""

from __future__ import annotations

import os
import subprocess

from tests.cluster.conftest import in_use, live_daemons


def test_a_leftover_cluster_is_cleaned_and_one_in_use_is_refused(tmp_path):
    """A state directory as tools/cluster.sh keeps it (pids/NAME), with a running daemon: refused when it was
    made by hand (no owner) or by a test process that still runs; not when that process is gone (a killed CI:
    up cleans it). A pid now held by another program is not a daemon of the cluster."""
    state = tmp_path / "megatok-cluster"
    (state / "pids").mkdir(parents=True)
    assert live_daemons(state) == [] and in_use(state) is None
    daemon = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        (state / "pids" / "sleep-node1").write_text(str(daemon.pid))
        (state / "pids" / "munged").write_text(str(os.getpid()))  # this pid is python's, not munged's
        (state / "pids" / "slurmctld").write_text(str(gone.pid))
        assert live_daemons(state) == [f"sleep-node1 ({daemon.pid})"]
        assert "up already" in in_use(state) and "made by the tests" not in in_use(state)
        (state / "owner").write_text(str(os.getpid()))
        assert f"made by the tests of process {os.getpid()}" in in_use(state)
        (state / "owner").write_text(str(gone.pid))
        assert in_use(state) is None
    finally:
        daemon.kill()
        daemon.wait()
    (state / "owner").unlink()
    assert live_daemons(state) == [] and in_use(state) is None
