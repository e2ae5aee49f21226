"""`rl sft` as a user runs it, on a config a test writes, and its metrics records: shared by the
SFT, VLM SFT, profiling, context-parallel and generation-eval tests."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


from conftest import TINY_MODEL, rl_command


CHAT_MODEL = TINY_MODEL.parent / "tiny-chat"


def sft(cfg: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(rl_command("sft", "@", str(cfg), *args), capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def config(tmp_path: Path, body: str, model: Path = TINY_MODEL, steps: int = 20) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "sft.toml"
    path.write_text(f'model = "{model}"\noutput_dir = "{tmp_path / "run"}"\nmax_steps = {steps}\nseq_len = 64\n'
                    "[trainer]\ntorch_threads = 1\n" + body)
    return path


def records(run: Path, program: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["program"] == program]


REVERSE = """[trainer.optim]
lr = 1e-4  # 1e-3 overshoots: this model is trained already (held-out loss 2.14 -> 2.32 in 20 steps)
[sft]
batch_size = 16
eval_every = 10
[[sft.datasets]]
function = "tasks.reverse:dataset"
size = 400
completion_key = "answer"
[[sft.eval_datasets]]
name = "heldout"
function = "tasks.reverse:dataset"
seed = 7
completion_key = "answer"
"""


# Checkpointed every step (step 1's checkpoint is what the two-rank test compares with); a
# checkpoint changes nothing the run computes, so its weights are those of the killed run's too.
UNINTERRUPTED = "[checkpoints]\nevery = 1\nkeep = 6\n" + REVERSE.replace("eval_every = 10", "eval_every = 0")
