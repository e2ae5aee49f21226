"""Keep Sampling Mask (trainer/sampling_mask.py): the trainer renormalises over the tokens the
sampler kept. Against vLLM's own masking code on random logits, and against a real vLLM server
(the project's `rl inference`, processed logprobs) on the tiny chat model: on-policy, the
trainer's masked logprobs match the engine's to float32 rounding, the unmasked ones are off by
exactly log(kept mass), and the kept sets rebuilt from the trainer's logits are the sampler's."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from conftest import ROOT
from rl.batch import Batch, Sample
from rl.config import LossConfig
from trainer.data import loss_weights, rank_micro_batches
from trainer.loss import policy_loss, token_logprobs_and_entropy
from trainer.sampling_mask import Truncation, kept_mask

CHAT_MODEL = ROOT / "models" / "tiny-chat"
TEMPERATURE, TOP_P, TOP_K = 0.9, 0.7, 5
PROMPTS = ["Spell this word backward (example: sun -> nus): ammonia",
           "Spell this word backward (example: sun -> nus): garden", "hello there"]


def vllm_kept(scaled: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """What vLLM 0.32's own code keeps: MinPLogitsProcessor.apply, then apply_top_k_top_p_pytorch
    (the path its CPU sampler takes without triton), in the sampler's order."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = scaled.clone()
    if bool((min_p > 0).any()):
        proc = object.__new__(MinPLogitsProcessor)  # only apply()'s two attributes are needed
        proc.min_p, proc.min_p_count = min_p[:, None].clone(), int((min_p > 0).sum())
        x = proc.apply(x)
    vocab = x.shape[-1]
    k = torch.where((k > 0) & (k < vocab), k, vocab).int()  # vLLM's "off" is k = vocab
    use_p = p if bool((p < 1).any()) else None  # vLLM passes None when no request uses top_p
    return apply_top_k_top_p_pytorch(x, k, use_p, allow_cpu_sync=True) > float("-inf")


@pytest.mark.parametrize("case", ["top_k", "top_p", "min_p", "all", "mixed_rows"])
def test_kept_mask_is_vllms_on_random_logits(case):
    torch.manual_seed(0)
    n, vocab = 300, 1000
    scaled = torch.randn(n, vocab) * 4
    k = torch.randint(1, 40, (n,)) if case in ("top_k", "all", "mixed_rows") else torch.full((n,), -1)
    p = torch.rand(n) * 0.95 + 0.05 if case in ("top_p", "all", "mixed_rows") else torch.ones(n)
    min_p = torch.rand(n) * 0.2 if case in ("min_p", "all", "mixed_rows") else torch.zeros(n)
    if case == "mixed_rows":  # rows with each setting off, as an engine batch mixes requests
        k[::3], p[1::3], min_p[2::3] = -1, 1.0, 0.0
    mine = kept_mask(scaled, k, p, min_p)
    assert torch.equal(mine, vllm_kept(scaled, k, p, min_p))
    assert mine.any(-1).all() and (mine.sum(-1) < vocab).all()


def test_masked_logprobs_keep_their_gradient_on_the_kept_set_only():
    torch.manual_seed(1)
    logits = torch.randn(1, 6, 12, requires_grad=True)
    tokens = torch.randint(0, 12, (1, 6))
    settings = (torch.full((1, 5), 3), torch.full((1, 5), 0.9), torch.zeros(1, 5))
    select = torch.tensor([[False, True, True, True, True]])
    trunc = Truncation(*settings, select)
    logprobs, entropy = token_logprobs_and_entropy(logits, tokens, 1.0, trunc)
    logprobs.sum().backward()
    keep = kept_mask(logits.detach()[0, :-1], *(s[0] for s in settings))
    keep[torch.arange(5), tokens[0, 1:]] = True  # the sampled token is always kept
    grad = logits.grad[0, :-1]
    assert torch.isfinite(grad).all() and torch.isfinite(entropy).all()
    assert (grad[1:][~keep[1:]] == 0).all() and (grad[0] != 0).all()  # position 0 is not selected
    want = torch.log_softmax(logits.detach()[0, :-1].masked_fill(~keep, float("-inf")), -1)
    assert torch.allclose(logprobs[0, 1:], want[torch.arange(1, 5), tokens[0, 2:]], atol=1e-6)
    assert trunc.misses == float((~kept_mask(logits.detach()[0, 1:-1], *(s[0, 1:] for s in settings))
                                  [torch.arange(4), tokens[0, 2:]]).sum())


# --- against a real vLLM server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_end_to_end import launch_server, wait_healthy

    tmp = tmp_path_factory.mktemp("sampling_mask")
    proc, url = launch_server(tmp, "inference", CHAT_MODEL, tmp / "run", seq_len=128)
    wait_healthy(proc, url)
    yield url
    proc.stop()


def prompt_ids() -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(CHAT_MODEL / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


def sampled_batch(url: str) -> Batch:
    """Samples from /generate (the route the orchestrator uses) at TEMPERATURE, TOP_P, TOP_K."""
    samples = []
    for i, prompt in enumerate(prompt_ids()):
        r = httpx.post(f"{url}/generate", timeout=120, json={
            "request_id": f"mask-{i}", "prompt_token_ids": prompt, "n": 16, "max_tokens": 24,
            "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K})
        r.raise_for_status()
        for s in r.json()["samples"]:
            samples.append(Sample.single_turn(prompt, s["token_ids"], s["logprobs"], s["versions"], 0.0, 1.0,
                                              temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K))
    return Batch.from_samples(1, samples)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(CHAT_MODEL, dtype=torch.float32).eval()


def trainer_view(model, batch: Batch, mask: bool) -> dict:
    """What the trainer computes on the batch at step 1 (same weights as sampled): its
    micro-batches, logprobs with or without the mask, and the loss's mismatch_kl."""
    vocab = model.config.vocab_size
    mbs = rank_micro_batches(batch, 0, 1, row_len=None, per_micro_batch=8, pad_id=0,
                             weights=loss_weights(batch, "token", 0))
    tokens = kl = 0.0
    diffs = []
    for mb in mbs:
        trunc = mb.truncation(vocab) if mask else None
        with torch.no_grad():
            logits = model(input_ids=mb.tokens, attention_mask=mb.attention_mask, use_cache=False).logits
            logprobs, _ = token_logprobs_and_entropy(logits, mb.tokens, mb.temperature, trunc)
        out = policy_loss(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask, mb.loss_weight,
                          mb.sequence_ids, LossConfig())
        tokens, kl = tokens + out.tokens, kl + out.mismatch_kl_sum
        on = mb.loss_mask > 0
        diffs.append((logprobs - mb.inference_logprobs)[on])
    return {"mismatch_kl": kl / tokens, "diff": torch.cat(diffs), "tokens": tokens}


@pytest.mark.slow
def test_on_policy_mismatch_kl_is_rounding_with_the_mask_and_the_kept_mass_without(server, model):
    batch = sampled_batch(server)
    masked, full = trainer_view(model, batch, mask=True), trainer_view(model, batch, mask=False)
    assert masked["tokens"] >= 100, masked["tokens"]
    # float32 on both sides, different kernels: per-token logprobs agree to ~1e-5, so
    # k3 ~ d^2 / 2 ~ 1e-10; 1e-6 leaves four orders of magnitude for kernel differences.
    assert masked["mismatch_kl"] < 1e-6, masked
    assert masked["diff"].abs().max() < 1e-3
    # Without the mask each token's log ratio is log(kept mass) <= 0, exactly (the engine's
    # logprob is the trainer's full-vocabulary one minus that): strictly biased low.
    assert (full["diff"] <= 1e-4).all()
    assert full["mismatch_kl"] > 1e3 * max(masked["mismatch_kl"], 1e-9), (full["mismatch_kl"], masked["mismatch_kl"])
    print(f"\nmismatch_kl with mask {masked['mismatch_kl']:.3e}, without {full['mismatch_kl']:.3e} "
          f"over {masked['tokens']:.0f} tokens; mean log(kept mass) {full['diff'].mean():.4f}")


@pytest.mark.slow
def test_rebuilt_kept_sets_are_the_samplers(server, model):
    """The sampler's kept set for each generated token: its processed top logprobs (top 10 >
    top_k 5 covers the set), finite exactly on the kept tokens (vLLM writes -inf as -9999)."""
    checked = 0
    for prompt in prompt_ids():
        r = httpx.post(f"{server}/v1/completions", timeout=120, json={
            "model": str(CHAT_MODEL), "prompt": prompt, "n": 16, "max_tokens": 24, "temperature": TEMPERATURE,
            "top_p": TOP_P, "top_k": TOP_K, "logprobs": 10, "return_token_ids": True,
            "return_tokens_as_token_ids": True})
        r.raise_for_status()
        for choice in r.json()["choices"]:
            ids = prompt + choice["token_ids"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, len(prompt) - 1:-1] / TEMPERATURE
            n = logits.shape[0]
            keep = kept_mask(logits, torch.full((n,), TOP_K), torch.full((n,), TOP_P), torch.zeros(n))
            for t, top in enumerate(choice["logprobs"]["top_logprobs"]):
                sampler = {int(key.split(":")[1]) for key, lp in top.items() if lp > -9999}
                assert sampler == set(keep[t].nonzero().flatten().tolist()), (t, top)
                assert choice["token_ids"][t] in sampler
                checked += 1
    assert checked >= 100
    print(f"\n{checked} tokens' kept sets agree")


def test_truncation_selects_only_truncated_loss_tokens():
    """Untruncated samples (and prompts) are never touched: a batch without top_k/top_p/min_p
    pays nothing."""
    plain = Sample.single_turn([1, 2], [3, 4], [-0.1, -0.2], [0, 0], 0.0, 1.0)
    cut = Sample.single_turn([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [0, 0, 0], 0.0, 1.0, top_p=0.8)
    for batch, want in ((Batch.from_samples(1, [plain, plain]), None), (Batch.from_samples(1, [plain, cut]), 3)):
        for row_len in (None, 16):
            (mb,) = rank_micro_batches(batch, 0, 1, row_len=row_len, per_micro_batch=2, pad_id=0,
                                       weights=loss_weights(batch, "token", 0))
            trunc = mb.truncation(vocab=10)
            assert (trunc is None) if want is None else int(trunc.select.sum()) == want
            if trunc is not None:
                assert math.isclose(float(trunc.top_p[trunc.select].max()), 0.8, rel_tol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mask", [True, False])
def test_the_trainer_program_masks_truncated_samples_and_warns_without(server, tmp_path, write_toml, mask):
    """Step 1 of `rl trainer` on a batch sampled with top_p/top_k: with the mask its
    mismatch_kl is rounding; without, it is the kept-mass bias, and the trainer warns, naming
    the cause."""
    from conftest import rl_command
    from rl.rundir import RunDir
    from test_trainer import run_trainer, trainer_metrics

    run = RunDir(tmp_path / "run")
    sampled_batch(server).write(run.rollout_dir(1))
    cfg = write_toml(f'model = "{CHAT_MODEL}"\noutput_dir = "{run.root}"\nmax_steps = 1\nseq_len = 128\n'
                     f"[trainer]\ntorch_threads = 1\nsampling_mask = {str(mask).lower()}\n")
    log = run_trainer(rl_command("trainer"), ["@", str(cfg)])
    (m,) = trainer_metrics(run)
    assert m["truncated_frac"] == 1.0
    if mask:
        assert m["mismatch_kl"] < 1e-6 and m["sampling_mask_miss_frac"] == 0.0, m
        assert "above trainer.mismatch_kl_warn" not in log
    else:
        assert m["mismatch_kl"] > 1e-2, m
        assert "above trainer.mismatch_kl_warn" in log and "trainer.sampling_mask = false" in log, log[-2000:]
