"""The lab itself: hosts that see each other by name as pods do, and the cost a silent DNS puts on lookups."""

from __future__ import annotations

import sys

from tests.multihost.lab import NetnsLab

LOOKUP = """
import socket, time
peer = socket.gethostbyname("lab-actor-0.lab")
started = time.monotonic()
try:
    socket.getnameinfo(("::ffff:" + peer, 1, 0, 0), 0)
except OSError:
    pass
print(socket.gethostname(), peer, round(time.monotonic() - started, 1))
"""


def test_each_host_has_its_name_and_finds_its_peers_by_pod_name_through_dns():
    with NetnsLab("lab", {"actor": 1, "rollout": 1}, dns="answering") as lab:
        done = lab.run("rollout", 0, [sys.executable, "-c", LOOKUP])
        hostname, peer, lookup_s = done.stdout.split()
        assert hostname == "lab-rollout-0" and peer == lab.hosts[("actor", 0)].ip
        assert float(lookup_s) < 1.0  # an answering DNS answers reverse lookups at once
        assert lab.dns_queries > 0  # the peer's name came from DNS: it is not in the rollout's /etc/hosts


def test_with_a_silent_dns_a_reverse_lookup_of_a_mapped_peer_address_waits_out_the_resolver():
    """What torch's c10d pays on every store start and first connection in such a cluster (measured: 10 s)."""
    with NetnsLab("lab", {"actor": 1, "rollout": 1}, dns="silent") as lab:
        done = lab.run("rollout", 0, [sys.executable, "-c", LOOKUP])
        hostname, peer, lookup_s = done.stdout.split()
        assert hostname == "lab-rollout-0" and peer == lab.hosts[("actor", 0)].ip  # from /etc/hosts
        assert float(lookup_s) >= 5.0
