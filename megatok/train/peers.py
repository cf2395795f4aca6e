"""Which rank is gone: the other ranks' hosts and processes, and a probe of each, for the line a rank ends
with when it loses contact (a collective that failed or timed out, the watchdog).

At start every rank opens a TCP socket that listens and is never read (the kernel completes a connection
to it for as long as the process lives), and the ranks exchange (host, address, port, pid) in one
collective. ``lost()`` then tries to connect to every other rank's socket at once, for up to a few
seconds: a refusal means the process is gone (its host answered for it), no answer means the host is
cut off or down (a lost node, a partition), a connection means the process runs (hung, or slow).

    gather(rank, world)      # collective, once the process group is up
    lost()                   # "rank 1 (node2, pid 4321) does not answer: ..." or "" without a table
    close()                  # the trainer is done: the socket closes
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass

PROBE_S = 3.0  # how long lost() waits for a peer's host to answer


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    addr: str
    port: int
    pid: int

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


_listener: socket.socket | None = None
_peers: list[Peer] = []
_rank = 0
_last_words = threading.RLock()  # the thread that took it may take it again (in-process callers)


def _close_in_child() -> None:
    """A forked child (a data loader's worker) does not keep the socket: once the rank is gone, a probe is
    refused, however long the worker takes to notice."""
    global _listener
    if _listener is not None:
        _listener.close()
    _listener = None


os.register_at_fork(after_in_child=_close_in_child)


def _local_address() -> str:
    """This rank's address as the others see it: the one it reaches MASTER_ADDR from (no packet is sent)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    family, _, _, _, sockaddr = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def gather(rank: int, world: int) -> list[Peer]:
    """Collective: every rank's host, address, listening port and pid, kept for :func:`lost`. A rank whose
    address cannot be found (no route to MASTER_ADDR) takes part with none, and is never probed."""
    import torch.distributed as tdist

    global _listener, _peers, _rank
    close()
    me = None
    try:
        addr = _local_address()
        _listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        _listener.bind((addr, 0))
        _listener.listen(min(max(world, 8), socket.SOMAXCONN))  # each other rank probes once per failure
        me = Peer(rank, socket.gethostname(), addr, _listener.getsockname()[1], os.getpid())
    except OSError:
        close()
    table: list[Peer | None] = [None] * world
    tdist.all_gather_object(table, me)
    _peers, _rank = [p for p in table if p is not None], rank
    return list(_peers)


def close() -> None:
    global _listener, _peers
    if _listener is not None:
        _listener.close()
    _listener, _peers = None, []


def probe(peers: list[Peer], timeout: float = PROBE_S) -> dict[Peer, str]:
    """Each peer's state: "running", "exited" (its host refused the connection) or "unreachable" (no
    answer within ``timeout`` seconds, or no route); all probed at once."""
    states: dict[Peer, str] = {}
    with selectors.DefaultSelector() as sel:
        for p in peers:
            s = socket.socket(socket.AF_INET6 if ":" in p.addr else socket.AF_INET)
            s.setblocking(False)
            err = s.connect_ex((p.addr, p.port))
            if err in (0, errno.EINPROGRESS):
                sel.register(s, selectors.EVENT_WRITE, p)
            else:
                states[p] = _state(err)
                s.close()
        deadline = time.monotonic() + timeout
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                states[key.data] = _state(key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
                sel.unregister(key.fileobj)
                key.fileobj.close()
        for key in list(sel.get_map().values()):
            states[key.data] = "unreachable"
            sel.unregister(key.fileobj)
            key.fileobj.close()
    return states


def _state(err: int) -> str:
    return "running" if err == 0 else "exited" if err == errno.ECONNREFUSED else "unreachable"


def _listed(peers: list[Peer], most: int = 4) -> str:
    names = ", ".join(map(str, peers[:most]))
    return names + (f" and {len(peers) - most} more" if len(peers) > most else "")


def lost(timeout: float = PROBE_S) -> str:
    """What became of the other ranks (:func:`probe`, :func:`describe`); "" when there is no table (before
    :func:`gather`, or a world of one)."""
    others = [p for p in _peers if p.rank != _rank]
    return describe(probe(others, timeout)) if others else ""


def describe(states: dict[Peer, str]) -> str:
    """One phrase naming the lost ranks: those whose host does not answer, then those whose process has
    exited; or, when all still run, that one is hung or slow."""
    gone = {what: sorted((p for p, s in states.items() if s == what), key=lambda p: p.rank)
            for what in ("unreachable", "exited")}
    parts = []
    if down := gone["unreachable"]:
        hosts = ", ".join(sorted({p.host for p in down}))
        parts.append(f"{_listed(down)} {'does' if len(down) == 1 else 'do'} not answer (host {hosts} cut off or down)")
    if ended := gone["exited"]:
        parts.append(f"{_listed(ended)} {'has' if len(ended) == 1 else 'have'} exited")
    return "; ".join(parts) or f"every other rank is still running ({len(states)}): one is hung or slow"


def last_words() -> None:
    """Called by whoever prints the line this process ends with (the main thread after a failed
    collective, the watchdog's thread): the first thread goes on, another one waits until the process has
    ended, so the process ends with one line."""
    _last_words.acquire()
