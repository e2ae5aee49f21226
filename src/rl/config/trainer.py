"""`[trainer]`: the FSDP2 trainer, grouped by concern as [orchestrator] is: `[trainer.optim]`,
`[trainer.loss]`, `[trainer.lora]`, `[trainer.parallel]` (rl/config/trainer_tables.py), and here
`[trainer.model]` (how the model is built and computed), `[trainer.batching]` (micro-batches),
`[trainer.mismatch]` (what corrects for the sampler's distribution), `[trainer.files]` (what it
leaves on disk) and `[trainer.timeouts]`. Where the programs run (cpus, gpus, metrics, threads,
profiling) stays at the top, as in the other programs' tables. Its checkpoints are the run's
`[checkpoints]` (rl/config/shared_tables.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, field_validator

from rl.config.section import Section
from rl.config.trainer_tables import LoRAConfig, LossConfig, OptimConfig, ParallelConfig


class ModelConfig(Section):
    """How the trainer builds and computes its model."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the FSDP2 mixed-precision policy (parameters stay float32). auto, resolved
    once at start-up (trainer/compute_dtype.py): bfloat16 on CUDA (and with flash_attention_2);
    on a CPU, bfloat16 only where it computes bf16 natively (avx512_bf16 or amx_bf16 in
    /proc/cpuinfo) for a model of hidden size 256 or more, else float32. An explicit bfloat16 on a
    CPU without native bf16 logs a warning: matmuls there run ~30x slower than float32."""

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


class BatchingConfig(Section):
    """How a batch is cut into the micro-batches of one forward/backward pass."""

    pack: bool = True
    """Pack samples into rows of at most seq_len tokens (first-fit decreasing; attention never
    crosses samples) instead of padding each sample to the longest of its micro-batch."""

    micro_batch_tokens: int = Field(8192, ge=8)
    """pack = true: tokens per forward/backward pass on each rank (micro_batch_tokens // seq_len
    packed rows, at least one; with trainer.parallel.context = C a row is split across C ranks,
    so a micro-batch is C x micro_batch_tokens // seq_len rows and seq_len may reach
    C x micro_batch_tokens). Gradients accumulate over micro-batches. On a GPU, as many as
    memory allows: a 0.5B model on an H100 stepped 1.5x faster at 32768 than at 8192 (the GPU
    was 59% busy at 8192; docs/performance.md, "On an H100")."""

    micro_batch_size: int = Field(64, ge=1)
    """pack = false: samples per padded forward/backward pass on each rank."""


class MismatchConfig(Section):
    """What corrects for, and watches, the difference between the sampler's distribution and the
    trainer's."""

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

    kl_warn: float = Field(1e-2, ge=0)
    """Log a warning when a step's mismatch_kl (k3 KL(pi_inference || pi_trainer) on the sampled
    tokens) exceeds this; 0: never. On policy it is numerics alone (~1e-6 in float32); staleness
    adds to it (the demo, max_async_level 1: median 1.4e-3, 4 steps of 300 above 1e-2)."""


class FilesConfig(Section):
    """What the trainer leaves in the run directory."""

    weights_shard_mb: int = Field(4096, ge=1)
    """Published weights are split into model-0000i-of-0000n.safetensors files of at most this
    size (MiB) plus an index, as HF does; a smaller model is one model.safetensors."""

    keep_weights: int = Field(3, ge=1)
    """Weight versions kept on disk; older ones are deleted once newer ones are STABLE."""

    keep_rollouts: int = Field(2, ge=1)
    """Consumed batches kept on disk (for inspection); older ones are deleted."""


class TrainerTimeoutsConfig(Section):
    """Every bound the trainer waits under (seconds). Its mirror is orchestrator.timeouts.weights_s:
    the trainer waits batch_s for the orchestrator's next batch, the orchestrator weights_s for
    the trainer's next weights."""

    batch_s: float = Field(3600, gt=0)
    """Longest to wait for the orchestrator's next batch before giving up (a heartbeat is logged meanwhile)."""

    run_s: float = Field(60, gt=0)
    """multi_run: a run whose next batch is missing and whose orchestrator has not signalled life
    (runs/<name>/heartbeats/orchestrator) for this long leaves; its adapter and optimizer are checkpointed so
    it can rejoin."""


class VisionConfig(Section):
    """A vision-language policy (docs/vlm.md); ignored for a text-only model."""

    train_tower: bool = False
    """Train the vision tower (patch embedding, encoder, its norm) too; false: it stays as loaded
    (no gradient, no optimizer state) while the connector and the language model train."""


class TrainerConfig(Section):
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

    torch_threads: int = Field(0, ge=0)
    """CPU threads for torch in the trainer; 0 keeps torch's default. On a small machine shared
    with the inference engine, 1 avoids the two fighting over cores."""

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

    optim: OptimConfig = OptimConfig()
    """Optimizer."""

    loss: LossConfig = LossConfig()
    """Policy-gradient loss."""

    lora: LoRAConfig = LoRAConfig()
    """LoRA adapters instead of full fine-tuning (rank > 0), and multi-run training."""

    parallel: ParallelConfig = ParallelConfig()
    """Data, context and expert parallel sizes (their product: the trainer's world size)."""

    vision: VisionConfig = VisionConfig()
    """A vision-language model's vision tower: frozen or trained."""

    model: ModelConfig = ModelConfig()
    """How the model is built and computed: dtype, attention, compile, memory savers."""

    batching: BatchingConfig = BatchingConfig()
    """Packing and micro-batch sizes."""

    mismatch: MismatchConfig = MismatchConfig()
    """Corrections for, and the watch on, sampler/trainer mismatch."""

    files: FilesConfig = FilesConfig()
    """What the trainer keeps on disk."""

    timeouts: TrainerTimeoutsConfig = TrainerTimeoutsConfig()
    """Every bound the trainer waits under."""
