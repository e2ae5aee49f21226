"""Packed attention on the CPU (issue 63, item 5): sdpa with the block-diagonal [T, T] mask
transformers builds for packed rows, against trainer.model.attention = "varlen" without the flash
kernel (SDPA per block of documents, trainer/packed_attention.py), which `auto` now picks here.

    .venv/bin/python benchmarks/packed_attention_cpu.py [--repeats 5] [--threads 1]

Two measurements, each the best of --repeats, one thread by default (a trainer rank's share of a
2-core machine):
  demo    forward + backward of a packed micro-batch (2 rows of 128, the tests' variable-length
          samples) through a tiny Qwen2 (hidden 128, 4 layers: the demos' shape), both kernels
  long    the attention call alone on one row of T tokens (4k, 16k) of samples of 200-2000
          tokens, 14 query and 2 KV heads of 64 (Qwen2.5-0.5B's): the row's mask built as
          transformers' sdpa path gets it, against the blocks; elements of the largest mask
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from trainer import packed_attention  # noqa: E402


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def demo(repeats: int) -> dict:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from test_packing import variable_batch
    from trainer.data import loss_weights, rank_micro_batches
    from trainer.model import forward_logits

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, tie_word_embeddings=True)
    batch = variable_batch(seed=1, n=12)
    mbs = rank_micro_batches(batch, 0, 1, row_len=128, per_micro_batch=2, pad_id=0,
                             weights=loss_weights(batch, "token", 0))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        packed_attention.register()
        for name in ("sdpa", "varlen"):
            model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation=name)

            def step():
                for mb in mbs:
                    forward_logits(model, mb, torch.device("cpu"), single_row=False).sum().backward()
            out[name] = best(step, repeats)
    return out


def long_rows(repeats: int) -> dict:
    rng, out = random.Random(0), {}
    for width in (4096, 16384):
        lengths, left = [], width
        while left > 0:
            lengths.append(min(left, rng.randint(200, 2000)))
            left -= lengths[-1]
        q, k, v = torch.randn(width, 14, 64), torch.randn(width, 2, 64), torch.randn(width, 2, 64)
        cu = packed_attention.boundaries(lengths, torch.device("cpu"))["cu_seq_lens_q"]
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

        def masked():
            mask = (doc[:, None] == doc[None, :]) & torch.ones(width, width, dtype=torch.bool).tril()
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                enable_gqa=True)
        blocks = packed_attention.mask_blocks(lengths, min(packed_attention.MASK_BLOCK_TOKENS, max(lengths)))
        out[width] = {"masked_s": best(masked, repeats),
                      "blocks_s": best(lambda: packed_attention.per_document_attention(q, k, v, cu, None), repeats),
                      "documents": len(lengths), "masked_elements": width * width,
                      "blocks_largest_mask": max((sum(b) ** 2 for b in blocks if len(b) > 1), default=0)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = demo(args.repeats)
    print(f"demo micro-batches, forward + backward: sdpa {d['sdpa']:.4f} s, varlen (blocks) {d['varlen']:.4f} s")
    for width, r in long_rows(args.repeats).items():
        print(f"one row of {width} tokens, {r['documents']} samples, attention forward: masked {r['masked_s']:.3f} s "
              f"({r['masked_elements']:,} mask elements), blocks {r['blocks_s']:.3f} s (largest mask "
              f"{r['blocks_largest_mask']:,})")


if __name__ == "__main__":
    main()
