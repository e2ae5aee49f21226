"""Separate "hosts" on one machine, for multi-host tests.

Where the machine allows it (root, iproute2), each host is a network namespace with its own
address on a bridge, and cutting its link takes its interface down: requests to it hang and time
out as they would across a real network. Elsewhere each host is a loopback address (127.0.0.x).
Either way a host has its own working directory, and the processes started on it are frozen
(SIGSTOP, the whole tree) while it is cut off: a host whose link is cut reaches neither the
network nor the shared storage, so its heartbeat stops too.

Ports: a fresh namespace has its own network stack, but loopback hosts share the machine's, so
tests ask `Network.free_port` for a port free on every host that will listen on it, at run time.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why hosts cannot be network namespaces here (so they fall back to loopback addresses),
    or None when they can. ASYNCRL_TEST_LOOPBACK_HOSTS=1 forces the fallback (to test it where
    namespaces work)."""
    if os.environ.get("ASYNCRL_TEST_LOOPBACK_HOSTS") == "1":
        return "forced by ASYNCRL_TEST_LOOPBACK_HOSTS=1"
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    # Everything Network does, once: some sandboxes allow namespaces but not bridges or veths.
    tag = f"rlp{os.getpid() % 100000}"
    try:
        _ip("netns", "add", tag)
        _ip("link", "add", f"{tag}b", "type", "bridge")
        _ip("link", "add", f"{tag}v", "type", "veth", "peer", "name", "eth0", "netns", tag)
        _ip("link", "set", f"{tag}v", "master", f"{tag}b", "up")
        return None
    except subprocess.CalledProcessError as e:
        return f"`{' '.join(e.cmd)}` failed: {(e.stderr or b'').decode(errors='replace').strip()}"
    except subprocess.TimeoutExpired as e:
        return f"`{' '.join(e.cmd)}` timed out"
    finally:
        for cmd in (["link", "del", f"{tag}v"], ["link", "del", f"{tag}b"], ["netns", "del", tag]):
            subprocess.run(["ip", *cmd], capture_output=True, timeout=30)


def namespaces_available() -> bool:
    return namespaces_unavailable() is None


# Bind address:port (port 0: any) and print the port bound; run inside a host's namespace.
_BIND = "import socket, sys; s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); print(s.getsockname()[1])"


class Host:
    def __init__(self, network: Network, name: str, index: int):
        self.network, self.name = network, name
        self.workdir = network.root / name
        self.workdir.mkdir(parents=True)
        self.procs: list[subprocess.Popen] = []
        self.frozen: list[psutil.Process] = []
        tag = f"{network.tag}{index}"
        if network.namespaces:
            self.address = f"{network.subnet}.{10 + index}"
            self.netns, self.link = f"rlns{tag}", f"rlv{tag}"
            _ip("netns", "add", self.netns)
            _ip("link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
            _ip("link", "set", self.link, "master", network.bridge, "up")
            for cmd in (["addr", "add", f"{self.address}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                        ["link", "set", "lo", "up"]):
                _ip("netns", "exec", self.netns, "ip", *cmd)
        else:
            self.address, self.netns, self.link = f"127.0.0.{20 + index}", None, None

    @property
    def interface(self) -> str:
        """The interface its address lives on (gloo must be told: the machine's host name
        resolves to an address outside the namespace)."""
        return "eth0" if self.netns else "lo"

    def bind(self, port: int = 0, address: str | None = None) -> int | None:
        """Bind `port` (0: any free one) on this host, on its address or `address` ("0.0.0.0" for
        a program that binds every interface), close at once, and return the port bound; None
        if it is taken."""
        address = self.address if address is None else address
        if self.netns is None:
            with socket.socket() as s:
                try:
                    s.bind((address, port))
                except OSError:
                    return None
                return s.getsockname()[1]
        r = subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-c", _BIND, address, str(port)],
                           capture_output=True, text=True, timeout=30)
        return int(r.stdout) if r.returncode == 0 else None

    def start(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        """Run argv on this host, in its working directory, in a session of its own."""
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        with open(log, "ab") as out:
            proc = subprocess.Popen(prefix + argv, cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, env={**os.environ, **env})
        self.procs.append(proc)
        return proc

    def processes(self) -> list[psutil.Process]:
        """Every process started on this host, with its descendants, now (a test that must act
        at once on what it sees lists them beforehand, and passes them to cut or kill)."""
        tree = []
        for p in self.procs:
            try:
                root = psutil.Process(p.pid)
                tree += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return tree

    def cut(self, tree: list[psutil.Process] | None = None) -> None:
        """Frozen first, then the link down: a test that has just seen the host busy (a request
        running on a server) cuts it before that work can finish (an `ip` command takes a
        while; signals are sent at once). `tree`: processes() listed beforehand."""
        self.frozen = self.processes() if tree is None else tree
        for p in self.frozen:
            try:
                p.send_signal(signal.SIGSTOP)
            except psutil.NoSuchProcess:
                pass
        if self.link:
            _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        for p in self.frozen:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        self.frozen = []
        if self.link:
            _ip("link", "set", self.link, "up")

    def kill(self, tree: list[psutil.Process] | None = None) -> None:
        """The host crashes: everything on it dies at once. `tree`: processes() listed
        beforehand (then nothing is listed between the call and the first signal)."""
        for p in self.processes() if tree is None else tree:
            try:
                p.send_signal(signal.SIGCONT)
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


class Network:
    """Hosts joined by a bridge (namespaces) or by the loopback interface."""

    def __init__(self, root: Path, namespaces: bool):
        self.root, self.namespaces = root, namespaces
        self.tag = f"{os.getpid() % 10000}"
        self.subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        self.hosts: list[Host] = []
        self.bridge = f"rlbr{self.tag}"
        if namespaces:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")

    def host(self, name: str) -> Host:
        h = Host(self, name, len(self.hosts) + 1)
        self.hosts.append(h)
        return h

    def free_port(self, *hosts: Host, address: str | None = None) -> int:
        """A port that is free, now, on every one of `hosts` (on its address, or on `address`),
        chosen by the first host's kernel: the same port on several hosts shows they are
        distinct (on loopback hosts, that each program binds its own address only)."""
        for _ in range(50):
            port = hosts[0].bind(0, address)
            if port is not None and all(h.bind(port, address) == port for h in hosts[1:]):
                return port
        raise RuntimeError(f"no port free on all of {[h.name for h in hosts]} in 50 tries")

    def close(self) -> None:
        for h in self.hosts:
            h.restore()
            h.kill()
            if h.netns:
                subprocess.run(["ip", "netns", "del", h.netns], capture_output=True, timeout=30)
        if self.namespaces:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
