"""Process group and FSDP2 sharding: the only place that knows about ranks and sharding.

One process (`rl trainer`) gets a world of one; under torchrun the usual environment variables
give the rank and world. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from trainer.expert_parallel import sharded_params


def init_distributed(timeout_s: float) -> torch.device:
    """`timeout_s` bounds every collective. Over ZMQ the other ranks sit in a broadcast while
    rank 0 waits for the next batch, so it must exceed the batch wait (the default, 10 to 30
    min, would kill a run whose orchestrator is merely slow)."""
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    if dist.is_initialized():  # a second Trainer in one process (benchmarks)
        return device
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None,
                                timeout=datetime.timedelta(seconds=timeout_s))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def apply_fsdp(model: torch.nn.Module, compute_dtype: torch.dtype, offload: bool = False) -> None:
    """Shard each decoder layer, then the root (embeddings, final norm, lm_head: tied weights
    must land in the same FSDP group, which the root is). `offload`: the shards live in host
    memory and each group is copied to the device for its forward (FSDP2's CPUOffloadPolicy;
    on a CPU-only machine the copy is to where they already are)."""
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # Pinned host memory makes the copies asynchronous; it needs an accelerator.
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    ignored = sharded_params(model)  # expert shards stay where expert parallelism put them
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=policy, ignored_params=ignored)
    fully_shard(model, mp_policy=mp, offload_policy=policy, ignored_params=ignored)


def share_bytes(data: bytes | None, device: torch.device) -> bytes:
    """Rank 0's `data` on every rank (the others pass None): a length, then a uint8 tensor, so
    every rank holds exactly what rank 0 checked and none unpickles what another wrote."""
    if dist.get_world_size() == 1:
        return data
    root = dist.get_rank() == 0
    size = torch.tensor([len(data) if root else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    blob = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if root
            else torch.empty(int(size), dtype=torch.uint8, device=device))
    dist.broadcast(blob, src=0)
    return blob.cpu().numpy().tobytes()


def share_json(obj, device: torch.device):
    """Rank 0's JSON-able `obj` on every rank (the others pass None)."""
    import json

    return json.loads(share_bytes(json.dumps(obj).encode() if dist.get_rank() == 0 else None, device))
