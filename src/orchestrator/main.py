"""The orchestrator: keeps groups generating on the inference servers, scores them, and hands
batches to the trainer under the async rule (rl/async_rule.py).

    rl orchestrator @ configs/demo.toml

Concurrent loops on one event loop:
  - `produce`: starts groups (orchestrator/rollouts.py) on the least-loaded server while fewer
    than max_in_flight_groups are in flight or finished-unbatched, and only groups that can still
    land in a batch under the off-policy bound m;
  - `follow_weights`: loads each new STABLE weights version into every server;
  - `pool.heal`: retries servers taken out of rotation and lets joining ones in;
  - `pool.discover`: adds the servers that announce themselves in the run directory, drops those
    whose heartbeat stops (orchestrator.discover_servers);
  - `run` (the main loop), for n = 1..max_steps: waits until version >= n-1-k serves on every
    server in rotation, takes the oldest fresh finished groups, hands batch n over, checkpoints,
    and cancels in-flight groups that batch n+1 could no longer accept (aborted on their server,
    prompts requeued).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import itertools
import json
import logging
import secrets
import signal
import time
from dataclasses import dataclass, field

import aiohttp

from orchestrator.delivery import weight_delivery
from orchestrator.evaluation import Evaluation
from orchestrator.prompts import Prompt, PromptQueue, decode_state, encode_state
from orchestrator.rollouts import Aborted, Group, Rollouts
from orchestrator.scoring import Reward, Teacher
from orchestrator.servers import Server, ServerPool
from orchestrator.sources import RowError, Source, mix
from orchestrator.tokenizer import load_tokenizer
from rl.async_rule import can_hand_over, is_fresh, min_serving_version, oldest_usable_version
from rl.batch import Batch
from rl.callables import load_callable
from rl.config import RunConfig
from rl.inference_api import GenerateRequest, GenerateResponse, InferenceClient, InferenceError, connector
from rl.faults import crash_point
from rl.heartbeat import PeerReporter, PeerWatch, current_instance, heartbeat_path, set_phase
from rl.polling import Backoff
from rl.preflight import orchestrator_state_refusal
from rl.rundir import RunDir, mark_stable, write_file_atomic
from rl.tracking import Tracker
from rl.transport import BatchSender

log = logging.getLogger("orchestrator")

HEARTBEAT_S = 15.0  # how often a wait says what it still waits for
MAX_ATTEMPTS = 3  # a prompt whose group fails (rewards, teacher) this often is dropped


@dataclass
class InFlight:
    prompt: Prompt
    server: Server
    version: int
    """Version the server served when the group started: no token of it is older."""
    requests: set[str] = field(default_factory=set)
    task: asyncio.Task | None = None
    cancelled: bool = False


@dataclass
class Counters:
    """Since the previous batch."""
    model_tokens: int = 0
    cancelled: int = 0
    failed: int = 0
    failed_requests: int = 0
    filtered: int = 0
    dropped_stale: int = 0
    requeued: int = 0
    """Groups taken off a server that stopped answering, prompts requeued."""
    skipped_rows: int = 0
    """Rows that cannot make a prompt (no prompt, a template that fails on them, too long)."""
    started: float = field(default_factory=time.monotonic)


class Orchestrator:
    def __init__(self, cfg: RunConfig, session: aiohttp.ClientSession):
        self.cfg, self.o = cfg, cfg.orchestrator
        self.run_dir = RunDir(cfg.run_dir)
        self.pool = ServerPool(cfg.urls, session, cfg.inference.api_token, self.o.server_retry_max_s,
                               lambda pool: weight_delivery(cfg, pool), on_fail=self.requeue_from)
        self.delivery = self.pool.delivery  # files, broadcast or LoRA adapters, chosen once
        self.rollouts = self._make_rollouts(session)
        evals = self._sources(session, evaluation=True)
        self.evaluation = Evaluation(self.rollouts, evals, self.o.eval) if evals else None
        self.evaluations: list[asyncio.Task] = []  # running beside training
        # (server, version) of each evaluation running: LoRA keeps that adapter loaded until it ends
        # (between its requests no group may hold it, and unload_unused would take it away).
        self.evaluating: list[tuple[Server, int]] = []
        self.sender = BatchSender(cfg.transport, self.run_dir)
        self.next_step, cursor, pending = self._resume_point()
        self.queue = PromptQueue(self._draws(), self._fetch, cursor, pending)
        self.in_flight: dict[str, InFlight] = {}
        self.finished: list[Group] = []
        self.weights_poll = Backoff(self.o.poll_interval_s, 5 * self.o.poll_interval_s)
        self.changed = asyncio.Condition()  # a group finished, a batch left, a version serves
        self.counters = Counters()
        self.background: list[asyncio.Task] = []
        self.chores: set[asyncio.Task] = set()
        self.attempts: dict[int, int] = {}  # prompt index -> failed groups so far
        # Request ids must not collide with a previous orchestrator's still running on a server.
        self.tag, self.seq = secrets.token_hex(3), 0
        t = cfg.tracking
        self.tracker = Tracker(cfg) if t.wandb or t.tensorboard else None

    def _make_rollouts(self, session: aiohttp.ClientSession) -> Rollouts:
        o = self.o
        env = load_callable(o.environment, "orchestrator.environment")() if o.environment else None
        sources = {} if env else {s.name: s for s in self._sources(session)}
        teacher = None
        if o.teacher_url:
            teacher = Teacher(InferenceClient(o.teacher_url, session, self.cfg.inference.api_token),
                              o.teacher_coef, o.request_timeout_s)
        return Rollouts(self.cfg, load_tokenizer(self.cfg.model), sources, teacher, env)

    def _sources(self, session: aiohttp.ClientSession, evaluation: bool = False) -> list[Source]:
        o = self.o
        sources = []
        for ds in o.resolved_datasets(evaluation):
            source = Source(ds, self.cfg.seed)
            key = "orchestrator.reward" if not (o.datasets or evaluation) else f"dataset {ds.name}: reward"
            source.reward = Reward(ds.reward, o.reward_timeout_s, session, o.reward_inline, key) if ds.reward else None
            sources.append(source)
        return sources

    def _draws(self):
        if self.rollouts.env is not None:
            return (("", row) for row in self.rollouts.env.dataset(self.cfg.seed))
        return mix(list(self.rollouts.sources.values()), self.cfg.seed)

    def _fetch(self, source: str, draw) -> tuple[dict, str]:
        if self.rollouts.env is not None:
            return draw, "orchestrator.environment"
        return self.rollouts.sources[source].fetch(draw)

    # --- checkpoint and resume -----------------------------------------------------------

    def _resume_point(self) -> tuple[int, int, list[Prompt]]:
        """(next step, data cursor, pending prompts): a fresh start, or where the last
        checkpoint left off."""
        saved = self.run_dir.checkpoint_steps("orchestrator")
        self.sender.discard_partial()
        if not saved:
            if refusal := orchestrator_state_refusal(self.run_dir):  # rl.cli refused it already
                raise SystemExit(refusal)
            return 1, 0, []
        path = self.run_dir.checkpoint_dir(saved[-1]) / "orchestrator" / "state.json"
        step, cursor, pending = decode_state(path.read_bytes())
        # A crash between handing batch n over and checkpointing it: batch n is out, its prompts
        # are still listed as pending and go out again; batch numbers stay contiguous.
        last = self.sender.last_handed_over(step)
        log.info("resuming after batch %d from %s: %d rows drawn, %d pending prompts re-issued",
                 last, path, cursor, len(pending))
        return last + 1, cursor, pending

    def checkpoint(self, step: int) -> None:
        pending = [*self.queue.requeued, *(g.prompt for g in self.in_flight.values()),
                   *(g.prompt for g in self.finished)]
        directory = self.run_dir.checkpoint_dir(step) / "orchestrator"
        directory.mkdir(parents=True, exist_ok=True)
        write_file_atomic(directory / "state.json", encode_state(step, self.queue.cursor, pending))
        mark_stable(directory)
        for old in self.run_dir.checkpoint_steps("orchestrator")[:-self.o.keep_checkpoints]:
            self.run_dir.remove_checkpoint(old, "orchestrator")

    # --- waiting, visibly -----------------------------------------------------------------

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, predicate, what: str, timeout_s: float) -> float:
        """Wait for `predicate()`, logging what it waits for; returns seconds waited."""
        if predicate():
            return 0.0
        start = last_beat = time.monotonic()
        async with self.changed:
            while not predicate():
                for task in self.background:
                    if task.done():  # a background loop died: surface its error, do not wait on
                        task.result()
                        raise RuntimeError(f"background task {task.get_name()} stopped")
                now = time.monotonic()
                if now - start > timeout_s:
                    raise TimeoutError(f"gave up after {timeout_s:.0f} s waiting for {what}")
                if now - last_beat > HEARTBEAT_S:
                    log.info("still waiting for %s (%.0f s)", what, now - start)
                    last_beat = now
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout=1.0)
                except TimeoutError:
                    pass
        return time.monotonic() - start

    # --- weights ---------------------------------------------------------------------------

    def latest_weights(self) -> tuple[int, object]:
        latest = self.run_dir.latest_stable_weights()
        return (0, self.cfg.model) if latest is None else (latest, self.run_dir.weights_dir(latest))

    async def follow_weights(self) -> None:
        while True:
            version, path = self.latest_weights()
            if version > self.pool.version or any(s.version != version for s in self.pool.in_rotation):
                await self.delivery.load(version, path)
                self.weights_poll.reset()
                await self.notify()
            # LoRA: what each group and evaluation in flight started on stays loaded (read only
            # by AdapterDelivery, hence lazily).
            in_use = itertools.chain(((g.server, g.version) for g in self.in_flight.values()), self.evaluating)
            await self.delivery.unload_unused(in_use)
            await self.until_weights_due()

    def weights_due(self) -> bool:
        """A batch was handed over whose weights are not served yet."""
        return self.next_step - 1 > self.pool.version

    async def until_weights_due(self) -> None:
        """Pause between looks at the run directory. A version's discovery is part of every
        weight update's latency (a tiny model reloads in ~35 ms; docs/performance.md), so while
        one is due: poll_interval_s, backing off to five times that while it does not come.
        Otherwise up to ten times that, woken by the hand-over of a batch: fast polling then
        would only cost file-system calls (round trips on NFS)."""
        if self.weights_due():
            await asyncio.sleep(self.weights_poll.next())
            return
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(self.weights_due), 10 * self.o.poll_interval_s)
            except TimeoutError:
                pass

    async def watch_trainer(self) -> None:
        """Say within seconds when the trainer dies or freezes (batches then wait for it: a
        trainer restarted with --resume continues), let the sender forget the batches it has
        trained, and stop if a multi-run trainer turned this run away."""
        watch = PeerWatch(heartbeat_path(self.cfg, "trainer"), "trainer", self.cfg.heartbeat_timeout_s)
        trainer = PeerReporter(watch, log, "batches wait for it (restart it with --resume)")
        ranks: dict[str, PeerReporter] = {}  # the trainer's other ranks, on other nodes maybe
        while True:
            if self.next_step <= self.cfg.max_steps:  # after the last batch, a trainer that exits is done
                trainer.poll()
                for path in RunDir(self.cfg.output_dir).heartbeat_dir.glob("trainer-rank*"):
                    if path.name not in ranks:
                        ranks[path.name] = PeerReporter(
                            PeerWatch(path, path.name, self.cfg.heartbeat_timeout_s), log,
                            "the trainer's collectives wait for it (torchrun stops the trainer if it is gone)")
                for reporter in ranks.values():
                    reporter.poll()
            # sender.redeliver hands the trainer again only the batches it has not trained.
            self.sender.forget(self.run_dir.latest_stable_weights() or 0)
            self.check_trainer()
            await asyncio.sleep(1.0)

    def check_trainer(self) -> None:
        """Multi-run: a trainer that turned this run away says why in trainer_status.json."""
        if not self.cfg.run_name:
            return
        try:
            status = json.loads(self.run_dir.trainer_status.read_text())
        except (OSError, ValueError):
            return
        if status.get("status") in ("rejected", "failed") and status.get("orchestrator") == current_instance():
            raise RuntimeError(f"the trainer {status['status']} run {self.cfg.run_name}: {status.get('detail')}")

    # --- groups ----------------------------------------------------------------------------

    def may_start_group(self) -> bool:
        queued = len(self.in_flight) + len(self.finished)
        server = self.pool.pick()
        if queued >= self.o.max_in_flight_groups or server is None:
            return False
        # The batch this group would most likely land in: the ones queued ahead fill earlier
        # batches. If the server's version is already too old for it, the group would only be
        # thrown away: wait for newer weights instead.
        target = self.next_step + queued // self.o.prompts_per_step
        return is_fresh(server.version, target, self.cfg.off_policy_steps)

    async def produce(self) -> None:
        while True:
            await self.wait_until(self.may_start_group, "room for a new group", float("inf"))
            server = self.pool.pick()
            self.seq += 1
            gid = f"{self.tag}-{self.seq}"
            g = InFlight(self.queue.take(), server, server.version)
            self.pool.assign(server)
            g.task = asyncio.create_task(self.run_group(gid, g), name=gid)
            self.in_flight[gid] = g

    async def run_group(self, gid: str, g: InFlight) -> None:
        adapter = self.delivery.adapter(g.version)

        async def generate(request: GenerateRequest) -> GenerateResponse:
            if g.cancelled:  # a multi-turn episode's next turn, after its group was aborted
                raise Aborted(request.request_id)
            if adapter is not None:  # every turn on the adapter the group started on
                request = request.model_copy(update={"lora": adapter})
            g.requests.add(request.request_id)
            self.pool.begin(g.server)
            try:
                response = await g.server.client.generate(request, self.o.request_timeout_s)
                self.pool.succeeded(g.server)
                return response
            except InferenceError:
                # Timed out or broke off: the server may still be generating it; free the slot.
                self.spawn(g.server.client.abort([request.request_id], timeout=2.0))
                raise
            finally:
                self.pool.end(g.server)
                g.requests.discard(request.request_id)

        group = None
        try:
            group = await self.rollouts.group(g.prompt, gid, generate)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # A cancelled group's prompt was requeued by cancel_hopeless: whatever it raised
            # while being cancelled must not requeue it a second time.
            if not g.cancelled:
                self.group_failed(gid, g, e)
        finally:
            self.pool.release(g.server)
            if not g.cancelled:
                self.in_flight.pop(gid, None)
        if g.cancelled or group is None:
            await self.notify()
            return
        self.counters.failed += group.failed
        if not group.samples:  # every rollout's reward or environment failed
            self.retry_or_drop(gid, g.prompt, f"{group.failed} of {self.o.group_size} rollouts failed")
        elif self.o.filter_zero_variance and self.rollouts.teacher is None and len(set(group.rewards)) == 1:
            self.counters.filtered += 1
        else:
            self.finished.append(group)
            self.counters.model_tokens += group.model_tokens
        await self.notify()

    def group_failed(self, gid: str, g: InFlight, e: Exception) -> None:
        if isinstance(e, (InferenceError, Aborted)):  # the server's fault, not the prompt's
            self.counters.failed_requests += 1
            self.in_flight.pop(gid, None)  # requeued here, not by requeue_from
            self.queue.give_back(g.prompt)
            self.pool.fail(g.server, str(e))
        elif isinstance(e, RowError):
            self.counters.skipped_rows += 1
            log.warning("row skipped: %s", e)
        else:  # a teacher that is down, a tokenizer that chokes
            self.counters.failed += self.o.group_size
            self.retry_or_drop(gid, g.prompt, f"{type(e).__name__}: {e}")

    def retry_or_drop(self, gid: str, prompt: Prompt, why: str) -> None:
        """Requeue a prompt whose group failed for a reason that may pass (a reward endpoint
        down); after MAX_ATTEMPTS the prompt is dropped, loudly, rather than retried forever."""
        n = self.attempts[prompt.index] = self.attempts.get(prompt.index, 0) + 1
        if n < MAX_ATTEMPTS:
            log.warning("group %s failed (%s); prompt %d requeued", gid, why, prompt.index)
            self.queue.give_back(prompt)
        else:
            log.error("group %s failed (%s); prompt %d dropped after %d attempts", gid, why, prompt.index, n)
            self.attempts.pop(prompt.index)

    def spawn(self, coro) -> None:
        """Fire and forget (best effort), but keep a reference so the task is not collected."""
        task = asyncio.create_task(coro)
        self.chores.add(task)
        task.add_done_callback(lambda t: (self.chores.discard(t), t.cancelled() or t.exception()))

    def requeue_from(self, server: Server) -> None:
        """A server stopped answering (health check, heartbeat: its host died or is cut off): its
        groups would finish late or never (request_timeout_s), so their prompts go back to the
        queue now, for the servers still there. Aborts are best effort: it may be unreachable."""
        doomed = [(gid, g) for gid, g in self.in_flight.items() if g.server is server]
        for gid, g in doomed:
            g.cancelled = True
            del self.in_flight[gid]
            self.queue.give_back(g.prompt)
            if g.requests:
                self.spawn(server.client.abort(sorted(g.requests), timeout=2.0))
            g.task.cancel()
        self.counters.requeued += len(doomed)
        if doomed:
            log.warning("requeued the prompts of %d group(s) in flight on %s", len(doomed), server.url)
        self.spawn(self.notify())

    async def cancel_hopeless(self) -> None:
        """Cancel in-flight groups the next batch could no longer accept: their oldest token
        is older than the off-policy bound allows. Their requests are aborted on the server
        (freeing its slots for useful work) and their prompts go back to the queue."""
        m = self.cfg.off_policy_steps
        doomed = [(gid, g) for gid, g in self.in_flight.items() if not is_fresh(g.version, self.next_step, m)]
        for gid, g in doomed:
            g.cancelled = True
            del self.in_flight[gid]
            self.queue.give_back(g.prompt)
            self.counters.cancelled += 1
        await asyncio.gather(*(self.abort(g) for _, g in doomed))
        for _, g in doomed:
            g.task.cancel()
        if doomed:
            log.info("cancelled %d in-flight group(s) older than version %d (max_off_policy_steps=%d); "
                     "prompts requeued", len(doomed), oldest_usable_version(self.next_step, m), m)

    async def abort(self, g: InFlight) -> None:
        if not g.requests:
            return
        try:
            await g.server.client.abort(sorted(g.requests))
        except InferenceError as e:  # the client side still lets go; say the server may not have
            log.warning("abort on %s failed: %s", g.server.url, e)

    # --- batches ---------------------------------------------------------------------------

    def drop_stale(self, step: int) -> None:
        keep = []
        for g in self.finished:
            if is_fresh(g.oldest_version, step, self.cfg.off_policy_steps):
                keep.append(g)
            else:
                self.queue.give_back(g.prompt)
                self.counters.dropped_stale += 1
        self.finished = keep

    def batch_ready(self, step: int) -> bool:
        self.drop_stale(step)
        return len(self.finished) >= self.o.prompts_per_step

    async def make_batch(self, step: int) -> None:
        k = self.cfg.max_async_level

        def versions_ok() -> bool:
            return can_hand_over(step, self.pool.serving_versions(), k)

        set_phase(f"making batch {step}")
        trainer_wait = await self.wait_until(
            versions_ok, f"version {min_serving_version(step, k)} to serve on every server "
            f"(max_async_level={k}) before batch {step}", self.o.trainer_timeout_s)
        group_wait = await self.wait_until(
            lambda: self.batch_ready(step), f"{self.o.prompts_per_step} groups for batch {step}",
            self.o.trainer_timeout_s)
        while True:
            # Both again, at once: a server may have left or rejoined rotation meanwhile.
            await self.wait_until(lambda: versions_ok() and self.batch_ready(step), f"batch {step}",
                                  self.o.trainer_timeout_s)
            # Ask the servers themselves: one restarted since its last request serves version 0
            # while still counted with the version it had (one /health per server per batch).
            await self.pool.check()
            if versions_ok() and self.batch_ready(step):
                break
        # Oldest first: they are the closest to going stale.
        self.finished.sort(key=lambda g: g.oldest_version)
        groups = self.finished[: self.o.prompts_per_step]
        self.finished = self.finished[self.o.prompts_per_step:]
        # From here on new groups are meant for the next batch (the send below yields to them).
        self.next_step = step + 1
        samples = [s for g in groups for s in g.samples]
        batch = Batch.from_samples(step, samples)
        set_phase(f"handing over batch {step}")
        await self.sender.send(batch, self.o.trainer_timeout_s)
        crash_point("orchestrator.handed_over", step)
        self.checkpoint(step)
        await self.cancel_hopeless()
        await self.notify()
        self.report(batch, groups, trainer_wait, group_wait)

    def report(self, batch: Batch, groups: list[Group], trainer_wait: float, group_wait: float) -> None:
        c, self.counters = self.counters, Counters()
        elapsed = max(time.monotonic() - c.started, 1e-9)
        step = batch.step
        staleness = [step - 1 - int(v) for v in batch.versions]
        rewards = [float(r) for r in batch.rewards]
        servers = max(len(self.pool.in_rotation), 1)
        record = {
            "program": "orchestrator", "step": step,
            "reward_mean": sum(rewards) / len(rewards),
            "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
            "staleness_hist": {str(s): n for s, n in sorted(collections.Counter(staleness).items())},
            "tokens_per_s": c.model_tokens / elapsed,
            "wait_s": trainer_wait + group_wait, "trainer_wait_frac": trainer_wait / elapsed,
            "group_wait_s": group_wait, "inference_idle_frac": self.pool.take_idle_s() / (elapsed * servers),
            "cancelled": c.cancelled, "failed": c.failed, "failed_requests": c.failed_requests,
            "filtered": c.filtered, "dropped_stale": c.dropped_stale, "requeued": c.requeued,
            "in_flight": len(self.in_flight), "buffered": len(self.finished),
            "serving_version": self.pool.serving_version, "servers_in_rotation": len(self.pool.in_rotation),
            "truncated": sum(g.truncated for g in groups), "skipped_rows": c.skipped_rows,
            **({} if (update_s := self.delivery.take_update_s()) is None else {"weight_update_s": update_s}),
            **reward_details(groups, len(self.rollouts.sources) > 1),
        }
        self.run_dir.append_metrics(record)
        log.info("batch %d reward %.3f staleness %.2f (max %d) %.0f tok/s | waited trainer %.2fs groups %.2fs "
                 "| in-flight %d idle %.0f%% | cancelled %d failed %d filtered %d stale %d truncated %d",
                 step, record["reward_mean"], record["staleness_mean"], record["staleness_max"],
                 record["tokens_per_s"], trainer_wait, group_wait, record["in_flight"],
                 100 * record["inference_idle_frac"], c.cancelled, c.failed + c.failed_requests,
                 c.filtered, c.dropped_stale, record["truncated"])

    # --- trackers ------------------------------------------------------------------------------

    async def track(self) -> None:
        """Forward metrics.jsonl to the trackers (rl/tracking.py), off the event loop."""
        while True:
            await asyncio.to_thread(self.tracker.forward)
            await asyncio.sleep(2.0)

    async def close_tracker(self) -> None:
        """Last records: the trainer writes its final step's after publishing the version this
        orchestrator waited for, so give it a moment."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not self._trainer_logged(self.cfg.max_steps):
            await asyncio.sleep(0.5)
        await asyncio.to_thread(self.tracker.close)

    def _trainer_logged(self, step: int) -> bool:
        try:
            lines = self.run_dir.metrics.read_bytes()[-65536:].splitlines()[1:]  # the first may be cut
        except OSError:
            return True
        for line in reversed(lines):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("program") == "trainer" and record.get("step") == step:
                return True
        return False

    # --- held-out evaluation -------------------------------------------------------------------

    def start_evaluation(self, step: int) -> None:
        """Evaluate the version `step` published, beside training (orchestrator/evaluation.py)."""
        if self.evaluation is not None:
            self.evaluations.append(asyncio.create_task(self.evaluate(step), name=f"evaluate-{step}"))

    async def evaluate(self, step: int) -> None:
        """One evaluation of version `step` (or the newest serving once it does); a failure is
        logged and the run goes on."""
        try:
            await self.wait_until(lambda: self.pool.serving_version >= step and self.pool.pick() is not None,
                                  f"version {step} to serve, to evaluate it", self.o.eval.timeout_s)
            server = self.pool.pick()
            version = server.version
            pin = (server, version)
            self.evaluating.append(pin)
            try:
                record = await asyncio.wait_for(self.evaluation.run(
                    server.client, version, step, f"{self.tag}-eval{step}", self.delivery.adapter(version)),
                    self.o.eval.timeout_s)
            finally:
                self.evaluating.remove(pin)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the run goes on without this evaluation
            log.warning("evaluation at step %d failed (%s: %s); the run goes on", step, type(e).__name__, e)
            return
        record["version_end"] = server.version  # a long evaluation may see the next version land
        self.run_dir.append_metrics(record)
        scores = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in record.items()
                           if k.startswith("eval/") and not k.endswith("/rows"))
        log.info("eval of version %d (step %d): %s (%.1f s)", version, step, scores, record["eval_s"])

    # --- the run ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.background = [asyncio.create_task(self.watch_trainer(), name="watch_trainer")]
        fixed = self.delivery.fixed_members  # a broadcast group: every listed server, none discovered
        if self.o.discover_servers and not fixed:
            exclude = {self.o.teacher_url.rstrip("/")} if self.o.teacher_url else set()
            self.background.append(asyncio.create_task(
                self.pool.discover(self.cfg.output_dir, exclude, self.cfg.heartbeat_timeout_s), name="discover"))
        await self.pool.connect(self.o.server_wait_timeout_s, every=fixed)
        await self.delivery.prepare()  # before any load (a broadcast group forms here)
        version, path = self.latest_weights()
        await self.delivery.load(version, path)
        if not self.pool.in_rotation:
            raise RuntimeError(f"no inference server could load version {version} from {path}")
        log.info("connected to %d server(s) (%s), serving version %d; first batch %d", len(self.pool.in_rotation),
                 ", ".join(s.url for s in self.pool.in_rotation), self.pool.serving_version, self.next_step)
        self.background.append(asyncio.create_task(
            self.sender.redeliver(self.o.trainer_timeout_s), name="redeliver"))
        if self.tracker is not None:
            self.background.append(asyncio.create_task(self.track(), name="track"))
        self.background += [asyncio.create_task(self.follow_weights(), name="follow_weights"),
                             asyncio.create_task(self.pool.heal(), name="heal"),
                             asyncio.create_task(self.produce(), name="produce")]

    async def run(self) -> None:
        try:
            await self.start()
            if self.next_step == 1:
                self.start_evaluation(0)
            every = self.o.eval.every
            for step in range(self.next_step, self.cfg.max_steps + 1):
                await self.make_batch(step)
                if every and step % every == 0 and step < self.cfg.max_steps:
                    self.start_evaluation(step)
            # Serve the final policy before stopping, so the run ends with it loaded.
            final = self.cfg.max_steps
            await self.wait_until(lambda: self.pool.serving_version >= final,
                                  f"final version {final} to serve", self.o.trainer_timeout_s)
            await asyncio.gather(*self.evaluations)  # each bounded by eval.timeout_s
            if self.evaluation is not None:
                await self.evaluate(final)
            log.info("done: %d batches; version %d serving", final, self.pool.serving_version)
            if self.tracker is not None:
                await self.close_tracker()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop the loops, then abort what is still generating (servers outlive the orchestrator)."""
        for t in self.background + self.evaluations:
            t.cancel()
        await asyncio.gather(*self.background, *self.evaluations, return_exceptions=True)
        groups = list(self.in_flight.values())
        for g in groups:
            g.cancelled = True
        await asyncio.gather(*(self.abort(g) for g in groups), return_exceptions=True)
        tasks = [g.task for g in groups if g.task]
        for t in tasks:
            t.cancel()
        # Pending aborts are let finish (each has its own short timeout): they free server slots.
        await asyncio.gather(*tasks, *self.chores, return_exceptions=True)
        self.sender.close()
        # LoRA: the server outlives this run: free its adapter slots for other runs. The final
        # adapter stays on disk (weights/step_n) for anyone to load again.
        await self.delivery.unload_all()


def reward_details(groups: list[Group], per_dataset: bool) -> dict[str, float]:
    """Mean of each named reward component ("reward/<name>") and, with several datasets, each
    dataset's mean reward ("reward_mean/<dataset>")."""
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for g in groups:
        if per_dataset:
            parts[f"reward_mean/{g.prompt.source}"] += g.rewards
        for components in g.components:
            for name, value in components.items():
                parts[f"reward/{name}"].append(value)
    return {key: sum(values) / len(values) for key, values in sorted(parts.items())}


def tune_gc() -> None:
    """The orchestrator allocates many short-lived lists (token ids, logprobs) per group, so the
    cyclic collector runs often; each full pass would also walk every long-lived object left
    behind at start (modules, the config, the tokenizer). Freezing those and collecting the young
    generation less often doubled the groups scheduled per second (measured when torch was still
    imported here: 370k tracked objects then, 52k now)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


async def _main(cfg: RunConfig) -> None:
    # SIGTERM (the launcher's, or a user's kill) stops like Ctrl-C: through run()'s cleanup,
    # which aborts requests on the servers, unloads adapters and removes the heartbeat.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    conns = connector(limit=cfg.orchestrator.max_in_flight_groups * cfg.orchestrator.group_size + 16)
    async with aiohttp.ClientSession(connector=conns) as session:
        orchestrator = Orchestrator(cfg, session)
        tune_gc()
        await orchestrator.run()


def main(cfg: RunConfig) -> int:
    if cfg.trainer.lora.multi_run and not cfg.run_name:
        log.error("trainer.lora.multi_run = true: this orchestrator needs run_name (its run's name, "
                  "e.g. compose configs/lora_multi/reverse.toml)")
        return 2
    RunDir(cfg.run_dir).make()
    try:
        asyncio.run(_main(cfg))
    except asyncio.CancelledError:
        log.warning("stopped by SIGTERM")
        return 128 + signal.SIGTERM
    return 0
