"""Publishing weights/step_n (trainer/weights.py: safetensors, config and tokenizer copies,
fsync, STABLE) against a plain safetensors save_file of the same tensors, which is the floor.

    .venv/bin/python benchmarks/weight_write.py [--shape tiny|0.5b] [--repeats 5]

The FSDP gather is not in either figure (one rank: nothing to gather); benchmarks/trainer_step.py
large reports gather + write. Results: benchmarks/results/weight_write_<shape>.json and
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rl.rundir import RunDir, remove_quietly  # noqa: E402
from trainer.weights import write_weights  # noqa: E402
from trainer_step import build_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "0.5b"], default="0.5b")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as d:
        tmp = Path(d)
        source = ROOT / "models" / "tiny-reverse" if args.shape == "tiny" else build_model("0.5b", tmp / "model")
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        size = sum(t.numel() * t.element_size() for t in state.values())
        run = RunDir(tmp / "run")
        run.make()
        ours, plain = [], []
        def plain_save(i: int) -> float:
            start = time.perf_counter()
            save_file(state, tmp / f"plain_{i}.safetensors")
            return time.perf_counter() - start

        # Interleaved, alternating which goes first, so page cache and disk writeback hit both alike.
        for i in range(args.repeats):
            if i % 2:
                plain.append(plain_save(i))
            ours.append(write_weights(run, i + 1, state, source, tied=True))
            if not i % 2:
                plain.append(plain_save(i))
            (tmp / f"plain_{i}.safetensors").unlink()
            remove_quietly(run.weights_dir(i + 1))
    result = {"shape": args.shape, "bytes": size, "write_weights_s": ours, "save_file_s": plain,
              "ratio_median": sorted(ours)[len(ours) // 2] / sorted(plain)[len(plain) // 2]}
    print(f"{args.shape}: {size / 1e6:.1f} MB; write_weights median {sorted(ours)[len(ours) // 2]:.3f}s, "
          f"plain save_file median {sorted(plain)[len(plain) // 2]:.3f}s, ratio {result['ratio_median']:.2f}x")
    out = ROOT / "benchmarks" / "results" / f"weight_write_{args.shape}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
