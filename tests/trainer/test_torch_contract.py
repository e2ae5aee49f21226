"""The torch contract: the signatures and behaviours of torch (and transformers) that
trainer/packed_attention.py and rl/gpu_placement.py rely on, held against the installed torch
(2.13, CPU build) and, for torch.nn.attention.varlen, against torch 2.11's as read from its
source (the GPU machine's torch; no GPU here to import it on). An upgrade that moves one fails
here, naming it, instead of turning the flash kernel off at a user's first step (issue 60:
2.11's varlen_attn has no enable_gqa, and a check that asked for it ran SDPA with a [T, T] mask).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from trainer import packed_attention

# torch.nn.attention.varlen.varlen_attn's parameters in torch 2.11 (pytorch/pytorch's
# torch/nn/attention/varlen.py as the search tool's copy holds it, commit 000459dc): no enable_gqa,
# no head-count check before torch.ops.aten._flash_attention_forward (FA2's kernel, which takes
# Hkv dividing Hq), causality from window_size == (-1, 0), and _should_use_cudnn returning False.
TORCH_2_11_VARLEN = {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux", "scale",
                     "window_size", "k_cache", "v_cache", "cache_seqlens", "cache_batch_idx", "page_table",
                     "seqused_k"}
POSITIONAL = ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"]  # as flash_varlen passes them


def params(function) -> set[str]:
    return set(inspect.signature(function).parameters)


def test_varlen_attn_takes_what_flash_varlen_passes():
    from torch.nn.attention import varlen

    signature = inspect.signature(varlen.varlen_attn).parameters
    assert list(signature)[:7] == POSITIONAL
    assert all(signature[n].kind == inspect.Parameter.KEYWORD_ONLY for n in ("scale", "window_size", "enable_gqa"))
    kernel = packed_attention.kernel_for(params(varlen.varlen_attn), cudnn=False)
    assert kernel is not None and kernel.causal == ("window_size", (-1, 0)) and kernel.gqa == "flag"
    # 2.11's: the same positions, causal the same way, GQA left to flash's kernel.
    assert set(POSITIONAL) <= TORCH_2_11_VARLEN
    assert packed_attention.kernel_for(TORCH_2_11_VARLEN, cudnn=False).gqa == "native"


def test_causality_is_a_window_of_minus_one_zero_compared_as_a_tuple():
    """varlen_attn decides `is_causal = window_size == (-1, 0)`: a list [-1, 0] would be
    non-causal attention, silently. Kernel.causal passes the tuple."""
    from torch.nn.attention import varlen

    source = Path(varlen.__file__).read_text()
    assert "is_causal = window_size == (-1, 0)" in source
    assert packed_attention.kernel_for(TORCH_2_11_VARLEN, False).causal[1] == (-1, 0)


def test_the_cudnn_switch_is_where_installed_kernel_asks():
    """installed_kernel asks varlen._should_use_cudnn(device index) whether cuDNN (no GQA) would run."""
    from torch.nn.attention import varlen

    assert list(inspect.signature(varlen._should_use_cudnn).parameters) == ["device_index"]
    assert varlen._should_use_cudnn(0) is False  # 2.13 (and 2.11): always flash
    assert "GQA is not supported with the cuDNN backend" in Path(varlen.__file__).read_text()


def test_sdpa_takes_what_the_per_document_path_passes():
    """A builtin (no signature to read): called as per_document_attention calls it, GQA included."""
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    masked = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, is_causal=False, scale=0.5,
                                                              enable_gqa=True)
    causal = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=None, is_causal=True, scale=0.5,
                                                              enable_gqa=True)
    assert masked.shape == (1, 4, 3, 8) and torch.allclose(masked, causal)


def test_the_gpu_memory_probe_reads_what_torch_has():
    """rl/gpu_placement.py's torch_memory_gib: torch.cuda.is_available, device_count and
    get_device_properties(index).total_memory (the latter from the type stubs: a CPU build has no
    CUDA device properties type to read)."""
    assert list(inspect.signature(torch.cuda.get_device_properties).parameters) == ["device"]
    assert callable(torch.cuda.device_count) and callable(torch.cuda.is_available)
    stubs = (Path(torch.__file__).parent / "_C" / "__init__.pyi").read_text()
    at = stubs.index("class _CudaDeviceProperties")
    assert "total_memory: _int" in stubs[at:at + 2000]


def test_transformers_passes_the_boundaries_to_the_attention_function():
    """forward_logits hands cu_seq_lens_q and max_length_q to the model; transformers' decoder
    layers pass their keyword arguments on to the registered attention function, and builds no
    mask for an implementation with no mask function registered (masking_utils)."""
    import transformers.masking_utils as masking
    from transformers import AttentionInterface

    assert callable(AttentionInterface.register)
    source = Path(masking.__file__).read_text()
    assert "if config._attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:" in source
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs

    assert {"cu_seq_lens_q", "max_length_q"} <= set(FlashAttentionKwargs.__annotations__)


def test_the_kernel_is_called_as_each_torch_signature_allows(monkeypatch):
    """2.13's varlen_attn refuses Hq != Hkv without enable_gqa; 2.11's has no such argument and
    passes the KV heads to flash's kernel (GQA native); a cuDNN path (no GQA) gets them expanded;
    an is_causal-style signature is made causal that way. (The signatures themselves are pinned
    above.)"""
    from torch.nn.attention import varlen

    installed, seen = params(varlen.varlen_attn), []
    monkeypatch.setattr(varlen, "varlen_attn", lambda q, k, v, *args, **kw: seen.append((k, v, args, kw)) or q)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cu = packed_attention.boundaries([4, 6], torch.device("cpu"))["cu_seq_lens_q"]
    for parameters, cudnn, heads, keywords in [
        (installed, False, 2, {"window_size": (-1, 0), "enable_gqa": True}),
        (TORCH_2_11_VARLEN, False, 2, {"window_size": (-1, 0)}),
        (TORCH_2_11_VARLEN, True, 4, {"window_size": (-1, 0)}),
        (TORCH_2_11_VARLEN - {"window_size"} | {"is_causal"}, False, 2, {"is_causal": True}),
    ]:
        kernel = packed_attention.kernel_for(parameters, cudnn)
        packed_attention.flash_varlen(q, k, v, cu, 6, 0.5, kernel)
        got_k, got_v, args, kw = seen.pop()
        assert got_k.shape[1] == got_v.shape[1] == heads and args == (cu, cu, 6, 6)
        assert kw == {"scale": 0.5, **keywords}, kernel
        if heads == 4:  # each query head's KV head as transformers' repeat_kv pairs them
            assert torch.equal(got_k[:, 1], k[:, 0]) and torch.equal(got_k[:, 2], k[:, 1])
    assert packed_attention.kernel_for(TORCH_2_11_VARLEN - {"window_size"}, False) is None
    assert packed_attention.kernel_for(TORCH_2_11_VARLEN - {"scale"}, False) is None
