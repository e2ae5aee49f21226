"""trainer.attention = "varlen": document-masked attention on packed rows, with PyTorch's own
kernels (no flash-attn package).

A packed micro-batch is R rows of back-to-back samples. sdpa sees them through an [R, 1, T, T]
block-diagonal mask: transformers builds it elementwise every forward, and the kernel computes
every block, the masked ones included. Here the rows are flattened to one sequence of R x T tokens
cut into documents (each sample, and each row's padding tail) at cumulative boundaries cu_seq_lens,
and attention runs per document: on CUDA in half precision through torch.nn.attention.varlen
(PyTorch's built-in flash kernel, varlen); elsewhere (CPU, float32) one causal SDPA call per
document, the same arithmetic a sample forwarded alone gets. No [T, T] mask is built, no work is
spent across documents, and nothing waits on the device: forward_logits (trainer/model.py)
computes the boundaries from the host's micro-batch and hands them in as keyword arguments, which
transformers passes through every decoder layer to the attention function.

Registered with transformers' AttentionInterface under "varlen" and deliberately not with its mask
interface: transformers then builds no mask at all (nor scans the position ids for packed samples,
a device round trip), so the documents come from cu_seq_lens alone, or, for a caller that gives
none, from the position ids (a document starts where they do not count up by one).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

NAME = "varlen"


@functools.cache
def kernel_available() -> bool:
    """Whether this torch has the varlen flash kernel with the arguments used here (torch >= 2.11:
    `window_size` for causality, `enable_gqa`; 2.10's took `is_causal`). Without it, "varlen"
    runs per document through SDPA, and auto picks sdpa."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return {"window_size", "enable_gqa"} <= set(inspect.signature(varlen_attn).parameters)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention_forward)


def document_lengths(position_ids: Tensor | None, attention_mask: Tensor | None, shape: torch.Size) -> list[int]:
    """Host-side lengths of the documents of a [R, T] micro-batch, row after row: packed rows
    split where the position ids restart; padded rows (attention_mask) into the real tokens and
    the padding tail; otherwise one document per row."""
    rows, width = shape
    if position_ids is not None:
        flat = position_ids.reshape(rows, width)
        starts = torch.ones_like(flat, dtype=torch.bool)
        starts[:, 1:] = flat[:, 1:] != flat[:, :-1] + 1
        at = starts.reshape(-1).nonzero().squeeze(1).tolist() + [rows * width]
        return [b - a for a, b in zip(at, at[1:])]
    if attention_mask is not None:
        real = attention_mask.reshape(rows, width).sum(1).tolist()
        return [n for r in real for n in (r, width - r) if n > 0]
    return [width] * rows


def boundaries(lengths: list[int], device: torch.device) -> dict:
    """The keyword arguments forward_logits hands the model: cumulative boundaries (int32, as the
    flash kernel wants them) and the longest document."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    if device.type == "cuda":  # pinned, so the copy does not wait for the queued kernels
        cu = cu.pin_memory().to(device, non_blocking=True)
    return {"cu_seq_lens_q": cu, "max_length_q": max(lengths)}


def varlen_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, cu_seq_lens_q: Tensor | None = None,
                             max_length_q: int | None = None, position_ids: Tensor | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function interface: query [B, Hq, T, D], key and value
    [B, Hkv, T, D]; returns [B, T, Hq, D]."""
    if dropout or sliding_window is not None or attention_mask is not None:
        raise NotImplementedError('trainer.attention = "varlen": no attention dropout, sliding window or 4D mask; '
                                  'use "sdpa" for this model')
    batch, heads, width, dim = query.shape
    if cu_seq_lens_q is None:  # a direct call: documents from the positions (a device round trip)
        positions = None if position_ids is None else position_ids.expand(batch, width).cpu()
        kw = boundaries(document_lengths(positions, None, torch.Size((batch, width))), query.device)
        cu_seq_lens_q, max_length_q = kw["cu_seq_lens_q"], kw["max_length_q"]
    q, k, v = (x.transpose(1, 2).reshape(batch * width, x.shape[1], dim) for x in (query, key, value))
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and kernel_available():
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
                          window_size=(-1, 0), enable_gqa=k.shape[1] != heads)
    else:
        out = per_document_attention(q, k, v, cu_seq_lens_q, scaling)
    return out.reshape(batch, width, heads, dim), None


def per_document_attention(q: Tensor, k: Tensor, v: Tensor, cu_seq_lens: Tensor, scaling: float | None) -> Tensor:
    """varlen attention where the flash kernel cannot run (CPU, float32): causal SDPA per document,
    q [N, Hq, D], k and v [N, Hkv, D] -> [N, Hq, D]."""
    lengths = cu_seq_lens.diff().tolist()
    gqa = k.shape[1] != q.shape[1]
    parts = [torch.nn.functional.scaled_dot_product_attention(
        qd.transpose(0, 1)[None], kd.transpose(0, 1)[None], vd.transpose(0, 1)[None], is_causal=True, scale=scaling,
        enable_gqa=gqa)[0].transpose(0, 1) for qd, kd, vd in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
    return torch.cat(parts)
