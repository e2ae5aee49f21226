"""GPU check for expert parallelism on NCCL (issue 63): two GPUs, two ranks (or four: data 2 x
expert 2), the comparison tests/trainer/test_expert_parallel.py runs on gloo (EP=2 against one unsharded
model: logprobs within float32 rounding's bound of a float64 model, gradients within 1e-4 of the
largest entry; a misrouted dispatch, and at four ranks one sent within the data dim, must fail
it), then benchmarks/trainer_parallel_moe.py's 64-expert step on as many ranks.

    python scripts/gpu_check_expert_parallel.py [--ranks 2|4] [--json FILE]

Exit 0 when every comparison passes on both ranks and the misrouted one fails; each result line
says which. Matrix products in float32 (TF32 off: its 10-bit mantissa is not float32's bound).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]


def worker(rank: int, world: int, port: int, out: str) -> None:
    from rl.config import ParallelConfig
    from test_expert_parallel import compare, qwen2_moe, tiny_moe
    from trainer.parallel import build_layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        layout = build_layout(ParallelConfig(expert=2), device)
        results = {"qwen3/replay": compare(tiny_moe, layout, "none", True, device),
                   "qwen3/own_routing": compare(tiny_moe, layout, "none", False, device),
                   "qwen2": compare(qwen2_moe, layout, "none", False, device),
                   "qwen3/misrouted": compare(tiny_moe, layout, "misrouted", True, device)}
        if world == 4:
            results["qwen3/wrong_group"] = compare(tiny_moe, layout, "wrong_group", True, device)
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="gpu_check_expert_parallel.json")
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=2, help="4: data 2 x expert 2")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.ranks:
        print(f"expert parallelism on NCCL at {args.ranks} ranks needs {args.ranks} GPUs; this machine has",
              torch.cuda.device_count())
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(args.json).with_suffix("")
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(args.ranks, port, str(out)), nprocs=args.ranks)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    ok = True
    for case in ranks[0]:
        worst = {k: max(r[case][k] for r in ranks) for k in ("logprob", "grad")}
        passed = worst["logprob"] <= 1 and worst["grad"] <= 1
        want = not case.endswith(("misrouted", "wrong_group"))
        ok &= passed == want
        print(f"{'ok ' if passed == want else 'FAIL'} {case}: worst logprob error {worst['logprob']:.3g} of its bound, "
              f"gradient {worst['grad']:.3g} of its bound ({'must pass' if want else 'must fail'})")
    bench = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trainer_parallel_moe.py"), "--ranks",
                            str(args.ranks), "--json", str(out / "bench.json")], capture_output=True, text=True)
    print(bench.stdout[-2000:] if bench.returncode == 0 else f"FAIL benchmark: {bench.stderr[-2000:]}")
    Path(args.json).write_text(json.dumps({"ranks": ranks, "ok": ok and bench.returncode == 0}, indent=1))
    return 0 if ok and bench.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
