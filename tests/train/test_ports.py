"""The rendezvous port a launch picks for itself (plain ``python launch/pretrain.py``, the tests, the sweep
tool's local runs)."""

import socket

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
