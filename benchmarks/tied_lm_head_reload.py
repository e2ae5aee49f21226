"""Cost of keeping a tied lm_head right after an in-place reload, inside the worker, alternating in
one engine (random 0.5B-class model, or the tiny one; the same files each time, already read):

  bare:   vLLM's reload_weights alone (leaves the lm_head on the OLD packed embedding);
  repack: reload_weights, then the lm_head's post-load processing (a new oneDNN-packed copy of
          the embedding: what inference/worker_extension.py did before issue 23);
  shared: asyncrl_reload_weights as it is now (the lm_head takes the packed copy the reload has
          just made for the embedding module).

    .venv/bin/python benchmarks/tied_lm_head_reload.py [--shape 0.5b|tiny] [--repeats 5]

Results: benchmarks/results/tied_lm_head_reload_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from inference.worker_extension import WeightReloadExtension  # noqa: E402


class TiedReloadBenchExtension(WeightReloadExtension):
    def bench_reload(self, mode: str, path: str) -> float:
        start = time.perf_counter()
        if mode == "shared":
            self.asyncrl_reload_weights(path)
        else:
            self.reload_weights(weights_path=path)
            if mode == "repack":
                lm_head = self.model_runner.get_model().lm_head
                lm_head.quant_method.process_weights_after_loading(lm_head)
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "0.5b"], default="0.5b")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks"),
                                                os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from weight_sync_lora import model_for

    modes = ["bare", "repack", "shared"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as d:
        model_dir = model_for(args.shape, Path(d))
        llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                  worker_extension_cls="tied_lm_head_reload.TiedReloadBenchExtension")
        llm.collective_rpc("bench_reload", args=("repack", str(model_dir)))  # vLLM's first reload is slow
        for r in range(args.repeats):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                times[mode].append(llm.collective_rpc("bench_reload", args=(mode, str(model_dir)))[0])
            print(f"repeat {r}: " + ", ".join(f"{m} {times[m][-1]:.3f} s" for m in modes), flush=True)
    result = {"shape": args.shape, "reload_s": times,
              "median_s": {m: statistics.median(v) for m, v in times.items()},
              "range_s": {m: [min(v), max(v)] for m, v in times.items()}}
    out = ROOT / "benchmarks" / "results" / f"tied_lm_head_reload_{args.shape}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median_s"], indent=1))


if __name__ == "__main__":
    main()
