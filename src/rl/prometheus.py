"""What the three programs share about Prometheus (docs/observability.md): the names' prefix, the
buckets of their latency histograms, the HTTP server the orchestrator and the trainer serve their
metrics on, and the file_sd target file every program writes into the run directory so that one
Prometheus job finds every program of every host:

    <output_dir>/prometheus/<program>-<host>-<port>.json
      [{"targets": ["<host>:<port>"], "labels": {"program": ..., "run": ..., "rank": ..., "host": ...}}]

Each program writes its own at start-up (under `rl run`, `rl slurm` or by hand alike) and removes
it when it exits of its own accord; a killed program's file stays, so Prometheus keeps scraping
its address and `up` says it is gone (deploy/prometheus/asyncrl_rules.yml,
AsyncrlMetricsGone). The labels ride on the target, not on every series: a series is then
named by (program, run, rank, host) wherever it is scraped through the file, and the label sets
stay bounded (no request ids, paths or versions as labels).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
from pathlib import Path

PREFIX = "asyncrl_"
TARGETS = "prometheus"  # the run directory's folder of target files
# Seconds, for the latency histograms: a reward call or a reload of a tiny model takes
# milliseconds, a real model's weight update or a multi-turn request minutes.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def advertised_host(host: str) -> str:
    """The host name Prometheus reaches a server bound to `host` by: this machine's name for the
    wildcard addresses, the address itself otherwise."""
    return socket.getfqdn() if host in ("", "0.0.0.0", "::") else host


def run_label(output_dir: Path | str, run_name: str = "") -> str:
    """The run label: the multi-run name, else the run directory's name (bounded: one per run)."""
    return run_name or Path(output_dir).resolve().name


def write_target(output_dir: Path | str, program: str, host: str, port: int, labels: dict[str, str]) -> Path:
    """Write this program's target file (atomically: Prometheus may read it at any moment) and
    have it removed when the process exits normally; returns its path."""
    host = advertised_host(host)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    folder = Path(output_dir) / TARGETS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{program}-{host}-{port}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps([{"targets": [address], "labels": {"program": program, "host": host, **labels}}],
                              indent=1) + "\n")
    tmp.replace(path)
    atexit.register(_remove, path, os.getpid())
    return path


def _remove(path: Path, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child (vLLM's engine core) exiting before us
        path.unlink(missing_ok=True)


def serve(registry, program: str, host: str, port: int, output_dir: Path | str, labels: dict[str, str]) -> Path:
    """Serve `registry` at http://host:port/metrics on a daemon thread and write the target file.
    The port was checked bindable at start-up (rl/preflight.py metrics_endpoint)."""
    from prometheus_client import start_http_server

    start_http_server(port, addr=host, registry=registry)
    return write_target(output_dir, program, host, port, labels)
