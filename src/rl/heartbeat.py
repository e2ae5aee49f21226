"""Liveness between programs that share nothing but a directory.

Every program (`rl inference`, `rl orchestrator`, `rl trainer`) keeps a heartbeat file under
the run directory's heartbeats/, rewritten every HEARTBEAT_EVERY_S by a daemon thread:

    line 1   the instance: "<pid>@<host> <start time>" (a restarted program writes a new one)
    line 2   a counter, then the phase the program's main loop last declared ("waiting for
             batch 7", "training step 7") and for how many seconds it has been in it
    line 3   inference servers only: "url <URL>", where the orchestrator reaches it, so that a
             server started on any host announces itself (orchestrator.servers.discover)

A watcher (another program, or `rl run`) judges a peer by whether the file *changes*, timed by
its own monotonic clock: no clock is compared across hosts, so unsynchronised clocks and a
network filesystem's mtimes do not matter. A file unchanged for timeouts.heartbeat_s means the peer is
dead, frozen, or cut off from the storage; a file removed means it stopped cleanly.

The thread proves the process is scheduled, not that its main loop progresses: a loop stuck
inside a collective still beats. The phase and its age say where it is stuck, and every wait in
the programs has its own timeout.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rl.config import RunConfig
from rl.rundir import RunDir, write_file_atomic

HEARTBEAT_EVERY_S = 2.0
# The phase a server declares once it answers requests: an orchestrator asks it at once then.
SERVING = "serving"
PEER_TIMEOUT_S = 20.0  # the default of timeouts.heartbeat_s

log = logging.getLogger("heartbeat")
_current: Heartbeat | None = None


def heartbeat_path(cfg: RunConfig, program: str) -> Path:
    """Where `program` started with `cfg` keeps its heartbeat. The orchestrator's is its run's
    (a multi-run trainer admits runs by it); the trainer and the servers serve every run of an
    output_dir; servers are told apart by the host and port of their URL."""
    if program == "orchestrator":
        return RunDir(cfg.run_dir).heartbeat_file(program)
    if program == "inference":
        return server_heartbeat_path(cfg.output_dir, cfg.inference.url)
    return RunDir(cfg.output_dir).heartbeat_file(program)


SERVER_PREFIX = "inference-"


def server_heartbeat_path(output_dir: Path, url: str) -> Path:
    """The heartbeat of the server at `url` (http://host:port): inference-<host>-<port>."""
    netloc = urlsplit(url).netloc.rsplit("@", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", netloc.replace("[", "").replace("]", "")).strip("-")
    return RunDir(output_dir).heartbeat_file(SERVER_PREFIX + name)


def server_heartbeats(output_dir: Path) -> list[Path]:
    return sorted(RunDir(output_dir).heartbeat_dir.glob(SERVER_PREFIX + "*"))


def announced_url(path: Path) -> str | None:
    """The URL a server's heartbeat announces; None: no URL line, or unreadable just now."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:  # removed meanwhile, or the share hiccuped: next look
        return None
    return lines[2][4:].strip().rstrip("/") if len(lines) >= 3 and lines[2].startswith("url ") else None


def announced_instance(path: Path) -> str | None:
    """The instance a heartbeat names (line 1); None: no heartbeat, or unreadable just now."""
    try:
        first = path.read_bytes().split(b"\n", 1)[0].decode(errors="replace").strip()
    except OSError:  # not there (yet), or the share hiccuped: next look
        return None
    return first or None


class Heartbeat:
    def __init__(self, path: Path, every_s: float = HEARTBEAT_EVERY_S, url: str | None = None):
        self.path, self.every_s = path, every_s
        self.url = url
        self.instance = f"{os.getpid()}@{socket.gethostname()} {time.time():.3f}"
        self.phase, self.phase_since = "starting", time.monotonic()
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {path.name}", daemon=True)

    def start(self) -> Heartbeat:
        global _current
        _current = self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.beat()
        self._thread.start()
        return self

    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase, self.phase_since = phase, time.monotonic()

    def beat(self) -> None:
        self.beats += 1
        age = time.monotonic() - self.phase_since
        text = f"{self.instance}\n{self.beats} {age:.0f}s {self.phase}\n"
        if self.url:
            text += f"url {self.url}\n"
        write_file_atomic(self.path, text.encode())

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.beat()
            except OSError as e:  # storage gone for a moment: watchers will say so if it lasts
                log.warning("heartbeat %s not written: %s", self.path, e)

    def stop(self) -> None:
        """A clean exit: the file goes, so watchers know the program stopped rather than died."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)


def current_instance() -> str | None:
    """This program's instance ("<pid>@<host> <start time>"), as its heartbeat names it."""
    return _current.instance if _current is not None else None


def set_phase(phase: str) -> None:
    """Declare what this program's main loop is doing now (no-op without a heartbeat)."""
    if _current is not None:
        _current.set_phase(phase)


@dataclass
class PeerState:
    name: str
    state: str
    """"unseen" (no file yet), "alive", "silent" (unchanged for timeout_s), "stopped" (removed)."""
    silent_s: float
    detail: str
    """The file's content on one line: instance, counter, phase."""

    def describe(self) -> str:
        """What went wrong, for a silent or stopped peer."""
        if self.state == "silent":
            return f"{self.name} silent for {self.silent_s:.0f} s (last heartbeat: {self.detail})"
        return f"{self.name} {self.state} (heartbeat removed)"


class PeerWatch:
    """Another program's heartbeat, judged by this process's clock only."""

    def __init__(self, path: Path, name: str, timeout_s: float = PEER_TIMEOUT_S):
        self.path, self.name, self.timeout_s = path, name, timeout_s
        self.content: bytes | None = None
        self.changed_at = time.monotonic()
        self.seen = False

    def poll(self) -> PeerState:
        now = time.monotonic()
        try:
            content = self.path.read_bytes()
        except FileNotFoundError:
            content = None
        except OSError as e:  # an unreachable share reads as no news: the silence grows
            log.debug("heartbeat %s unreadable: %s", self.path, e)
            content = self.content
        if content != self.content:
            self.content, self.changed_at = content, now
            self.seen = self.seen or content is not None
        detail = (self.content or b"").decode(errors="replace").strip().replace("\n", " | ")
        if self.content is None:
            return PeerState(self.name, "stopped" if self.seen else "unseen", 0.0, detail)
        silent = now - self.changed_at
        return PeerState(self.name, "silent" if silent >= self.timeout_s else "alive", silent, detail)

    @property
    def instance(self) -> str | None:
        return self.content.split(b"\n", 1)[0].decode(errors="replace") if self.content else None

    @property
    def phase(self) -> str | None:
        """The phase line 2 declares (SERVING, "waiting for batch 7"), None if there is none."""
        lines = (self.content or b"").decode(errors="replace").splitlines()
        parts = lines[1].split(" ", 2) if len(lines) >= 2 else []
        return parts[2] if len(parts) == 3 else None


class PeerReporter:
    """Logs a peer's transitions once each (silent, back, stopped), not on every poll."""

    def __init__(self, watch: PeerWatch, logger: logging.Logger, consequence: str):
        self.watch, self.log, self.consequence = watch, logger, consequence
        self.last = "unseen"

    def poll(self) -> PeerState:
        s = self.watch.poll()
        if s.state != self.last:
            if s.state == "silent":
                self.log.warning("%s: dead, frozen or cut off? %s", s.describe(), self.consequence)
            elif s.state == "stopped":
                self.log.warning("%s; %s", s.describe(), self.consequence)
            elif s.state == "alive" and self.last in ("silent", "stopped"):
                self.log.info("%s is back: %s", s.name, s.detail)
            self.last = s.state
        return s
