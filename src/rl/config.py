"""One run, one config: shared keys at the top, one table per program.

Every program parses the same files (`@ a.toml @ b.toml`, composed left to right, then
`--table.key value` overrides) into `RunConfig`, so a run started by `rl run` and one started by
hand in three terminals resolve to exactly the same settings. Each key's docstring is its
documentation (`rl <program> --help` and `--dry-run` show them).

It is longer than the project's other files on purpose: it is the schema, one class per table and
a documented field per key, plus the checks that span tables (which need the whole config in one
place). The orchestrator's table, the largest, lives in rl/orchestrator_config.py, and datasets
and evaluation, a schema of their own, in rl/dataset_config.py.
"""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, NonNegativeInt, ValidationError, field_validator, model_validator

from rl.addresses import HostPort, ZmqEndpoint, check_zmq_endpoint
from rl.config_section import Section
from rl.orchestrator_config import OrchestratorConfig, moved_key
from rl.sft_config import SftConfig


class ConfigError(Exception):
    """A config problem, with a one-line message naming the key or file at fault."""


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

    reload_timeout_s: float = Field(300, gt=0)
    """Longest a weight update may take (waiting behind another, the pause: "wait" lets running
    requests finish first, and the load) before /update_weights answers 504; the reload goes on,
    and /health answers 503 until it ends."""

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

    extra_args: list[str] = []
    """Further `vllm serve` flags, passed through verbatim (e.g. ["--max-num-seqs", "256"])."""

    @property
    def url(self) -> str:
        """Where the orchestrator reaches this server (see advertise_url)."""
        if self.advertise_url:
            return self.advertise_url
        host = socket.getfqdn() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"


class TransportConfig(Section):
    kind: Literal["filesystem", "zmq"] = "filesystem"
    """How batches reach the trainer: rollouts/step_n in the run directory, or ZMQ PUSH/PULL."""

    address: ZmqEndpoint = "tcp://127.0.0.1:5557"
    """ZMQ address the orchestrator connects to, and the trainer binds unless `bind` is set
    (tcp://host:port or ipc:///path); kind = "zmq" only."""

    bind: str = ""
    """ZMQ address trainer rank 0 binds when it differs from `address`, e.g. tcp://*:5557 when
    the orchestrator runs on another host. Empty: address."""

    @field_validator("bind")
    @classmethod
    def _bind_form(cls, bind: str) -> str:
        return check_zmq_endpoint(bind) if bind else bind


class WeightSyncConfig(Section):
    kind: Literal["filesystem", "broadcast"] = "filesystem"
    """filesystem: the trainer writes weights/step_n and every server reloads from it.
    broadcast: trainer rank 0 streams the weights to every inference worker over a collective
    (NCCL on GPU, gloo on CPU); weights/step_n then holds only the bucket manifest + STABLE."""

    address: HostPort = "127.0.0.1:29710"
    """host:port where trainer rank 0 hosts the broadcast group's rendezvous store; servers
    must reach it."""

    bucket_mb: int = Field(256, ge=1)
    """Weights travel in packed buckets of at most this size (MiB)."""

    timeout_s: float = Field(600, gt=0)
    """Longest wait for every member to join the broadcast group, and for one broadcast."""

    delta: bool = False
    """Publish each version as the values that changed since the last full version (bit for bit;
    docs/weight_deltas.md) instead of the whole model: written to weights/step_n/delta.safetensors,
    or with kind "broadcast" only the changed values sent. Servers keep that full version in host
    memory (one more copy of the weights) and rebuild each version from it, checked against the
    version's checksum. Full weights only (not with trainer.lora.rank > 0)."""

    full_every: int = Field(8, ge=1)
    """With delta: a full version every this many versions (a delta grows with the distance from
    its base), and always the first one a trainer publishes (after a restart too)."""


class OptimConfig(Section):
    lr: float = Field(3e-4, gt=0)
    """AdamW learning rate."""

    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""

    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global L2 norm."""

    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warm-up, from lr down to lr * min_lr_ratio at max_steps."""

    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from 0 to lr."""

    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate of the linear and cosine schedules, as a fraction of lr."""


class LossConfig(Section):
    objective: Literal["ppo_clip", "truncated_is"] = "ppo_clip"
    """ppo_clip: -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A). truncated_is: REINFORCE weighted
    by the detached ratio capped at tis_cap, -min(r, tis_cap).detach() * A * logprob (CISPO-style:
    every token keeps a gradient, however far off-policy). r = pi_trainer / pi_inference."""

    ratio_level: Literal["token", "sequence"] = "token"
    """token: one ratio per token. sequence: the geometric mean of a sample's token ratios, shared
    by all its tokens (GSPO); masking then drops whole samples."""

    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip: the ratio is held above 1 - clip_low for negative advantages."""

    clip_high: float = Field(0.28, ge=0)
    """PPO clip: the ratio is held below 1 + clip_high for positive advantages (DAPO's
    clip-higher keeps exploration alive)."""

    tis_cap: float = Field(2.0, gt=0)
    """truncated_is: cap of the importance weight."""

    mask_low: float | None = Field(None, ge=0)
    """Tokens (or samples, with ratio_level sequence) whose ratio is below this get no gradient
    at all (unset: no lower mask). Guards against engine/trainer mismatch (e.g. 0.125)."""

    mask_high: float | None = Field(None, gt=0)
    """Tokens (or samples) whose ratio is above this get no gradient (unset: none; e.g. 8)."""

    kl_coef: float = Field(0.0, ge=0)
    """Weight of a KL penalty (k3 estimator, per token) towards kl_target; 0 turns it off."""

    kl_target: Literal["reference", "inference"] = "reference"
    """reference: the starting model, kept frozen in the trainer (one more forward pass per
    micro-batch, and its memory). inference: the logprobs the engine sampled with."""

    normalization: Literal["token", "sequence", "constant"] = "token"
    """How per-token losses sum to the batch loss. token: divide by the batch's loss tokens (every
    token weighs the same). sequence: mean over each sample's tokens, then over samples (GRPO).
    constant: divide by samples * norm_length (Dr. GRPO: no length bias)."""

    norm_length: int = Field(0, ge=0)
    """normalization = constant: the constant per sample; 0 means seq_len."""


_ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoRAConfig(Section):
    rank: int = Field(0, ge=0, le=512)
    """LoRA rank; 0 trains every weight (full fine-tuning). With a rank, only the adapters train,
    weights/step_n holds a peft adapter, and servers load it with /load_lora_adapter: the base
    weights never move."""

    alpha: float = Field(16.0, gt=0)
    """LoRA alpha: the adapter's output is scaled by alpha / rank."""

    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (training only)."""

    target_modules: list[str] = Field(default_factory=lambda: list(_ALL_LINEAR), min_length=1)
    """Names of the linear layers that get an adapter (the last part of the module path)."""

    multi_run: bool = False
    """Trainer: train every run found under output_dir/runs/<name>/ at once, each from its own
    config (written there by its orchestrator), with its own adapter, optimizer and step counter.
    Runs join and leave while the trainer keeps going. See docs/lora.md."""

    slots: int = Field(4, ge=1)
    """multi_run: adapter slots, i.e. the most runs trained at once; a run that arrives while
    all are taken waits for one to free up."""

    run_timeout_s: float = Field(60, gt=0)
    """multi_run: a run whose next batch is missing and whose orchestrator has not signalled life
    (runs/<name>/heartbeats/orchestrator) for this long leaves; its adapter and optimizer are checkpointed so
    it can rejoin."""

    idle_exit_s: float = Field(0, ge=0)
    """multi_run: exit once no run has been training for this long (after at least one run came
    and went); 0 serves until stopped."""


class ParallelConfig(Section):
    """How the trainer's ranks are laid out: data x context x expert = the world size, checked at
    start-up (docs/trainer.md, "Parallelism")."""

    data: int = Field(0, ge=0)
    """FSDP2 data-parallel ranks; 0: the world size divided by context x expert."""

    context: int = Field(1, ge=1)
    """Ranks that one packed row is split across (context parallelism): samples longer than one
    rank's memory holds."""

    expert: int = Field(1, ge=1)
    """Ranks that a mixture-of-experts model's experts are split across (expert parallelism)."""


class TrainerConfig(Section):
    optim: OptimConfig = OptimConfig()
    """Optimizer."""

    parallel: ParallelConfig = ParallelConfig()
    """Data, context and expert parallel sizes (their product: the trainer's world size)."""

    cpus: list[NonNegativeInt] = []
    """Cores this program and everything it starts may run on; empty: all (see inference.cpus)."""

    gpus: list[NonNegativeInt] = []
    """GPUs of the trainer, as indices into the GPUs `rl run` sees (see inference.gpus): `rl run`
    starts one rank per GPU (under torchrun when there are several). Empty under `rl run`: the
    GPUs inference.gpus leaves (rl/gpu_placement.py)."""

    metrics_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus metrics: the rank of local rank r on port metrics_port + r of its host
    (http://metrics_host:<port>/metrics), each writing output_dir/prometheus/trainer-<host>-<port>.json
    for Prometheus' file_sd (docs/observability.md); 0: off."""

    metrics_host: str = "127.0.0.1"
    """Address the metrics ports bind (see orchestrator.metrics_host)."""

    loss: LossConfig = LossConfig()
    """Policy-gradient loss."""

    sampling_mask: bool = True
    """Keep Sampling Mask: for samples drawn with top_k, top_p or min_p, renormalise the
    trainer's logprobs over the tokens the sampler kept (rebuilt from the sample's settings,
    vLLM's steps in vLLM's order) before the ratio, the clipping and the KL. The engine reports
    the truncated distribution's logprobs; without this the ratio compares it with the full
    one. Untruncated samples are never touched; false turns it off for all. Where the batch
    carries the sampler's own kept set (orchestrator.sampling.record_kept_sets), that set is used instead
    of the rebuilt one."""

    routing_replay: bool = False
    """Mixture-of-experts models: each MoE layer sends each token to the experts the inference
    engine routed it to (recorded with the batch: needs inference.record_routing), the router's
    softmax at those experts as the mixing weights, so the router still learns (the R3 recipe,
    trainer/routing_replay.py). Off: the trainer routes by itself; routing_agreement still reports
    how often it picks the engine's experts whenever batches carry a record."""

    mismatch_kl_warn: float = Field(1e-2, ge=0)
    """Log a warning when a step's mismatch_kl (k3 KL(pi_inference || pi_trainer) on the sampled
    tokens) exceeds this; 0: never. On policy it is numerics alone (~1e-6 in float32); staleness
    adds to it (the demo, max_async_level 1: median 1.4e-3, 4 steps of 300 above 1e-2)."""

    lora: LoRAConfig = LoRAConfig()
    """LoRA adapters instead of full fine-tuning (rank > 0), and multi-run training."""

    pack: bool = True
    """Pack samples into rows of at most seq_len tokens (first-fit decreasing; attention never
    crosses samples) instead of padding each sample to the longest of its micro-batch."""

    micro_batch_tokens: int = Field(8192, ge=8)
    """pack = true: tokens per forward/backward pass on each rank (micro_batch_tokens // seq_len
    packed rows, at least one). Gradients accumulate over micro-batches. On a GPU, as many as
    memory allows: a 0.5B model on an H100 stepped 1.5x faster at 32768 than at 8192 (the GPU
    was 59% busy at 8192; docs/performance.md, "On an H100")."""

    micro_batch_size: int = Field(64, ge=1)
    """pack = false: samples per padded forward/backward pass on each rank."""

    attention: Literal["auto", "sdpa", "flash_attention_2", "varlen"] = "auto"
    """Attention kernel of the trainer's model. sdpa: packed samples get a block-diagonal
    [T, T] mask. varlen: packed rows are cut into their samples and attention runs per sample
    (trainer/packed_attention.py): PyTorch's own flash kernel on CUDA in bfloat16 (no flash-attn
    package; Ampere or newer), elsewhere SDPA per block of samples (a mask no longer than the
    longest sample, never the row's). flash_attention_2: the flash-attn package's varlen kernel.
    auto: flash_attention_2 on CUDA in bfloat16 where flash-attn is installed, else varlen."""

    compile: Literal["auto"] | bool = "auto"
    """torch.compile each decoder layer's forward before FSDP2 shards it (trainer/compiled_layers.py):
    fused elementwise kernels, one compile per new micro-batch width until the width is
    symbolic. auto: on for CUDA with full fine-tuning of a dense model; off on the CPU (minutes
    of compiling for a demo that steps in a fraction of a second), with LoRA and with MoE
    routing hooks."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass: less memory, ~30% more
    compute."""

    reference_offload: bool = False
    """The KL reference model (loss.kl_target = "reference", full fine-tuning) lives in host
    memory and each decoder layer is copied to the GPU for its forward (FSDP2 CPU offload):
    the GPU holds one layer of it at a time instead of a whole copy, for one host-to-device
    copy of its weights per micro-batch. With LoRA the reference is the base model itself and
    costs nothing (docs/trainer.md, "Memory")."""

    logits_chunk_tokens: int = Field(1024, ge=0)
    """Logprobs and entropy come from the last hidden states this many tokens at a time, and only
    for loss tokens (trainer/logprob_head.py): the logits' memory is ~4 x 4 bytes x chunk x
    vocabulary (2.5 GB at 1024 x 151,936) instead of that per token of the micro-batch. 0:
    full [tokens, vocabulary] logits, as transformers computes them."""

    checkpoint_every: int = Field(50, ge=0)
    """Save a trainer checkpoint (model, optimizer, scheduler, step, RNG) every this many steps,
    and at the last step; 0 turns checkpoints off."""

    profile_steps: list[int] = []
    """[first, last]: record steps first..last with torch.profiler on every rank (CPU ops, and CUDA
    kernels on a GPU); writes logs/profile_rank<R>.txt (ops by their own time), a Chrome trace in
    profile/ and one log line with the device's busy share of those steps (trainer/profiling.py).
    Empty: off. Leave a step or two of warm-up before first."""

    @field_validator("profile_steps")
    @classmethod
    def _profile_window(cls, v: list[int]) -> list[int]:
        if v and (len(v) != 2 or not 1 <= v[0] <= v[1]):
            raise ValueError("expected [first, last] with 1 <= first <= last")
        return v

    keep_checkpoints: int = Field(2, ge=1)
    """Complete trainer checkpoints kept on disk; older ones are deleted."""

    weights_shard_mb: int = Field(4096, ge=1)
    """Published weights are split into model-0000i-of-0000n.safetensors files of at most this
    size (MiB) plus an index, as HF does; a smaller model is one model.safetensors."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the FSDP2 mixed-precision policy (parameters stay float32). auto, resolved
    once at start-up (trainer/compute_dtype.py): bfloat16 on CUDA (and with flash_attention_2);
    on a CPU, bfloat16 only where it computes bf16 natively (avx512_bf16 or amx_bf16 in
    /proc/cpuinfo) for a model of hidden size 256 or more, else float32. An explicit bfloat16 on a
    CPU without native bf16 logs a warning: matmuls there run ~30x slower than float32."""

    torch_threads: int = Field(0, ge=0)
    """CPU threads for torch in the trainer; 0 keeps torch's default. On a small machine shared
    with the inference engine, 1 avoids the two fighting over cores."""

    batch_timeout_s: float = Field(3600, gt=0)
    """Longest to wait for the next batch before giving up (a heartbeat is logged meanwhile)."""

    keep_rollouts: int = Field(2, ge=1)
    """Consumed batches kept on disk (for inspection); older ones are deleted."""

    keep_weights: int = Field(3, ge=1)
    """Weight versions kept on disk; older ones are deleted once newer ones are STABLE."""


class SlurmConfig(Section):
    """`rl slurm @ cfg.toml` only: how the sbatch script it prints places the programs."""

    inference_nodes: int = Field(1, ge=1)
    """Nodes running inference servers."""

    servers_per_node: int = Field(1, ge=1)
    """Inference servers per inference node, on ports inference.port, +1, ...; the node's GPUs
    are split evenly between them (tensor parallelism goes in inference.extra_args)."""

    trainer_nodes: int = Field(1, ge=1)
    """Nodes of the trainer (one torchrun per node, a static rendezvous on the first: rank 0
    must be there, where the orchestrator connects).
    The orchestrator runs on the first trainer node too: it needs CPU only."""

    gpus_per_node: int = Field(8, ge=0)
    """GPUs per node; the trainer runs one rank per GPU (0: a CPU cluster, one rank per node)."""

    partition: str = ""
    """#SBATCH --partition; empty: the cluster's default."""

    account: str = ""
    """#SBATCH --account; empty: none."""

    time_limit: str = "24:00:00"
    """#SBATCH --time."""

    job_name: str = "asyncrl"
    """#SBATCH --job-name."""

    sbatch_args: list[str] = []
    """Further #SBATCH lines, verbatim (e.g. ["--exclusive", "--mem=0"])."""

    setup: list[str] = []
    """Shell lines the job runs first (module loads, `source .venv/bin/activate`); every step
    inherits the environment they leave."""

    rendezvous_port: int = Field(29500, ge=1, le=65535)
    """Port of the trainer's torchrun rendezvous on the first trainer node."""

    template: Path | None = None
    """A Jinja2 template to render instead of the built-in one (src/asyncrl/slurm.sbatch.j2,
    documented in docs/slurm.md)."""


class TrackingConfig(Section):
    """Experiment trackers fed from metrics.jsonl by the orchestrator (orchestrator/reporting/tracking.py)."""

    wandb: bool = False
    """Log to Weights & Biases (`pip install wandb`); files under output_dir/tracking/."""

    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    """auto: online when WANDB_API_KEY is set, else offline (`wandb sync` uploads it later)."""

    wandb_project: str = "asyncrl"
    """The Weights & Biases project the run logs to."""

    wandb_entity: str | None = None
    """The Weights & Biases team or user owning the project; unset: the API key's default entity."""

    run_name: str = ""
    """The run's name in the trackers; empty: the run directory's name."""

    tensorboard: bool = False
    """Write TensorBoard event files to output_dir/tracking/tensorboard (`pip install tensorboard`)."""


class RunConfig(Section):
    model: Path
    """Path of the starting model, a local HF-format directory (config, tokenizer, safetensors)."""

    output_dir: Path = Path("runs/default")
    """The run directory shared by the three programs (rollouts, weights, logs, metrics)."""

    max_steps: int = Field(20, ge=1)
    """Optimizer steps to train; also the number of batches the orchestrator hands over."""

    seq_len: int = Field(256, ge=8)
    """Longest prompt + completion, tokens; the server's max_model_len."""

    max_async_level: int = Field(2, ge=0)
    """k: batch n is handed over only once version >= n-1-k serves on every server. 0 is
    synchronous on-policy RL. Default 2, from two recipes that agree (docs/performance.md,
    "Learning speed"): on the CPU demo's 2 reached a reward in ~25% less wall time than 1 (the
    same reward per step, the trainer waiting less for batches; 3 no better), on the reversal ~6%
    less (8% shorter steps), and on a train-bound reversal raced against TRL's GRPOTrainer, 2 with
    in-flight updates reached trailing-10 reward 0.5 in 0.85x TRL's time where 1 without took
    1.15x. The staleness it adds is corrected per token (the sampler's logprobs in the PPO ratio);
    a real-sized model has not been measured at 2 on a GPU yet."""

    seed: int = 0
    """Seed of the data stream and of the trainer."""

    heartbeat_timeout_s: float = Field(20, ge=5)
    """A program whose heartbeat file (output_dir/heartbeats/) has not changed for this long is
    reported dead, frozen or cut off by the programs watching it (judged by each watcher's own
    clock: hosts need no clock sync). On a network filesystem whose attribute cache delays
    changes, raise it above that delay (docs/multi-host.md)."""

    resume: bool = False
    """Trainer: continue from the latest complete checkpoint in output_dir (`--resume`). Without
    it the trainer refuses a run directory that already holds weights. The orchestrator always
    resumes from its own state."""

    run_name: str = Field("", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$|^$")
    """Multi-run LoRA: this run's name; its directory is output_dir/runs/<run_name>/ and its
    adapter is served as "<run_name>-v<version>". Empty: a run of its own in output_dir."""

    inference: InferenceConfig = InferenceConfig()
    transport: TransportConfig = TransportConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: TrainerConfig = TrainerConfig()
    slurm: SlurmConfig = SlurmConfig()
    tracking: TrackingConfig = TrackingConfig()
    sft: SftConfig = SftConfig()

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        o = self.orchestrator
        if o.scheduling.max_in_flight_groups < o.scheduling.prompts_per_step:
            raise ValueError(
                f"orchestrator.scheduling.max_in_flight_groups ({o.scheduling.max_in_flight_groups}) must be >= "
                f"orchestrator.scheduling.prompts_per_step ({o.scheduling.prompts_per_step}), or no batch could fill"
            )
        for d in o.resolved_datasets() + o.resolved_datasets(evaluation=True):
            if d.sampling.max_tokens >= self.seq_len:
                key = "orchestrator.sampling.max_tokens" if d.spec.max_tokens is None else f"dataset {d.name}: max_tokens"
                raise ValueError(
                    f"{key} ({d.sampling.max_tokens}) must be below seq_len ({self.seq_len}): "
                    "seq_len bounds prompt + completion, so no prompt would fit"
                )
        t = self.trainer
        if t.pack and t.micro_batch_tokens < self.seq_len:
            raise ValueError(
                f"trainer.micro_batch_tokens ({t.micro_batch_tokens}) must be >= seq_len "
                f"({self.seq_len}): a sample of seq_len tokens must fit in one micro-batch"
            )
        if t.attention == "flash_attention_2" and t.dtype == "float32":
            raise ValueError('trainer.attention = "flash_attention_2" needs trainer.dtype = "bfloat16" or "auto" '
                             "(flash attention has no float32 kernel)")
        lo, hi = t.loss.mask_low, t.loss.mask_high
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"trainer.loss.mask_low ({lo}) must be below trainer.loss.mask_high ({hi})")
        lora = t.lora
        if (lora.multi_run or self.run_name) and lora.rank == 0:
            raise ValueError("trainer.lora.multi_run and run_name need LoRA: set trainer.lora.rank > 0")
        if (lora.multi_run or self.run_name) and self.transport.kind != "filesystem":
            raise ValueError('multi-run LoRA needs transport.kind = "filesystem" (one rollouts/ per run)')
        if lora.rank and self.weight_sync.delta:
            raise ValueError("weight_sync.delta applies to full weights: trainer.lora.rank > 0 publishes adapters")
        if lora.rank and self.weight_sync.kind != "filesystem":
            raise ValueError('trainer.lora.rank > 0 syncs adapters through files: weight_sync.kind must be "filesystem"')
        m = o.scheduling.max_off_policy_steps
        if m is not None and m < self.max_async_level:
            raise ValueError(
                f"orchestrator.scheduling.max_off_policy_steps ({m}) must be >= max_async_level "
                f"({self.max_async_level})"
            )
        return self

    @property
    def off_policy_steps(self) -> int:
        m = self.orchestrator.scheduling.max_off_policy_steps
        return self.max_async_level if m is None else m

    @property
    def run_dir(self) -> Path:
        """This run's directory: output_dir, or output_dir/runs/<run_name> in a multi-run."""
        return self.output_dir / "runs" / self.run_name if self.run_name else self.output_dir

    @property
    def weight_delivery(self) -> str:
        """How each version reaches the servers, the one choice every program follows: "adapters"
        (trainer.lora.rank > 0: peft adapters through files), "broadcast" (weight_sync.kind: full
        weights streamed to the servers' workers) or "files" (full weights through files).
        Each program maps it to its own class: orchestrator/servers/delivery.py, trainer/publish.py,
        inference/adapters.py."""
        if self.trainer.lora.rank > 0:
            return "adapters"
        return "broadcast" if self.weight_sync.kind == "broadcast" else "files"

    @property
    def adapter_prefix(self) -> str:
        """Servers hold this run's adapter versions as "<prefix>-v<version>"."""
        return self.run_name or "policy"

    @property
    def urls(self) -> list[str]:
        return self.orchestrator.servers.urls or [self.inference.url]


# --- loading ---------------------------------------------------------------------------------


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse_value(raw: str) -> Any:
    """A CLI value is read as a TOML value when it parses as one (numbers, booleans, lists),
    otherwise as a plain string, so `--model some/path` needs no quotes."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a TOML file") from None
    except PermissionError:
        raise ConfigError(f"config file {path}: permission denied") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}): save it as UTF-8 TOML") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    return data


def parse_args(argv: list[str]) -> tuple[dict, bool]:
    """Split `@ a.toml @ b.toml --x.y v --dry-run` into one merged dict and the dry-run flag."""
    merged: dict = {}
    dry_run = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@" or arg.startswith("@"):
            name = arg[1:] or (argv[i + 1] if i + 1 < len(argv) else "")
            if not name:
                raise ConfigError("'@' must be followed by a config file")
            merged = _merge(merged, _read_toml(Path(name)))
            i += 1 if arg[1:] else 2
        elif arg == "--dry-run":
            dry_run = True
            i += 1
        elif arg == "--resume" and (i + 1 >= len(argv) or argv[i + 1].startswith(("--", "@"))):
            merged["resume"] = True
            i += 1
        elif arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"--{key}: missing value")
                value = argv[i + 1]
                i += 1
            i += 1
            node = merged
            *parents, leaf = key.replace("-", "_").split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    # (a key that is a table now, written the old way: its new place)
                    raise ConfigError(moved_key(merged.get("orchestrator")) or f"--{key}: {part} is not a table")
            node[leaf] = _parse_value(value)
        else:
            raise ConfigError(f"unexpected argument {arg!r} (expected '@ file.toml' or --key value)")
    return merged, dry_run


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        return f"unknown config key: {key}"
    if first["type"] == "missing":
        return f"missing config key: {key}"
    msg = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:
        return f"config error: {msg}"
    return f"config key {key}: {msg} (got {first.get('input')!r})"


def load_config(argv: list[str]) -> tuple[RunConfig, bool]:
    data, dry_run = parse_args(argv)
    hint = moved_key(data.get("orchestrator"))
    if hint:
        raise ConfigError(hint)
    try:
        return RunConfig.model_validate(data), dry_run
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def to_toml_dict(cfg: RunConfig) -> dict:
    """The resolved config as TOML-writable data (no None values, paths as strings)."""

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if x is not None}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return clean(cfg.model_dump(mode="json"))
