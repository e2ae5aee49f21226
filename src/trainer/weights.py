"""Publishing weights/step_n: the full state dict gathered from the FSDP2 shards and written as
an HF-format directory (safetensors + the starting model's config and tokenizer), or with LoRA a
peft adapter (adapter_model.safetensors + adapter_config.json); STABLE last.

A server freshly started on weights/step_n serves exactly what /update_weights loaded from it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rl.weights import delta as wd
from rl.weights.broadcast import plan_buckets
from rl.config import RunConfig
from rl.faults import crash_point
from rl.rundir import STABLE, RunDir, publish_dir, remove_quietly

# Small files that make a weights directory a loadable HF model on its own.
_COPIED = ("*.json", "*.txt", "*.model", "*.jinja")


def served_dtype(cfg: RunConfig) -> torch.dtype | None:
    """The dtype the servers hold the weights in, when the config says it (inference.dtype). None
    under "auto": vLLM then picks by model and device (a bf16 model on a GPU without bf16 is served
    in fp16, an fp16 model whose type bans fp16 in bf16), so the trainer's dtype is published."""
    # inference.dtype's names are torch's own.
    return None if cfg.inference.dtype == "auto" else getattr(torch, cfg.inference.dtype)


def gather_full_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Collective: every rank must call it; only rank 0 gets the tensors (on CPU). With `dtype`,
    floating tensors come cast to it: the trainer keeps float32 master weights, and a server
    holding bfloat16 would round them on load exactly as this cast does (round to nearest even),
    so publishing them cast halves the bytes written, read and broadcast per version (a 0.5B model:
    1.98 -> 0.99 GB) for the same served weights. (A model whose server keeps some parameters in
    float32, such as an MoE router's bias, would need those left alone: none of the dense models
    served today.)"""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if dtype is not None:
        for name, tensor in state.items():  # one tensor at a time: its float32 copy goes as its cast comes
            if tensor.is_floating_point():
                state[name] = tensor.to(dtype)
    return state


def untied(state_dict: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """The tensors a version holds: safetensors refuses shared storage, and HF checkpoints of tied
    models omit lm_head (vLLM ties it to the embedding itself)."""
    return {k: v for k, v in state_dict.items() if k != "lm_head.weight"} if tied else state_dict


def write_weights(run: RunDir, step: int, state_dict: dict[str, torch.Tensor], source: Path, tied: bool,
                  shard_bytes: int = 4 << 30, digest: wd.Digest | None = None) -> float:
    """Write weights/step_<step> (rank 0 only), with `digest` (a base deltas may be taken
    against, rl/weights/delta.py) beside it; returns seconds taken."""
    start = time.perf_counter()
    out = _staging(run, step)
    state_dict = untied(state_dict, tied)
    if digest is not None:
        (out / wd.DIGEST).write_bytes(digest.to_json())
    metadata = {"format": "pt", "asyncrl_version": str(step)}
    # The same in-order size grouping as broadcast buckets (a bigger tensor gets its own file).
    shards = plan_buckets(((k, t.numel() * t.element_size()) for k, t in state_dict.items()), shard_bytes)
    if len(shards) == 1:
        save_file({k: v.contiguous() for k, v in state_dict.items()}, out / "model.safetensors", metadata=metadata)
    else:
        weight_map = {}
        for i, names in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: state_dict[k].contiguous() for k in names}, out / fname, metadata=metadata)
            weight_map.update(dict.fromkeys(names, fname))
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for pattern in _COPIED:
        for f in source.glob(pattern):
            if f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
    _publish(out, run.weights_dir(step), step)
    return time.perf_counter() - start


def write_delta(run: RunDir, step: int, manifest: wd.Manifest, changes: dict[str, torch.Tensor]) -> float:
    """weights/step_<step> as a delta (rank 0): delta.safetensors then delta.json, published like a
    full version (written aside, STABLE, one rename); returns seconds taken."""
    start = time.perf_counter()
    out = _staging(run, step)
    save_file({k: v.contiguous() for k, v in changes.items()}, out / wd.TENSORS,
              metadata={"format": "pt", "asyncrl_version": str(step)})
    (out / wd.MANIFEST).write_bytes(manifest.to_json())
    _publish(out, run.weights_dir(step), step)
    return time.perf_counter() - start


def write_adapter(run: RunDir, step: int, tensors: dict[str, torch.Tensor], config: dict) -> float:
    """weights/step_<step> as a peft adapter (rank 0); returns seconds taken."""
    start = time.perf_counter()
    out = _staging(run, step)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "adapter_model.safetensors",
              metadata={"format": "pt", "asyncrl_version": str(step)})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    _publish(out, run.weights_dir(step), step)
    return time.perf_counter() - start


def _staging(run: RunDir, step: int) -> Path:
    """An empty directory next to weights/step_<step> to write the version into. Written aside
    and renamed into place: a resumed trainer rewrites versions its killed predecessor had
    published, and a server must never read a half-rewritten one."""
    final = run.weights_dir(step)
    out = final.with_name(f".{final.name}.tmp")
    remove_quietly(out)  # a partial one from a crash
    out.mkdir(parents=True)
    return out


def _publish(out: Path, final: Path, step: int) -> None:
    crash_point("weights.staged", step)
    # Nobody reads the temporary directory: publish_dir fsyncs every file, STABLE included,
    # once, before the rename that makes the version visible.
    (out / STABLE).write_bytes(b"")
    publish_dir(out, final)


def prune_weights(run: RunDir, keep: int) -> None:
    """Delete all but the newest `keep` STABLE versions (the orchestrator loads only the newest),
    and the full versions those deltas are taken against: a server that joins late or restarts
    rebuilds a delta from its base's files."""
    stable = [n for n in run.weight_steps() if (run.weights_dir(n) / STABLE).exists()]
    kept = set(stable[-keep:])
    for n in stable[-keep:]:
        manifest = run.weights_dir(n) / wd.MANIFEST
        if manifest.is_file():
            kept.add(wd.Manifest.from_json(manifest.read_bytes()).base_version)
    for n in stable:
        if n not in kept:
            remove_quietly(run.weights_dir(n))

