"""The orchestrator's Prometheus metrics (orchestrator.metrics_port; docs/observability.md).

Most are fed from what the reporting station already reports: each batch's metrics.jsonl record
(reporting/batch_report.py) sets the step's gauges and adds its counts since the previous batch to the
counters, each evaluation's record its scores. The rest are read when Prometheus scrapes (the
servers in rotation, the run directory's disk) or timed where nothing else records them: the
reward's and the inference requests' latencies (rollout/single_turn.py, flight.py) and the
sandbox's runs by outcome (sandbox/sandbox.py).

Every name starts with asyncrl_orchestrator_; the run, host and program labels come from the
target file (rl/prometheus.py). Labels here are bounded by the code or the config: a sandbox
outcome (7 values), an evaluation score's name (the eval datasets').
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rl import prometheus
from rl.config import RunConfig

REGISTRY = CollectorRegistry(auto_describe=True)
_P = "asyncrl_orchestrator_"
_S = prometheus.SECONDS_BUCKETS


def _gauge(name: str, about: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(_P + name, about, labels, registry=REGISTRY)


def _counter(name: str, about: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(_P + name, about, labels, registry=REGISTRY)


def _histogram(name: str, about: str) -> Histogram:
    return Histogram(_P + name, about, buckets=_S, registry=REGISTRY)


STEP = _gauge("step", "Last batch handed over to the trainer.")
LAST_BATCH = _gauge("last_batch_timestamp_seconds", "Unix time the last batch was handed over.")
IN_FLIGHT = _gauge("groups_in_flight", "Groups generating when the last batch was handed over.")
BUFFERED = _gauge("groups_buffered", "Groups finished but in no batch yet, at the last hand-over.")
REWARD = _gauge("reward_mean", "Mean reward of the last batch's samples.")
REWARD_SAMPLED = _gauge("reward_sampled_mean", "Mean reward of every sample scored since the previous batch "
                                               "(its group batched or filtered).")
STALENESS_MEAN = _gauge("staleness_mean_steps", "Mean staleness of the last batch's samples, steps.")
STALENESS_MAX = _gauge("staleness_max_steps", "Largest staleness in the last batch, steps.")
OFF_POLICY_BOUND = _gauge("max_off_policy_steps", "The config's staleness bound (max_off_policy_steps, else "
                                                  "max_async_level).")
# Counts since the previous batch in metrics.jsonl, added up.
COUNTED = {
    "filtered": _counter("groups_filtered", "Groups filtered out (zero reward variance and the like)."),
    "episodes_failed_scored": _counter("episodes_failed", "Episodes (rollouts) whose reward or environment failed, in every "
                                       "group scored, filtered ones included."),
    "requeued": _counter("groups_requeued", "Groups taken off a server that stopped answering, prompts requeued."),
    "cancelled": _counter("groups_cancelled_off_policy", "In-flight groups aborted as too far off-policy."),
    "dropped_stale": _counter("groups_dropped_stale", "Finished groups dropped as too stale for the next batch."),
    "failed_requests": _counter("requests_failed", "Inference requests that failed (timed out, broke off)."),
    "truncated": _counter("samples_truncated", "Batched completions cut at max_tokens."),
}
SAMPLES = _counter("samples_scored", "Samples scored.")
TOKENS = _counter("model_tokens", "Tokens the model generated.")
TRAINER_WAIT = _counter("trainer_wait_seconds", "Time spent waiting for the trainer's weights to serve "
                                                "(max_async_level) before a batch.")
GROUP_WAIT = _counter("group_wait_seconds", "Time spent waiting for enough groups for a batch.")
HANDOVER = _histogram("handover_seconds", "Time to hand a batch over to the trainer (write or send).")
WEIGHT_UPDATE = _histogram("weight_update_seconds", "Time to bring every server to a new version.")
REWARD_SECONDS = _histogram("reward_seconds", "Latency of one group's reward call (single-turn datasets).")
REQUEST_SECONDS = _histogram("request_seconds", "Latency of one inference request (a group's or a turn's).")
SANDBOX_RUNS = _counter("sandbox_runs", "Model-written programs run in the sandbox, by outcome "
                                        "(ok, error, timeout, cpu, memory, output, killed).", ("outcome",))
EVAL = _gauge("eval_score", "Latest held-out evaluation's scores, by name (eval/<name> in metrics.jsonl).", ("name",))
SERVERS = _gauge("servers", "Inference servers the orchestrator knows.")
SERVERS_UP = _gauge("servers_in_rotation", "Inference servers in rotation (healthy).")
DISK_FREE = _gauge("run_dir_free_bytes", "Free bytes on the run directory's filesystem.")
DISK_SIZE = _gauge("run_dir_size_bytes", "Size of the run directory's filesystem, bytes.")


def sandbox_run(outcome: str) -> None:
    """One sandboxed run ended (sandbox/sandbox.py OUTCOME_LISTENERS, added by orchestrator/main.py)."""
    SANDBOX_RUNS.labels(outcome).inc()


def batch_reported(record: dict, model_tokens: int, handover_s: float) -> None:
    """One batch's metrics.jsonl record (batch_report.py), its tokens and hand-over time."""
    STEP.set(record["step"])
    LAST_BATCH.set(time.time())
    IN_FLIGHT.set(record["in_flight"])
    BUFFERED.set(record["buffered"])
    REWARD.set(record["reward_mean"])
    if "reward_sampled_mean" in record:
        REWARD_SAMPLED.set(record["reward_sampled_mean"])
    STALENESS_MEAN.set(record["staleness_mean"])
    STALENESS_MAX.set(record["staleness_max"])
    for key, counter in COUNTED.items():
        counter.inc(record[key])
    SAMPLES.inc(record["samples_scored"])
    TOKENS.inc(model_tokens)
    TRAINER_WAIT.inc(record["wait_s"] - record["group_wait_s"])
    GROUP_WAIT.inc(record["group_wait_s"])
    HANDOVER.observe(handover_s)
    if "weight_update_s" in record:
        WEIGHT_UPDATE.observe(record["weight_update_s"])


def evaluated(record: dict) -> None:
    """One held-out evaluation's record (evaluation/held_out.py)."""
    for key, value in record.items():
        if key.startswith("eval/") and not key.endswith("/rows") and isinstance(value, (int, float)):
            EVAL.labels(key.removeprefix("eval/")).set(value)


def start(cfg: RunConfig, servers: Callable[[], int], in_rotation: Callable[[], int]) -> None:
    """With orchestrator.metrics_port: the read-at-scrape gauges, the HTTP server, the target file."""
    o = cfg.orchestrator
    if not o.metrics_port:
        return
    OFF_POLICY_BOUND.set(cfg.off_policy_steps)
    SERVERS.set_function(servers)
    SERVERS_UP.set_function(in_rotation)
    root = Path(cfg.output_dir)
    DISK_FREE.set_function(lambda: shutil.disk_usage(root).free)
    DISK_SIZE.set_function(lambda: shutil.disk_usage(root).total)
    prometheus.serve(REGISTRY, "orchestrator", o.metrics_host, o.metrics_port, cfg.output_dir,
                     {"run": prometheus.run_label(cfg.output_dir, cfg.run_name), "rank": "0"})
