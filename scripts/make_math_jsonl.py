"""Write math word problems as jsonl, the shape a user's own math data takes ({"prompt", "answer"}
per line), for configs/qwen_math_gpu.toml: GSM8K-style problems from reasoning-gym's
gsm_symbolic templates plus linear equations, generated offline and seeded.

    python scripts/make_math_jsonl.py --out data/math     # train.jsonl (5000 rows), test.jsonl (500)

With GSM8K or MATH already on disk as jsonl or parquet, skip this and point the config's `path`
(and `prompt_key` / `answer_key`) at them instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import reasoning_gym

TASKS = {"gsm_symbolic": 0.8, "simple_equations": 0.2}


def write(path: Path, rows: int, seed: int) -> None:
    with path.open("w", encoding="utf-8") as f:
        for task, share in TASKS.items():
            for entry in reasoning_gym.create_dataset(task, size=int(rows * share), seed=seed):
                f.write(json.dumps({"prompt": entry["question"], "answer": str(entry["answer"]), "task": task}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/math"))
    ap.add_argument("--train-rows", type=int, default=5000)
    ap.add_argument("--test-rows", type=int, default=500)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "train.jsonl", args.train_rows, seed=1)
    write(args.out / "test.jsonl", args.test_rows, seed=2)  # another seed: held out
    print(f"wrote {args.out}/train.jsonl and {args.out}/test.jsonl")


if __name__ == "__main__":
    main()
