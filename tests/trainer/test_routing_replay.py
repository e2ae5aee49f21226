"""Routing replay (trainer.mismatch.routing_replay) on a transformers Qwen3-MoE: every MoE layer sends each
recorded token to exactly the recorded experts, the router still gets a gradient, unrecorded
positions keep the router's own choice, agreement is counted per layer; and the batch carries the
record through packing and padding to the micro-batch positions it belongs to. The engine side
(what vLLM routed, recorded and returned by /generate): tests/inference/test_routing_vllm.py."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from float32_rounding import logit_error
from rl.batch import Batch, Sample
from rl.inference_api import RoutedExperts
from trainer.data import loss_weights, rank_micro_batches
from trainer.routing_replay import RoutingReplay, routers

LAYERS, EXPERTS, TOP_K = 3, 4, 2


def tiny_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                            num_attention_heads=2, num_key_value_heads=1, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, moe_intermediate_size=32, norm_topk_prob=True,
                            max_position_embeddings=64)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


def experts_used(model) -> tuple[list[torch.Tensor], list]:
    """The top-k index each layer's experts module is called with, recorded per forward."""
    seen: list[torch.Tensor] = []
    handles = [layer.mlp.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
               for layer in model.model.layers]
    return seen, handles


def other_experts(own: torch.Tensor) -> torch.Tensor:
    """For each row of top-k ids, a different valid set (the next experts round the ring)."""
    return (own + 1) % EXPERTS


def own_routing(model, tokens: torch.Tensor) -> torch.Tensor:
    """[R, T, layers, top_k]: the experts the model picks by itself."""
    seen, handles = experts_used(model)
    with torch.no_grad():
        model(input_ids=tokens)
    for h in handles:
        h.remove()
    return torch.stack([s.reshape(*tokens.shape, TOP_K) for s in seen], dim=2)


def test_the_routers_of_every_moe_layer_are_found_in_layer_order():
    model = tiny_moe()
    assert [layer for layer, _ in routers(model)] == list(range(LAYERS))
    assert all(r is model.model.layers[i].mlp.gate for i, r in routers(model))


def test_replay_uses_exactly_the_recorded_experts_per_layer_and_the_router_still_learns():
    model = tiny_moe()
    tokens = torch.randint(0, 20, (2, 7))
    own = own_routing(model, tokens)
    recorded = other_experts(own)
    routed = torch.ones(tokens.shape, dtype=torch.bool)
    routed[1, 5:] = False  # no record there: the router's own choice stands
    replay = RoutingReplay(model, replay=True)
    seen, handles = experts_used(model)
    trained = torch.ones(tokens.shape, dtype=torch.bool)
    with replay.recorded(recorded, routed, trained):
        logits = model(input_ids=tokens).logits
        replay.end_forward()
        logits.logsumexp(-1).sum().backward()
    for h in handles:
        h.remove()
    for layer, used in enumerate(seen):
        used = used.reshape(*tokens.shape, TOP_K)
        want = torch.where(routed[..., None], recorded[:, :, layer], own[:, :, layer])
        # Replay changes the input of later layers, so "own" is only the reference at layer 0's
        # unrecorded positions; recorded positions must be the record at every layer.
        assert torch.equal(used[routed], want[routed]), layer
        if layer == 0:
            assert torch.equal(used, want)
    for _, router in routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    # The record differs from the router's own choice at every recorded position: agreement 0.
    metrics = replay.metrics(replay.take_sums().tolist())
    assert metrics["routing_agreement"] == 0.0
    assert all(metrics[f"routing_agreement/layer_{i}"] == 0.0 for i in range(LAYERS))
    assert metrics["routing_replayed_frac"] == pytest.approx(float(routed.sum()) / routed.numel())


def test_replaying_the_models_own_routing_changes_nothing_and_agreement_counts_per_layer():
    model = tiny_moe()
    tokens = torch.randint(0, 20, (2, 6))
    own = own_routing(model, tokens)
    head_in = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: head_in.append(i[0]))
    with torch.no_grad():
        plain = model(input_ids=tokens).logits
    hook.remove()
    # How far float32 rounding may move each logit in any summation order (tests/float32_rounding.py:
    # its tiny models' 4 layers and 384-wide products bound this 3-layer, 64-wide one; 9 products a
    # layer with the router and the experts' weighted sum).
    bound = logit_error(9) * (model.lm_head.weight.abs() @ head_in[0].abs().transpose(-1, -2)).amax(-2)
    # The record as the engine returns it: each row's experts in some order of its own.
    recorded = own.flip(-1)
    # At layer 1, a third of the positions differ from the model's choice.
    flipped = torch.zeros(tokens.shape, dtype=torch.bool)
    flipped[:, ::3] = True
    replay = RoutingReplay(model, replay=False)
    recorded_off = recorded.clone()
    recorded_off[:, :, 1][flipped] = other_experts(own[:, :, 1][flipped])
    routed = torch.ones(tokens.shape, dtype=torch.bool)
    with replay.recorded(recorded_off, routed, routed), torch.no_grad():
        unreplayed = model(input_ids=tokens).logits
    metrics = replay.metrics(replay.take_sums().tolist())
    assert torch.equal(unreplayed, plain)  # replay off: the router routes
    assert metrics["routing_agreement/layer_0"] == 1.0 and metrics["routing_agreement/layer_2"] == 1.0
    assert metrics["routing_agreement/layer_1"] == pytest.approx(1 - float(flipped.float().mean()))
    assert "routing_replayed_frac" not in metrics  # replay off
    on = RoutingReplay(model, replay=True)
    replay.remove()
    with on.recorded(recorded, routed, routed), torch.no_grad():
        replayed = model(input_ids=tokens).logits
    # The same experts with the router's own weights (a softmax gathered at the record instead of
    # top-k of the softmax), each token's two experts summed in the record's order: the same
    # computation in another summation order, so within rounding's bound.
    assert ((replayed - plain).abs() <= bound[..., None]).all()


def test_steps_without_a_record_report_no_agreement_and_unrecorded_tokens_are_warned_about(caplog):
    model = tiny_moe()
    replay = RoutingReplay(model, replay=True)
    tokens = torch.randint(0, 20, (1, 5))
    trained = torch.ones(tokens.shape, dtype=torch.bool)
    with replay.recorded(None, None, trained), torch.no_grad():
        model(input_ids=tokens)
    metrics = replay.metrics(replay.take_sums().tolist())
    assert metrics == {"routing_replayed_frac": 0.0}  # no agreement without a record to agree with
    with caplog.at_level("WARNING", logger="trainer"):
        for step in (5, 6, 104, 105):
            replay.warn_unrecorded(step, {"routing_replayed_frac": 0.9})
        replay.warn_unrecorded(300, {"routing_replayed_frac": 1.0})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("step 5: 10.0% of the trained tokens had no recorded routing")
    assert said[1].startswith("step 105:")


def test_a_batch_that_records_more_moe_layers_than_the_model_has_is_refused():
    model = tiny_moe()
    replay = RoutingReplay(model, replay=True)
    routing = torch.zeros(1, 4, LAYERS + 1, TOP_K, dtype=torch.long)
    with pytest.raises(ValueError, match=f"routing for {LAYERS + 1} MoE layers, the model has {LAYERS}"):
        with replay.recorded(routing, torch.ones(1, 4, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)):
            pass


def sample(n: int, seed: int, routed: bool = True, first_token: int = 1) -> Sample:
    """n tokens first_token, first_token + 1, ...: every token of a test batch unique."""
    rng = np.random.default_rng(seed)
    experts = rng.integers(0, EXPERTS, (n, LAYERS, TOP_K)).astype(np.uint8) if routed else None
    mask = np.ones(n, np.uint8)
    if routed:
        mask[-1] = 0  # the last sampled token: never fed forward, no record
    return Sample(tokens=list(range(first_token, first_token + n)), loss_mask=[0] + [1] * (n - 1), logprobs=[0.0] * n,
                  advantages=[1.0] * n, versions=[-1] + [0] * (n - 1), reward=1.0, routed_experts=experts,
                  routed=mask if routed else None)


@pytest.mark.parametrize("packed", [True, False])
def test_each_tokens_record_reaches_its_micro_batch_position(packed):
    samples = [sample(5, 0), sample(3, 1, routed=False, first_token=6), sample(7, 2, first_token=9)]
    meta, payload = Batch.from_samples(1, samples).encode()
    batch = Batch.decode(meta, payload, "test")
    weights = loss_weights(batch, "token", 16)
    mbs = rank_micro_batches(batch, 0, 1, row_len=16 if packed else None, per_micro_batch=4, pad_id=0,
                             weights=weights)
    found = {int(mb.tokens[r, t]): mb.routing[r, t].numpy() for mb in mbs
             for r in range(mb.tokens.shape[0]) for t in range(mb.tokens.shape[1]) if mb.routed[r, t]}
    want = {tok: row for s in samples if s.routed_experts is not None
            for tok, row, on in zip(s.tokens, s.routed_experts, s.routed) if on}
    assert found.keys() == want.keys() and len(want) == 4 + 6  # none for the unrouted sample or last tokens
    for tok, row in want.items():
        assert np.array_equal(found[tok], row), tok


def test_a_batch_without_routing_carries_none_and_decodes_so():
    meta, payload = Batch.from_samples(1, [sample(4, 0, routed=False)]).encode()
    batch = Batch.decode(meta, payload, "test")
    assert batch.routing() is None
    mbs = rank_micro_batches(batch, 0, 1, row_len=16, per_micro_batch=4, pad_id=0,
                             weights=loss_weights(batch, "token", 16))
    assert all(mb.routing is None for mb in mbs)


def answer(rows: np.ndarray, missing: list[int] = ()) -> RoutedExperts:
    return RoutedExperts(layers=list(range(rows.shape[1])), top_k=rows.shape[2], dtype="uint8",
                         positions=len(rows), data=base64.b64encode(rows.astype(np.uint8).tobytes()).decode(),
                         missing=list(missing))


def test_a_multi_turn_record_keeps_each_positions_first_routing_and_adds_the_new_ones():
    """Turn 1 ran 5 positions (prompt 3 + 3 sampled, the last never fed forward); turn 2's request
    recomputed all of them (other weights: other experts) and ran 4 more. Positions 0-4 keep turn
    1's rows (the forward that sampled from them), 5-8 are turn 2's; a gap turn 1 left (a cached
    prompt position) is filled by turn 2."""
    from rl.routing_rows import RoutingRows

    first = np.full((5, LAYERS, TOP_K), 1)
    second = np.full((9, LAYERS, TOP_K), 2)
    record = RoutingRows(LAYERS, TOP_K, np.uint8)
    record.add(answer(first, missing=[1]))
    record.add(answer(second))
    experts, routed = record.padded(11)  # then 2 environment tokens no request ran
    assert experts[:, 0, 0].tolist() == [1, 2, 1, 1, 1, 2, 2, 2, 2, 0, 0]
    assert routed.tolist() == [1] * 9 + [0, 0]


def forward(recorder, requests: list[tuple[str, list[int]]], experts: int) -> None:
    """One engine forward: each (internal id, positions) in batch order, every layer routing
    every token to experts (experts, experts + 1)."""
    tokens = sum(len(p) for _, p in requests)
    for layer in range(len(recorder.layers)):
        recorder.capture(layer, torch.tensor([[experts, experts + 1]] * (tokens + 3)))  # + padding rows
    starts = np.cumsum([0] + [len(p) for _, p in requests])
    recorder.after_forward([r for r, _ in requests], starts, np.concatenate([p for _, p in requests]))


def test_the_engine_recorder_files_rows_by_request_and_position_keeping_the_first():
    """Request a-... prefills 4 positions beside b's decode step, then decodes; it is preempted and
    recomputes positions 0-4 (other rows), then decodes on. Its record keeps the first row of each
    position; rows go out once, by the id the request was made with."""
    from inference.routing_capture import RoutingRecorder

    rec = RoutingRecorder([0, 1], TOP_K, EXPERTS)
    a, b = "gen-0-abcdefgh", "gen-1-12345678"
    forward(rec, [(a, [0, 1, 2, 3]), (b, [7])], experts=0)
    forward(rec, [(a, [4]), (b, [8])], experts=1)
    forward(rec, [(a, [0, 1, 2, 3, 4])], experts=2)  # recomputed after preemption
    forward(rec, [(a, [5])], experts=2)
    rec.finish([a])
    taken = rec.take(["gen-0", "gen-1", "gen-9"])
    assert set(taken) == {"gen-0", "gen-1"}
    rows = RoutedExperts(**rec.describe(), **taken["gen-0"]).array()
    assert rows[:, 0, 0].tolist() == [0, 0, 0, 0, 1, 2] and rows.shape == (6, 2, TOP_K)
    b_rows = RoutedExperts(**rec.describe(), **taken["gen-1"])
    assert b_rows.positions == 9 and b_rows.missing == list(range(7))  # b's prompt ran before recording
    assert rec.take(["gen-0"]) == {} and rec.running == {} and rec.finished_bytes == 0


@pytest.mark.parametrize("index", [0, 1])
def test_a_padding_micro_batch_replays_on_each_context_share(index):
    """A rank with fewer micro-batches than its peers trains padding ones (trainer/data.py), which
    carry no record; under context parallelism its routers see its share of the row, and the
    stand-in record must be that share's size (found in `rl run` at data 2 x context 2 x expert 2
    on tiny-moe: the whole row's record met a share's router, and the rank died)."""
    from trainer.context_parallel import ContextShare
    from trainer.data import _padding
    from trainer.trainer import routing_record

    model = tiny_moe()
    mb, share = _padding(0, packed=True), ContextShare(None, 2, index)
    replay = RoutingReplay(model, replay=True)
    seen, handles = experts_used(model)
    try:
        with replay.recorded(*routing_record(mb, share)), torch.no_grad():
            model(input_ids=share.local(mb.tokens, 0), position_ids=share.local(mb.position_ids, 0))
    finally:
        replay.remove()
        for h in handles:
            h.remove()
    assert [s.shape for s in seen] == [(1, TOP_K)] * LAYERS  # the share's one token, its own routing
    assert replay.take_sums().tolist() == [0.0] * (LAYERS + 3)  # nothing recorded, replayed or trained
