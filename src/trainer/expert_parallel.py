"""Expert parallelism (trainer.parallel.expert): each rank of an expert group holds 1/EP of every
MoE layer's experts, and each token's hidden state travels to the ranks holding its experts and
back, by two all-to-alls over the group per layer (docs/moe.md, "Expert parallelism").

Why: under FSDP2 alone every rank all-gathers every expert of a layer for its forward (and again
for its backward, then reduce-scatters their gradient), so a layer's whole expert set sits in each
rank's memory in turn and crosses the network three times per step, though each token uses top_k
of them. Here a rank computes with 1/EP of the experts only (gathered, when data ranks sit
beside the expert group, from that shard's data replicas alone); what else moves is top_k
hidden states per token.

What stays as without EP:
- The router (transformers' `*TopKRouter`) runs unchanged on each rank's own tokens, and its
  choice, or routing replay's recorded one (trainer/routing_replay.py replaces the router's output
  before the experts see it), is exactly what the dispatch sends: the load-balancing loss, computed
  from the router's logits, is untouched.
- Each expert computes as transformers' experts do (gate_up, act(gate) * up, down; grouped_mm,
  transformers' default implementation), and each token's weighted outputs are summed over its
  slots as there: only the matrix products' blocking (rows batched differently) can round
  differently.
- The expert tensors are DTensors of their full HF shape [experts, ...] sharded on dim 0 over the
  expert group (Shard(0) on the "expert" dim of trainer/parallel.py's expert mesh), so checkpoints
  (DCP), AdamW and the published weights (full_tensor gathers them: the same HF files as without
  EP) treat them like every other parameter.

Beside data or context ranks (docs/moe.md, "Expert parallelism"): the ranks holding the same
expert shard (same expert coordinate, every data and context coordinate) are that shard's data
replicas. FSDP2 shards each expert shard again over them (trainer/parallel.py apply_fsdp: the
"expert_data" dim, as torchtitan's "efsdp"), gathers it for the layer's forward within them only,
and reduce-scatters its gradient over them: the sum over every data replica's tokens.

Gradients: the trainer scales each rank's loss by the world size for FSDP2's average over every
rank. An expert shard's gradient already sums its expert group's tokens (the all-to-all's
backward brings them home), then FSDP2 averages it over the world / EP data replicas: EP times
the sum over every rank. The experts' forward divides their gradient by EP (`_GradScale`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def moe_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every MoE layer's experts module: transformers' `*Experts` (gate_up_proj [experts, 2 x
    intermediate, hidden], down_proj [experts, hidden, intermediate], act_fn), as Qwen2-MoE and
    Qwen3-MoE hold them, beside a router named "gate"."""
    found = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if (isinstance(getattr(module, "gate", None), torch.nn.Module) and experts is not None
                and getattr(getattr(experts, "gate_up_proj", None), "ndim", 0) == 3
                and getattr(getattr(experts, "down_proj", None), "ndim", 0) == 3):
            found.append(experts)
    return found


def placement(expert_ids: torch.Tensor, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each expert lives: (the expert-group rank holding it, its index in that rank's shard).
    Shard g holds experts g x per_rank to (g + 1) x per_rank - 1 (`shard_rows`)."""
    return torch.div(expert_ids, per_rank, rounding_mode="floor"), expert_ids % per_rank


def shard_rows(shard: int, per_rank: int) -> slice:
    """The experts (rows of dim 0 of each expert tensor) shard `shard` holds."""
    return slice(shard * per_rank, (shard + 1) * per_rank)


def apply_expert_parallel(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Keep this rank's 1/EP of every MoE layer's experts (as DTensor shards of the full tensors)
    and route their forward through the expert group. `mesh`: the 1-D expert mesh
    (trainer/parallel.py Layout.experts["expert"]), whose ranks in order hold the shards in order.
    Before FSDP2 (trainer/parallel.py apply_fsdp shards these over the expert mesh's
    "expert_data" dim: `sharded_params`)."""
    ep = mesh.size()
    if ep == 1:
        return
    group, shard = mesh.get_group(), mesh.get_local_rank()
    for experts in moe_experts(model):
        total = experts.gate_up_proj.shape[0]
        if total % ep:
            raise ValueError(f"trainer.parallel.expert = {ep} does not divide the model's {total} experts per layer")
        per_rank = total // ep
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = full.detach()[shard_rows(shard, per_rank)].clone()
            setattr(experts, name, torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
                                                      requires_grad=full.requires_grad))
        experts.expert_parallel = ExpertShard(group, shard, per_rank, total)
        experts.forward = _forward_of(experts)


def sharded_params(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The expert parameters apply_expert_parallel sharded, for FSDP2's ignored_params (empty
    without EP)."""
    return {p for experts in moe_experts(model) if hasattr(experts, "expert_parallel")
            for p in (experts.gate_up_proj, experts.down_proj)}


class ExpertShard:
    """What an experts module's dispatch needs: its group, which shard it holds, how many experts a
    shard holds, and how many the layer has."""

    def __init__(self, group: dist.ProcessGroup, shard: int, per_rank: int, total: int):
        self.group, self.shard, self.per_rank, self.total = group, shard, per_rank, total
        self.size = dist.get_world_size(group)


def _forward_of(experts: torch.nn.Module):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return dispatch(experts, hidden_states, top_k_index, top_k_weights)

    return forward


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: the gradient goes back the way the rows came (the
    reverse exchange, split sizes swapped). gloo (CPU) and NCCL both implement uneven splits."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv_counts: list[int], send_counts: list[int], group) -> torch.Tensor:
        ctx.counts, ctx.group = (recv_counts, send_counts), group
        out = rows.new_empty(sum(recv_counts), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv_counts, send_counts = ctx.counts
        return _AllToAll.apply(grad.contiguous(), send_counts, recv_counts, ctx.group), None, None, None


class _GradScale(torch.autograd.Function):
    """The identity forward; backward scales the gradient (1 / EP: module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _exchange_counts(send: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def dispatch(experts: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output [tokens, hidden] for this rank's tokens: each (token, slot) pair goes to
    the rank holding its expert, is computed there, and comes back to be weighted and summed."""
    ep: ExpertShard = experts.expert_parallel
    tokens, top_k = top_k_index.shape
    chosen = top_k_index.reshape(-1)
    # Sorted by expert: grouped by destination rank, and within it by expert.
    order = torch.argsort(chosen, stable=True)
    destination, local_ids = placement(chosen[order], ep.per_rank)
    send_counts = torch.bincount(destination, minlength=ep.size)
    recv_counts = _exchange_counts(send_counts, ep.group)
    send_counts = send_counts.tolist()
    rows = hidden[torch.div(order, top_k, rounding_mode="floor")]
    received = _AllToAll.apply(rows, recv_counts, send_counts, ep.group)
    received_ids = local_ids.new_empty(sum(recv_counts))
    dist.all_to_all_single(received_ids, local_ids.contiguous(), recv_counts, send_counts, group=ep.group)
    computed = _local_experts(experts, received, received_ids, ep.per_rank)
    back = _AllToAll.apply(computed, send_counts, recv_counts, ep.group)
    # Back in (token, slot) order, each token's slots summed as transformers' grouped_mm path
    # sums them (in the compute dtype's accumulator, not index_add's).
    weighted = (back * top_k_weights.reshape(-1)[order, None])[torch.argsort(order)]
    return weighted.view(tokens, top_k, -1).sum(1).to(hidden.dtype)


_GROUPED = (torch.float32, torch.bfloat16, torch.float16)  # grouped_mm's dtypes; float64 loops per expert


def _local_experts(experts: torch.nn.Module, rows: torch.Tensor, local_ids: torch.Tensor, per_rank: int) -> torch.Tensor:
    """Each row through its local expert (gate_up, act(gate) * up, down: transformers' experts),
    in one grouped matrix product per projection as transformers' default grouped_mm path does.
    The weights in the rows' dtype (FSDP2's mixed-precision policy has cast them so when it
    gathered them; the cast keeps a model FSDP2 does not manage right)."""
    ep: ExpertShard = experts.expert_parallel
    gate_up, down = (_GradScale.apply(p.to_local().to(rows.dtype), 1.0 / ep.size)
                     for p in (experts.gate_up_proj, experts.down_proj))
    if not len(rows):  # nothing came: the weights still join the graph, so every rank's backward runs the same collectives
        return rows + (gate_up.sum() + down.sum()) * 0
    by_expert = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=per_rank)
    x = rows[by_expert]
    if rows.dtype in _GROUPED and hasattr(torch.nn.functional, "grouped_mm"):
        offsets = counts.cumsum(0).to(torch.int32)
        gate, up = torch.nn.functional.grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        y = torch.nn.functional.grouped_mm(experts.act_fn(gate) * up, down.transpose(-2, -1), offs=offsets)
    else:
        parts = []
        for j, part in enumerate(x.split(counts.tolist())):
            gate, up = torch.nn.functional.linear(part, gate_up[j]).chunk(2, dim=-1)
            parts.append(torch.nn.functional.linear(experts.act_fn(gate) * up, down[j]))
        y = torch.cat(parts)
    return y[torch.argsort(by_expert)]
