"""Publishing weights/step_n: the full state dict gathered from the FSDP2 shards and written as
an HF-format directory (safetensors + the starting model's config and tokenizer), STABLE last.

A server freshly started on weights/step_n serves exactly what /update_weights loaded from it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rl.rundir import RunDir, mark_stable, remove_quietly

# Small files that make a weights directory a loadable HF model on its own.
_COPIED = ("*.json", "*.txt", "*.model", "*.jinja")


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank must call it; only rank 0 gets the tensors (on CPU)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def write_weights(
    run: RunDir, step: int, state_dict: dict[str, torch.Tensor], source: Path, tied: bool
) -> float:
    """Write weights/step_<step> (rank 0 only); returns seconds taken."""
    start = time.perf_counter()
    out = run.weights_dir(step)
    remove_quietly(out)  # a partial directory from a crash has no STABLE; start it over
    out.mkdir(parents=True)
    if tied:
        # safetensors refuses shared storage, and HF checkpoints of tied models omit lm_head.
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state_dict.items()}, out / "model.safetensors",
              metadata={"format": "pt", "asyncrl_version": str(step)})
    for pattern in _COPIED:
        for f in source.glob(pattern):
            if f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
    mark_stable(out)
    return time.perf_counter() - start


def prune_weights(run: RunDir, keep: int) -> None:
    """Delete all but the newest `keep` STABLE versions (the orchestrator loads only the newest)."""
    stable = [n for n in run.weight_steps() if (run.weights_dir(n) / "STABLE").exists()]
    for n in stable[:-keep]:
        remove_quietly(run.weights_dir(n))

