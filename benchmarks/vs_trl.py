"""asyncrl against TRL's synchronous GRPOTrainer on this machine, same model, task, batch
(prompts x completions), temperature and learning rate, one after the other.

    .venv/bin/python benchmarks/vs_trl.py reward  [--steps 600] [--target 0.7]
    .venv/bin/python benchmarks/vs_trl.py throughput [--steps 8]

reward:     the reversal task on the demo model (configs/reverse_demo.toml): wall time from launch until
            the trailing-10 mean reward reaches --target (and lower thresholds, for runs that
            stop short of it); both stop at --steps.
throughput: the generation-heavy workload (configs/long.toml): completions/s over the steps
            after the first two.
TRL runs in its own environment, .venv-trl (built here on first use: torch pinned, trl, the
same transformers as ours), on both cores (2 torch threads); generation is transformers'
generate (TRL's vLLM modes need CUDA to sync weights). Results:
benchmarks/results/vs_trl_<mode>.json and docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from rl_runs import ROOT, ensure_long_model, run_rl, window

TRL_VENV = ROOT / ".venv-trl"
TRL_PACKAGES = ["torch==2.13.0", "transformers==5.19.0", "trl==1.16.0"]


def ensure_trl() -> None:
    python = TRL_VENV / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode:
        print(f"building {TRL_VENV} ({', '.join(TRL_PACKAGES)})", flush=True)
        subprocess.run(["python3", "-m", "venv", str(TRL_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_PACKAGES], check=True)


def trl_run(name: str, model: str, task: str, steps: int, prompts: int, group: int, max_tokens: int,
            temperature: float, lr: float, stop_at: float | None) -> tuple[float, list[dict]]:
    out = ROOT / "runs" / "bench" / f"{name}.jsonl"
    argv = [str(TRL_VENV / "bin" / "python"), str(ROOT / "benchmarks" / "trl_grpo.py"), "--model", model,
            "--task", task, "--steps", str(steps), "--prompts", str(prompts), "--group-size", str(group),
            "--max-tokens", str(max_tokens), "--temperature", str(temperature), "--lr", str(lr), "--out", str(out)]
    if stop_at is not None:
        argv += ["--stop-at", str(stop_at)]
    print("$", " ".join(argv[1:]), flush=True)
    start = time.time()
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=7200)
    wall = time.time() - start
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return wall, [{"time": r["time"] - start, "reward": r["reward"]} for r in records if "step" in r]


def time_to(curve: list[dict], target: float) -> float | None:
    """Seconds from launch until the trailing-10 mean reward first reaches target."""
    for i in range(9, len(curve)):
        if sum(r["reward"] for r in curve[i - 9:i + 1]) / 10 >= target:
            return curve[i]["time"]
    return None


def ours_curve(started: float, records: list[dict]) -> list[dict]:
    return [{"time": r["time"] - started, "reward": r["reward_mean"]}
            for r in records if r["program"] == "orchestrator"]


def reward_race(args) -> dict:
    cfg = {"prompts": 8, "group": 8, "max_tokens": 12, "temperature": 1.0, "lr": 5e-4}  # configs/reverse_demo.toml's
    trl_wall, trl = trl_run("vs_trl_reward_trl", "models/tiny-reverse", "reverse", args.steps, cfg["prompts"],
                            cfg["group"], cfg["max_tokens"], cfg["temperature"], cfg["lr"], stop_at=None)
    started = time.time()
    ours_wall, records = run_rl("configs/reverse_demo.toml", ROOT / "runs" / "bench" / "vs_trl_reward_ours",
                                ["--max_steps", str(args.steps), "--trainer.checkpoint_every", "0"], timeout_s=7200)
    ours = ours_curve(started, records)
    thresholds = sorted({args.target, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6})
    table = {str(t): {"ours_s": time_to(ours, t), "trl_s": time_to(trl, t)} for t in thresholds}
    for t, row in table.items():
        if row["ours_s"] and row["trl_s"]:
            row["ratio"] = row["ours_s"] / row["trl_s"]
        print(f"trailing-10 reward {t}: asyncrl {row['ours_s']}, TRL {row['trl_s']}, ratio {row.get('ratio')}")
    return {"recipe": cfg, "steps": args.steps, "target": args.target, "thresholds": table,
            "ours": {"wall_s": ours_wall, "curve": ours}, "trl": {"wall_s": trl_wall, "curve": trl}}


def throughput(args) -> dict:
    model = str(ensure_long_model().relative_to(ROOT))
    cfg = {"prompts": 4, "group": 8, "max_tokens": 256, "temperature": 1.0, "lr": 1e-4}  # configs/long.toml's
    samples = cfg["prompts"] * cfg["group"]
    trl_wall, trl = trl_run("vs_trl_throughput_trl", model, "count", args.steps, cfg["prompts"], cfg["group"],
                            cfg["max_tokens"], cfg["temperature"], cfg["lr"], stop_at=None)
    trl_rate = (len(trl) - 3) * samples / (trl[-1]["time"] - trl[2]["time"])
    _, records = run_rl("configs/long.toml", ROOT / "runs" / "bench" / "vs_trl_throughput_ours",
                        ["--max_steps", str(args.steps)], timeout_s=7200)
    ours = window(records, 2, samples)
    print(f"completions/s: asyncrl {ours['completions_per_s']:.2f}, TRL {trl_rate:.2f}: "
          f"{ours['completions_per_s'] / trl_rate:.2f}x")
    return {"recipe": cfg, "steps": args.steps, "ours": ours, "trl": {"completions_per_s": trl_rate, "wall_s": trl_wall,
            "curve": trl}, "ratio": ours["completions_per_s"] / trl_rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["reward", "throughput"])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--target", type=float, default=0.7)
    args = ap.parse_args()
    args.steps = args.steps or (600 if args.mode == "reward" else 8)
    ensure_trl()
    result = reward_race(args) if args.mode == "reward" else throughput(args)
    out = ROOT / "benchmarks" / "results" / f"vs_trl_{args.mode}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
