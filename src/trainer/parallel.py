"""Process group, device mesh and FSDP2 sharding: the only place that knows about ranks and sharding.

One process (`rl trainer`) gets a world of one; under torchrun the usual environment variables
give the rank and world. gloo on CPU, NCCL on GPU.

The ranks form a mesh ("data", "context", "expert") = [trainer.parallel] (docs/trainer.md,
"Parallelism"). Dense parameters are FSDP2-sharded over every rank; the batch is split over
data x expert (ranks differing only in their expert coordinate see different samples, as in
torchtitan); the ranks of one context group see the same samples, each a contiguous share of
every row's tokens (trainer/context_parallel.py). With expert parallelism a second view of the
same ranks, ("expert_data", "expert") = (data x context, expert), holds the experts: sharded
over "expert" (trainer/expert_parallel.py), each shard FSDP2-sharded over "expert_data", the
ranks that hold the same shard (torchtitan's sparse mesh, its "efsdp" and "ep").
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard

from rl.config import ParallelConfig
from rl.config.parallel_layout import mesh_sizes
from trainer.context_parallel import ContextShare
from trainer.expert_parallel import sharded_params

DIMS = ("data", "context", "expert")
EXPERT_DIMS = ("expert_data", "expert")


@dataclass(frozen=True)
class Layout:
    """This rank's place in the mesh. `batch_rank` of `batch_ranks`: which share of the batch it
    trains on (data x expert coordinates); `context`: its share of every row."""

    rank: int
    world: int
    sizes: tuple[int, int, int]
    mesh: DeviceMesh
    context: ContextShare
    experts: DeviceMesh | None = None  # ("expert_data", "expert") where expert > 1

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
    ep = sizes[2]
    # Ranks r and r + k E hold the same experts: the expert dim is the mesh's innermost.
    experts = (init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=EXPERT_DIMS) if ep > 1 else None)
    return Layout(rank, world, sizes, mesh, ContextShare(group, sizes[1], index), experts)


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
               reduce_dtype: torch.dtype = torch.float32, experts: DeviceMesh | None = None) -> None:
    """Shard each decoder layer, then the root (embeddings, final norm, lm_head: tied weights
    must land in the same FSDP group, which the root is). `offload`: the shards live in host
    memory and each group is copied to the device for its forward (FSDP2's CPUOffloadPolicy;
    on a CPU-only machine the copy is to where they already are). `reduce_dtype`: float64 in the
    tests that compare layouts in float64. `experts`: Layout.experts, where expert parallelism
    sharded the experts (trainer/expert_parallel.py): FSDP2 shards each expert shard over its
    "expert_data" dim (its own parameter group: gathered and reduce-scattered among the ranks
    holding that shard), every other parameter over every rank."""
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    # Pinned host memory makes the copies asynchronous; it needs an accelerator.
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    kwargs = dict(mp_policy=mp, offload_policy=policy)
    if expert_params := sharded_params(model):
        if experts is None:
            raise ValueError("apply_fsdp: the model's experts are sharded: pass the expert mesh (Layout.experts)")
        # One FSDPMeshInfo object for every expert parameter: FSDP2 groups parameters by it.
        info = FSDPMeshInfo(experts["expert_data"], shard_mesh_dim=0)
        kwargs["shard_placement_fn"] = lambda p: ShardPlacementResult(Shard(0), info) if p in expert_params else None
    for unit in shard_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for parameters on more than one mesh (expert parallelism: the
    experts on ("expert_data", "expert"), the rest on every rank): DTensor reductions do not mix
    meshes, so each mesh's norm is reduced alone and the total is the norm of those (as
    torchtitan's clip with EP). One mesh: torch's own, unchanged."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if len(by_mesh) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded one by one below the root: a text model's decoder layers; a
    vision-language model's decoder layers, its vision encoder's layers and then the whole
    vision tower (its embeddings and norm), so that the vision forward gathers only the tower's
    parameters, and a frozen tower's units hold no trainable ones (trainer/vision.py)."""
    from trainer.vision import is_vision_language, towers

    if not is_vision_language(model.config):
        return list(model.model.layers)
    tower, vision_layers, text_layers = towers(model)
    return text_layers + vision_layers + [tower]


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
