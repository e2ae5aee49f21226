"""GPU placement: which GPUs the server and the trainer of one machine get (`inference.gpus`,
`trainer.gpus`, `inference.tensor_parallel`), and what cannot work on them.

Why here: without it every program of `rl run` landed on GPU 0 (CUDA's default), the trainer was
one process whatever the machine had, and on one shared GPU the trainer's model arrived while vLLM
profiled its memory (vLLM counts every drop of free memory in that window as its own use: a
smaller KV cache, or no room for it at all).

`rl run` resolves a plan once (plan()), shows it with --dry-run, passes the chosen keys on to its
children as overrides (so each resolves the same config) with CUDA_VISIBLE_DEVICES set, starts
the trainer under torchrun when it has several GPUs, and on a shared GPU only once the server
serves (asyncrl/launcher.py). A program started by hand applies its own key (apply()).

Defaults for N visible GPUs: 1, the server and the trainer share it (the server's memory share
chosen to leave the trainer room: shared_memory_share); 2, one each; N, the server the first
ceil(N/2) (as data-parallel ranks), the trainer the rest. Indices are into the GPUs this process
sees: CUDA_VISIBLE_DEVICES's entries when it is set, else the NVIDIA driver's devices.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rl.config import ConfigError, RunConfig
from rl.preflight import safetensors_header

PLACED_ENV = "ASYNCRL_GPUS_PLACED"  # set by `rl run` for its children: their GPUs are already chosen
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")
# Flags that give a vLLM server more than one GPU: with `gpus` keys they would contradict them.
PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp")
# What the trainer holds per parameter (divided among its ranks by FSDP2): full fine-tuning keeps
# float32 weights, gradients and AdamW's two moments (16 bytes), and at the step AdamW's foreach
# implementation holds one more float32 per parameter (its intermediate lists: 4 bytes). LoRA
# keeps the frozen base in float32 (the trainer loads float32; adapters and their state negligible).
FULL_BYTES_PER_PARAM = 16
ADAMW_FOREACH_BYTES_PER_PARAM = 4
LORA_BYTES_PER_PARAM = 4
# Activations a decoder layer keeps per token for its backward, in values of the compute dtype:
# the two norms' inputs and outputs (4 x hidden), the query and the attention's output (2 x
# hidden), keys and values (2 x kv width), the MLP's gate, up, activation and product
# (4 x intermediate). With activation checkpointing a layer keeps its input (1 x hidden) and one
# layer at a time holds the full set again.
ACTIVATION_HIDDEN, ACTIVATION_KV, ACTIVATION_INTERMEDIATE = 6, 2, 4
# The logits of one chunk of the logprob head (logits_chunk_tokens; every token without it): the
# float32 logits, the log-softmax, its exp and their gradients, ~5 copies (docs/trainer.md).
LOGIT_COPIES, LOGIT_BYTES = 5, 4
GATHERED_LAYERS = 2  # FSDP2 holds a layer unsharded while it prefetches the next
CUDA_CONTEXT_GIB = 0.75  # one process's CUDA context with cuBLAS's workspace (each of the two)
ALLOCATOR_SLACK = 1.10  # the caching allocator's fragmentation, over what the trainer holds
MOST_SHARE = 0.9  # vLLM's own default share; a shared GPU's engine never gets more


class PlacementError(ConfigError):
    pass


@dataclass(frozen=True)
class GpuPlan:
    visible: tuple[str, ...]
    """The GPU ids this process sees (CUDA_VISIBLE_DEVICES entries, or driver indices)."""
    inference: tuple[int, ...]
    trainer: tuple[int, ...]
    tensor_parallel: int
    memory_share: float | None = None
    """inference.gpu_memory_utilization to pass on (chosen for a shared GPU), else None."""

    @property
    def shared(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.inference) & set(self.trainer)))

    @property
    def data_parallel(self) -> int:
        return len(self.inference) // self.tensor_parallel

    def env(self, program: str) -> dict[str, str]:
        """The environment a child program starts with ("inference" or "trainer")."""
        ids = self.inference if program == "inference" else self.trainer
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.visible[i] for i in ids), PLACED_ENV: "1"}

    def overrides(self) -> list[str]:
        """Config overrides for every child: the same placement, resolved once."""
        args = ["--inference.gpus", _toml_list(self.inference), "--trainer.gpus", _toml_list(self.trainer)]
        if self.memory_share is not None:
            args += ["--inference.gpu_memory_utilization", f"{self.memory_share:.2f}"]
        return args

    def describe(self) -> str:
        server = f"server on GPU(s) {list(self.inference)}"
        if self.data_parallel > 1 or self.tensor_parallel > 1:
            server += f" ({self.data_parallel} data-parallel x {self.tensor_parallel} tensor-parallel)"
        ranks = len(self.trainer)
        trainer = f"trainer on GPU(s) {list(self.trainer)} ({ranks} rank{'s' if ranks > 1 else ''}"
        trainer += ", torchrun)" if ranks > 1 else ")"
        line = f"GPU placement of {len(self.visible)} visible: {server}, {trainer}"
        if self.shared:
            share = "" if self.memory_share is None else f", the server takes {self.memory_share:.2f} of its memory"
            line += f"; GPU(s) {list(self.shared)} shared: the trainer starts once the server serves{share}"
        return line


def parallel_flags(extra_args: list[str]) -> list[str]:
    """The flags among `vllm serve` arguments that give the server more than one GPU."""
    return [flag for arg in extra_args if (flag := arg.partition("=")[0]) in PARALLEL_FLAGS]


def _toml_list(ids: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, ids)) + "]"


def visible_gpus(environ: dict | None = None, driver: Path = DRIVER_GPUS) -> tuple[str, ...]:
    """The GPUs CUDA would give this process, without importing torch: CUDA_VISIBLE_DEVICES's
    entries when it is set (empty or "-1": none), else one per device the NVIDIA driver lists."""
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [part.strip() for part in listed.split(",") if part.strip()]
        return tuple(ids[:ids.index("-1")] if "-1" in ids else ids)
    try:
        return tuple(str(i) for i in range(len(list(driver.iterdir()))))
    except OSError:
        return ()


def _check_ids(key: str, ids: list[int], n: int) -> None:
    if ids and n == 0:
        raise PlacementError(f"{key} = {ids}: no GPU is visible (CUDA_VISIBLE_DEVICES, or no NVIDIA driver); "
                             "leave it empty on a CPU machine")
    bad = [i for i in ids if i >= n]
    if bad:
        raise PlacementError(f"{key} = {ids}: GPU index(es) {bad} not among the {n} visible "
                             f"(indices 0..{n - 1}; CUDA_VISIBLE_DEVICES narrows what is visible)")
    if len(set(ids)) != len(ids):
        raise PlacementError(f"{key} = {ids}: a GPU is listed twice")


def split(n: int, inference: list[int], trainer: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The two GPU lists for n visible GPUs, from what the config gave (empty: choose)."""
    if not inference and not trainer:
        if n == 1:
            return (0,), (0,)
        first = (n + 1) // 2
        return tuple(range(first)), tuple(range(first, n))
    if inference and trainer:
        return tuple(inference), tuple(trainer)
    given, key, other = (inference, "inference.gpus", "trainer.gpus") if inference else (trainer, "trainer.gpus",
                                                                                       "inference.gpus")
    rest = tuple(i for i in range(n) if i not in given)
    if not rest:
        if n > 1:
            raise PlacementError(f"{key} = {given} takes every visible GPU and {other} is empty: list {other} "
                                 "(the same GPU in both shares it)")
        rest = tuple(given)
    return (tuple(given), rest) if inference else (rest, tuple(given))


def plan(cfg: RunConfig, visible: tuple[str, ...], total_gib: float | None = None,
         shape: ModelShape | None = None) -> GpuPlan | None:
    """The placement of `rl run` on these GPUs, or None without GPUs. `total_gib` (the shared GPU's
    memory) and `shape` (the model's, model_shape) size a shared GPU's memory share; either
    unknown: the config's own share is used as it is."""
    inf, tr = cfg.inference, cfg.trainer
    n = len(visible)
    _check_ids("inference.gpus", inf.gpus, n)
    _check_ids("trainer.gpus", tr.gpus, n)
    if n == 0:
        return None
    inference, trainer = split(n, inf.gpus, tr.gpus)
    if len(inference) % inf.tensor_parallel:
        raise PlacementError(f"inference.tensor_parallel = {inf.tensor_parallel} does not divide the server's "
                             f"{len(inference)} GPU(s) {list(inference)}: give inference.gpus a multiple of it")
    flags = parallel_flags(inf.extra_args)
    if flags:
        raise PlacementError(f"inference.extra_args sets {flags[0]}, which `rl run` chooses from inference.gpus "
                             "and inference.tensor_parallel on a GPU machine: set those keys instead")
    gpu_plan = GpuPlan(visible, inference, trainer, inf.tensor_parallel)
    if gpu_plan.shared:
        gpu_plan = GpuPlan(visible, inference, trainer, inf.tensor_parallel,
                           shared_memory_share(cfg, total_gib, shape, len(trainer)))
    return gpu_plan


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of the model: its parameters, its decoder's widths (config.json)
    and its largest tensor (the safetensors headers), which vLLM's layerwise reload copies once
    more, outside its own memory budget, while it loads that layer."""
    params: int
    layers: int
    hidden: int
    kv_width: int
    intermediate: int
    vocab: int
    largest_tensor_bytes: int


def compute_bytes(cfg: RunConfig) -> int:
    """Bytes of a value in the trainer's compute dtype (auto: bfloat16 on a GPU)."""
    return 4 if cfg.trainer.model.dtype == "float32" else 2


def micro_batch_tokens(cfg: RunConfig) -> int:
    """Tokens one rank's forward holds: a context-parallel row is split across its ranks."""
    t, context = cfg.trainer.batching, cfg.trainer.parallel.context
    whole = max(t.micro_batch_tokens * context, cfg.seq_len) if t.pack else t.micro_batch_size * cfg.seq_len
    return -(-whole // context)


def trainer_need(cfg: RunConfig, shape: ModelShape, ranks: int = 1) -> dict[str, float]:
    """What one trainer rank holds on its GPU at its peak, by part, in GiB, from its config: the
    sharded weights and optimizer state (and AdamW's temporaries at the step), the KL reference
    model, the layers FSDP2 holds gathered, one micro-batch's activations, the logits of one chunk,
    and the allocator's slack over all of it."""
    t, p, act = cfg.trainer, shape.params, compute_bytes(cfg)
    full = not t.lora.rank
    parts = {"weights and optimizer": p * (FULL_BYTES_PER_PARAM if full else LORA_BYTES_PER_PARAM) / ranks,
             "optimizer step": p * ADAMW_FOREACH_BYTES_PER_PARAM / ranks if full else 0.0}
    loss = t.loss
    if loss.kl_coef > 0 and loss.kl_target == "reference" and full:  # LoRA's reference is its base
        parts["reference model"] = p * act / (shape.layers if t.model.reference_offload else ranks)
    layer = p / max(shape.layers, 1)
    parts["gathered layers"] = GATHERED_LAYERS * layer * (act + (4 if full else 0))
    per_layer = act * (ACTIVATION_HIDDEN * shape.hidden + ACTIVATION_KV * shape.kv_width
                       + ACTIVATION_INTERMEDIATE * shape.intermediate)
    tokens = micro_batch_tokens(cfg)
    kept = act * shape.hidden * shape.layers + per_layer if t.model.activation_checkpointing else per_layer * shape.layers
    parts["activations"] = tokens * kept
    chunk = min(t.model.logits_chunk_tokens or tokens, tokens)
    parts["logits"] = LOGIT_COPIES * LOGIT_BYTES * chunk * shape.vocab
    gib = {k: v / 2**30 for k, v in parts.items()}
    gib["allocator slack"] = sum(gib.values()) * (ALLOCATOR_SLACK - 1)
    return gib


def outside_the_server(cfg: RunConfig, shape: ModelShape, ranks: int = 1) -> dict[str, float]:
    """What a shared GPU must hold beside the server's share, in GiB: the trainer's need, the two
    processes' CUDA contexts, and the reload's copy of the largest tensor."""
    return {**trainer_need(cfg, shape, ranks), "CUDA contexts": 2 * CUDA_CONTEXT_GIB,
            "reload's largest tensor": shape.largest_tensor_bytes / 2**30}


def describe_need(need: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in need.items() if v >= 0.05)


def shared_memory_share(cfg: RunConfig, total_gib: float | None, shape: ModelShape | None,
                        ranks: int = 1) -> float | None:
    """The server's share of a GPU it shares with the trainer (vLLM's gpu_memory_utilization):
    what outside_the_server leaves, at most MOST_SHARE. A share the config gives is kept if it
    leaves that room, and refused otherwise; None when the memory or the model is unknown."""
    given = cfg.inference.gpu_memory_utilization
    if total_gib is None or shape is None:
        return None
    parts = outside_the_server(cfg, shape, ranks)
    need = sum(parts.values())
    room = min(MOST_SHARE, 1 - need / total_gib)
    what = f"~{need:.1f} GiB ({shape.params / 1e9:.2f}B parameters; GiB: {describe_need(parts)})"
    if given is not None:
        if given > room:
            raise PlacementError(
                f"inference.gpu_memory_utilization = {given:g} leaves {(1 - given) * total_gib:.1f} GiB of the shared "
                f"GPU's {total_gib:.0f} GiB, and beside the server it needs {what}: set it to {max(room, 0):.2f} or "
                "less, or give the trainer a GPU of its own (trainer.gpus)")
        return None
    if room < 0.1:
        raise PlacementError(
            f"trainer.gpus: beside the server the shared GPU's {total_gib:.0f} GiB must hold {what}, leaving the "
            "server too little: give the trainer and the server GPUs of their own (inference.gpus, trainer.gpus), "
            "or use LoRA (trainer.lora.rank), activation checkpointing or fewer trainer.batching.micro_batch_tokens")
    return float(int(room * 100)) / 100  # rounded down: a share that fits stays one


def refusals(cfg: RunConfig, gpu_plan: GpuPlan) -> None:
    """Combinations that cannot work on this placement, each one line naming the key."""
    if cfg.weight_delivery == "broadcast" and gpu_plan.shared:
        raise PlacementError(
            f'weight_sync.kind = "broadcast" with the trainer and the server on GPU(s) {list(gpu_plan.shared)}: '
            'NCCL cannot join two ranks on one device; use weight_sync.kind = "files", or give them GPUs of '
            "their own (inference.gpus, trainer.gpus)")
    broadcast_refusal(cfg, gpu_plan.data_parallel)


def data_parallel_ranks(cfg: RunConfig) -> int:
    """The server's data-parallel ranks, from a flag in inference.extra_args, else inference.gpus."""
    args = cfg.inference.extra_args
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in ("--data-parallel-size", "-dp"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "1")
            return int(value) if value.isdigit() else 1
    return max(1, len(cfg.inference.gpus) // cfg.inference.tensor_parallel)


def broadcast_refusal(cfg: RunConfig, data_parallel: int) -> None:
    """A broadcast reaches each worker at rank_offset + its rank within its replica: the replicas
    of a data-parallel server would all take the same ranks."""
    if cfg.weight_delivery == "broadcast" and data_parallel > 1:
        raise PlacementError(
            f'weight_sync.kind = "broadcast" into a server of {data_parallel} data-parallel ranks: their workers '
            'would take the same broadcast ranks; use weight_sync.kind = "files", or one replica per server '
            "(inference.tensor_parallel = the number of inference.gpus)")


def broadcast_into_data_parallel(cfg: RunConfig) -> None:
    """The server's start-up check of broadcast_refusal, from its own config."""
    broadcast_refusal(cfg, data_parallel_ranks(cfg))


def model_params(model: Path) -> int | None:
    """The model's parameter count from its safetensors headers (no tensor is read), or None."""
    found = tensor_sizes(model)
    return None if found is None else sum(n for n, _ in found)


DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I8": 1, "U8": 1, "BOOL": 1}


def tensor_sizes(model: Path) -> list[tuple[int, int]] | None:
    """(elements, bytes) of each tensor in the model's safetensors headers, or None."""
    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        return None
    out = []
    try:
        for path in files:
            for name, entry in safetensors_header(path).items():
                if name != "__metadata__":
                    count = 1
                    for dim in entry["shape"]:
                        count *= dim
                    out.append((count, count * DTYPE_BYTES.get(entry["dtype"], 4)))
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return out


def model_shape(model: Path) -> ModelShape | None:
    """The model's shape from config.json (its text model's, for a multimodal one) and its
    safetensors headers, or None when either cannot be read."""
    sizes = tensor_sizes(model)
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    try:
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or hidden // heads)
        return ModelShape(
            params=sum(n for n, _ in sizes), layers=int(text["num_hidden_layers"]), hidden=hidden,
            kv_width=int(text.get("num_key_value_heads") or heads) * head_dim,
            intermediate=int(text.get("intermediate_size") or 4 * hidden), vocab=int(text["vocab_size"]),
            largest_tensor_bytes=max(b for _, b in sizes))
    except (KeyError, TypeError, ValueError):
        return None


def torch_memory_gib(cuda, index: int) -> float | None:
    """Visible device `index`'s memory as torch sees it (its numbering follows CUDA_VISIBLE_DEVICES),
    or None when torch sees no such device."""
    if not cuda.is_available() or index >= cuda.device_count():
        return None
    return cuda.get_device_properties(index).total_memory / 2**30


PROBE = "import sys, torch; from rl.gpu_placement import torch_memory_gib; print(torch_memory_gib(torch.cuda, {}))"


def gpu_memory_gib(index: int = 0) -> float | None:
    """Visible GPU `index`'s memory, asked of torch in a short child process: torch's view honours
    CUDA_VISIBLE_DEVICES (nvidia-smi lists the machine's GPU 0 whatever it says), and a CUDA context
    in `rl run` itself would hold memory on the shared GPU for the whole run. None when unknown."""
    try:
        out = subprocess.run([sys.executable, "-c", PROBE.format(int(index))], capture_output=True, text=True,
                             timeout=120, check=True).stdout.split()
        return float(out[-1]) if out and out[-1] != "None" else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def check(cfg: RunConfig) -> GpuPlan | None:
    """`rl run`'s start-up check: the plan for this machine's GPUs, and its refusals. The shared
    GPU's memory is asked for only where a GPU is shared."""
    visible = visible_gpus()
    if not visible and not (cfg.inference.gpus or cfg.trainer.gpus):
        return None
    gpu_plan = plan(cfg, visible)
    if gpu_plan is not None and gpu_plan.shared:
        gpu_plan = plan(cfg, visible, gpu_memory_gib(gpu_plan.shared[0]), model_shape(cfg.model))
    if gpu_plan is not None:
        refusals(cfg, gpu_plan)
    return gpu_plan


def ids_check(program: str):
    """The start-up check of a program's own `gpus` key (inference or trainer) against the GPUs
    it sees; under `rl run` its GPUs were already chosen and made visible."""
    def gpu_ids(cfg: RunConfig) -> None:
        ids = getattr(cfg, program).gpus
        if ids and not os.environ.get(PLACED_ENV):
            _check_ids(f"{program}.gpus", ids, len(visible_gpus()))

    return gpu_ids


def apply(cfg: RunConfig, program: str) -> None:
    """A program started by hand with `gpus` set: see only those GPUs. Under `rl run` (PLACED_ENV)
    the launcher already did."""
    ids = cfg.inference.gpus if program == "inference" else cfg.trainer.gpus
    if not ids or os.environ.get(PLACED_ENV):
        return
    visible = visible_gpus()
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] for i in ids)
    os.environ[PLACED_ENV] = "1"
