"""trainer.model.attention = "varlen": document-masked attention on packed rows, with PyTorch's own
kernels (no flash-attn package).

A packed micro-batch is R rows of back-to-back samples. sdpa sees them through an [R, 1, T, T]
block-diagonal mask: transformers builds it elementwise every forward, and the kernel computes
every block, the masked ones included. Here the rows are flattened to one sequence of R x T tokens
cut into documents (each sample, and each row's padding tail) at cumulative boundaries cu_seq_lens,
and attention runs per document: on CUDA in half precision through torch.nn.attention.varlen
(PyTorch's built-in flash kernel, varlen; called as the installed torch's signature allows:
installed_kernel); elsewhere (CPU, float32, a torch without the kernel) through SDPA per document,
short documents grouped into blocks of at most MASK_BLOCK_TOKENS with a mask of the block's size.
No [T, T] mask is built at any length, no work is spent across blocks, and nothing waits on the
device: forward_logits (trainer/model.py) computes the boundaries from the host's micro-batch and
hands them in as keyword arguments, which transformers passes through every decoder layer to the
attention function.

Registered with transformers' AttentionInterface under "varlen" and deliberately not with its mask
interface: transformers then builds no mask at all (nor scans the position ids for packed samples,
a device round trip), so the documents come from cu_seq_lens alone, or, for a caller that gives
none, from the position ids (a document starts where they do not count up by one).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

NAME = "varlen"
log = logging.getLogger("trainer")


# Short documents share one SDPA call (a block) with a block-diagonal mask of the block's size, a
# block at most as long as the longest document and MASK_BLOCK_TOKENS: one call per sample costs
# a Python round per sample and layer (the demo's rows hold ~10 samples), one mask per row costs
# T^2 (a billion elements at 32k). A document longer than that runs alone, causal, with no mask.
MASK_BLOCK_TOKENS = 1024


@dataclass(frozen=True)
class Kernel:
    """How torch's varlen flash kernel is called on this torch, decided from its signature:
    `causal`, the keyword that makes it causal (2.11 and 2.13: window_size = (-1, 0); the module's
    first form took is_causal); `gqa`, how a query head finds its key/value head: "flag" (2.13
    refuses Hq != Hkv unless enable_gqa), "native" (2.11 has no such argument and passes Hkv heads
    to aten's flash kernel, which maps each query head to its group), "expand" (the KV heads
    repeated first: where varlen._should_use_cudnn says cuDNN runs, which has no GQA; some
    versions said so on capability 10)."""
    causal: tuple[str, object]
    gqa: str

    def describe(self) -> str:
        gqa = {"flag": "enable_gqa", "native": "GQA native to the kernel", "expand": "KV heads expanded"}[self.gqa]
        return f"torch.nn.attention.varlen's flash kernel ({self.causal[0]} for causality, {gqa})"


def kernel_for(parameters: set[str], cudnn: bool) -> Kernel | None:
    """The way to call a varlen_attn with these keyword parameters (None: not callable here)."""
    if "scale" not in parameters:
        return None
    if "window_size" in parameters:
        causal = ("window_size", (-1, 0))
    elif "is_causal" in parameters:
        causal = ("is_causal", True)
    else:
        return None
    gqa = "flag" if "enable_gqa" in parameters else "expand" if cudnn else "native"
    return Kernel(causal, gqa)


@functools.cache
def installed_kernel(device_index: int | None = None) -> Kernel | None:
    """The installed torch's varlen kernel for this CUDA device, or None (no such module, or a
    signature this file does not know how to call)."""
    import inspect

    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    cudnn = getattr(varlen, "_should_use_cudnn", None)
    uses_cudnn = bool(cudnn(device_index)) if cudnn is not None and device_index is not None else False
    return kernel_for(set(inspect.signature(varlen.varlen_attn).parameters), uses_cudnn)


def kernel_available() -> bool:
    """Whether this torch's varlen flash kernel can be called (whatever its GQA handling)."""
    return installed_kernel() is not None


def runs_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the flash kernel runs for this query: CUDA, half precision, Ampere or newer, a torch with it."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and kernel_available() \
        and ampere(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def ampere(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 8


@functools.cache
def describe(device: torch.device, dtype: torch.dtype) -> str:
    """What runs for attention = "varlen" on this device and dtype, for the trainer's start-up line."""
    if runs_kernel(device, dtype):
        return installed_kernel(device.index if device.index is not None else 0).describe()
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        why = f"{str(dtype).removeprefix('torch.')} on {device.type}"
    else:
        why = "no varlen kernel in this torch" if not kernel_available() else "the flash kernel needs Ampere or newer"
    return (f"SDPA per document ({why}): short documents grouped into blocks no longer than the longest "
            f"(nor {MASK_BLOCK_TOKENS} tokens) under a mask of the block's size, longer ones alone and causal; "
            "no [T, T] mask")


def register(device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
    """Registers the attention function; with the device and compute dtype, logs once which kernel runs."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    if device is not None and dtype is not None:
        announce(device, dtype)


@functools.cache
def announce(device: torch.device, dtype: torch.dtype) -> None:
    log.info('attention = "varlen" on %s in %s: %s', device.type, str(dtype).removeprefix("torch."),
             describe(device, dtype))


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
    flash kernel wants them) and the longest document. The boundaries carry the host's lengths
    (host_lengths), so that the per-document path never reads them back from the device."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    if device.type == "cuda":  # pinned, so the copy does not wait for the queued kernels
        cu = cu.pin_memory().to(device, non_blocking=True)
    cu.host_lengths = list(lengths)
    return {"cu_seq_lens_q": cu, "max_length_q": max(lengths)}


def varlen_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, cu_seq_lens_q: Tensor | None = None,
                             max_length_q: int | None = None, position_ids: Tensor | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function interface: query [B, Hq, T, D], key and value
    [B, Hkv, T, D]; returns [B, T, Hq, D]."""
    if dropout or sliding_window is not None or attention_mask is not None:
        raise NotImplementedError('trainer.model.attention = "varlen": no attention dropout, sliding window or 4D mask; '
                                  'use "sdpa" for this model')
    batch, heads, width, dim = query.shape
    if cu_seq_lens_q is None:  # a direct call: documents from the positions (a device round trip)
        positions = None if position_ids is None else position_ids.expand(batch, width).cpu()
        kw = boundaries(document_lengths(positions, None, torch.Size((batch, width))), query.device)
        cu_seq_lens_q, max_length_q = kw["cu_seq_lens_q"], kw["max_length_q"]
    q, k, v = (x.transpose(1, 2).reshape(batch * width, x.shape[1], dim) for x in (query, key, value))
    if runs_kernel(query.device, query.dtype):
        out = flash_varlen(q, k, v, cu_seq_lens_q, max_length_q, scaling,
                           installed_kernel(query.device.index if query.device.index is not None else 0))
    else:
        out = per_document_attention(q, k, v, cu_seq_lens_q, scaling)
    return out.reshape(batch, width, heads, dim), None


def flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scaling: float | None,
                 kernel: Kernel) -> Tensor:
    """torch's varlen flash kernel, causal, called as `kernel` says this torch wants."""
    from torch.nn.attention.varlen import varlen_attn

    groups = q.shape[1] // k.shape[1]
    extra = dict([kernel.causal])
    if kernel.gqa == "flag":
        extra["enable_gqa"] = groups > 1
    elif kernel.gqa == "expand" and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **extra)


def mask_blocks(lengths: list[int], most: int = MASK_BLOCK_TOKENS) -> list[list[int]]:
    """Consecutive documents grouped into blocks of at most `most` tokens (a longer document is a
    block of its own)."""
    blocks: list[list[int]] = []
    total = most + 1
    for n in lengths:
        if n + total > most or n > most:
            blocks.append([])
            total = 0
        blocks[-1].append(n)
        total += n
    return blocks


# Not traced by torch.compile (trainer.model.compile): the plan is Python over the host's lengths, made
# at the first layer and kept on the boundaries; traced, a compiled layer under activation
# checkpointing saved other tensors in its forward than in its recompute (CheckpointError).
# Eager here, the layer's other ops stay compiled.
@torch.compiler.disable
def per_document_attention(q: Tensor, k: Tensor, v: Tensor, cu_seq_lens: Tensor, scaling: float | None,
                           most: int = MASK_BLOCK_TOKENS) -> Tensor:
    """varlen attention where the flash kernel cannot run (CPU, float32, an older torch), q [N, Hq, D],
    k and v [N, Hkv, D] -> [N, Hq, D]: one causal SDPA call per block of mask_blocks, a block of
    one document with no mask, a block of several with a block-diagonal causal mask of its own
    size. A block holds no more tokens than the longest document (nor than `most`), so its mask
    is at most that document's length squared, whatever the row's length, and never a row's."""
    gqa = k.shape[1] != q.shape[1]
    parts = [torch.nn.functional.scaled_dot_product_attention(
        *(x[at:at + size].transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask, is_causal=mask is None,
        scale=scaling, enable_gqa=gqa)[0].transpose(0, 1) for at, size, mask in block_plan(cu_seq_lens, q.device, most)]
    return torch.cat(parts)


def block_plan(cu_seq_lens: Tensor, device: torch.device, most: int) -> list[tuple[int, int, Tensor | None]]:
    """(start, tokens, mask or None) per block, computed once per forward: every decoder layer gets
    the same boundaries object, which keeps the plan (as it keeps the host's lengths)."""
    cached = getattr(cu_seq_lens, "block_plan", None)
    if cached is not None and cached[0] == most:
        return cached[1]
    lengths = getattr(cu_seq_lens, "host_lengths", None) or cu_seq_lens.diff().tolist()
    plan, at = [], 0
    for block in mask_blocks(lengths, min(most, max(lengths))):
        plan.append((at, sum(block), None if len(block) == 1 else block_mask(block, device)))
        at += sum(block)
    cu_seq_lens.block_plan = (most, plan)
    return plan


def block_mask(block: list[int], device: torch.device) -> Tensor:
    """[n, n] boolean: token i may see token j when both are in one document and j <= i."""
    doc = torch.repeat_interleave(torch.arange(len(block)), torch.tensor(block)).to(device)
    return (doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool, device=device).tril()
