"""Flaky services around the orchestrator: a reward that raises or hangs (sync, async, HTTP), an
inference server answering HTTP 500 or leaving requests hanging. Each run must still end at
max_steps with every batch made once and no prompt lost (check_rules, tests/orchestrator/test_scheduling.py),
the failures counted in the metrics. Stand-in servers (tests/fake_inference.py): seconds each.
test_scheduling.py has the neighbours: a raising reward in groups of four, a server going down
for a while, a server that never answers.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest
from aiohttp import web

import fake_inference
from fake_inference import FakeServer, score_over_http
from orchestrator.rewards.registry import make_reward
from scenarios import DATASET, check_rules, run_scenario

SWAP_WARNING = "the hung threads are leaked"
HANG_GUARD_S = 60  # a scenario that has not ended by then hangs (none takes a second when right)


@pytest.fixture(autouse=True)
def faults():
    fake_inference.reset_faults()
    yield
    fake_inference.release_hung_rewards.set()  # their threads would otherwise outlive the test


def orchestrator_metrics(o, key: str) -> int:
    return sum(r[key] for r in o.metrics if r["program"] == "orchestrator")


def rotation_spells(records, url: str) -> list[tuple[logging.LogRecord, logging.LogRecord | None]]:
    """Each time the pool took `url` out of rotation, with the record of its return (None if the
    run ended first), checked to alternate."""
    spells, out = [], None
    for r in records:
        m = r.getMessage()
        if m.startswith(f"server {url} out of rotation"):
            assert out is None, f"out of rotation twice without a return: {m}"
            out = r
        elif m.startswith(f"server {url} back in rotation"):
            assert out is not None, f"back in rotation without having left: {m}"
            spells.append((out, r))
            out = None
    return spells + ([(out, None)] if out is not None else [])


def assert_out_for_a_second(records, url: str) -> int:
    """Every time out of rotation, `url` was due back after one second (servers.retry_max_s 1
    caps the backoff), came back (unless the run ended first), and not before that second was
    over: heal() lets it in only once retry_at has passed. Returns how many times."""
    spells = rotation_spells(records, url)
    for out, back in spells:
        assert out.getMessage().endswith("retry in 1 s"), out.getMessage()
        # record.created is time.time(), the pool's clock time.monotonic(): allow for their drift.
        assert back is None or back.created - out.created >= 0.99, (out.getMessage(), back.created - out.created)
    assert all(back is not None for _, back in spells[:-1])
    return len(spells)


def test_a_reward_hanging_for_good_gets_fresh_threads_and_the_run_completes(tmp_path, caplog):
    """The first scoring of 40% of the prompts hangs for good (groups of two: ~20% of the calls).
    Each hung call keeps its thread: with eight threads and no replacement the run would stall
    once eight had hung. Each call times out on its own and fails its rollout (its group, of two,
    is requeued); once half the threads are stuck a fresh set takes over, with one warning."""
    server = FakeServer(lambda: 0.0005)
    # A run that stalls fails on its own: timeouts.weights_s (30 s) with no batch. No group is
    # cancelled as stale (max_off_policy_steps): a cancelled group's hung call is never timed,
    # and with batches coming faster than 0.3 s every hung group could be cancelled first (seen
    # once, under load: no "timed out" line at all).
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        o = asyncio.run(run_scenario(tmp_path, [server], max_steps=12, orchestrator={
            "datasets": [{**DATASET, "reward": "fake_inference:hanging_reward"}], "timeouts": {"reward_s": 0.3},
            "scheduling": {"max_off_policy_steps": 100}}))
    check_rules(o)
    assert len(fake_inference.faulted) > 8  # more calls hung than there are threads
    messages = [r.getMessage() for r in caplog.records]
    assert any("timed out after 0.3 s" in m for m in messages)
    assert orchestrator_metrics(o, "episodes_failed_scored") > 0
    swaps = [m for m in messages if SWAP_WARNING in m]
    assert swaps and all("fake_inference:hanging_reward" in m for m in swaps)


@pytest.mark.parametrize("reward", ["raising_reward", "hanging_async_reward"])
def test_a_failed_reward_fails_its_group_of_two_and_the_prompt_is_retried(tmp_path, reward):
    """Unlike test_a_raising_reward_fails_only_that_rollout (groups of four go on with the other
    rollouts), a group of two with one failed rollout has no group-relative signal left: the group
    fails, its prompt is requeued, and no prompt is lost. The async reward that hangs is cut off
    by reward_timeout_s (well within the time its group takes to go stale: a cancelled group
    would count no failure)."""
    o = asyncio.run(run_scenario(tmp_path, [FakeServer(lambda: 0.0005)], step_latency=lambda: 0.05,
                                 max_steps=8, max_async_level=2, orchestrator={
                                     "datasets": [{**DATASET, "reward": f"fake_inference:{reward}"}],
                                     "timeouts": {"reward_s": 0.05}}))
    check_rules(o)
    assert orchestrator_metrics(o, "episodes_failed_scored") > 0


def hangs_on_h(prompt: str, completion: str, row: dict) -> float:
    if completion.startswith("h"):
        fake_inference.release_hung_rewards.wait()
    return 1.0


def test_calls_queued_behind_hung_ones_are_not_charged_for_the_wait(caplog):
    """Eight groups whose second call hangs take all eight threads; four more groups queue behind
    them. The hung calls fail their rollout alone (the third completion is scored), and the queued
    groups run on fresh threads once half are stuck: their time in the queue is no timeout."""
    async def scenario():
        reward = make_reward("test_flaky_services:hangs_on_h", 0.5, session=None)
        hung = [reward.score("p=", ["a", "h", "b"], {}) for _ in range(8)]
        queued = [reward.score("p=", ["c", "d"], {}) for _ in range(4)]
        # Only a guard against hanging (the hung calls end at their 0.5 s timeout): what shows
        # the queued calls were not charged for their wait is that they score, below.
        return await asyncio.wait_for(asyncio.gather(*hung, *queued), HANG_GUARD_S)

    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        scores = asyncio.run(scenario())
    assert scores == [[1.0, None, 1.0]] * 8 + [[1.0, 1.0]] * 4
    swaps = [r.getMessage() for r in caplog.records if SWAP_WARNING in r.getMessage()]
    # One swap, once at least half the eight threads were stuck; how many more of the eight had
    # passed their timeout by then depends on when each call started (a loaded machine spreads
    # them out: "7 calls hung" was seen beside a busy suite).
    assert len(swaps) == 1, swaps
    hung = int(re.search(r"(\d+) calls hung past", swaps[0])[1])
    assert 4 <= hung <= 8 and f"hold {hung} of 8 reward threads" in swaps[0], swaps


def test_an_http_reward_that_hangs_fails_only_that_rollout():
    release = asyncio.Event()

    async def score(request):
        body = await request.json()
        if body["completion"].startswith("h"):
            await release.wait()
        return web.json_response({"reward": 0.5})

    async def scenario():
        # Only a guard against hanging: the hung call ends at its 0.3 s timeout or never.
        return await asyncio.wait_for(score_over_http(score, 0.3, "p=", ["a", "h", "b"], {}, release), HANG_GUARD_S)

    assert asyncio.run(scenario()) == [0.5, None, 0.5]


def test_a_server_answering_500_to_some_requests_keeps_its_place(tmp_path, caplog):
    """Server b answers 30% of its generate requests with HTTP 500: each fails its group (counted
    in failed_requests, prompt requeued) and takes b out of rotation for a second (the backoff,
    capped by servers.retry_max_s); b comes back each time and serves again. Stand-ins only: no
    request makes a healthy real engine answer 500 (docs/reliability.md says why); the same
    branch of the orchestrator (any non-200 answer, broken connection or timeout is an
    InferenceError) is shown on real engines by test_engine_stalls_vllm.py's request timeout and
    test_kill_inference.py's killed server."""
    a, b = FakeServer(lambda: 0.002), FakeServer(lambda: 0.002, error_rate=0.3)
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        o = asyncio.run(run_scenario(tmp_path, [a, b], step_latency=lambda: 0.1, max_steps=30,
                                     orchestrator={"servers": {"retry_max_s": 1}}))
    check_rules(o)
    assert 0 < orchestrator_metrics(o, "failed_requests") <= len(b.errors)
    assert len(b.errors) >= 2  # an error after the first one: it was back in rotation
    served_after = [r for r in b.requests.values() if r.started > b.errors[0] and r.aborted_at is None]
    assert served_after, "no request served after the first 500"
    # Out of rotation for a second each time a request failed (requests already sent when it
    # left may fail too: one spell for them).
    assert 1 <= assert_out_for_a_second(caplog.records, o.cfg.urls[1]) <= orchestrator_metrics(o, "failed_requests")
    assert not rotation_spells(caplog.records, o.cfg.urls[0])


def test_requests_hanging_past_request_timeout_are_aborted_on_the_server(tmp_path, caplog):
    """20% of server b's requests hang: after timeouts.request_s the orchestrator gives up on them
    (counted in failed_requests, b out of rotation for a second), aborts them on b (freeing its
    slots; under "wait" updates a hung request also holds b's next weight update back) and
    requeues their prompts. max_async_level 4 keeps a hung group fresh for longer than the
    timeout: cancelled as stale first, it would be aborted without ever timing out. Updates "wait"
    (in_flight_updates off): the held-back update is what this case checks."""
    a, b = FakeServer(lambda: 0.002), FakeServer(lambda: 0.002, hang_rate=0.2)
    update_asked: list[float] = []  # when each /update_weights reached b
    update = b.update_weights

    async def recorded_update(request):
        update_asked.append(time.monotonic())
        return await update(request)

    b.update_weights = recorded_update  # b.app() routes to it
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        o = asyncio.run(run_scenario(tmp_path, [a, b], step_latency=lambda: 0.1, max_steps=15, max_async_level=4,
                                     orchestrator={"timeouts": {"request_s": 0.3}, "servers": {"retry_max_s": 1},
                                                   "scheduling": {"in_flight_updates": False}}))
    check_rules(o)
    assert orchestrator_metrics(o, "failed_requests") > 0  # timeouts: b sends no error
    hung = [b.requests[i] for i in b.hung]
    assert hung and all(r.aborted_at is not None and r.finished is not None for r in hung)
    assert b.running == 0
    assert assert_out_for_a_second(caplog.records, o.cfg.urls[1]) >= 1
    # A weight update that reached b while a request hung there took effect only once the
    # abort had ended that request ("wait" updates wait for b's running requests).
    held = [(t, r) for t in update_asked for r in hung if r.started < t < r.finished]
    assert held, "no update reached b while a request hung there"
    changes = [t for t, _ in b.versions[1:]]
    for asked, r in held:
        assert not [c for c in changes if asked < c < r.finished], "b's version moved under a hung request"
        assert [c for c in changes if c >= r.finished], "the held update never took effect"


def test_requests_hanging_under_in_flight_updates_go_stale_and_are_aborted(tmp_path):
    """The same hanging server under in-flight updates (the default): nothing waits for b's hung
    requests, so batches run ahead to max_async_level and each hung group goes stale after a few
    steps of 0.1 s: it is cancelled (counted in `cancelled`, not in failed_requests), its requests
    aborted on b, its prompt requeued. Even at the other case's request_s of 0.3 s, 6 of 7 hung
    groups were cancelled within 0.12-0.22 s and none timed out (three runs); here request_s is
    long, so a stale cancel (or the final stop) is the only way out."""
    a, b = FakeServer(lambda: 0.002), FakeServer(lambda: 0.002, hang_rate=0.2)
    o = asyncio.run(run_scenario(tmp_path, [a, b], step_latency=lambda: 0.1, max_steps=15, max_async_level=4,
                                 orchestrator={"timeouts": {"request_s": 30}, "servers": {"retry_max_s": 1}}))
    check_rules(o)
    hung = [b.requests[i] for i in b.hung]
    assert hung and all(r.aborted_at is not None and r.finished is not None for r in hung)
    assert b.running == 0
    assert orchestrator_metrics(o, "cancelled") > 0
    assert orchestrator_metrics(o, "failed_requests") == 0  # none waited out its 30 s
