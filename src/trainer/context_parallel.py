"""Context parallelism: every row of a micro-batch split across the ranks of a context group,
each holding a contiguous share of its tokens, attention exact across the split.

How (docs/trainer.md, "Parallelism", says why this and not Ulysses or ring attention): each
rank embeds and runs every layer on its own share only; at each attention it gathers the
shares' keys and values from the group (all-gather: with grouped-query attention they are a
small part of a layer's activations, e.g. 2 of Qwen2.5-0.5B's 14 heads) and attends its own
queries to them, document by document (the packed samples are known on the host, from the
whole row's position ids). A document that began on an earlier rank is attended in two parts,
the keys before the share (all visible) and the share's own causal block, merged exactly by
their log-sum-exps; the backward gives each part the merged output and log-sum-exp
(FlashAttention-2's identity), and the keys' and values' gradients go back to the ranks that
own them (reduce-scatter; all-reduce and slice on gloo, which has no reduce-scatter). The
positions (rotary) are the whole row's, sliced, so each token sits where it would unsplit.

After the last layer each rank's LogprobHead computes its share's logprobs and entropy; the
group gathers them into whole rows, and every rank computes the loss on the whole micro-batch,
identically: sequence-level ratios, teacher signals, the sampling mask's sums see every token.
The gather's backward hands each rank its own share of the (identical) gradient, so the group's
gradients add up to the unsplit micro-batch's once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

NAME = "context"


@dataclass(frozen=True)
class ContextShare:
    """A rank's place in its context group: `size` ranks (1: no context parallelism), this one
    the `index`-th share of every row."""

    group: dist.ProcessGroup | None
    size: int
    index: int

    def span(self, width: int) -> tuple[int, int, int]:
        """(padded width, start, stop): rows are padded to a multiple of size, then cut evenly."""
        padded = -(-width // self.size) * self.size
        n = padded // self.size
        return padded, self.index * n, (self.index + 1) * n

    def local(self, x: Tensor, fill, width: int | None = None) -> Tensor:
        """This rank's share of a per-position tensor [R, T, ...] laid out over `width` positions
        (T, or T - 1 for per-predicted-token fields), padded with `fill`."""
        padded, start, stop = self.span(x.shape[1] if width is None else width)
        if x.shape[1] < padded:
            x = torch.cat([x, x.new_full((x.shape[0], padded - x.shape[1], *x.shape[2:]), fill)], 1)
        return x[:, start:stop]


# --- collectives with their gradients ---------------------------------------------------------


class _GatherShares(torch.autograd.Function):
    """[.., n, ..] shares along `dim` -> the group's [.., size * n, ..]; backward: each share's
    gradient summed over the group (whose every member used the whole)."""

    @staticmethod
    def forward(ctx, x: Tensor, share: ContextShare, dim: int) -> Tensor:
        ctx.share, ctx.dim = share, dim
        parts = [torch.empty_like(x) for _ in range(share.size)]
        dist.all_gather(parts, x.contiguous(), group=share.group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        share, dim = ctx.share, ctx.dim
        parts = [p.contiguous() for p in grad.chunk(share.size, dim)]
        if dist.get_backend(share.group) == dist.Backend.NCCL:
            out = torch.empty_like(parts[share.index])
            dist.reduce_scatter(out, parts, group=share.group)
            return out, None, None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=share.group)  # gloo has no reduce-scatter
        return grad.chunk(share.size, dim)[share.index].contiguous(), None, None


class _GatherIdentical(_GatherShares):
    """_GatherShares' forward, for a result every member then uses identically (the loss, computed
    on the whole micro-batch by each): backward takes this rank's share of the gradient, which
    is the same on every member, without summing it `size` times."""

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.chunk(ctx.share.size, ctx.dim)[ctx.share.index].contiguous(), None, None


def gather_shares(x: Tensor, share: ContextShare, dim: int) -> Tensor:
    return _GatherShares.apply(x, share, dim)


def gather_identical(x: Tensor, share: ContextShare, dim: int) -> Tensor:
    return _GatherIdentical.apply(x, share, dim)


# --- attention across the split ---------------------------------------------------------------


@dataclass(frozen=True)
class Pieces:
    """What the attention function needs to know about the split, handed to the model as a
    keyword argument (transformers passes it to every layer's attention; activation
    checkpointing keeps it for the recomputation): per (row, document) met by this share, the
    share-local query range [q0, q1) and where the document starts in the row (key index s),
    keys [s, start + q1) of the gathered row."""

    share: ContextShare
    start: int  # the share's first position in the padded row
    pieces: tuple[tuple[int, int, int, int], ...]  # (row, q0, q1, s)


def pieces(share: ContextShare, lengths: list[int], rows: int, padded: int) -> Pieces:
    """Pieces from the documents' lengths (row after row, packed_attention.document_lengths of
    the padded micro-batch)."""
    _, start, stop = share.span(padded)
    out, at = [], 0
    for n in lengths:
        row, s = divmod(at, padded)
        q0, q1 = max(s, start), min(s + n, stop)
        if q0 < q1:
            out.append((row, q0 - start, q1 - start, s))
        at += n
    assert at == rows * padded, (at, rows, padded)
    return Pieces(share, start, tuple(out))


def _attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    """(out, logsumexp [B, H, L] float32) of one block: the fused kernel (flash on CPU; flash on
    CUDA, half precision)."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                     scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    if q.is_cuda:
        cum = torch.empty(0, dtype=torch.int32, device=q.device)
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum, cum, q.shape[2], k.shape[2], 0.0, causal, zero, zero, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _parts(q0: int, q1: int, s: int, start: int) -> list[tuple[int, int, bool]]:
    """A piece's key blocks in the gathered row: before the share (all visible), then causal."""
    own = (start + q0, start + q1, True)
    return [(s, start + q0, False), own] if s < start + q0 else [own]


def _heads(x: Tensor, repeat: int) -> Tensor:
    return x.repeat_interleave(repeat, 1) if repeat > 1 else x


def _unheads(grad: Tensor, repeat: int) -> Tensor:
    """The gradient of _heads: the repeated heads' gradients summed onto their key head."""
    if repeat == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.view(b, h // repeat, repeat, n, d).sum(2)


class _PiecewiseAttention(torch.autograd.Function):
    """q [R, Hq, n, D] (the share's queries), k and v [R, Hkv, T, D] (the gathered row) ->
    [R, Hq, n, D]. Key heads are repeated to Hq block by block (the fused CPU kernel wants as many
    as query heads): the saved gathered row stays Hkv wide."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, p: Pieces, scale: float | None) -> Tensor:
        repeat = q.shape[1] // k.shape[1]
        out = torch.zeros_like(q)
        lse = torch.zeros(q.shape[:3], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                          device=q.device)
        for row, q0, q1, s in p.pieces:
            qq = q[row:row + 1, :, q0:q1]
            got = [_attend(qq, _heads(k[row:row + 1, :, a:b], repeat), _heads(v[row:row + 1, :, a:b], repeat),
                           causal, scale) for a, b, causal in _parts(q0, q1, s, p.start)]
            if len(got) == 1:
                o, l = got[0]
            else:  # exact merge of two softmax blocks by their log-sum-exps
                (o1, l1), (o2, l2) = got
                l = torch.logaddexp(l1, l2)  # float32 (float64 for a float64 model)
                o = (o1.to(l.dtype) * (l1 - l).exp()[..., None] + o2.to(l.dtype) * (l2 - l).exp()[..., None])
                o = o.to(q.dtype)
            out[row:row + 1, :, q0:q1] = o
            lse[row:row + 1, :, q0:q1] = l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.p, ctx.scale = p, scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        p, scale = ctx.p, ctx.scale
        repeat = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dout = dout.contiguous()
        for row, q0, q1, s in p.pieces:
            r, qs = slice(row, row + 1), slice(q0, q1)
            for a, b, causal in _parts(q0, q1, s, p.start):
                # Each block's gradient from the merged output and log-sum-exp: P = exp(S - lse).
                gq, gk, gv = _attend_backward(dout[r, :, qs], q[r, :, qs], _heads(k[r, :, a:b], repeat),
                                              _heads(v[r, :, a:b], repeat), out[r, :, qs], lse[r, :, qs], causal,
                                              scale)
                dq[r, :, qs] += gq
                dk[r, :, a:b] += _unheads(gk, repeat)
                dv[r, :, a:b] += _unheads(gv, repeat)
        return dq, dk, dv, None, None


def context_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                              attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              sliding_window: int | None = None, context_pieces: Pieces | None = None,
                              **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function interface (query [B, Hq, n, D], key and value
    [B, Hkv, n, D] -> [B, n, Hq, D]). Without `context_pieces` (a call not split: the logprob
    head's probe), trainer/packed_attention.py's document-masked attention."""
    if context_pieces is None:
        from trainer.packed_attention import varlen_attention_forward

        return varlen_attention_forward(module, query, key, value, attention_mask, dropout, scaling,
                                        sliding_window, **kwargs)
    if dropout or sliding_window is not None:
        raise NotImplementedError("trainer.parallel.context > 1: no attention dropout or sliding window")
    share = context_pieces.share
    key, value = (gather_shares(x, share, 2) for x in (key, value))
    out = _PiecewiseAttention.apply(query.contiguous(), key.contiguous(), value.contiguous(), context_pieces,
                                    scaling)
    return out.transpose(1, 2), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, context_attention_forward)
