"""The trainer's start-up checks (rl/preflight.py runs them, with the shared ones, for `rl
trainer` and `rl run`): the weights hold every LoRA target, the attention kernel exists, rank 0
can bind its endpoints, and the run directory's state suits a fresh start or --resume."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from rl.config import ConfigError, RunConfig
from rl.gpu_placement import ids_check
from rl.config.parallel_layout import cpu_world, mesh_sizes
from rl.preflight import (bindable, cores, is_rank0, metrics_endpoint, mixture_of_experts, model_config, output_dir,
                          routed_experts, safetensors_header, seq_len_fits, weight_files)
from rl.rundir import RunDir
from rl.transport.registry import receiver_endpoint


def trainer_state_refusal(run: RunDir, resume: bool) -> str | None:
    """Why a trainer must not start on `run`, or None: fresh, it refuses weights from an earlier
    run; resuming, it needs a checkpoint, or, before the first one, every batch since step 1
    (the state at step 0 is the base model and a fresh optimizer, which the config determines:
    replaying the batches from there gives the same weights). Also asked by the trainer itself
    for each run a multi-run trainer admits."""
    if not run.weight_steps():
        return None
    if not resume:
        return (f"output_dir {run.root} already holds weights from an earlier run: pass --resume to "
                "continue it, or choose another output_dir")
    if not run.checkpoint_steps("trainer") and 1 not in run.rollout_steps():
        return (f"--resume: no complete trainer checkpoint under {run.checkpoints} and batch 1 "
                f"({run.rollout_dir(1)}) is gone, so the run cannot be replayed from its start "
                "(with checkpoints.every = 0 batches are not kept for that): choose another output_dir")
    return None


def trainer_run_state(cfg: RunConfig) -> None:
    if cfg.trainer.lora.multi_run or not is_rank0():
        return  # multi-run: each run's state is judged when it joins
    if refusal := trainer_state_refusal(RunDir(cfg.run_dir), cfg.resume):
        raise ConfigError(refusal)


def model_for_training(cfg: RunConfig) -> None:
    """Trainer: config and weights; with LoRA, every target module exists in the weights."""
    data = model_config(cfg)
    files = weight_files(cfg)
    seq_len_fits(cfg, data)
    if cfg.trainer.lora.rank:
        _lora_targets(cfg, files)


def _tensor_names(files: list[Path]) -> set[str]:
    """Names in safetensors headers (8-byte length, then JSON): no tensor is read."""
    names: set[str] = set()
    for path in files:
        if path.suffix != ".safetensors":
            return set()  # .bin files are pickles: never opened here
        names |= set(safetensors_header(path)) - {"__metadata__"}
    return names


def _lora_targets(cfg: RunConfig, files: list[Path]) -> None:
    try:
        parts = {part for name in _tensor_names(files) for part in name.split(".")}
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(f"model = {cfg.model}: unreadable safetensors header ({e})") from None
    missing = [t for t in cfg.trainer.lora.target_modules if parts and t not in parts]
    if missing:
        raise ConfigError(f"trainer.lora.target_modules: {missing} name no layer of {cfg.model}; "
                          "use names from its weights (e.g. q_proj, v_proj)")


def trainer_attention(cfg: RunConfig) -> None:
    import importlib.util

    if cfg.trainer.model.attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError('trainer.model.attention = "flash_attention_2": the flash-attn package is not installed; '
                          'install it (CUDA only) or use "auto"')


def trainer_endpoints(cfg: RunConfig) -> None:
    """Rank 0 binds the batch transport (zmq) and hosts the broadcast rendezvous."""
    if not is_rank0():
        return
    if bound := receiver_endpoint(cfg.transport):
        key, endpoint = bound
        scheme, _, rest = endpoint.partition("://")
        if scheme == "ipc":
            if not Path(rest).parent.is_dir():
                raise ConfigError(f"{key} = {endpoint}: directory {Path(rest).parent} does not exist")
        else:
            host, _, port = rest.rpartition(":")
            bindable(key, "" if host == "*" else host.strip("[]"), int(port))
    if cfg.weight_delivery == "broadcast":
        bindable("weight_sync.address", "", int(cfg.weight_sync.address.rpartition(":")[2]))


def parallel_layout(cfg: RunConfig) -> None:
    """[trainer.parallel] multiplies to the trainer's world: torchrun's WORLD_SIZE, else the GPUs
    it is given (`rl run` starts one rank per GPU; on CPU, the configured product)."""
    p = cfg.trainer.parallel
    world = int(os.environ.get("WORLD_SIZE", 0)) or len(cfg.trainer.gpus) or cpu_world(p)
    mesh_sizes(p, world)  # raises ConfigError naming trainer.parallel


def routing_replay(cfg: RunConfig) -> None:
    """trainer.mismatch.routing_replay replays what the engine recorded: that needs the record."""
    if cfg.trainer.mismatch.routing_replay and not cfg.inference.record_routing:
        raise ConfigError("trainer.mismatch.routing_replay: the batches carry routing only with inference.record_routing = "
                          "true (the engine's record is what replay replays)")


def expert_parallel(cfg: RunConfig) -> None:
    """trainer.parallel.expert splits each MoE layer's experts evenly over that many ranks: a
    mixture-of-experts model whose experts per layer it divides. Data and context ranks beside
    the expert groups are trainer.parallel's check (the mesh against the world size)."""
    ep = cfg.trainer.parallel.expert
    if ep == 1:
        return
    experts = routed_experts(model_config(cfg))
    if not experts:
        raise ConfigError(f"trainer.parallel.expert = {ep}: model = {cfg.model} is not a mixture-of-experts model")
    if experts % ep:
        raise ConfigError(f"trainer.parallel.expert = {ep} does not divide the {experts} experts per MoE layer of "
                          f"model = {cfg.model}")


CHECKS = (cores("trainer"), metrics_endpoint("trainer"), ids_check("trainer"), output_dir, model_for_training,
          mixture_of_experts("trainer.mismatch.routing_replay"), routing_replay, expert_parallel, trainer_attention, parallel_layout,
          trainer_run_state, trainer_endpoints)
