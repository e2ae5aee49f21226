"""asyncrl's Prometheus metrics on `rl inference`'s /metrics, beside vLLM's own (vllm:*): vLLM's
server serves prometheus_client's default registry there (vllm/entrypoints/serve/instrumentator/
metrics.py, one API server), and ours is registered into it. No port of their own: Prometheus
scrapes the server's port, found through output_dir/prometheus/inference-<host>-<port>.json
(rl/prometheus.py), written when the routes attach.

Weight updates are timed and counted around the route (routes.py), not inside the reload: the
answer says what happened (reload_s > 0: reloaded; 0: already serving it; 4xx: refused; 5xx: failed),
and the directory's manifest says how it arrived (a weight delta, a broadcast, or full files).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import HTTPException
from prometheus_client import REGISTRY as DEFAULT, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rl.weights import broadcast as bc
from rl import prometheus
from rl.weights import delta as wd
from rl.config import RunConfig

REGISTRY = CollectorRegistry(auto_describe=True)
_P = "asyncrl_inference_"
RELOAD_SECONDS = Histogram(_P + "reload_seconds", "Time the engine took to load a new version (pause, load, resume).",
                           buckets=prometheus.SECONDS_BUCKETS, registry=REGISTRY)
UPDATES = Counter(_P + "weight_updates", "Versions loaded, by how they arrived (full, delta, broadcast).", ("kind",),
                  registry=REGISTRY)
REFUSED = Counter(_P + "weight_updates_refused", "Weight updates refused before the engine was touched, by HTTP "
                                                 "status (a delta against another base, a path outside the roots...).",
                  ("code",), registry=REGISTRY)
FAILED = Counter(_P + "weight_updates_failed", "Weight updates that failed or timed out (HTTP 5xx).", ("code",),
                 registry=REGISTRY)
LIVE = ((_P + "weight_version", "gauge", "Policy version the engine serves."),
        (_P + "requests_aborted", "counter", "Engine requests stopped by /abort while they ran."))


def kind_of(path: Path) -> str:
    """How the version at `path` arrives: the manifest the directory holds names it."""
    if (path / wd.MANIFEST).is_file():
        return "delta"
    return "broadcast" if (path / bc.MANIFEST).is_file() else "full"


async def timed_update(update: Callable[[], Awaitable[dict]], path: Path) -> dict:
    """Run one /update_weights and count what came of it."""
    try:
        answer = await update()
    except HTTPException as e:
        (REFUSED if e.status_code < 500 else FAILED).labels(str(e.status_code)).inc()
        raise
    if answer.get("reload_s", 0) > 0:
        RELOAD_SECONDS.observe(answer["reload_s"])
        UPDATES.labels(kind_of(path)).inc()
    return answer


class Live:
    """The values read at each scrape: the version served, the requests aborted."""

    def __init__(self, generations):
        self.generations = generations

    def collect(self):
        version, aborted = LIVE
        yield GaugeMetricFamily(version[0], version[2], value=self.generations.version)
        yield CounterMetricFamily(aborted[0], aborted[2], value=self.generations.aborted)


_live: list[Live] = []


def attach(cfg: RunConfig, generations) -> None:
    """Our metrics into the registry vLLM's /metrics serves; this server's target file."""
    for old in _live:  # a second server in one process (tests): the newest one's values
        REGISTRY.unregister(old)
    _live[:] = [Live(generations)]
    REGISTRY.register(_live[0])
    if REGISTRY not in DEFAULT._collector_to_names:
        DEFAULT.register(REGISTRY)
    url = cfg.inference.url.split("://", 1)[1]
    host, _, port = url.rpartition(":")
    prometheus.write_target(cfg.output_dir, "inference", host.strip("[]"), int(port),
                            {"run": prometheus.run_label(cfg.output_dir, cfg.run_name)})
