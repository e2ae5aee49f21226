"""The orchestrator's scheduling rules, against stand-in servers whose latency the test dictates
(tests/fake_inference.py) and a stand-in trainer that publishes a version per batch:

- no batch n is handed over before version n-1-k serves on every server (max_async_level k);
- no batch n holds a token older than version n-1-m (max_off_policy_steps m);
- every prompt drawn is in exactly one batch or still pending in the final checkpoint: cancelled,
  failed and stale groups' prompts come back, none is used twice;
- nothing hangs (every scenario runs under a timeout).
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import free_port
from fake_inference import FakeServer, start
from orchestrator.orchestrator import Orchestrator
from orchestrator.async_rule import is_fresh
from rl.rundir import RunDir
from rl.inference_api import connector
from scenarios import DATASET, Outcome, check_rules, latencies, run_scenario

pytestmark = pytest.mark.slow

def token_latency(kind: str, scale: float, rng: random.Random):
    def draw() -> float:
        if kind == "uniform":
            return rng.uniform(0, 2 * scale)
        if kind == "exponential":
            return rng.expovariate(1 / scale)
        return scale * (30 if rng.random() < 0.15 else 1)  # a few rollouts 30x longer
    return draw


@settings(max_examples=24, deadline=None, suppress_health_check=list(HealthCheck))
@given(k=st.sampled_from([0, 1, 2, 4]), extra=st.sampled_from([0, 3]), kind=latencies,
       scale=st.floats(0.0002, 0.004), train_s=st.floats(0, 0.03), update_s=st.floats(0, 0.01),
       n_servers=st.integers(1, 3), in_flight_updates=st.booleans(), seed=st.integers(0, 2**16))
def test_async_rules_hold_for_any_latency(k, extra, kind, scale, train_s, update_s, n_servers,
                                          in_flight_updates, seed):
    rng = random.Random(seed)
    servers = [FakeServer(token_latency(kind, scale, rng), update_latency=update_s) for _ in range(n_servers)]
    with tempfile.TemporaryDirectory() as tmp:
        outcome = asyncio.run(run_scenario(
            Path(tmp), servers, step_latency=lambda: rng.uniform(0, train_s), max_async_level=k,
            orchestrator={"scheduling": {"max_off_policy_steps": k + extra, "in_flight_updates": in_flight_updates}}))
        check_rules(outcome)


def test_hopeless_groups_are_aborted_on_the_server_and_their_prompts_requeued(tmp_path):
    """k = m = 1 with a few rollouts 200x slower than the rest: batches fill with the fast groups
    (oversampling), and a slow group started on version v is useless once batch v+3 is being
    built; it must be aborted mid-generation, not left to run. (In-flight updates: with "wait"
    updates a slow request would hold the version back, and so never fall behind.)"""
    rng = random.Random(1)
    server = FakeServer(lambda: 0.2 if rng.random() < 0.2 else 0.001)
    outcome = asyncio.run(run_scenario(tmp_path, [server], step_latency=lambda: 0.02, max_async_level=1,
                                       max_steps=8, orchestrator={"sampling": {"max_tokens": 8}, "scheduling": {"in_flight_updates": True}}))
    check_rules(outcome)
    cancelled = sum(r.get("cancelled", 0) for r in outcome.metrics)
    assert cancelled > 0
    # Aborted on the server itself, before the request would have run its course (fewer than its
    # 8 tokens: how long that took depends on the machine, not on the abort).
    stopped_early = [r for r in server.requests.values() if r.aborted_at is not None and r.tokens < 8]
    assert len(stopped_early) >= 1
    assert all(r.finished is not None for r in server.requests.values())


def test_in_flight_updates_give_per_token_versions(tmp_path):
    """With in-flight updates long rollouts straddle a weight change: their tokens carry both
    versions, in order; with "wait" updates no sample mixes versions."""
    def scenario(root, in_flight):
        rng = random.Random(2)
        server = FakeServer(lambda: 0.02 if rng.random() < 0.3 else 0.001)
        return asyncio.run(run_scenario(root, [server], max_async_level=2,
                                        orchestrator={"sampling": {"max_tokens": 8}, "scheduling": {"in_flight_updates": in_flight}}))

    def mixed(o: Outcome) -> int:
        count = 0
        for b in o.batches.values():
            for s in b.sample_slices():
                v = b.token_versions[s][b.loss_mask[s] == 1]
                assert (v[1:] >= v[:-1]).all()
                count += int(v.min() != v.max())
        return count

    keep = scenario(tmp_path / "keep", True)
    check_rules(keep)
    assert mixed(keep) > 0
    wait = scenario(tmp_path / "wait", False)
    check_rules(wait)
    assert mixed(wait) == 0


def test_a_failing_server_leaves_rotation_and_comes_back(tmp_path):
    """One of two servers goes down mid-run: its groups are requeued, the run continues on the
    other, and it rejoins (serving the current version) once healthy again."""
    a, b = FakeServer(lambda: 0.002), FakeServer(lambda: 0.002)
    back_at = []

    async def outage():
        await asyncio.sleep(0.3)
        b.down = True
        await asyncio.sleep(0.8)
        b.down = False
        back_at.append(time.monotonic())

    async def scenario():
        task = asyncio.create_task(outage())
        o = await run_scenario(tmp_path, [a, b], step_latency=lambda: 0.1, max_steps=30,
                               orchestrator={"servers": {"retry_max_s": 1}})
        await task
        return o

    o = asyncio.run(scenario())
    check_rules(o)
    orchestrator_metrics = [r for r in o.metrics if r["program"] == "orchestrator"]
    assert min(r["servers_in_rotation"] for r in orchestrator_metrics) == 1
    assert orchestrator_metrics[-1]["servers_in_rotation"] == 2
    assert b.version == a.version  # rejoined on the current weights
    assert any(r.started > back_at[0] for r in b.requests.values()), "no work after rejoining"


def test_resume_continues_the_batch_numbers_and_reissues_pending_prompts(tmp_path):
    """An orchestrator stopped after batch 3 and started again: batches 4.. follow, no prompt is
    lost or used twice across the two lives."""
    server = FakeServer(lambda: 0.001)
    asyncio.run(run_scenario(tmp_path, [server], max_steps=3))
    first_life = RunDir(tmp_path).checkpoint_steps("orchestrator")
    assert first_life[-1] == 3
    o = asyncio.run(run_scenario(tmp_path, [FakeServer(lambda: 0.001)], max_steps=6))
    check_rules(o)


def test_zero_variance_groups_are_filtered_and_counted(tmp_path):
    server = FakeServer(lambda: 0.0005)
    o = asyncio.run(run_scenario(tmp_path, [server], max_steps=3, orchestrator={
        "datasets": [{**DATASET, "reward": "fake_inference:coin_reward"}],
        "scheduling": {"filter_zero_variance": True, "group_size": 2}}))
    check_rules(o, every_prompt_batched_or_pending=False)
    records = [r for r in o.metrics if r["program"] == "orchestrator"]
    assert sum(r["filtered"] for r in records) > 0
    # The policy's own reward counts the filtered groups too: every sample scored, batched or not.
    batched = sum(b.num_samples for b in o.batches.values())
    assert sum(r["samples_scored"] for r in records) >= batched + 2 * sum(r["filtered"] for r in records)
    assert all(0 <= r["reward_sampled_mean"] <= 1 for r in records if r["samples_scored"])
    for b in o.batches.values():
        for lo in range(0, b.num_samples, 2):
            assert b.rewards[lo] != b.rewards[lo + 1]


def test_the_starting_weights_are_evaluated_after_the_first_batch_and_alone(tmp_path):
    """Step 0's evaluation starts once batch 1 is handed over (it no longer shares the engine
    with the first batch), and no server loads version 1 until it ends: every token it scores is
    version 0's, though the trainer publishes version 1 meanwhile. Later evaluations do not hold
    the weights back."""
    server = FakeServer(lambda: 0.002)
    evaluation = {"rows": 12, "every": 2, "concurrency": 2, "datasets": [
        {"name": "held", "function": "fake_inference:dataset", "reward": "fake_inference:reward"}]}
    o = asyncio.run(run_scenario(tmp_path, [server], max_steps=4, max_async_level=2,
                                 orchestrator={"eval": evaluation}))
    check_rules(o)
    tag = o.orchestrator.tag
    baseline = [r for rid, r in server.requests.items() if rid.startswith(f"{tag}-eval0")]
    assert len(baseline) == 12
    assert min(r.started for r in baseline) >= o.handed_over_at[1]
    first_update = next(t for t, v in server.versions if v >= 1)
    assert max(r.finished for r in baseline) <= first_update
    evals = {r["step"]: r for r in o.metrics if r["program"] == "eval"}
    assert (evals[0]["version"], evals[0]["version_end"]) == (0, 0)
    assert sorted(evals) == [0, 2, 4]


def test_a_raising_reward_fails_only_that_rollout(tmp_path):
    """30% of reward calls raise: those rollouts are counted as failed and left out, their
    groups go on with the rest (a group needs two scored rollouts), and the run completes."""
    server = FakeServer(lambda: 0.0005)
    o = asyncio.run(run_scenario(tmp_path, [server], max_steps=3, orchestrator={
        "datasets": [{**DATASET, "reward": "fake_inference:flaky_reward"}], "scheduling": {"group_size": 4}}))
    assert sorted(o.batches) == [1, 2, 3]
    assert sum(r["episodes_failed_scored"] for r in o.metrics if r["program"] == "orchestrator") > 0
    sizes = [b.num_samples for b in o.batches.values()]
    assert min(sizes) < 16 and min(sizes) >= 8  # 4 groups of 2 to 4 scored rollouts


def idle_s(server: FakeServer, start: float, end: float) -> float:
    """Seconds of [start, end] during which `server` had no request generating (by its own
    record: from a request's arrival to the end of its last decode step)."""
    busy, reach = 0.0, start
    for lo, hi in sorted((r.started, r.finished if r.finished is not None else end) for r in server.requests.values()):
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            busy += hi - lo
            reach = hi
    return (end - start) - busy


def test_orchestrator_keeps_many_servers_busy(tmp_path):
    """Four servers taking 60 ms a request (6 tokens of 10 ms) and room for 32 groups: after the
    start-up ramp (batch 2) no server is ever left idle by a scheduling decision. What the
    orchestrator guarantees, checked at each of its decisions (the stand-in servers share its
    event loop, so what they hold at that moment is exact):

    - routing: every group goes to a server with the fewest groups among those taking requests,
      so a server with nothing to do gets the next group, none is left out;
    - room: whenever it stops starting groups, it is at max_in_flight_groups (in flight plus
      finished and waiting for a batch), or every server is in the middle of a weight update, or
      the least-loaded server's weights are too old for the batch the group would land in; never
      while it could have started one.

    Not a share of wall time: idle time between a group's end and the next one's start is the
    orchestrator's CPU time per group against 10 ms a token, which a loaded machine stretches
    (a run with three others sharing two cores: 74% busy, though every decision was right);
    benchmarks/orchestrator_throughput.py measures scheduling speed. The orchestrator's own idle
    accounting (inference_idle_frac) must be consistent with the servers' records: it counts a
    server idle only while none of its requests is out (from before it is sent until its answer
    is read), a superset of the time the server generates, so it can never exceed the idle time
    the servers record over the same windows."""
    servers = [FakeServer(lambda: 0.01) for _ in range(4)]
    decisions = {"assigned": 0, "at capacity": 0, "weights too old": 0, "updating": 0}
    windows: list[tuple[float, float, float]] = []  # (start, end, idle server-seconds) per record

    def on_start(orch: Orchestrator) -> None:
        pool, o, m = orch.pool, orch.settings, orch.cfg.off_policy_steps
        assign, may_start, take_idle_s = pool.assign, orch.may_start_group, pool.take_idle_s
        last = [time.monotonic()]

        def warmed_up() -> bool:  # batch 2 handed over, the last one not yet
            return 2 < orch.next_step <= orch.cfg.max_steps

        def taking() -> list:
            return [s for s in pool.in_rotation if not s.updating]

        def checked_assign(server) -> None:
            if warmed_up():
                fewest = min(s.groups for s in taking())
                assert server.groups == fewest, \
                    f"group sent to {server.url} ({server.groups} groups) while another had {fewest}"
                decisions["assigned"] += 1
            assign(server)

        def checked_may_start() -> bool:
            ok = may_start()
            if not ok and warmed_up():
                queued = len(orch.in_flight) + len(orch.finished)
                if queued >= o.scheduling.max_in_flight_groups:
                    decisions["at capacity"] += 1
                elif not taking():
                    decisions["updating"] += 1
                else:
                    target = orch.next_step + queued // o.scheduling.prompts_per_step
                    assert not is_fresh(pool.pick().version, target, m), (
                        f"no group started with {queued} of {o.scheduling.max_in_flight_groups} queued, "
                        f"groups per server {[s.groups for s in taking()]}")
                    decisions["weights too old"] += 1
            return ok

        def recorded_take_idle_s() -> float:
            now, idle = time.monotonic(), take_idle_s()
            windows.append((last[0], now, idle))
            last[0] = now
            return idle

        pool.assign, orch.may_start_group, pool.take_idle_s = checked_assign, checked_may_start, recorded_take_idle_s

    o = asyncio.run(run_scenario(tmp_path, servers, max_steps=30, max_async_level=4, on_start=on_start,
                                 orchestrator={"scheduling": {"max_in_flight_groups": 32, "prompts_per_step": 8,
                                                              "in_flight_updates": True}}))
    check_rules(o)
    # The checks ran: batches 3 to 30 took 28 x 8 groups, all started within the checked span but
    # those queued when it began (at most max_in_flight_groups).
    oc = o.cfg.orchestrator.scheduling
    assert decisions["assigned"] >= oc.prompts_per_step * (o.cfg.max_steps - 2) - oc.max_in_flight_groups, decisions
    assert len(windows) == o.cfg.max_steps
    for lo, hi, idle in windows[1:]:  # the first also counts the time before on_start
        # Same clock, one thread: the orchestrator's idle intervals lie inside the servers' own.
        assert idle <= sum(idle_s(s, lo, hi) for s in servers) + 1e-9 * len(servers) * (hi - lo + 1), (lo, hi, idle)


@pytest.mark.parametrize("server_count", [2])
def test_groups_spread_over_servers(tmp_path, server_count):
    servers = [FakeServer(lambda: 0.002) for _ in range(server_count)]
    asyncio.run(run_scenario(tmp_path, servers, max_steps=4))
    counts = [len(s.requests) for s in servers]
    assert min(counts) > 0.3 * max(counts), counts


def test_a_server_that_never_answers_ends_in_a_clear_timeout(tmp_path):
    """Every request times out (timeouts.request_s), the server leaves rotation and is retried;
    with no batch possible the orchestrator gives up after trainer_timeout_s, saying what it
    waited for, rather than hanging."""
    stuck = FakeServer(lambda: 1000.0)
    # The orchestrator's own give-up, naming its trainer_timeout_s, not run_scenario's cap.
    with pytest.raises(TimeoutError, match="gave up after 3 s waiting for 4 groups for batch 1"):
        asyncio.run(run_scenario(tmp_path, [stuck], max_steps=2, timeout_s=60,
                                 orchestrator={"timeouts": {"request_s": 0.5, "weights_s": 3}}))
    assert len(stuck.requests) >= 2  # retried after the backoff


def test_a_server_restarted_between_requests_is_reloaded(tmp_path):
    """A server that restarts while idle comes back on the base model (version 0) and fails no
    request: a health check must notice and bring it back to the current version. It restarts
    while the trainer holds version 10 back, until b serves version 9 again (or 60 s pass), so
    no routine push of a new version can be what brings it back."""
    a, b = FakeServer(lambda: 0.002), FakeServer(lambda: 0.002)
    calls, restarted, pause_ends = [], [], []
    back = asyncio.Event()

    async def hold_version_10() -> None:
        try:
            await asyncio.wait_for(back.wait(), 60)
        finally:
            pause_ends.append(time.monotonic())

    def step_latency():
        calls.append(time.monotonic())
        if len(calls) == 10:  # before version 10
            return hold_version_10()
        return 0.1

    async def restart():
        while not (len(calls) >= 10 and b.version == 9):
            await asyncio.sleep(0.005)
        b.version = 0  # what a fresh `rl inference` reports
        restarted.append(time.monotonic())
        while b.version != 9:  # brought back (only a reload sets it)
            await asyncio.sleep(0.005)
        back.set()

    async def scenario():
        task = asyncio.create_task(restart())
        o = await run_scenario(tmp_path, [a, b], step_latency=step_latency, max_steps=20)
        await task
        return o

    o = asyncio.run(scenario())
    check_rules(o)
    assert b.version == a.version == 20
    reloads = [(t, v) for t, v in b.versions if t > restarted[0] and v > 0]
    assert reloads and reloads[0][1] == 9 and reloads[0][0] < pause_ends[0], \
        f"not brought back to version 9 during the pause: {reloads[:2]}"
    assert [w for w in o.warnings if "out of rotation" in w] == \
        [f"server {o.cfg.urls[1]} out of rotation (reports version 0, expected 9 (restarted?)); 1 of 2 left, retry in 1 s"]
    assert not [w for w in o.warnings if "requeued" in w or "failed" in w], o.warnings


def test_a_server_announced_in_the_run_directory_joins_on_the_current_version_and_leaves(tmp_path):
    """A server nobody listed starts mid-run and announces itself with its heartbeat (as `rl
    inference` on another host does): it joins once healthy, loaded with the current version
    before its first request, and leaves when its heartbeat goes; its groups are requeued and
    no prompt is lost."""
    from rl.heartbeat import Heartbeat, server_heartbeat_path

    a, b = FakeServer(lambda: 0.002), FakeServer(lambda: 0.002)
    run = RunDir(tmp_path)
    left: dict[str, int] = {}  # when the pool let b go: the last group id issued, batches made
    orchestrator: list[Orchestrator] = []

    class Leaving(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:  # runs inside pool.remove, synchronously
            if "left the pool" in record.getMessage():
                left.update(seq=orchestrator[0].flight.seq, batches=len(run.rollout_steps()))

    leaving = Leaving(logging.WARNING)

    async def join_and_leave():
        port = free_port()
        runner = await start(b, port)
        url = f"http://127.0.0.1:{port}"
        try:
            while len(run.rollout_steps()) < 2:
                await asyncio.sleep(0.01)
            beat = Heartbeat(server_heartbeat_path(tmp_path, url), every_s=0.2, url=url).start()
            while len(b.requests) < 5:
                await asyncio.sleep(0.01)
            beat.stop()  # a clean stop: the heartbeat file goes
            # b keeps answering while the run makes three more batches after the pool let it go:
            # any request routed to it after that reaches it and is recorded.
            while not left or len(run.rollout_steps()) < min(left["batches"] + 3, 40):
                await asyncio.sleep(0.01)
        finally:
            await runner.cleanup()

    def on_start(orch: Orchestrator) -> None:
        orchestrator.append(orch)
        logging.getLogger("orchestrator").addHandler(leaving)

    async def scenario():
        task = asyncio.create_task(join_and_leave())
        try:
            o = await run_scenario(tmp_path, [a], step_latency=lambda: 0.15, max_steps=40, on_start=on_start)
        finally:
            logging.getLogger("orchestrator").removeHandler(leaving)
        await task
        return o

    o = asyncio.run(scenario())
    check_rules(o)
    first_request = min(r.started for r in b.requests.values())
    loaded = [(t, v) for t, v in b.versions if v > 0]
    assert loaded and loaded[0][0] < first_request, "served before it was brought to the current version"
    assert b.versions[1][1] >= 2  # joined after batch 2: not on the base model
    # Group ids count up (tag-seq, one request per group here): none issued after the pool let
    # b go went to b. (One issued before may reach it a moment after.)
    assert left, "b never left the pool"
    late = [i for i in b.requests if int(i.rsplit("-", 1)[1]) > left["seq"]]
    assert not late, f"used after it left: {late}"
    assert [s.url for s in o.orchestrator.pool.servers] == [o.cfg.orchestrator.servers.urls[0]]


def test_a_restarted_server_is_asked_when_it_starts_and_again_when_its_heartbeat_says_serving(tmp_path):
    """A server out of rotation is retried with a backoff that doubles up to servers.retry_max_s;
    vLLM takes ~20-30 s to get ready, so a restarted one would wait up to that backoff once
    ready. Its heartbeat says when it starts (a new instance) and when it serves: the pool asks
    it at once on each, and not in between (it is still starting: the backoff stands)."""
    from orchestrator.servers.pool import ServerPool
    from rl.heartbeat import SERVING, Heartbeat, server_heartbeat_path

    url = "http://127.0.0.1:9"  # never asked here: discover() only schedules the next question

    async def until(what: str, condition, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        async with aiohttp.ClientSession(connector=connector()) as session:
            pool = ServerPool([url], session, None, retry_max_s=30, delivery=lambda pool: None)
            s = pool.servers[0]
            s.joined, s.backoff_s, s.retry_at = True, 16.0, time.monotonic() + 16  # down a while
            beat = Heartbeat(server_heartbeat_path(tmp_path, url), every_s=0.05, url=url).start()
            watch = asyncio.create_task(pool.discover(tmp_path, set(), timeout_s=20, every_s=0.05))
            try:
                await until("the new instance to be asked at once", lambda: s.retry_at == 0.0)
                assert s.backoff_s == 1.0
                s.backoff_s, s.retry_at = 2.0, time.monotonic() + 60  # asked: not up yet
                beats = beat.beats
                await until("three more beats", lambda: beat.beats >= beats + 3)
                await asyncio.sleep(0.1)  # and two turns of discover() after the last
                assert s.retry_at > time.monotonic() + 30, "asked again while it still starts"
                beat.set_phase(SERVING)
                await until("the ready server to be asked at once", lambda: s.retry_at == 0.0)
                assert s.backoff_s == 1.0
            finally:
                watch.cancel()
                beat.stop()

    asyncio.run(scenario())


def test_a_cancel_that_meets_a_notify_is_not_lost():
    """SIGTERM cancels the orchestrator's main task wherever it waits. Python 3.11's
    asyncio.wait_for returned the inner wait's result when that wait ended in the same loop turn
    as the cancel, and the cancel was lost: a run told to stop went on waiting for its final
    version (seen once in a suite run). The waits go through orchestrator.bounded_wait instead."""
    from orchestrator.bounded_wait import notified

    async def scenario(wait) -> str:
        changed, ready = asyncio.Condition(), []

        async def waiter() -> str:
            async with changed:
                await wait(changed, lambda: bool(ready))
            return "went on waiting"

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # it waits on the condition now
        async with changed:
            ready.append(True)
            changed.notify_all()  # its wait ends ...
        task.cancel()  # ... in the same loop turn as the cancel
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(scenario(lambda c, _: notified(c, 5.0))) == "cancelled"
    assert asyncio.run(scenario(lambda c, ready: notified(c, 5.0, ready))) == "cancelled"
    if sys.version_info < (3, 12):  # the race itself, as 3.11's wait_for loses it (3.12 rewrote wait_for)
        assert asyncio.run(scenario(lambda c, _: asyncio.wait_for(c.wait(), 5.0))) == "went on waiting"
