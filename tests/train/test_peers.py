"""Which rank is gone (megatok.train.peers): a rank that loses contact probes the others' listening sockets
and names them in its last line. Real sockets and processes on this machine (a cut-off node, across the
network namespaces of tools/cluster.sh: tests/cluster)."""

import os
import socket
import time

from megatok.train import peers
from megatok.train.peers import Peer
from tests.conftest import two_gloo_ranks


def test_probe_tells_a_running_process_from_an_exited_one_and_an_unreachable_host():
    running = socket.socket()
    running.bind(("127.0.0.1", 0))
    running.listen(8)
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    gone_port = gone.getsockname()[1]
    gone.close()  # nothing listens there: the host refuses
    full = socket.socket()  # a host that does not answer: its accept queue is full, so SYNs go unanswered
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    fillers = [socket.socket() for _ in range(3)]
    for f in fillers:
        f.setblocking(False)
        f.connect_ex(full.getsockname())
    time.sleep(0.2)
    table = [Peer(1, "a", "127.0.0.1", running.getsockname()[1], 11), Peer(2, "b", "127.0.0.1", gone_port, 22),
             Peer(3, "c", "127.0.0.1", full.getsockname()[1], 33)]
    t = time.monotonic()
    states = peers.probe(table, timeout=1.0)
    assert 0.9 < time.monotonic() - t < 3
    assert [states[p] for p in table] == ["running", "exited", "unreachable"]
    for s in (running, full, *fillers):
        s.close()


def test_the_phrase_names_the_lost_ranks_and_their_hosts():
    a, b, c = Peer(1, "node2", "10.0.0.2", 1, 11), Peer(2, "node2", "10.0.0.2", 2, 22), Peer(3, "node3", "x", 3, 33)
    assert peers.describe({a: "unreachable", c: "running"}) == (
        "rank 1 (node2, pid 11) does not answer (host node2 cut off or down)")
    assert peers.describe({b: "unreachable", a: "unreachable", c: "exited"}) == (
        "rank 1 (node2, pid 11), rank 2 (node2, pid 22) do not answer (host node2 cut off or down); "
        "rank 3 (node3, pid 33) has exited")
    assert peers.describe({a: "running", c: "running"}) == "every other rank is still running (2): one is hung or slow"
    many = {Peer(r, f"n{r}", "x", r, r): "exited" for r in range(1, 8)}
    assert peers.describe(many).endswith("rank 4 (n4, pid 4) and 3 more have exited")


WORKER = """
import os, sys, time, torch, torch.distributed as dist
from megatok.train import peers
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
table = peers.gather(rank, 2)
dist.barrier()
result = {"table": [(p.rank, p.host, p.pid) for p in table]}
if rank == 0:
    result["alive"] = peers.lost()
dist.barrier()
if rank == 0:  # rank 1 has left: once its socket is closed, it is named
    deadline = time.monotonic() + 60
    while "has exited" not in (said := peers.lost()) and time.monotonic() < deadline:
        time.sleep(0.2)
    result["gone"] = said
torch.save(result, out)
os._exit(0)
"""


def test_a_rank_names_the_rank_that_left(tmp_path):
    zero, one = two_gloo_ranks(tmp_path, WORKER)
    host = socket.gethostname()
    assert zero["table"] == one["table"] and [r for r, _, _ in zero["table"]] == [0, 1]
    assert all(h == host for _, h, _ in zero["table"]) and zero["table"][0][2] != os.getpid()
    pid1 = zero["table"][1][2]
    assert zero["alive"] == "every other rank is still running (1): one is hung or slow"
    assert zero["gone"] == f"rank 1 ({host}, pid {pid1}) has exited"


def test_a_forked_child_does_not_keep_the_listening_socket(monkeypatch):
    """A data loader's worker outlives its rank by seconds: the rank's socket must not live on in it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    monkeypatch.setattr(peers, "_listener", listener)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if peers._listener is None else 1)
    assert os.waitpid(pid, 0)[1] == 0
    peer = Peer(1, "here", "127.0.0.1", listener.getsockname()[1], os.getpid())
    assert peers.probe([peer], 1.0)[peer] == "running"  # the parent's is untouched
    listener.close()
    assert peers.probe([peer], 1.0)[peer] == "exited"


def test_without_a_table_there_is_nothing_to_say():
    peers.close()
    assert peers.lost() == ""


def test_one_thread_prints_the_last_line(monkeypatch):
    """The main thread reporting a failed collective and the watchdog's thread: whichever comes second waits
    (the first ends the process); the first may come again (a caller that runs several fits in one process)."""
    import threading

    monkeypatch.setattr(peers, "_last_words", threading.RLock())  # this process's own stays free
    peers.last_words()
    peers.last_words()
    other = threading.Thread(target=peers.last_words, daemon=True)
    other.start()
    other.join(0.5)
    assert other.is_alive()  # waits for a process end that never comes here; a daemon thread, left behind
