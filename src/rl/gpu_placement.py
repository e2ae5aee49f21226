"""GPU placement: which GPUs the server and the trainer of one machine get (`inference.gpus`,
`trainer.gpus`, `inference.tensor_parallel`), and what cannot work on them.

Why here: without it every program of `rl run` landed on GPU 0 (CUDA's default), the trainer was
one process whatever the machine had, and on one shared GPU the trainer's model arrived while vLLM
profiled its memory (vLLM counts every drop of free memory in that window as its own use: a
smaller KV cache, or no room for it at all).

`rl run` resolves a plan once (plan()), shows it with --dry-run, passes the chosen keys on to its
children as overrides (so each resolves the same config) with CUDA_VISIBLE_DEVICES set, starts
the trainer under torchrun when it has several GPUs, and on a shared GPU only once the server
serves (rl/cli/launcher.py). A program started by hand applies its own key (apply()).

Defaults for N visible GPUs: 1, the server and the trainer share it (the server's memory share
chosen to leave the trainer room: shared_memory_share); 2, one each; N, the server the first
ceil(N/2) (as data-parallel ranks), the trainer the rest. Indices are into the GPUs this process
sees: CUDA_VISIBLE_DEVICES's entries when it is set, else the NVIDIA driver's devices.
"""

from __future__ import annotations

import os
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rl.config import ConfigError, RunConfig
from rl.preflight import safetensors_header

PLACED_ENV = "ASYNCRL_GPUS_PLACED"  # set by `rl run` for its children: their GPUs are already chosen
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")
# Flags that give a vLLM server more than one GPU: with `gpus` keys they would contradict them.
PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp")
# Trainer bytes per parameter for full fine-tuning: float32 weights, gradients and AdamW's two
# moments (activations come on top: TRAINER_HEADROOM).
FULL_BYTES_PER_PARAM = 16
# LoRA: the frozen base in float32 (the trainer loads float32), adapters and their state negligible.
LORA_BYTES_PER_PARAM = 4
TRAINER_HEADROOM = 1.25  # activations, the logits chunk, CUDA's own context and allocator slack
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
         params: int | None = None) -> GpuPlan | None:
    """The placement of `rl run` on these GPUs, or None without GPUs. `total_gib` (one GPU's
    memory) and `params` (the model's parameter count) size a shared GPU's memory share; either
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
                           shared_memory_share(cfg, total_gib, params))
    return gpu_plan


def trainer_gib(cfg: RunConfig, params: int) -> float:
    """What the trainer needs on its GPU, by the model's size: its weights and optimizer state
    with headroom for activations (a floor: long sequences need more)."""
    per_param = LORA_BYTES_PER_PARAM if cfg.trainer.lora.rank else FULL_BYTES_PER_PARAM
    return params * per_param * TRAINER_HEADROOM / 2**30


def shared_memory_share(cfg: RunConfig, total_gib: float | None, params: int | None) -> float | None:
    """The server's share of a GPU it shares with the trainer (vLLM's gpu_memory_utilization):
    what the trainer leaves, at most MOST_SHARE. A share the config gives is kept if it leaves the
    trainer room, and refused otherwise; None when the memory or the model's size is unknown."""
    given = cfg.inference.gpu_memory_utilization
    if total_gib is None or params is None:
        return None
    need = trainer_gib(cfg, params)
    room = min(MOST_SHARE, 1 - need / total_gib)
    if given is not None:
        if given > room:
            raise PlacementError(
                f"inference.gpu_memory_utilization = {given:g} leaves the trainer {(1 - given) * total_gib:.1f} GiB of "
                f"the shared GPU's {total_gib:.0f} GiB, and it needs ~{need:.1f} GiB ({params / 1e9:.2f}B parameters): "
                f"set it to {max(room, 0):.2f} or less, or give the trainer a GPU of its own (trainer.gpus)")
        return None
    if room < 0.1:
        raise PlacementError(
            f"trainer.gpus: the trainer needs ~{need:.1f} GiB ({params / 1e9:.2f}B parameters) of the shared GPU's "
            f"{total_gib:.0f} GiB, leaving the server too little: give the trainer and the server GPUs of their own "
            "(inference.gpus, trainer.gpus), or use LoRA (trainer.lora.rank)")
    return float(int(room * 100)) / 100  # rounded down: a share that fits stays one


def refusals(cfg: RunConfig, gpu_plan: GpuPlan) -> None:
    """Combinations that cannot work on this placement, each one line naming the key."""
    if cfg.weight_delivery == "broadcast" and gpu_plan.shared:
        raise PlacementError(
            f'weight_sync.kind = "broadcast" with the trainer and the server on GPU(s) {list(gpu_plan.shared)}: '
            'NCCL cannot join two ranks on one device; use weight_sync.kind = "filesystem", or give them GPUs of '
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
            'would take the same broadcast ranks; use weight_sync.kind = "filesystem", or one replica per server '
            "(inference.tensor_parallel = the number of inference.gpus)")


def broadcast_into_data_parallel(cfg: RunConfig) -> None:
    """The server's start-up check of broadcast_refusal, from its own config."""
    broadcast_refusal(cfg, data_parallel_ranks(cfg))


def model_params(model: Path) -> int | None:
    """The model's parameter count from its safetensors headers (no tensor is read), or None."""
    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for path in files:
            for name, entry in safetensors_header(path).items():
                if name != "__metadata__":
                    count = 1
                    for dim in entry["shape"]:
                        count *= dim
                    total += count
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return total


def gpu_memory_gib() -> float | None:
    """The first visible GPU's memory, from nvidia-smi (no torch import), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return float(out.split()[0]) / 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def check(cfg: RunConfig) -> GpuPlan | None:
    """`rl run`'s start-up check: the plan for this machine's GPUs, and its refusals."""
    visible = visible_gpus()
    if not visible and not (cfg.inference.gpus or cfg.trainer.gpus):
        return None
    gpu_plan = plan(cfg, visible, gpu_memory_gib(), model_params(cfg.model))
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
