"""Keep Sampling Mask (trainer/sampling_mask.py): the trainer renormalises over the tokens the
sampler kept. Against vLLM's own masking code on random logits, and against a real vLLM server
(the project's `rl inference`, processed logprobs) on the tiny chat model: on-policy, the
trainer's masked logprobs match the engine's to float32 rounding, the unmasked ones are off by
exactly log(kept mass), and the kept sets rebuilt from the trainer's logits are the sampler's.

"To float32 rounding" is derived, not measured (CPUs differ in the last bits: AMD or Intel with
AMX, other kernels, other summation orders): tests/inference/test_inference_lora.py's bound on how far
float32 rounding may move a logit of the tiny models (LOGIT_ERROR times the scale of the logit's
own terms, any summation order) holds for the engine and for the trainer alike, so their logits
differ by at most twice it. Where a token sits that close to a top-k or top-p boundary, either
side may keep it: `kept_bounds` gives, per position, the tokens surely kept and those possibly
kept under any such difference; the sampler's set and the rebuilt one both lie between the two,
and equal each other wherever the two coincide (most positions)."""

from __future__ import annotations


import httpx
import pytest
import torch

from conftest import ROOT
from float32_rounding import U, gamma, k3, k3_error, kept_bounds, log_softmax_error, logits_and_gap
from rl.batch import Batch
from rl.config import LossConfig
from trainer.data import loss_weights, rank_micro_batches
from trainer.loss import policy_loss, token_logprobs_and_entropy
from trainer.sampling_mask import NO_TRUNCATION, Truncation, kept_mask
from samples import single_turn, write_batch

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
    # Exact (float64) against the trainer's float32 log_softmax: within its rounding.
    want = torch.log_softmax(logits.detach()[0, :-1].double().masked_fill(~keep, float("-inf")), -1)
    rounding = log_softmax_error(12, float(logits.detach().abs().max()))
    assert ((logprobs[0, 1:] - want[torch.arange(1, 5), tokens[0, 2:]]).abs() <= rounding).all()
    assert trunc.misses == float((~kept_mask(logits.detach()[0, 1:-1], *(s[0, 1:] for s in settings))
                                  [torch.arange(4), tokens[0, 2:]]).sum())


# --- against a real vLLM server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from programs import launch_server, wait_healthy

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
            "request_id": f"mask-{i}", "prompt_token_ids": prompt, "n": 32, "max_tokens": 24,
            "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K})
        r.raise_for_status()
        for s in r.json()["samples"]:
            samples.append(single_turn(prompt, s["token_ids"], s["logprobs"], s["versions"], 0.0, 1.0,
                                              temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K))
    return Batch.from_samples(1, samples)


@pytest.fixture(scope="module")
def sampled(server) -> Batch:
    """One sampled batch for the tests below: each only reads it (the trainer program's tests
    write it to their own run)."""
    return sampled_batch(server)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    # One thread for the test's own forwards (some 170 of them, each a few tiny matrix products):
    # torch's default (a thread per core), next to the engine, the trainer program and the other
    # workers on 2 cores, spends far more in its threads' spin-waits than in them (profiled on a
    # loaded machine: 0.4 s a forward, 70 s of this file). The bounds compared with hold for any
    # summation order, so the thread count changes nothing they assert. Restored for the tests
    # of other files on this worker.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AutoModelForCausalLM.from_pretrained(CHAT_MODEL, dtype=torch.float32).eval()
    torch.set_num_threads(threads)


def trainer_view(model, batch: Batch, mask: bool, bounds: bool = True) -> dict:
    """What the trainer computes on the batch at step 1 (same weights as sampled): its
    micro-batches, logprobs with or without the mask, and the loss's mismatch_kl; and per loss
    token (in the same order) what float32 rounding allows:
    - "gap": how far another float32 implementation's scaled logits (the engine's, the trainer
      program's) may lie from these;
    - "spread": log of the mass of the tokens possibly kept over that of those surely kept (the
      sampled token in both; 0 unless a token sits within rounding of a boundary);
    - "log_kept": log of the mass the rebuilt set (and the sampled token) holds, of all;
    - "log_possible": the same for the tokens possibly kept;
    - "may_miss": the sampled token is not surely kept (a miss is possible);
    - "largest": the largest |scaled logit| (float32 log_softmax's rounding grows with it).
    The masked logprob here is then within 2 * gap + spread of the engine's (the token's logit,
    the normaliser, and a kept set between the sure and the possible one on either side).
    bounds=False: "gap" only of these (the others are the same for either mask: one view's do)."""
    vocab = model.config.vocab_size
    mbs = rank_micro_batches(batch, 0, 1, row_len=None, per_micro_batch=8, pad_id=0,
                             weights=loss_weights(batch, "token", 0))
    tokens = kl = 0.0
    diffs, gaps, spreads, log_kept, log_possible, may_miss, largest = [], [], [], [], [], [], []
    for mb in mbs:
        trunc = mb.truncation(vocab) if mask else NO_TRUNCATION
        logits, gap = logits_and_gap(model, input_ids=mb.tokens, attention_mask=mb.attention_mask)
        with torch.no_grad():
            logprobs, _ = token_logprobs_and_entropy(logits, mb.tokens, mb.temperature, trunc)
        out = policy_loss(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask, mb.loss_weight,
                          mb.sequence_ids, LossConfig())
        tokens, kl = tokens + out.tokens, kl + out.mismatch_kl_sum
        on = mb.loss_mask > 0
        diffs.append((logprobs - mb.inference_logprobs)[on])
        for r, t in on.nonzero().tolist():
            temperature, k, p = float(mb.temperature[r, t]), int(mb.top_k[r, t]), float(mb.top_p[r, t])
            assert float(mb.min_p[r, t]) == 0.0  # kept_bounds covers top_k and top_p only
            scaled = logits[r, t].double() / temperature
            g = float(gap[r, t]) / temperature
            gaps.append(g)
            if not bounds:
                continue
            token = int(mb.tokens[r, t + 1])
            surely, possibly = kept_bounds(scaled, g, k, p)
            may_miss.append(not bool(surely[token]))
            surely[token] = possibly[token] = True  # the sampler drew it; the trainer adds it back
            kept = kept_mask(scaled.float()[None], torch.tensor([k]), torch.tensor([p]), torch.zeros(1))[0]
            kept[token] = True
            lse_surely, lse_possibly, lse_kept = (torch.logsumexp(scaled[m], 0) for m in (surely, possibly, kept))
            lse_all = torch.logsumexp(scaled, 0)
            largest.append(float(scaled.abs().max()))
            spreads.append(float(lse_possibly - lse_surely))
            log_kept.append(float(lse_kept - lse_all))
            log_possible.append(float(lse_possibly - lse_all))
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    return {"mismatch_kl": kl / tokens, "diff": torch.cat(diffs), "tokens": tokens, "gap": as_tensor(gaps),
            "spread": as_tensor(spreads), "log_kept": as_tensor(log_kept),
            "log_possible": as_tensor(log_possible), "may_miss": torch.tensor(may_miss, dtype=torch.bool),
            "largest": as_tensor(largest)}


@pytest.mark.slow
def test_on_policy_mismatch_kl_is_rounding_with_the_mask_and_the_kept_mass_without(sampled, model):
    batch = sampled
    masked, full = trainer_view(model, batch, mask=True), trainer_view(model, batch, mask=False, bounds=False)
    assert masked["tokens"] >= 100, masked["tokens"]
    # With the mask, each logprob is the engine's to within what float32 rounding allows (wider
    # only at a token on a kept set's boundary), and mismatch_kl at most what those allow.
    bound = 2 * masked["gap"] + masked["spread"]
    assert (masked["diff"].double().abs() <= bound).all(), (masked["diff"].double().abs() - bound).max()
    assert masked["mismatch_kl"] <= float(k3(bound).mean()), masked["mismatch_kl"]
    # Without the mask each token's log ratio is log(kept mass) <= 0 (the engine's logprob is the
    # trainer's full-vocabulary one minus that) plus rounding: the token's logit and the engine's
    # normaliser over its kept set, which the full one can only exceed: at most 2 * gap, and it
    # is the masked ratio plus log(kept mass) exactly (the same logits, the same engine logprob).
    assert (full["diff"].double() <= 2 * full["gap"]).all(), (full["diff"].double() - 2 * full["gap"]).max()
    # To rounding: the two float32 log_softmaxes (over the vocabulary, over the kept set), the
    # float32 division by the temperature (each scaled logit off by U * its size, the two
    # normalisers by at most that each) and the two float32 subtractions of the engine's logprob.
    rebuilt = masked["diff"].double() + masked["log_kept"]
    vocab = model.config.vocab_size
    rounding = (2 * torch.tensor([log_softmax_error(vocab, b) for b in masked["largest"].tolist()])
                + 2 * U * masked["largest"] + U * (full["diff"].double().abs() + masked["diff"].double().abs()))
    assert ((full["diff"].double() - rebuilt).abs() <= rounding).all(), ((full["diff"].double() - rebuilt).abs() - rounding).max()
    # top_k 5 of 308 tokens: every kept mass is below 1, so the unmasked ratios are biased low.
    assert (masked["log_kept"] < 0).all() and full["mismatch_kl"] > masked["mismatch_kl"]
    print(f"\nmismatch_kl with mask {masked['mismatch_kl']:.3e}, without {full['mismatch_kl']:.3e} "
          f"over {masked['tokens']:.0f} tokens; mean log(kept mass) {full['diff'].mean():.4f}; "
          f"{int(masked['may_miss'].sum())} tokens on a boundary")


@pytest.mark.slow
def test_rebuilt_kept_sets_are_the_samplers(server, model):
    """The sampler's kept set for each generated token: its processed top logprobs (top 10 >
    top_k 5 covers the set), finite exactly on the kept tokens (vLLM writes -inf as -9999).
    It and the rebuilt set lie between the tokens surely kept and those possibly kept under
    float32 rounding (kept_bounds): equal wherever the two coincide."""
    checked = exact = 0
    for prompt in prompt_ids():
        r = httpx.post(f"{server}/v1/completions", timeout=120, json={
            "model": str(CHAT_MODEL), "prompt": prompt, "n": 48, "max_tokens": 24, "temperature": TEMPERATURE,
            "top_p": TOP_P, "top_k": TOP_K, "logprobs": 10, "return_token_ids": True,
            "return_tokens_as_token_ids": True})
        r.raise_for_status()
        for choice in r.json()["choices"]:
            ids = prompt + choice["token_ids"]
            logits, gap = logits_and_gap(model, input_ids=torch.tensor([ids]))
            logits, gap = logits[0, len(prompt) - 1:-1] / TEMPERATURE, gap[0, len(prompt) - 1:-1] / TEMPERATURE
            n = logits.shape[0]
            keep = kept_mask(logits, torch.full((n,), TOP_K), torch.full((n,), TOP_P), torch.zeros(n))
            for t, top in enumerate(choice["logprobs"]["top_logprobs"]):
                sampler = {int(key.split(":")[1]) for key, lp in top.items() if lp > -9999}
                rebuilt = set(keep[t].nonzero().flatten().tolist())
                surely, possibly = (set(m.nonzero().flatten().tolist())
                                    for m in kept_bounds(logits[t], float(gap[t]), TOP_K, TOP_P))
                assert surely <= sampler <= possibly, (t, top, surely, possibly)
                assert surely <= rebuilt <= possibly, (t, rebuilt, surely, possibly)
                assert choice["token_ids"][t] in sampler
                checked += 1
                if surely == possibly:  # no token within rounding of a boundary: the same set
                    assert sampler == rebuilt
                    exact += 1
    # Most positions have no token that close to a boundary (~3 in 4 of them with the bound's
    # worst case; samples end at eos after ~4 tokens on average, so 144 samples give ~500
    # positions): enough are compared exactly.
    assert exact >= 100, (exact, checked)
    print(f"\n{checked} tokens' kept sets agree, {exact} exactly (no token within rounding of a boundary)")


def test_truncation_selects_only_truncated_loss_tokens():
    """Untruncated samples (and prompts) are never touched: a batch without top_k/top_p/min_p
    pays nothing."""
    plain = single_turn([1, 2], [3, 4], [-0.1, -0.2], [0, 0], 0.0, 1.0)
    cut = single_turn([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [0, 0, 0], 0.0, 1.0, top_p=0.8)
    for batch, want in ((Batch.from_samples(1, [plain, plain]), None), (Batch.from_samples(1, [plain, cut]), 3)):
        for row_len in (None, 16):
            (mb,) = rank_micro_batches(batch, 0, 1, row_len=row_len, per_micro_batch=2, pad_id=0,
                                       weights=loss_weights(batch, "token", 0))
            trunc = mb.truncation(vocab=10)
            assert (trunc is NO_TRUNCATION) if want is None else int(trunc.select.sum()) == want
            if want is not None:
                # Carried as float32: 0.8 rounded once, exactly.
                assert float(trunc.top_p[trunc.select].max()) == float(torch.tensor(0.8, dtype=torch.float32))


@pytest.mark.slow
@pytest.mark.parametrize("mask", [True, False])
def test_the_trainer_program_masks_truncated_samples_and_warns_without(sampled, model, tmp_path, write_toml, mask):
    """Step 1 of `rl trainer` on a batch sampled with top_p/top_k: with the mask its
    mismatch_kl is rounding; without, it is the kept-mass bias, and the trainer warns, naming
    the cause."""
    from conftest import rl_command
    from rl.rundir import RunDir
    from trainer_runs import run_trainer, trainer_metrics

    run = RunDir(tmp_path / "run")
    write_batch(sampled, run.rollout_dir(1))
    cfg = write_toml(f'model = "{CHAT_MODEL}"\noutput_dir = "{run.root}"\nmax_steps = 1\nseq_len = 128\n'
                     f"[trainer]\ntorch_threads = 1\nmismatch.sampling_mask = {str(mask).lower()}\n")
    log = run_trainer(rl_command("trainer"), ["@", str(cfg)])
    (m,) = trainer_metrics(run)
    assert m["truncated_frac"] == 1.0
    # What float32 rounding allows on this batch (trainer_view): the program's logits are one
    # more float32 implementation's, within gap of the test's as the engine's are: its masked
    # logprobs within 3 * gap + spread of the engine's (its logit and normaliser against the
    # test's, the engine's normaliser), its unmasked ones at most 3 * gap + log(mass possibly kept).
    view = trainer_view(model, Batch.read(run.rollout_dir(1)), mask=True)
    warn = 1e-2  # trainer.mismatch.kl_warn's default
    if mask:
        # A sampled token can be missing from the rebuilt set only where it is not surely kept.
        assert m["sampling_mask_miss_frac"] <= float(view["may_miss"].double().mean()), m
        assert m["mismatch_kl"] <= float(k3(3 * view["gap"] + view["spread"]).mean()), m
    else:
        # k3 falls towards 0 from below: each token's at least k3(min(0, that upper bound)).
        upper = (3 * view["gap"] + view["log_possible"]).clamp(max=0)
        low = float(k3(upper).mean())
        # Less what float32 allows the trainer: each token's k3 evaluated (its x is the log of
        # the sampler's kept mass, within spread of the rebuilt set's, plus at most 3 * gap:
        # |x| <= size, where k3_error(size) is the largest), their sum over the step's tokens
        # and the division by the count.
        size = view["log_kept"].abs() + view["spread"] + 3 * view["gap"]
        evaluated = sum(k3_error(float(x)) for x in size) / len(size)
        floor = (low - evaluated) * (1 - gamma(len(size)))
        assert m["mismatch_kl"] >= floor, (m, low, floor)
    assert ("above trainer.mismatch.kl_warn" in log) == (m["mismatch_kl"] > warn), (m, log[-2000:])
    if not mask and m["mismatch_kl"] > warn:
        assert "trainer.mismatch.sampling_mask = false" in log, log[-2000:]


# --- replayed kept sets (orchestrator.sampling.record_kept_sets) ---------------------------------------


def replayed_batch(url: str) -> Batch:
    """Samples from /generate with kept_sets: each token's kept set as the sampler had it."""
    samples = []
    for i, prompt in enumerate(prompt_ids()):
        r = httpx.post(f"{url}/generate", timeout=120, json={
            "request_id": f"kept-{i}", "prompt_token_ids": prompt, "n": 16, "max_tokens": 24,
            "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K, "kept_sets": True})
        r.raise_for_status()
        for s in r.json()["samples"]:
            assert len(s["kept"]) == len(s["token_ids"])
            samples.append(single_turn(prompt, s["token_ids"], s["logprobs"], s["versions"], 0.0, 1.0,
                                       temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, kept=s["kept"]))
    return Batch.from_samples(1, samples)


@pytest.mark.slow
def test_replayed_kept_sets_are_the_samplers_and_stay_when_the_weights_move(server, model):
    """Every recorded set holds the sampled token and lies between the tokens surely and possibly
    kept under float32 rounding (kept_bounds, from the same weights' logits); the trainer replays
    each, misses none, and its logprobs are the engine's to within the logits' own rounding (no
    set ambiguity left). With other weights (a stale sample: the logits moved), the replayed sets
    are still exactly the recorded ones, where a rebuild would follow the new logits."""
    from trainer.sampling_mask import kept_sets

    batch = replayed_batch(server)
    vocab = model.config.vocab_size
    mbs = rank_micro_batches(batch, 0, 1, row_len=None, per_micro_batch=8, pad_id=0,
                             weights=loss_weights(batch, "token", 0))
    torch.manual_seed(0)
    checked = moved = 0
    for mb in mbs:
        logits, gap = logits_and_gap(model, input_ids=mb.tokens, attention_mask=mb.attention_mask)
        trunc = mb.truncation(vocab)
        with torch.no_grad():
            logprobs, _ = token_logprobs_and_entropy(logits, mb.tokens, mb.temperature, trunc)
        assert trunc.replayed == float(trunc.select.sum()) and trunc.misses == 0.0
        for r, t in (mb.loss_mask > 0).nonzero().tolist():
            recorded = {x for x in mb.kept[r, t].tolist() if x >= 0}
            token = int(mb.tokens[r, t + 1])
            scaled, g = logits[r, t].double() / TEMPERATURE, float(gap[r, t]) / TEMPERATURE
            surely, possibly = (set(m.nonzero().flatten().tolist()) for m in kept_bounds(scaled, g, TOP_K, TOP_P))
            assert token in recorded and len(recorded) <= TOP_K and surely <= recorded <= possibly, (recorded, surely)
            assert abs(float(logprobs[r, t]) - float(mb.inference_logprobs[r, t])) <= 2 * g
            checked += 1
        # Other weights: noise on the logits, large enough to reorder the top tokens.
        sel = trunc.select
        stale = (logits[:, :-1] + 3 * torch.randn_like(logits[:, :-1]))[sel] / TEMPERATURE
        at = Truncation(trunc.top_k[sel], trunc.top_p[sel], trunc.min_p[sel], sel, kept=mb.kept[sel])
        replayed, _ = kept_sets(stale, at)
        recorded = torch.zeros_like(replayed).scatter_(1, mb.kept[sel].clamp(min=0).long(), mb.kept[sel] >= 0)
        assert torch.equal(replayed, recorded)
        moved += int((kept_mask(stale, at.top_k, at.top_p, at.min_p) != recorded).any(-1).sum())
    assert checked >= 100 and moved > 0, (checked, moved)
    print(f"\n{checked} tokens replayed; with moved logits a rebuild would have changed {moved} of their sets")


def test_kept_sets_that_may_exceed_max_logprobs_are_refused_naming_the_field(server):
    """top_p alone over 308 tokens: a set may hold the whole vocabulary, past the 20 logprobs
    the server reports per token (inference.max_logprobs' default)."""
    r = httpx.post(f"{server}/generate", timeout=60, json={
        "request_id": "kept-too-big", "prompt_token_ids": prompt_ids()[0], "max_tokens": 4,
        "top_p": TOP_P, "kept_sets": True})
    message = r.json()["error"]["message"]  # vLLM's error shape, which our HTTPExceptions take
    assert r.status_code == 400 and message.startswith("kept_sets:") and "inference.max_logprobs 20" in message, message
