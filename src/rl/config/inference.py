"""`[inference]`: the vLLM server that generates rollouts and reloads weights when told."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, NonNegativeInt

from rl.config.section import Section


class InferenceTimeoutsConfig(Section):
    """Every bound the server waits under (seconds)."""

    reload_s: float = Field(300, gt=0)
    """Longest a weight update may take (waiting behind another, the pause: "wait" lets running
    requests finish first, and the load) before /update_weights answers 504; the reload goes on,
    and /health answers 503 until it ends."""


class InferenceConfig(Section):
    host: str = "127.0.0.1"
    """Address the server binds. Admin routes live on the same server, so keep it on loopback
    unless the orchestrator runs on another host and `api_token` is set."""

    port: int = Field(8000, ge=1, le=65535)
    """Port of the OpenAI-compatible and admin routes."""

    advertise_url: str = Field("", pattern=r"^$|^https?://[^/\s]+$")
    """URL at which the orchestrator reaches this server, announced in the run directory
    (heartbeats/) so that an orchestrator with orchestrator.servers.discover finds it. Empty:
    http://<host>:<port>, with this machine's host name when host is 0.0.0.0 or ::."""

    cpus: list[NonNegativeInt] = []
    """Cores this program and everything it starts may run on; empty: all. Where the three
    programs share a machine, giving each its own cores stops them competing (vLLM's engine
    computes on every core it may use). E.g. on 2 cores: inference [0], orchestrator
    [0], trainer [1]."""

    api_token: str | None = None
    """Bearer token required on every route of the server but the probes (/health, /ping,
    /metrics, /version, /load), vLLM's included; the orchestrator sends it. Unset: the
    ASYNCRL_API_TOKEN environment variable (which keeps it out of config files), else no token.
    Never written to saved configs."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight dtype of the engine; auto takes the checkpoint's."""

    enforce_eager: bool | None = None
    """Skip CUDA graph capture and compilation. Unset: chosen by the device, eager on CPU (a faster
    start; CPU engines gain nothing from graphs) and with record_routing (its capture is Python
    inside the MoE op, which graph replays skip), graphs on GPU (inference/device_defaults.py)."""

    gpus: list[NonNegativeInt] = []
    """GPUs of the server, as indices into the GPUs `rl run` sees (CUDA_VISIBLE_DEVICES when set).
    `rl run` sets CUDA_VISIBLE_DEVICES for it; `rl inference` started by hand applies it itself.
    Empty under `rl run`: chosen by rl/gpu_placement.py (1 GPU: shared with the trainer; 2: one
    each; N: the first ceil(N/2)); `--dry-run` shows the choice. The server runs
    len(gpus) / tensor_parallel vLLM data-parallel ranks of tensor_parallel GPUs each."""

    tensor_parallel: int = Field(1, ge=1)
    """GPUs per model replica of the server (vLLM --tensor-parallel-size); len(gpus) must be a
    multiple of it, the rest of the GPUs become data-parallel ranks (--data-parallel-size)."""

    one_process_engine: bool = True
    """CPU engines with one worker (no tensor, pipeline or data parallel flags in extra_args): run
    vLLM's worker inside its engine-core process instead of a process of its own, and fork that
    process from the server (which already imported torch and vLLM) instead of spawning it.
    Measured here (docs/performance.md, benchmarks/engine_start.py): ready in 10-11 s instead of
    23-24 s, start 10-11 CPU s instead of 25 (two interpreters fewer importing torch and vLLM);
    generation is as fast within the runs' spread, for half the CPU (no scheduler polling the
    worker). The engine's OpenMP threads then follow this program's cores (`cpus`, else $VLLM_CPU_OMP_THREADS_BIND when it lists cores). GPU engines
    with one worker already run it so; false keeps vLLM's separate worker process."""

    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Share of GPU memory vLLM may take (GPU engines); unset: vLLM's own default, 0.9. Lower it
    when the trainer shares the GPU. CPU engines do not use it: their KV cache is
    cpu_kv_cache_gib (vLLM 0.32's CPU worker weighs this share against the machine's memory only
    when no KV size is given, and this server always gives one)."""

    cpu_kv_cache_gib: int = Field(1, ge=1)
    """KV-cache size for the CPU engine, GiB (sets VLLM_CPU_KVCACHE_SPACE, unless the environment
    sets it). At start the KV cache and the model's weights must fit in the memory other programs
    leave available, or the server refuses to start, saying how much there is."""

    max_loras: int = Field(8, ge=1)
    """With LoRA (trainer.lora.rank > 0): adapters the engine holds at once. Each run keeps about
    two versions resident (the newest, and the one its in-flight groups started on), so give
    at least 2 per concurrent run."""

    tool_call_parser: str = "hermes"
    """vLLM's tool-call parser for /v1/chat/completions requests that carry `tools=`
    (`--enable-auto-tool-choice --tool-call-parser`): agents written against the OpenAI client
    get their calls back as message.tool_calls. "hermes" is orchestrator.tools.parser's format
    (<tool_call>{"name": ..., "arguments": ...}</tool_call>); any name vLLM registers works; ""
    turns it off (vLLM then refuses tools= with 400)."""

    max_logprobs: int = Field(20, ge=0)
    """Most logprobs one sampled token may report (vLLM's --max-logprobs): bounds the kept sets
    orchestrator.sampling.record_kept_sets reads off them (a set of up to top_k + 1, or the vocabulary
    when top_k is off)."""

    record_routing: bool = False
    """Record which experts every MoE layer routes each token to, for /generate's routed_experts
    and the trainer's routing replay (inference/routing_capture.py). Needs a mixture-of-experts
    model (checked at start-up). Turns vLLM's prefix cache off: prompt tokens served from it run
    through no router, so they would have no record; each prompt is then computed per sample."""

    timeouts: InferenceTimeoutsConfig = InferenceTimeoutsConfig()
    """Every bound the server waits under."""

    extra_args: list[str] = []
    """Further `vllm serve` flags, passed through verbatim (e.g. ["--max-num-seqs", "256"])."""

    @property
    def url(self) -> str:
        """Where the orchestrator reaches this server (see advertise_url)."""
        if self.advertise_url:
            return self.advertise_url
        host = socket.getfqdn() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

