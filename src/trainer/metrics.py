"""The trainer's Prometheus metrics (trainer.metrics_port; docs/observability.md), fed from each
step's metrics.jsonl record (trainer.py train_one) on every rank: rank r of a host serves on
metrics_port + its local rank, its target file labelled with its global rank.

MFU is exported only where the device's peak is known (PEAK_BF16_FLOPS, bfloat16 compute): the
model's FLOPs are estimated as 6 x parameters per token trained (forward and backward, attention
left out), the usual estimate, so it is a lower bound for long sequences; over the peak of every
rank (the batch's tokens are the whole world's work), so every rank reports the job's MFU.
"""

from __future__ import annotations

import os
import resource
import time

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rl import prometheus
from rl.config import RunConfig

MFU = ("asyncrl_trainer_mfu_ratio", "Model FLOPs utilisation of the last step (6 x parameters per token); only "
       "where the device's peak is known.")
# Dense bfloat16 tensor-core peaks, FLOP/s, from the vendors' data sheets (SXM parts where a
# PCIe part differs: an H100 PCIe reads as "H100 PCIe" and is listed before the SXM entry).
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("B200", 2250e12),
                   ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12), ("L4", 121e12))


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """The device's dense peak for the compute dtype, or None where it is not known (CPUs,
    float32, GPUs not in the table)."""
    if device.type != "cuda" or dtype != "bfloat16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_BF16_FLOPS if part in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """The accelerator memory this rank's tensors peaked at; on a CPU, the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class TrainerMetrics:
    """One rank's metrics. Without trainer.metrics_port nothing is served and step() only sets
    values nobody reads."""

    def __init__(self, cfg: RunConfig, rank: int, device: torch.device, world: int = 1):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.device, self.world = device, world
        self.params, self.peak = 0, None  # at the first step: the model and its dtype come after this
        p = "asyncrl_trainer_"
        self.step_ = Gauge(p + "step", "Last step trained.", registry=r)
        self.last_step = Gauge(p + "last_step_timestamp_seconds", "Unix time the last step ended.", registry=r)
        self.started = Gauge(p + "start_timestamp_seconds", "Unix time the trainer started.", registry=r)
        self.loss = Gauge(p + "loss", "Last step's loss.", registry=r)
        self.grad_norm = Gauge(p + "grad_norm", "Last step's gradient norm (before clipping).", registry=r)
        self.entropy = Gauge(p + "entropy", "Last step's mean entropy of the policy on its tokens.", registry=r)
        self.mismatch_kl = Gauge(p + "mismatch_kl", "Last step's mismatch KL, k3 KL(pi_inference, pi_trainer) on the "
                                 "sampled tokens.", registry=r)
        self.kl_bound = Gauge(p + "mismatch_kl_bound", "The config's trainer.mismatch.kl_warn (0: none).", registry=r)
        self.tokens_per_s = Gauge(p + "tokens_per_second", "Last step's tokens trained per second of step time.",
                                  registry=r)
        self.tokens = Counter(p + "tokens", "Tokens trained (prompts and completions).", registry=r)
        self.mfu: Gauge | None = None
        self.memory = Gauge(p + "peak_memory_bytes", "Peak accelerator memory of this rank (CPU: peak resident "
                                                     "memory of the process).", registry=r)
        seconds = prometheus.SECONDS_BUCKETS
        self.step_s = Histogram(p + "step_seconds", "Time of one optimizer step (forward, backward, update).",
                                buckets=seconds, registry=r)
        self.publish_s = Histogram(p + "publish_seconds", "Time to publish a version's weights.", buckets=seconds,
                                   registry=r)
        self.wait_s = Histogram(p + "batch_wait_seconds", "Time waiting for the next batch.", buckets=seconds,
                                registry=r)
        self.started.set(time.time())
        self.kl_bound.set(cfg.trainer.mismatch.kl_warn)
        t = cfg.trainer
        if t.metrics_port:
            port = t.metrics_port + int(os.environ.get("LOCAL_RANK", "0"))
            prometheus.serve(r, "trainer", t.metrics_host, port, cfg.output_dir,
                             {"run": prometheus.run_label(cfg.output_dir, cfg.run_name), "rank": str(rank)})

    def step(self, record: dict, model: torch.nn.Module, dtype: str) -> None:
        """One step's metrics.jsonl record (trainer.py train_one); `dtype`: the compute dtype."""
        if not self.params:
            self.params = sum(p.numel() for p in model.parameters())
            self.peak = peak_flops(self.device, dtype)
            if self.peak:
                self.mfu = Gauge(*MFU, registry=self.registry)
        self.step_.set(record["step"])
        self.loss.set(record["loss"])
        self.grad_norm.set(record["grad_norm"])
        self.entropy.set(record["entropy"])
        self.mismatch_kl.set(record["mismatch_kl"])
        self.tokens_per_s.set(record["trainer_tokens_per_s"])
        self.tokens.inc(record["tokens"])
        if self.mfu is not None and record["step_s"] > 0:
            # The whole batch's FLOPs (every rank's record holds the whole batch's tokens) over
            # the whole world's peak: each rank reports the job's utilisation.
            self.mfu.set(6 * self.params * record["tokens"] / record["step_s"] / (self.peak * self.world))
        self.memory.set(peak_memory_bytes(self.device))
        self.step_s.observe(record["step_s"])
        self.publish_s.observe(record["write_s"])
        self.wait_s.observe(record["wait_s"])
        self.last_step.set(time.time())
