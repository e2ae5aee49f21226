"""The trainer at the hardware's pace, checked on CPU: trainer.model.attention = "varlen" (packed rows
cut into their samples, trainer/packed_attention.py), trainer.model.compile (each decoder layer's
forward compiled, trainer/compiled_layers.py) and trainer.model.dtype = "auto" (trainer/compute_dtype.py).

The model is a tiny random Qwen2 with the dimensions tests/float32_rounding.py derives its bounds
for, loaded as the trainer loads it (load_model: FSDP2 on a one-rank gloo group, the logprob
head), its weights drawn wider than transformers' default so that a sample seeing its row
neighbours moves its logprobs far beyond rounding (checked: the same computation with the row
boundaries dropped fails each comparison). The CUDA kernels themselves (torch's varlen flash
attention, inductor's Triton code) are not run here: no GPU.
"""

from __future__ import annotations

import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from float32_rounding import LAYERS, LOGIT_ERROR, U, WIDEST
from rl.config import RunConfig
from samples import variable_batch
from trainer import packed_attention
from trainer.compiled_layers import compile_wanted
from trainer.compute_dtype import cpu_flags, resolve_dtype, slow_bf16_warning
from trainer.data import loss_weights, rank_micro_batches
from trainer.model import attention_implementation, load_model, micro_batch_logprobs

CPU = torch.device("cpu")
# A parameter's gradient chains the forward's products, the backward's (the same widths,
# transposed) and one sum over the micro-batch's tokens: normwise, within this many roundings
# (to first order, as float32_rounding.py bounds a logit) of its size.
GRADIENT_TERMS = 2 * (LAYERS * 6 + 1) * WIDEST


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, intermediate_size=WIDEST, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, tie_word_embeddings=True,
                      pad_token_id=0, initializer_range=0.1)
    path = tmp_path_factory.mktemp("packed_attention") / "tiny-qwen2"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def group():
    """A one-rank process group for FSDP2, as `rl trainer` makes one; gone after this module."""
    from trainer.parallel import init_distributed

    started = not dist.is_initialized()
    init_distributed(60)
    yield
    if started:
        dist.destroy_process_group()


def load(path, **model) -> torch.nn.Module:
    """`model`: keys of [trainer.model]."""
    cfg = RunConfig.model_validate({"model": str(path), "seq_len": 64, "trainer": {"model": model}})
    return load_model(cfg, CPU, trainable=True, dtype="float32")[0]


def micro_batches(packed: bool, seed: int = 1):
    batch = variable_batch(seed=seed, n=12)
    return rank_micro_batches(batch, 0, 1, row_len=128 if packed else None, per_micro_batch=2 if packed else 4,
                              pad_id=0, weights=loss_weights(batch, "token", 0))


def head_bound(model):
    """A hook on the model's head collecting, per forward, each position's rounding bound of a
    logit: LOGIT_ERROR * max_v sum_j |E_vj h_j|, h the head's input (tests/float32_rounding.py)."""
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(
        LOGIT_ERROR * (i[0].detach().abs() @ m.weight.detach().abs().T).amax(-1)))
    return seen, hook


def scored(model, mbs, grad: bool = True):
    """Per sample, its loss tokens' (logprobs, logit rounding bounds there); and each parameter's
    gradient of the weighted logprob sum (what the policy loss backpropagates through)."""
    model.zero_grad(set_to_none=True)
    seen, hook = head_bound(model)
    out: dict[int, list] = {}
    try:
        for mb in mbs:
            with torch.set_grad_enabled(grad):
                lp, _ = micro_batch_logprobs(model, mb, CPU, single_row=False)
            bound, mask = seen[-1], mb.loss_mask > 0
            if grad:
                (lp[mask] * mb.loss_weight[mask]).sum().backward()
            for row in range(mb.tokens.shape[0]):
                for i in mb.sequence_ids[row].unique().tolist():
                    at = (mb.sequence_ids[row] == i) & mask[row]
                    if i >= 0 and at.any():
                        out.setdefault(i, []).append((lp[row][at].detach(), bound[row, :-1][at]))
    finally:
        hook.remove()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()} if grad else {}
    return {i: tuple(torch.cat(x) for x in zip(*v)) for i, v in out.items()}, grads


def assert_same(got, want, tokens: int) -> None:
    """Two float32 computations of the same logprobs and gradients: each logprob within twice
    the two logits' bounds (its logit and the normaliser), each gradient normwise within
    GRADIENT_TERMS + tokens roundings."""
    (a, grads_a), (b, grads_b) = got, want
    assert sorted(a) == sorted(b)
    for i in a:
        bound = 2 * (a[i][1] + b[i][1])
        assert ((a[i][0] - b[i][0]).abs() <= bound).all(), f"sample {i}: {((a[i][0] - b[i][0]).abs() - bound).max()}"
    assert grads_a.keys() == grads_b.keys()
    for name, g in grads_b.items():
        err, allowed = float((grads_a[name] - g).norm()), (GRADIENT_TERMS + tokens) * U * float(g.norm())
        assert err <= allowed, f"{name}: gradient differs by {err:.3g} (allowed {allowed:.3g})"


def loss_tokens(mbs) -> int:
    return int(sum(mb.loss_mask.sum() for mb in mbs))


def test_varlen_gives_packed_samples_their_unpacked_logprobs_and_gradients(tiny, group, monkeypatch):
    varlen = load(tiny, attention="varlen")
    assert varlen.config._attn_implementation == "varlen"
    packed = micro_batches(packed=True)
    assert any(len({int(i) for i in row.unique()} - {-1}) > 2 for mb in packed for row in mb.sequence_ids)
    want = scored(load(tiny, attention="sdpa"), micro_batches(packed=False))
    got = scored(varlen, packed)
    assert_same(got, want, loss_tokens(packed))
    # The check can fail: with each row taken as one document, samples see their neighbours.
    monkeypatch.setattr(packed_attention, "document_lengths", lambda positions, mask, shape: [shape[1]] * shape[0])
    with pytest.raises(AssertionError, match="sample|gradient"):
        assert_same(scored(varlen, packed), want, loss_tokens(packed))


def test_varlen_padded_micro_batches_and_direct_calls_keep_samples_apart(tiny, group):
    """pack = false rows (each row's padding a document of its own), and a call with positions
    but no boundaries (found from the positions), as sdpa computes them."""
    sdpa, varlen = load(tiny, attention="sdpa"), load(tiny, attention="varlen")
    padded = micro_batches(packed=False)
    assert_same(scored(varlen, padded), scored(sdpa, padded), loss_tokens(padded))
    mb = micro_batches(packed=True)[0]
    logits = []
    for model in (varlen, sdpa):
        seen, hook = head_bound(model)
        with torch.no_grad():
            logits.append(model(input_ids=mb.tokens, position_ids=mb.position_ids, use_cache=False).logits)
        hook.remove()
        logits.append(seen[0])
    a, bound_a, b, bound_b = logits
    real = mb.tokens != 0  # padding tails differ (sdpa lets them see each other); they carry no loss
    assert ((a - b).abs()[real] <= (bound_a + bound_b)[real][:, None]).all()


@pytest.mark.parametrize("attention", ["sdpa", "varlen", "varlen_whole_rows"])
def test_a_packed_sample_never_sees_its_row_neighbours(tiny, group, monkeypatch, attention):
    """Changing a row's first sample leaves every other sample's logprobs bit for bit, its row
    neighbours' (which follow it, so causal attention alone would let them see it) included.
    varlen_whole_rows: the same with each row taken as one document, which must fail."""
    model = load(tiny, attention=attention.removesuffix("_whole_rows"))
    if attention.endswith("_whole_rows"):
        monkeypatch.setattr(packed_attention, "document_lengths", lambda positions, mask, shape: [shape[1]] * shape[0])
    mbs = micro_batches(packed=True)
    before, _ = scored(model, mbs, grad=False)
    mb = next(mb for mb in mbs if len(set(mb.sequence_ids[0].tolist()) - {-1}) >= 3)
    seq = mb.sequence_ids[0]
    victim = int(seq[seq >= 0][0])
    # Token t + 1 belongs to the sample that position t predicts in, and so does token t.
    at = torch.cat([seq == victim, torch.zeros(1, dtype=torch.bool)]) | torch.cat(
        [torch.zeros(1, dtype=torch.bool), seq == victim])
    mb.tokens[0][at] = (mb.tokens[0][at] + 7) % 30 + 2
    after, _ = scored(model, mbs, grad=False)
    assert not torch.equal(before[victim][0], after[victim][0])
    moved = [i for i in before if i != victim and not torch.equal(before[i][0], after[i][0])]
    neighbours = set(seq.tolist()) - {-1, victim}
    assert moved == ([] if attention != "varlen_whole_rows" else sorted(neighbours)), (victim, moved)


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler (g++)")
def test_compiled_layers_train_as_eager_ones_do_under_fsdp2_and_activation_checkpointing(tiny, group):
    from torch._dynamo.utils import counters

    mbs = micro_batches(packed=True)
    eager = scored(load(tiny, compile=False, activation_checkpointing=True), mbs)
    graphs = counters["stats"]["unique_graphs"]
    compiled = load(tiny, compile=True, activation_checkpointing=True)
    got = scored(compiled, mbs)
    assert counters["stats"]["unique_graphs"] > graphs  # compiled, not silently eager
    assert_same(got, eager, loss_tokens(mbs))
    assert list(compiled.state_dict()) == list(load(tiny).state_dict())  # no "_orig_mod." in the names


def test_compile_auto_is_on_for_cuda_full_fine_tuning_only():
    assert compile_wanted("auto", "cuda", lora=False, moe=False)
    assert not compile_wanted("auto", "cpu", lora=False, moe=False)
    assert not compile_wanted("auto", "cuda", lora=True, moe=False)
    assert not compile_wanted("auto", "cuda", lora=False, moe=True)
    assert compile_wanted(True, "cpu", lora=True, moe=True) and not compile_wanted(False, "cuda", False, False)


@pytest.mark.parametrize("dtype, device, capability, flash, want", [
    ("float32", "cpu", None, False, "varlen"), ("bfloat16", "cpu", None, False, "varlen"),
    ("float32", "cuda", (9, 0), False, "varlen"), ("bfloat16", "cuda", (9, 0), False, "varlen"),
    ("bfloat16", "cuda", (9, 0), True, "flash_attention_2"), ("bfloat16", "cuda", (7, 5), True, "varlen"),
    ("float32", "cuda", (9, 0), True, "varlen"),
])
def test_attention_auto_never_picks_a_masked_kernel(monkeypatch, dtype, device, capability, flash, want):
    """auto: flash-attn's kernel where it runs, else varlen (the flash kernel or SDPA per document):
    never sdpa, whose packed rows get a [T, T] mask."""
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: flash)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert attention_implementation("auto", dtype, torch.device(device)) == want
    assert attention_implementation("sdpa", dtype, torch.device(device)) == "sdpa"


@pytest.mark.parametrize("choice, device, flags, hidden, attention, want", [
    ("auto", "cuda", set(), 128, "auto", "bfloat16"),
    ("auto", "cpu", {"avx2", "fma"}, 4096, "auto", "float32"),  # emulated bf16: ~30x slower
    ("auto", "cpu", {"avx512f", "avx512_bf16"}, 896, "auto", "bfloat16"),
    ("auto", "cpu", {"amx_bf16"}, 384, "auto", "bfloat16"),  # configs/long.toml's model
    ("auto", "cpu", {"avx512_bf16"}, 128, "auto", "float32"),  # the demos' and tests' models
    ("auto", "cpu", {"avx2"}, 128, "flash_attention_2", "bfloat16"),  # flash has no float32 kernel
    ("float32", "cuda", set(), 4096, "auto", "float32"),
    ("bfloat16", "cpu", {"avx2"}, 128, "auto", "bfloat16"),  # asked for: kept, with a warning
])
def test_dtype_auto(choice, device, flags, hidden, attention, want):
    assert resolve_dtype(choice, device, flags, hidden, attention) == want


def test_explicit_bfloat16_on_an_emulating_cpu_warns_once_at_start(tmp_path, monkeypatch, caplog):
    from trainer import trainer as trainer_module
    from trainer.trainer import Trainer

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2 fma\n")
    assert cpu_flags(cpuinfo) == {"fpu", "sse2", "avx2", "fma"} and cpu_flags(tmp_path / "none") == set()
    monkeypatch.setattr(trainer_module, "cpu_flags", lambda: cpu_flags(cpuinfo))
    hf_config = Qwen2Config(hidden_size=896)
    stub = SimpleNamespace(device=CPU, rank=0)
    for dtype, want, warned in (("bfloat16", "bfloat16", 1), ("auto", "float32", 0), ("float32", "float32", 0)):
        caplog.clear()
        cfg = RunConfig.model_validate({"model": "m", "trainer": {"model": {"dtype": dtype}}})
        with caplog.at_level(logging.WARNING, logger="trainer"):
            assert Trainer.compute_dtype(stub, cfg, hf_config) == want
        assert [r.getMessage() for r in caplog.records] == [
            "trainer.model.dtype = bfloat16: this CPU has no native bf16 (no avx512_bf16/amx_bf16): matmuls run ~30x "
            "slower than float32; use auto or float32"] * warned
    assert slow_bf16_warning("bfloat16", "cpu", {"avx512_bf16"}) is None
    assert slow_bf16_warning("bfloat16", "cuda", set()) is None


def test_flash_attention_2_needs_bfloat16_or_auto():
    assert RunConfig.model_validate({"model": "m", "trainer": {"model": {"attention": "flash_attention_2"}}}).trainer.model.dtype == "auto"
    with pytest.raises(ValueError, match='trainer.model.attention = "flash_attention_2" needs trainer.model.dtype'):
        RunConfig.model_validate({"model": "m", "trainer": {"model": {"attention": "flash_attention_2", "dtype": "float32"}}})


# --- no [T, T] mask for packed rows (issue 63, item 5) ----------------------------------------


def sdpa_calls(monkeypatch) -> list[tuple[int, int, int]]:
    """Every SDPA call from here on, as (query length, key length, mask elements: 0 without one)."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, *args, **kwargs):
        calls.append((q.shape[-2], k.shape[-2], 0 if attn_mask is None else attn_mask[0, 0].numel()
                      if attn_mask.dim() == 4 else attn_mask.numel()))
        return sdpa(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    return calls


def test_auto_builds_no_row_sized_mask_for_packed_rows(tiny, group, monkeypatch):
    """The trainer's own forward (auto on this CPU: varlen) on packed rows (~120 wide): no SDPA call
    sees a mask or keys beyond the micro-batch's longest sample, forward and backward (activation
    checkpointing recomputes the forward); sdpa, measured the same way, gets a [T, T] mask per row."""
    mbs = micro_batches(packed=True)
    width = min(mb.tokens.shape[1] for mb in mbs)
    longest = max(max(packed_attention.document_lengths(mb.position_ids, None, mb.tokens.shape)) for mb in mbs)
    assert longest < width  # rows hold several samples: a row-sized block would be a [T, T] mask
    for checkpointing in (False, True):
        model = load(tiny, attention="auto", activation_checkpointing=checkpointing)
        assert model.config._attn_implementation == "varlen"
        calls = sdpa_calls(monkeypatch)
        scored(model, mbs)
        monkeypatch.undo()
        assert calls and all(keys <= longest and mask <= longest ** 2 for _, keys, mask in calls), calls
        assert any(mask for _, _, mask in calls)  # short samples did share blocks
    calls = sdpa_calls(monkeypatch)
    scored(load(tiny, attention="sdpa"), mbs, grad=False)
    assert any(mask == rows * rows >= width * width for rows, _, mask in calls)


def test_long_documents_run_alone_without_a_mask(monkeypatch):
    """A 3000-token document beside short ones: it runs alone and causal; the short ones share
    blocks of at most MASK_BLOCK_TOKENS; nothing holds a mask of the row's size."""
    lengths = [40, 3000, 300, 500, 700, 8]
    assert packed_attention.mask_blocks(lengths) == [[40], [3000], [300, 500], [700, 8]]
    assert packed_attention.mask_blocks([5, 5, 5], most=10) == [[5, 5], [5]]
    q, k, v = torch.randn(sum(lengths), 4, 8), torch.randn(sum(lengths), 2, 8), torch.randn(sum(lengths), 2, 8)
    calls = sdpa_calls(monkeypatch)
    packed_attention.per_document_attention(q, k, v, packed_attention.boundaries(lengths, CPU)["cu_seq_lens_q"],
                                            None)
    assert calls == [(40, 40, 0), (3000, 3000, 0), (800, 800, 800 ** 2), (708, 708, 708 ** 2)]


def attention_bound(q, k, v, mask, scale: float):
    """How far a float32 SDPA of float32 inputs may be from the exact output, per element
    [H, N, D]: the scores s = scale q.k are off by E <= gamma(D + 1) scale sum_d |q_d k_d| (the
    scaling one more rounding); softmax turns a shift of every score by at most E, the rounding of
    s - max (U * 2 max|s|), exp's own error (2 ULPS U) and the quotient (U) into a relative error of
    each weight, twice for numerator and normaliser, the normaliser's sum gamma(n); the weighted
    sum of values adds gamma(n); a blockwise (online) softmax rescales its running sums once per
    block, each an exp and a product: at most n blocks. All relative to sum_j p_j |v_j|, p the exact
    weights (to first order). q [H, N, D] (k, v repeated to H heads), mask [N, N] boolean."""
    from float32_rounding import ULPS, gamma

    q64, k64, v64 = q.double(), k.double(), v.double()
    n, dim = mask.sum(-1).max().item(), q.shape[-1]
    s = scale * q64 @ k64.transpose(-1, -2)
    magnitude = (scale * q64.abs() @ k64.abs().transpose(-1, -2)).masked_fill(~mask, 0)
    shift = gamma(dim + 1) * magnitude.amax(-1, keepdim=True)
    largest = s.masked_fill(~mask, 0).abs().amax(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    relative = (2 * (2 * shift + 2 * U * largest + 2 * ULPS * U + U) + gamma(n) + gamma(n)
                + n * 2 * (2 * ULPS * U + U))
    return p @ v64, relative * (p @ v64.abs())


def test_blocks_equal_the_masked_row_within_float32_rounding():
    """per_document_attention (blocks and single documents) against SDPA with the row's
    block-diagonal mask: each within attention_bound of the exact (float64) output, so within the
    sum of the two bounds of each other; the same with one boundary dropped fails."""
    torch.manual_seed(3)
    lengths = [7, 30, 1, 50, 12, 28]  # one row of 128, documents as packing leaves them
    width, heads, kv, dim = sum(lengths), 4, 2, 16
    q, k, v = torch.randn(width, heads, dim), torch.randn(width, kv, dim), torch.randn(width, kv, dim) * 3
    cu = packed_attention.boundaries(lengths, CPU)["cu_seq_lens_q"]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (doc[:, None] == doc[None, :]) & torch.ones(width, width, dtype=torch.bool).tril()
    kh, vh = (x.transpose(0, 1).repeat_interleave(heads // kv, 0) for x in (k, v))
    exact, bound = attention_bound(q.transpose(0, 1), kh, vh, mask, dim ** -0.5)
    masked = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        enable_gqa=True)[0]
    assert ((masked.double() - exact).abs() <= bound).all()
    for most in (1, 40, packed_attention.MASK_BLOCK_TOKENS):  # one document per call; blocks; one block
        got = packed_attention.per_document_attention(q, k, v, cu, None, most=most).transpose(0, 1)
        assert ((got.double() - exact).abs() <= bound).all(), most
        assert ((got - masked).abs() <= 2 * bound).all(), most
    merged = packed_attention.boundaries([7 + 30, 1, 50, 12, 28], CPU)["cu_seq_lens_q"]
    wrong = packed_attention.per_document_attention(q, k, v, merged, None).transpose(0, 1)
    assert not ((wrong - masked).abs() <= 2 * bound).all()


# --- which varlen kernel runs, decided from torch's signature (issue 60, item 5) -----------------


def test_the_start_up_line_says_which_kernel_runs(monkeypatch, caplog):
    """With the device faked: on an H100-class GPU in bfloat16 the flash kernel (as this torch takes
    GQA), on a Turing GPU or in float32 SDPA per document, saying why."""
    for cache in (packed_attention.describe, packed_attention.announce, packed_attention.ampere,
                  packed_attention.installed_kernel):
        cache.cache_clear()
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="trainer"):
        packed_attention.register(cuda, torch.bfloat16)
        packed_attention.register(cuda, torch.bfloat16)  # the reference model: said once
        packed_attention.register(cuda, torch.float32)
        capability["value"] = (7, 5)
        packed_attention.ampere.cache_clear()
        packed_attention.describe.cache_clear()
        packed_attention.announce.cache_clear()
        packed_attention.register(cuda, torch.bfloat16)
        packed_attention.register(CPU, torch.float32)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert lines[0] == ('attention = "varlen" on cuda in bfloat16: torch.nn.attention.varlen\'s flash kernel '
                        "(window_size for causality, enable_gqa)")
    assert lines[1].startswith('attention = "varlen" on cuda in float32: SDPA per document (float32 on cuda)')
    assert "(the flash kernel needs Ampere or newer)" in lines[2]
    assert "(float32 on cpu)" in lines[3] and "no [T, T] mask" in lines[3]
    for cache in (packed_attention.describe, packed_attention.announce, packed_attention.ampere,
                  packed_attention.installed_kernel):
        cache.cache_clear()
