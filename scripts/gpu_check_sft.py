"""The GPU check's `sft` item (scripts/gpu_check.py): `rl sft` of the model as a user runs it, on
prompt/answer rows the check writes (sums of a list of numbers: rows of many lengths, so packing
and rank balance do their work), and what must hold on the machine's own kernels:

- the held-out loss falls and weights/step_N is an HF model directory;
- a run SIGKILLed after a step and resumed from its checkpoint ends on the weights of a run never
  interrupted. Where they differ, two uninterrupted runs are compared too: if those differ as
  well, the kernels are not deterministic (some CUDA backward kernels accumulate with atomics)
  and the note says by how much each differs; if only the resumed one differs, resume lost state
  and the item fails;
- a LoRA run publishes a peft adapter, and its held-out loss falls too.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from gpu_check_items import CheckFailed, Context, last_line, merged, records, run_logged, write_config

GPU_STEPS, CPU_STEPS = 30, 6
# Rows written for training: each of the item's four runs tokenizes all of them at its start. A
# CPU run trains on 6 x 8 = 48 of them.
GPU_ROWS, CPU_ROWS = 4000, 400


def write_rows(path: Path, count: int, numbers: tuple[int, int], seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            xs = [rng.randrange(100) for _ in range(rng.randint(*numbers))]
            f.write(json.dumps({"prompt": "Add: " + " ".join(map(str, xs)), "answer": str(sum(xs))}) + "\n")


def sft_config(ctx: Context, name: str, extra: dict) -> Path:
    """A run directory ctx.path/name and its config: GPU rows of 40-200 numbers (~100-600
    tokens), the tiny model's of 2-4 (its seq_len is 128 characters). Only the run that is killed
    keeps checkpoints (a 0.5B model's, with its optimizer state, is ~6 GB)."""
    gpu = ctx.gpu
    steps = GPU_STEPS if gpu else CPU_STEPS
    data = ctx.path / "data"
    if not data.exists():
        data.mkdir()
        numbers = (40, 200) if gpu else (2, 4)
        write_rows(data / "train.jsonl", GPU_ROWS if gpu else CPU_ROWS, numbers, seed=0)
        write_rows(data / "heldout.jsonl", 64, numbers, seed=1)
    sft = {"batch_size": 32 if gpu else 8, "eval_every": steps // 2, "eval_rows": 64,
           "datasets": [{"name": "sums", "path": str(data / "train.jsonl"), "completion_key": "answer"}],
           "eval_datasets": [{"name": "heldout", "path": str(data / "heldout.jsonl"), "completion_key": "answer"}]}
    base = {"max_steps": steps, "checkpoints": {"every": 0}, "trainer": {"optim": {"lr": 1e-4}}, "sft": sft}
    return write_config(ctx.path / f"{name}.toml", ctx, ctx.path / name, merged(base, extra))


def sft(ctx: Context, cfg: Path, *args: str, env: dict | None = None) -> int:
    log = ctx.path / f"{cfg.stem}.log"
    return run_logged([sys.executable, "-m", "asyncrl", "sft", "@", str(cfg), *args], log, {**ctx.gpu_env(), **(env or {})})


def finished(ctx: Context, cfg: Path, *args: str) -> Path:
    """Runs `rl sft` to its end; the run directory (or CheckFailed naming the log)."""
    rc = sft(ctx, cfg, *args)
    log = ctx.path / f"{cfg.stem}.log"
    if rc != 0:
        raise CheckFailed(f"rl sft ({cfg.stem}) exited {rc}: {last_line(log)}", log)
    return ctx.path / cfg.stem


def heldout(root: Path) -> tuple[float, float]:
    losses = [r["eval/loss"] for r in records(root, "eval")]
    if len(losses) < 2:
        raise CheckFailed(f"{root.name}: {len(losses)} held-out evaluation(s) in metrics.jsonl, expected 3",
                          root / "logs")
    return losses[0], losses[-1]


def max_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between two safetensors files' tensors (0.0: bit-equal)."""
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    if x.keys() != y.keys():
        raise CheckFailed(f"{a} and {b} hold different tensors")
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def check_resume(ctx: Context, whole: Path, steps: int) -> tuple[str, dict]:
    killed = sft_config(ctx, "killed", {"checkpoints": {"every": steps // 2}})
    crash = f"trainer.after_step:{steps // 2 + 1}"
    rc = sft(ctx, killed, env={"ASYNCRL_CRASH_AT": crash})
    if rc != -9:
        raise CheckFailed(f"rl sft with ASYNCRL_CRASH_AT={crash} exited {rc}, expected -9 (SIGKILL)",
                          ctx.path / "killed.log")
    finished(ctx, killed, "--resume")
    weights = f"weights/step_{steps}/model.safetensors"
    resumed = max_difference(whole / weights, ctx.path / "killed" / weights)
    if resumed == 0.0:
        return "resume bit-exact", {"resume_max_diff": 0.0}
    again = finished(ctx, sft_config(ctx, "again", {}))
    straight = max_difference(whole / weights, again / weights)
    if straight == 0.0:
        raise CheckFailed(f"the resumed run's weights differ by {resumed:.3g} while two uninterrupted runs "
                          "are bit-equal: resume lost state", ctx.path / "killed.log")
    return (f"resume within the kernels' own nondeterminism (max |diff| {resumed:.2g}; two uninterrupted "
            f"runs {straight:.2g})", {"resume_max_diff": resumed, "straight_max_diff": straight})


def check_sft(ctx: Context) -> tuple[str, dict]:
    steps = GPU_STEPS if ctx.gpu else CPU_STEPS
    whole = finished(ctx, sft_config(ctx, "whole", {}))
    first, last = heldout(whole)
    if not last < first:
        raise CheckFailed(f"held-out loss did not fall: {first:.4g} -> {last:.4g}", ctx.path / "whole.log")
    if not (whole / f"weights/step_{steps}/config.json").exists():
        raise CheckFailed(f"weights/step_{steps} holds no config.json", ctx.path / "whole.log")
    trained = [r for r in records(whole, "trainer") if r.get("step", 0) > 1]  # step 1 holds the warm-up
    tokens_per_s = sum(r["trainer_tokens_per_s"] for r in trained) / len(trained)
    step_s = sum(r["step_s"] for r in trained) / len(trained)
    resume_note, resume = check_resume(ctx, whole, steps)
    lora = finished(ctx, sft_config(ctx, "lora", {"trainer": {"lora": {"rank": 16, "alpha": 32},
                                                              "optim": {"lr": 1e-3}}}))
    lora_first, lora_last = heldout(lora)
    if not (lora / f"weights/step_{steps}/adapter_model.safetensors").exists():
        raise CheckFailed(f"the LoRA run's weights/step_{steps} holds no adapter_model.safetensors",
                          ctx.path / "lora.log")
    if not lora_last < lora_first:
        raise CheckFailed(f"LoRA held-out loss did not fall: {lora_first:.4g} -> {lora_last:.4g}", ctx.path / "lora.log")
    note = (f"{steps} steps: held-out loss {first:.3g} -> {last:.3g}, {step_s:.2f} s/step, "
            f"{tokens_per_s:.0f} tok/s; {resume_note}; LoRA {lora_first:.3g} -> {lora_last:.3g}")
    return note, {"heldout_loss": [first, last], "step_s": step_s, "trainer_tokens_per_s": tokens_per_s,
                  "lora_heldout_loss": [lora_first, lora_last], **resume}

