"""A cluster's network on one Linux machine: every role replica on a host of its own, as in pods.

Each host is a network namespace on a bridge, with its own IP, its own hostname (a UTS namespace) and its own
/etc/hosts and /etc/resolv.conf (`ip netns exec` bind-mounts /etc/netns/<ns>/*). Two name services:

- `dns="answering"`: as in a healthy cluster. A host's /etc/hosts names only itself (the kubelet writes it so);
  peers are found through a DNS server on the bridge that answers their `<pod>` and `<pod>.<job>` names at
  once, and reverse lookups of their addresses too.
- `dns="silent"`: as in a cluster whose DNS does not answer (the well-known slow-DNS case, at its worst).
  Every host's /etc/hosts names every replica; the resolver points at an address on the bridge that takes
  queries and never replies, so any lookup that misses /etc/hosts waits out the resolver (5 s x 2 tries by
  default). torch's c10d looks up the IPv4-mapped form of peer addresses (`::ffff:10.x.y.z`), which no
  /etc/hosts names: every first TCPStore connection and store start pays those 10 s.

Needs root, iproute2's `ip` and util-linux's `unshare` (CI runs as root on Linux; `make` installs iproute2
when it is missing). Traffic stays on the bridge, between namespaces this lab made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rljob.launch.local import ReplicaHost
from rljob.runtime.wire.identity import pod_dns_name, pod_hostname

DnsMode = Literal["answering", "silent"]
NETNS_ETC = Path("/etc/netns")
PREFIX = "rjl"
"""Every bridge, veth and namespace this lab makes starts with it, followed by the owning test process's pid
and a letter per lab (a deleted namespace's links can outlive it for a moment: a next lab never reuses them)."""
_labs_made = itertools.count()


class LabUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no `ip`, no namespaces)."""


def unavailable_reason() -> str | None:
    """Why a lab cannot be made here, or None when it can."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2, util-linux)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _remove_namespace(ns: str) -> None:
    for pid in _namespace_pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def remove_orphans() -> None:
    """Remove what labs of test processes that are gone left behind (a killed pytest skips its teardown)."""
    names = subprocess.run(["ip", "-o", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for name in {n for n in names if n.startswith(PREFIX)}:
        owner = _owner(name)
        if owner is not None and not _pid_alive(owner):
            _remove_namespace(name)
    for line in links.splitlines():
        link = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        owner = _owner(link) if link.startswith(PREFIX) else None
        if owner is not None and not _pid_alive(owner):
            subprocess.run(["ip", "link", "del", link], capture_output=True)


def _owner(name: str) -> int | None:
    """The pid in a lab's name (`rjl<pid><letter>...`)."""
    found = re.match(rf"{PREFIX}(\d+)", name)
    return int(found.group(1)) if found else None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 under 10.213.0.0/16 that no interface on this machine uses."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    start = os.getpid() % 250
    for third in ((start + k) % 250 for k in range(250)):
        if f"inet 10.213.{third}." not in used:
            return ipaddress.IPv4Network(f"10.213.{third}.0/24")
    raise LabUnavailable("no free subnet under 10.213.0.0/16")


class _NameServer:
    """The bridge's DNS address: answers pod names (`answering`) or takes queries and never replies (`silent`)."""

    def __init__(self, address: str, mode: DnsMode, records: dict[str, str]) -> None:
        self.mode = mode
        self.records = {name.lower().rstrip("."): ip for name, ip in records.items()}
        self.reverse = {ipaddress.IPv4Address(ip).reverse_pointer: name for name, ip in records.items()}
        self.queries = 0
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind((address, 53))
        self._socket.settimeout(0.2)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lab-dns", daemon=True)
        self._thread.start()

    def _answer(self, data: bytes) -> bytes | None:
        from dnslib import PTR, QTYPE, RCODE, RR, A, DNSRecord

        request = DNSRecord.parse(data)
        reply = request.reply()
        name = str(request.q.qname).lower().rstrip(".")
        if request.q.qtype == QTYPE.PTR and name in self.reverse:
            reply.add_answer(RR(request.q.qname, QTYPE.PTR, rdata=PTR(self.reverse[name] + "."), ttl=30))
        elif name in self.records:
            if request.q.qtype == QTYPE.A:  # other types (AAAA: pods here have no IPv6) get an empty answer
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(self.records[name]), ttl=30))
        else:
            reply.header.rcode = RCODE.NXDOMAIN
        return reply.pack()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                data, peer = self._socket.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.queries += 1
            if self.mode == "silent":
                continue
            with contextlib.suppress(Exception):  # a malformed query gets no answer, as from a real server
                answer = self._answer(data)
                if answer is not None:
                    self._socket.sendto(answer, peer)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self._socket.close()


@dataclass
class LabHost:
    namespace: str
    hostname: str
    dns_name: str
    ip: str


@dataclass
class NetnsLab:
    """Hosts for the replicas of one job; use as a context manager, pass `host` to `LocalRun(hosts=...)`."""

    job: str
    replicas: dict[str, int]
    dns: DnsMode = "silent"
    hosts: dict[tuple[str, int], LabHost] = field(default_factory=dict)
    bridge: str = ""
    gateway: str = ""
    _nameserver: _NameServer | None = None

    def __enter__(self) -> NetnsLab:
        reason = unavailable_reason()
        if reason is not None:
            raise LabUnavailable(reason)
        remove_orphans()
        tag = f"{PREFIX}{os.getpid()}{chr(97 + next(_labs_made) % 26)}"
        self.bridge = f"{tag}b"
        subnet = _free_subnet()
        self.gateway = str(subnet[1])
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            keys = [(role, i) for role, count in self.replicas.items() for i in range(count)]
            for n, (role, i) in enumerate(keys):
                ns = f"{tag}h{n}"
                ip = str(subnet[10 + n])
                names = pod_hostname(self.job, role, i), pod_dns_name(self.job, role, i)
                self.hosts[(role, i)] = LabHost(ns, *names, ip)
                _remove_namespace(ns)
                _ip("netns", "add", ns)
                veth = f"{tag}v{n}"
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{ip}/{subnet.prefixlen}", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            self._write_name_files()
            records = {h.hostname: h.ip for h in self.hosts.values()} | {h.dns_name: h.ip for h in self.hosts.values()}
            self._nameserver = _NameServer(self.gateway, self.dns, records)
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
            self.__exit__(None, None, None)
            raise LabUnavailable(f"could not make the lab's network ({detail})") from exc
        return self

    def _write_name_files(self) -> None:
        for host in self.hosts.values():
            etc = NETNS_ETC / host.namespace
            etc.mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost", f"{host.ip} {host.dns_name} {host.hostname}"]
            if self.dns == "silent":  # no DNS to ask: every replica's name is in every host's file
                lines += [f"{h.ip} {h.dns_name} {h.hostname}" for h in self.hosts.values() if h is not host]
            (etc / "hosts").write_text("\n".join(lines) + "\n")
            (etc / "resolv.conf").write_text(f"nameserver {self.gateway}\nsearch {self.job}\n")

    def __exit__(self, *exc_info: object) -> None:
        if self._nameserver is not None:
            self._nameserver.close()
            self._nameserver = None
        for n, host in enumerate(self.hosts.values()):
            subprocess.run(["ip", "link", "del", f"{self.bridge[:-1]}v{n}"], capture_output=True)
            _remove_namespace(host.namespace)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    @property
    def dns_queries(self) -> int:
        """Queries the bridge's DNS address received (answered or not)."""
        return 0 if self._nameserver is None else self._nameserver.queries

    def host(self, role: str, replica: int) -> ReplicaHost:
        """The `LocalRun(hosts=...)` layout: enter the replica's namespace, take its hostname, exec the role."""
        host = self.hosts[(role, replica)]
        return ReplicaHost(
            name=host.dns_name,
            address=host.ip,
            command_prefix=self.command_prefix(role, replica),
        )

    def command_prefix(self, role: str, replica: int) -> tuple[str, ...]:
        host = self.hosts[(role, replica)]
        # `ip netns exec` enters the namespace and mounts its hosts/resolv.conf; unshare gives it a hostname
        # of its own; both exec, so the process the launcher started is the role itself.
        return (
            "ip",
            "netns",
            "exec",
            host.namespace,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            host.hostname,
        )

    def cut(self, role: str, replica: int) -> None:
        """Cut one host off the network: its link goes down (a partition; the host's processes run on). Packets to
        and from it are lost, TCP connections stay open and retransmit, as across a failed switch port."""
        _ip("-n", self.hosts[(role, replica)].namespace, "link", "set", "eth0", "down")

    def restore(self, role: str, replica: int) -> None:
        """Bring a cut host's link back up (its address and route come back with it)."""
        _ip("-n", self.hosts[(role, replica)].namespace, "link", "set", "eth0", "up")

    def run(self, role: str, replica: int, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a command on one host and wait for it."""
        return subprocess.run(
            [*self.command_prefix(role, replica), *argv], capture_output=True, text=True, timeout=timeout
        )
