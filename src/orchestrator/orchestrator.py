"""The orchestrator: keeps groups generating on the inference servers, scores them, and hands
batches to the trainer under the async rule (orchestrator/async_rule.py). `rl orchestrator` runs it
(orchestrator/main.py).

Concurrent loops on one event loop:
  - `produce`: starts groups (orchestrator/rollout/groups.py) on the least-loaded server while fewer
    than max_in_flight_groups are in flight or finished-unbatched, and only groups that can still
    land in a batch under the off-policy bound m;
  - `follow_weights`: loads each new STABLE weights version into every server;
  - `pool.heal`: retries servers taken out of rotation and lets joining ones in;
  - `pool.discover`: adds the servers that announce themselves in the run directory, drops those
    whose heartbeat stops (orchestrator.servers.discover);
  - `run` (the main loop), for n = 1..max_steps: waits until version >= n-1-k serves on every
    server in rotation, takes the oldest fresh finished groups, checkpoints batch n, hands it
    over, and cancels in-flight groups that batch n+1 could no longer accept (aborted on their server,
    prompts requeued).
Beside them: `watch_trainer` (orchestrator/servers/trainer_watch.py), the batch sender's `redeliver`, the
evaluations (orchestrator/evaluation/held_out.py) and, with wandb or TensorBoard on, `track`
(orchestrator/reporting/batch_report.py, which also writes each batch's metrics record).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from dataclasses import dataclass, field

import aiohttp

from orchestrator.async_rule import can_hand_over, is_fresh, min_serving_version, oldest_usable_version
from orchestrator.bounded_wait import notified, wait_visibly
from orchestrator.checkpoint import checkpointed_batch, resume_point, save_checkpoint
from orchestrator.evaluation.held_out import EvaluationRunner
from orchestrator.group_outcomes import GroupOutcomes
from orchestrator.prompts.curriculum import Curriculum
from orchestrator.prompts.dataset_mix import RowError
from orchestrator.prompts.queue import Prompt, PromptQueue
from orchestrator.reporting.batch_report import Counters, Reporting
from orchestrator.rollout.groups import Group, Rollouts
from orchestrator.rollout.kind import Aborted
from orchestrator.servers.pool import ServerPool
from orchestrator.servers.server import Server
from orchestrator.servers.trainer_watch import watch_trainer
from rl.batch import Batch
from rl.config import RunConfig
from rl.faults import crash_point
from rl.heartbeat import set_phase
from rl.inference_api import GenerateRequest, GenerateResponse, InferenceError
from rl.polling import Backoff
from rl.rundir import RunDir
from rl.transports import batch_sender

log = logging.getLogger("orchestrator")


@dataclass
class InFlight:
    prompt: Prompt
    server: Server
    version: int
    """Version the server served when the group started: no token of it is older."""
    requests: set[str] = field(default_factory=set)
    task: asyncio.Task | None = None
    cancelled: bool = False


class Orchestrator:
    def __init__(self, cfg: RunConfig, session: aiohttp.ClientSession):
        self.cfg, self.settings = cfg, cfg.orchestrator
        self.run_dir = RunDir(cfg.run_dir)
        self.pool = ServerPool.for_run(cfg, session, on_fail=self.requeue_from)
        self.delivery = self.pool.delivery  # files, broadcast or LoRA adapters, chosen once
        # Request ids must not collide with a previous orchestrator's still running on a server.
        self.tag, self.seq = secrets.token_hex(3), 0
        self.rollouts = Rollouts.from_config(cfg, session)
        self.evaluations = EvaluationRunner.for_run(cfg, session, self.rollouts, self.pool, self.run_dir,
                                                    self.wait_until, self.tag)
        self.sender = batch_sender(cfg.transport, self.run_dir)
        self.next_step, cursor, pending, record, self.unsent = resume_point(self.run_dir, self.sender)
        self.curriculum = (Curriculum(self.settings.curriculum, cfg.seed, record)
                           if self.settings.curriculum.enabled else None)
        self.queue = PromptQueue(self.rollouts.kind.draws(cfg.seed), self.rollouts.kind.fetch, cursor, pending,
                                 admit=self.curriculum.admit if self.curriculum else None)
        self.in_flight: dict[str, InFlight] = {}
        self.finished: list[Group] = []
        self.weights_poll = Backoff(self.settings.scheduling.poll_interval_s, 5 * self.settings.scheduling.poll_interval_s)
        self.changed = asyncio.Condition()  # a group finished, a batch left, a version serves
        self.counters = Counters()
        self.background: list[asyncio.Task] = []
        self.chores: set[asyncio.Task] = set()
        # What would make the run spin ends it.
        self.outcomes = GroupOutcomes(self.settings, self.rollouts.kind, self.queue,
                                      has_teacher=self.rollouts.teacher is not None)
        self.streaks = self.outcomes.streaks
        self.reporting = Reporting(cfg, self.run_dir, self.pool, per_dataset=len(self.rollouts.kind.sources) > 1)
        if self.next_step > 1:  # resumed: its predecessor may have died between checkpoint and record
            last = self.next_step - 1
            self.reporting.recover(last, lambda: self.unsent if self.unsent is not None
                                   else checkpointed_batch(self.run_dir, last))

    # --- waiting, visibly -----------------------------------------------------------------

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, predicate, what: str, timeout_s: float) -> float:
        """Wait for `predicate()`, saying what it waits for; returns seconds waited."""
        if self.streaks.verdict is not None:
            raise self.streaks.verdict
        return await wait_visibly(self.changed, predicate, what, timeout_s, self.why_not_wait)

    def why_not_wait(self) -> None:
        """Raises what makes a wait pointless: the verdict of a run that can only spin
        (orchestrator/streaks.py), even while others progress, or a background loop that died
        (its error surfaced, not waited on)."""
        if self.streaks.verdict is not None:
            raise self.streaks.verdict
        for task in self.background:
            if task.done():
                task.result()
                raise RuntimeError(f"background task {task.get_name()} stopped")

    # --- weights ---------------------------------------------------------------------------

    def latest_weights(self) -> tuple[int, object]:
        latest = self.run_dir.latest_stable_weights()
        return (0, self.cfg.model) if latest is None else (latest, self.run_dir.weights_dir(latest))

    async def follow_weights(self) -> None:
        while True:
            version, path = self.latest_weights()
            if version > 0 and not self.evaluations.baseline_done.is_set():
                # Version 0 serves until its evaluation ends (bounded by eval.timeout_s).
                await self.evaluations.baseline_done.wait()
                continue
            if version > self.pool.version or any(s.version != version for s in self.pool.in_rotation):
                await self.delivery.load(version, path)
                self.weights_poll.reset()
                await self.notify()
            # LoRA: what each group and evaluation in flight started on stays loaded (read only
            # by AdapterDelivery, hence lazily).
            in_use = itertools.chain(((g.server, g.version) for g in self.in_flight.values()), self.evaluations.pins)
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
            await notified(self.changed, 10 * self.settings.scheduling.poll_interval_s, self.weights_due)

    # --- groups ----------------------------------------------------------------------------

    def may_start_group(self) -> bool:
        queued = len(self.in_flight) + len(self.finished)
        server = self.pool.pick()
        if queued >= self.settings.scheduling.max_in_flight_groups or server is None:
            return False
        # The batch this group would most likely land in: the ones queued ahead fill earlier
        # batches. If the server's version is already too old for it, the group would only be
        # thrown away: wait for newer weights instead.
        target = self.next_step + queued // self.settings.scheduling.prompts_per_step
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
        who = self.rollouts.kind.culprit(g.prompt)

        async def generate(request: GenerateRequest) -> GenerateResponse:
            self.streaks.rendered(who)  # its row made a request: the dataset has usable rows
            if g.cancelled:  # a multi-turn episode's next turn, after its group was aborted
                raise Aborted(request.request_id)
            # Every turn on the adapter the group started on (None: the base weights, full tuning).
            request = request.model_copy(update={"lora": adapter})
            g.requests.add(request.request_id)
            self.pool.begin(g.server)
            try:
                response = await g.server.client.generate(request, self.settings.timeouts.request_s)
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
        if not g.cancelled and group is not None:
            self.settle(gid, g, group)
        await self.notify()

    def settle(self, gid: str, g: InFlight, group: Group) -> None:
        """A finished group: batched, filtered, or (every rollout failed) retried or dropped."""
        self.counters.failed += group.failed
        if not group.samples:
            self.outcomes.retry_or_drop(gid, g.prompt, f"{group.failed} of {self.settings.scheduling.group_size} rollouts "
                                        f"failed, last: {group.error or 'no error recorded'}")
            return
        self.counters.sampled_rewards += group.rewards
        if self.curriculum is not None:
            self.curriculum.scored(g.prompt, group.rewards)
        if self.outcomes.keep(g.prompt, group):
            self.finished.append(group)
            self.counters.model_tokens += group.model_tokens
        else:
            self.counters.filtered += 1

    def group_failed(self, gid: str, g: InFlight, e: Exception) -> None:
        if isinstance(e, (InferenceError, Aborted)):  # the server's fault, not the prompt's
            self.counters.failed_requests += 1
            self.in_flight.pop(gid, None)  # requeued here, not by requeue_from
            self.queue.give_back(g.prompt)
            self.pool.fail(g.server, str(e))
        elif isinstance(e, RowError):  # said once per batch, with the count (make_batch), not per row
            self.counters.skipped_rows += 1
            self.counters.first_skip = self.counters.first_skip or str(e)
            self.outcomes.skipped(g.prompt, e)
        else:  # a teacher that is down, a tokenizer that chokes
            self.counters.failed += self.settings.scheduling.group_size
            self.outcomes.retry_or_drop(gid, g.prompt, f"{type(e).__name__}: {e}")

    def spawn(self, coro) -> None:
        """Fire and forget (best effort), but keep a reference so the task is not collected."""
        task = asyncio.create_task(coro)
        self.chores.add(task)
        task.add_done_callback(lambda t: (self.chores.discard(t), t.cancelled() or t.exception()))

    def withdraw(self, doomed) -> list[InFlight]:
        """Take the groups in flight that `doomed(g)` picks out of flight, their prompts back to
        the queue; whatever they raise while their tasks are cancelled requeues nothing again."""
        out = [(gid, g) for gid, g in self.in_flight.items() if doomed(g)]
        for gid, g in out:
            g.cancelled = True
            del self.in_flight[gid]
            self.queue.give_back(g.prompt)
        return [g for _, g in out]

    def requeue_from(self, server: Server) -> None:
        """A server stopped answering (health check, heartbeat: its host died or is cut off): its
        groups would finish late or never (timeouts.request_s), so their prompts go back to the
        queue now, for the servers still there. Aborts are best effort: it may be unreachable."""
        doomed = self.withdraw(lambda g: g.server is server)
        for g in doomed:
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
        doomed = self.withdraw(lambda g: not is_fresh(g.version, self.next_step, m))
        self.counters.cancelled += len(doomed)
        await asyncio.gather(*(self.abort(g) for g in doomed))
        for g in doomed:
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
        return len(self.finished) >= self.settings.scheduling.prompts_per_step

    async def make_batch(self, step: int) -> None:
        k = self.cfg.max_async_level

        def versions_ok() -> bool:
            return can_hand_over(step, self.pool.serving_versions(), k)

        set_phase(f"making batch {step}")
        trainer_wait = await self.wait_until(
            versions_ok, f"version {min_serving_version(step, k)} to serve on every server "
            f"(max_async_level={k}) before batch {step}", self.settings.timeouts.trainer_s)
        group_wait = await self.wait_until(
            lambda: self.batch_ready(step), f"{self.settings.scheduling.prompts_per_step} groups for batch {step}",
            self.settings.timeouts.trainer_s)
        while True:
            # Both again, at once: a server may have left or rejoined rotation meanwhile.
            await self.wait_until(lambda: versions_ok() and self.batch_ready(step), f"batch {step}",
                                  self.settings.timeouts.trainer_s)
            # Ask the servers themselves: one restarted since its last request serves version 0
            # while still counted with the version it had (one /health per server per batch).
            await self.pool.check()
            if versions_ok() and self.batch_ready(step):
                break
        # Oldest first: they are the closest to going stale.
        self.finished.sort(key=lambda g: g.oldest_version)
        groups = self.finished[: self.settings.scheduling.prompts_per_step]
        self.finished = self.finished[self.settings.scheduling.prompts_per_step:]
        # From here on new groups are meant for the next batch (the send below yields to them).
        self.next_step = step + 1
        samples = [s for g in groups for s in g.samples]
        batch = Batch.from_samples(step, samples)
        encoded = batch.encode()  # once: the checkpoint and the hand-over take the same bytes
        # Checkpoint first, with the batch: a crash before the batch reaches the trainer hands
        # the same bytes over again, one after counts it done (orchestrator/checkpoint.py).
        self.checkpoint(step, encoded)
        crash_point("orchestrator.checkpointed", step)
        set_phase(f"handing over batch {step}")
        await self.sender.send(batch, self.settings.timeouts.trainer_s, encoded)
        crash_point("orchestrator.handed_over", step)
        await self.cancel_hopeless()
        await self.notify()
        c, self.counters = self.counters, Counters()
        self.reporting.report(batch, groups, c, trainer_wait, group_wait, len(self.in_flight), len(self.finished),
                              self.curriculum.report() if self.curriculum else {})
        if c.skipped_rows:
            log.warning("%d row(s) skipped since the previous batch (first: %s)", c.skipped_rows, c.first_skip)

    def checkpoint(self, step: int, encoded: tuple[bytes, bytes]) -> None:
        """Checkpoint batch `step` before it leaves (orchestrator/checkpoint.py): the prompts
        drawn but not in a batch yet go out again after a resume."""
        pending = [*self.queue.requeued, *(g.prompt for g in self.in_flight.values()),
                   *(g.prompt for g in self.finished)]
        save_checkpoint(self.run_dir, step, encoded, self.queue.cursor, pending, self.settings.checkpoints.keep,
                        self.curriculum.state() if self.curriculum else None)

    # --- the run ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.background = [asyncio.create_task(
            watch_trainer(self.cfg, self.run_dir, self.sender, lambda: self.next_step), name="watch_trainer")]
        fixed = self.delivery.fixed_members  # a broadcast group: every listed server, none discovered
        if self.settings.servers.discover and not fixed:
            exclude = {self.settings.teacher.url.rstrip("/")} if self.settings.teacher.url else set()
            self.background.append(asyncio.create_task(
                self.pool.discover(self.cfg.output_dir, exclude, self.cfg.heartbeat_timeout_s), name="discover"))
        await self.pool.connect(self.settings.timeouts.server_wait_s, every=fixed)
        await self.delivery.prepare()  # before any load (a broadcast group forms here)
        version, path = self.latest_weights()
        await self.delivery.load(version, path)
        if not self.pool.in_rotation:
            raise RuntimeError(f"no inference server could load version {version} from {path}")
        log.info("connected to %d server(s) (%s), serving version %d; first batch %d", len(self.pool.in_rotation),
                 ", ".join(s.url for s in self.pool.in_rotation), self.pool.serving_version, self.next_step)
        self.background.append(asyncio.create_task(
            self.sender.redeliver(self.settings.timeouts.trainer_s), name="redeliver"))
        if self.reporting.tracker is not None:
            self.background.append(asyncio.create_task(self.reporting.track(), name="track"))
        self.background += [asyncio.create_task(self.follow_weights(), name="follow_weights"),
                             asyncio.create_task(self.pool.heal(self.settings.timeouts.server_wait_s), name="heal"),
                             asyncio.create_task(self.produce(), name="produce")]

    async def run(self) -> None:
        try:
            await self.start()
            if self.unsent is not None:  # checkpointed, maybe never delivered: the same bytes again
                await self.sender.send(self.unsent, self.settings.timeouts.trainer_s)
                self.unsent = None
            if self.next_step > 1:
                self.evaluations.no_baseline()
            every = self.settings.eval.every
            for step in range(self.next_step, self.cfg.max_steps + 1):
                await self.make_batch(step)
                if step == 1:
                    self.evaluations.start(0)  # after the first batch, not beside it (evaluation.py)
                if every and step % every == 0 and step < self.cfg.max_steps:
                    self.evaluations.start(step)
            # Serve the final policy before stopping, so the run ends with it loaded.
            final = self.cfg.max_steps
            await self.wait_until(lambda: self.pool.serving_version >= final,
                                  f"final version {final} to serve", self.settings.timeouts.trainer_s)
            await self.evaluations.finish(final)
            log.info("done: %d batches; version %d serving", final, self.pool.serving_version)
            if self.reporting.tracker is not None:
                await self.reporting.close_tracker()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop the loops, then abort what is still generating (servers outlive the orchestrator)."""
        for t in self.background + self.evaluations.tasks:
            t.cancel()
        await asyncio.gather(*self.background, *self.evaluations.tasks, return_exceptions=True)
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

