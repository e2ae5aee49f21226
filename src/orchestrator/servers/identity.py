"""Whether the program answering at a server's URL is the one the run directory announces there.

A URL names a port, not a program. Two runs on one machine (or two tests side by side) may both
want port 8000: the second server fails to bind, and without this check its orchestrator trained
happily on the first run's server, which sampled from another model and refused every weight
update (seen in CI: two `rl run`s on the default port). Every server's heartbeat
(output_dir/heartbeats/inference-<host>-<port>) names its instance, and its /health reports the
same (inference/routes.py): a server whose /health names another instance, or none while its
run expects one, is not this run's server and never joins rotation.

The run's own server (orchestrator.servers.urls empty: the URL is [inference]'s) must be
announced before it joins; a listed URL without a heartbeat in this output_dir is a server
started elsewhere (another host without the shared directory, a stand-in) and is taken on its
/health alone.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from rl.heartbeat import announced_instance, server_heartbeat_path


class Identity:
    def __init__(self, output_dir: Path, own_url: str | None):
        """`own_url`: the run's own server's URL when it has no listed servers (it must be announced)."""
        self.output_dir = output_dir
        self.own_url = own_url.rstrip("/") if own_url else None

    def problem(self, url: str, health: dict) -> str | None:
        """Why the server answering at `url` with `health` is not this run's; None if it is."""
        path = server_heartbeat_path(self.output_dir, url)
        announced = announced_instance(path)
        answers = health.get("instance")
        if announced is None:
            if url.rstrip("/") == self.own_url:
                return (f"no heartbeat announces it yet ({path}): the run's own server joins once "
                        "`rl inference` with this output_dir has started")
            return None
        if answers != announced:
            port = urlsplit(url).port
            return (f"another program holds port {port}: it answers as {answers or 'a server naming no instance'}, "
                    f"while {path} announces {announced} (two runs on one port? set [inference] port)")
        return None
