"""Expert parallelism against FSDP2 alone on a 64-expert MoE (issue 63, item 4): expert parameters
per rank, at rest and while a layer computes, and seconds per training step, at EP=1 (FSDP2
shards every parameter, experts included, and all-gathers a layer's experts for its forward) and
EP>1 (trainer/expert_parallel.py: each rank computes with 1/EP of every layer's experts, tokens
travel; with data ranks beside the expert groups, each expert shard is FSDP2-sharded over its
data replicas and gathered among them only).

    python benchmarks/trainer_parallel_moe.py [--ranks 2] [--experts 1,2] [--layers 2] [--tokens 512]
                                              [--steps 3] [--json FILE]

`--ranks 4 --experts 1,2`: FSDP2 alone on 4 ranks against data 2 x expert 2.
A random Qwen3-MoE built in-process (no download): hidden 512, 64 experts top 8, expert size 256,
8 heads, vocabulary 2048, `--layers` decoder layers (few: a CPU has to run it), float32,
`--ranks` ranks on gloo (or NCCL where CUDA is), each rank `--tokens` tokens of its own per step,
AdamW.
The trainer's own step (trainer/trainer.py) adds batching and the loss family around the same
forward, backward, clip and optimizer step measured here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def build(layers: int) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=64,
                            num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True,
                            max_position_embeddings=4096, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(config).float()


def expert_numel(experts: torch.nn.Module) -> int:
    """Elements of a layer's expert tensors as this rank holds them right now: FSDP2's shard at
    rest, the full tensors it gathered during the layer's forward, EP's own shard always."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in (experts.gate_up_proj, experts.down_proj))


def measure(model: torch.nn.Module, ep: int, args, device: torch.device) -> dict:
    from rl.config import ParallelConfig
    from trainer.expert_parallel import apply_expert_parallel, moe_experts
    from trainer.parallel import apply_fsdp, build_layout, clip_grad_norm

    rank, world = dist.get_rank(), dist.get_world_size()
    layout = build_layout(ParallelConfig(expert=ep), device)
    if ep > 1:
        apply_expert_parallel(model, layout.experts["expert"])
    apply_fsdp(model, torch.float32, experts=layout.experts)
    experts = moe_experts(model)
    at_rest = sum(expert_numel(e) for e in experts)
    while_computing = []
    hooks = [e.register_forward_pre_hook(lambda m, a: while_computing.append(expert_numel(m))) for e in experts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.steps + 1):  # the first warms up
        tokens = torch.randint(0, 2048, (1, args.tokens), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        logits = model(input_ids=tokens, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
        (loss * world).backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        # A step lasts as long as its slowest rank. CPU seconds (this process's, every thread):
        # on a loaded shared machine wall time mostly measures waiting for a core.
        took = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if step:
            times.append(took.tolist())
    for h in hooks:
        h.remove()
    return {"ep": ep, "data": layout.sizes[0], "expert_params_at_rest": at_rest, "expert_params_per_layer_while_computing": max(while_computing),
            "step_s_median": statistics.median(t[0] for t in times),
            "step_cpu_s_median": statistics.median(t[1] for t in times), "steps_wall_cpu_s": times}


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    base = build(args.layers)
    rows = [measure(copy.deepcopy(base).to(device), ep, args, device) for ep in args.experts]
    if rank == 0:
        experts = sum(e.numel() for n, e in base.named_parameters() if ".experts." in n)
        out = {"layers": args.layers, "tokens_per_rank": args.tokens, "ranks": world, "device": str(device),
               "expert_params_total": experts, "rows": rows}
        print(json.dumps(out, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--ranks", type=int, default=2, help="the world: data = ranks / expert")
    parser.add_argument("--experts", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                        help="expert-parallel sizes to measure, comma-separated (1: FSDP2 alone)")
    parser.add_argument("--json")
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
