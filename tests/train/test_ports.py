"""The rendezvous port a launch picks for itself (plain ``python launch/pretrain.py``, the tests, the sweep
tool's local runs)."""

import socket

from megatok.train import dist
from megatok.train.dist import free_port


def test_free_ports_are_bindable_and_outside_the_kernels_own_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first_ephemeral = int(f.read().split()[0])
    ports = [free_port() for _ in range(50)]
    assert all(10000 <= p < min(first_ephemeral, 30000) for p in ports)  # never one the kernel hands out itself
    assert len(set(ports)) > 40  # drawn at random, so two launches starting together rarely collide
    with socket.socket() as taken:  # a port in use is never returned
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        assert ports[0] not in {free_port() for _ in range(200)}


def test_a_port_taken_on_ipv6_only_is_not_returned(monkeypatch):
    """torch's store listens on IPv4 and IPv6 at once, so a port some program holds on IPv6 only would fail
    it; a port taken on IPv4 only is covered above."""
    with socket.socket(socket.AF_INET6) as taken:
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with socket.socket() as probe:  # the IPv4 side of that port is free
            probe.bind(("", port))
        offered = iter([port, port, 12345])

        class Draws:
            def randrange(self, lo, hi):
                return next(offered)

        monkeypatch.setattr(dist.random, "SystemRandom", Draws)
        assert free_port() == 12345
