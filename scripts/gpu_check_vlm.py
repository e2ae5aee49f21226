"""The GPU check's `vlm` item (scripts/gpu_check.py): the trainer's vision-language step on the
machine's own kernels (issue 62, docs/vlm.md). `rl sft` on image chats (tasks/shapes.py's
pictures: rows with image_url parts, as the RL datasets take them), packed, the pictures through
the trainer's vision path (trainer/vision.py), full fine-tuning with the vision tower frozen.

The model: on a GPU, SmolVLM-Instruct's shape (2.25B, random weights), built here by
scripts/make_vlm_model.py --shape smolvlm-2b the first time (a couple of minutes; kept under
--out); on CPU, models/tiny-vlm. --model (the text model the other items use) is not read.

What must hold: the held-out loss falls (random weights: from ~log(vocab)), each step's record has
its tokens, weights/step_N is an HF model directory. The note gives s/step, tokens/s and the peak
GPU memory the parent measures (the Outcome's peak_gpu_mib): the figures docs/performance.md's
"A VLM at real size" lacks, which this machine's CPU run (benchmarks/vlm_real_size.py) cannot give.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpu_check_items import CheckFailed, Context, last_line, records, run_logged, write_config

ROOT = Path(__file__).resolve().parents[1]
GPU_STEPS, CPU_STEPS = 6, 4


def vlm_model(ctx: Context) -> Path:
    if not ctx.gpu:
        return ROOT / "models" / "tiny-vlm"
    out = ctx.path.parent / "smolvlm-shape-2b"
    if not (out / "model.safetensors").exists():
        log = ctx.path / "make_vlm_model.log"
        rc = run_logged([sys.executable, str(ROOT / "scripts" / "make_vlm_model.py"), "--shape", "smolvlm-2b",
                         "--out", str(out)], log, cwd=ROOT / "scripts")
        if rc != 0:
            raise CheckFailed(f"make_vlm_model.py --shape smolvlm-2b exited {rc}: {last_line(log)}", log)
    return out


def check_vlm(ctx: Context) -> tuple[str, dict]:
    model = vlm_model(ctx)
    steps = GPU_STEPS if ctx.gpu else CPU_STEPS
    root = ctx.path / "vlm"
    sft = {"batch_size": 16 if ctx.gpu else 8, "eval_every": steps, "eval_rows": 16,
           "datasets": [{"name": "shapes", "function": "tasks.shapes:sft_rows", "size": 400}],
           "eval_datasets": [{"name": "heldout", "function": "tasks.shapes:sft_heldout"}]}
    extra = {"max_steps": steps, "seq_len": 256, "checkpoints": {"every": 0}, "trainer": {"optim": {"lr": 1e-4}},
             "sft": sft}
    cfg = write_config(ctx.path / "vlm.toml", ctx, root, extra, model=str(model))
    log = ctx.path / "vlm.log"
    env = {**ctx.gpu_env(), "PYTHONPATH": str(ROOT / "src")}
    rc = run_logged([sys.executable, "-m", "asyncrl", "sft", "@", str(cfg)], log, env)
    if rc != 0:
        raise CheckFailed(f"rl sft on image chats exited {rc}: {last_line(log)}", log)
    losses = [r["eval/loss"] for r in records(root, "eval")]
    if len(losses) < 2 or not losses[-1] < losses[0]:
        raise CheckFailed(f"held-out loss did not fall: {losses}", log)
    if not (root / f"weights/step_{steps}/config.json").exists():
        raise CheckFailed(f"weights/step_{steps} holds no config.json", log)
    trained = [r for r in records(root, "trainer") if r.get("step", 0) > 1]  # step 1 holds the warm-up
    step_s = sum(r["step_s"] for r in trained) / len(trained)
    tokens_per_s = sum(r["trainer_tokens_per_s"] for r in trained) / len(trained)
    note = (f"{model.name}, {steps} steps of {sft['batch_size']} image chats: held-out loss {losses[0]:.3g} -> "
            f"{losses[-1]:.3g}, {step_s:.2f} s/step, {tokens_per_s:.0f} tok/s")
    return note, {"model": model.name, "heldout_loss": [losses[0], losses[-1]], "step_s": step_s,
                  "trainer_tokens_per_s": tokens_per_s}

