"""Process group, device mesh and FSDP2 sharding: the only place that knows about ranks and sharding.

One process (`rl trainer`) gets a world of one; under torchrun the usual environment variables
give the rank and world. gloo on CPU, NCCL on GPU.

The ranks form a mesh ("data", "context", "expert") = [trainer.parallel] (docs/trainer.md,
"Parallelism"). Dense parameters are FSDP2-sharded over every rank; the batch is split over
data x expert (ranks differing only in their expert coordinate see different samples, as in
torchtitan); the ranks of one context group see the same samples, each a contiguous share of
every row's tokens (trainer/context_parallel.py).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rl.config import ParallelConfig
from rl.parallel_layout import mesh_sizes
from trainer.context_parallel import ContextShare
from trainer.expert_parallel import sharded_params

DIMS = ("data", "context", "expert")


@dataclass(frozen=True)
class Layout:
    """This rank's place in the mesh. `batch_rank` of `batch_ranks`: which share of the batch it
    trains on (data x expert coordinates); `context`: its share of every row."""

    rank: int
    world: int
    sizes: tuple[int, int, int]
    mesh: DeviceMesh
    context: ContextShare

    @property
    def batch_ranks(self) -> int:
        return self.sizes[0] * self.sizes[2]

    @property
    def batch_rank(self) -> int:
        data, _, expert = self.coordinates
        return data * self.sizes[2] + expert

    @property
    def coordinates(self) -> tuple[int, int, int]:
        _, c, e = self.sizes
        return self.rank // (c * e), self.rank // e % c, self.rank % e

    @property
    def counts_once(self) -> bool:
        """Whether this rank adds its context group's metrics (computed alike on every member)."""
        return self.context.index == 0

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group along `dim` ("expert": trainer/expert_parallel.py's)."""
        return self.mesh[dim].get_group()


def build_layout(parallel: ParallelConfig, device: torch.device) -> Layout:
    """The mesh for the initialised world (every rank calls it: building groups is collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = mesh_sizes(parallel, world)
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=DIMS)
    index = rank // sizes[2] % sizes[1]
    group = mesh["context"].get_group() if sizes[1] > 1 else None
    return Layout(rank, world, sizes, mesh, ContextShare(group, sizes[1], index))


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


def apply_fsdp(model: torch.nn.Module, compute_dtype: torch.dtype, offload: bool = False,
               reduce_dtype: torch.dtype = torch.float32) -> None:
    """Shard each decoder layer, then the root (embeddings, final norm, lm_head: tied weights
    must land in the same FSDP group, which the root is). `offload`: the shards live in host
    memory and each group is copied to the device for its forward (FSDP2's CPUOffloadPolicy;
    on a CPU-only machine the copy is to where they already are). `reduce_dtype`: float64 in the
    tests that compare layouts in float64."""
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
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
