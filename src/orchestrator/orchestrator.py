"""The orchestrator: keeps groups generating on the inference servers, scores them, and hands
batches to the trainer under the async rule (orchestrator/async_rule.py). `rl orchestrator` runs it
(orchestrator/main.py).

Concurrent loops on one event loop:
  - `produce`: starts groups (orchestrator/flight.py, which runs and settles them) on the
    least-loaded server while fewer than max_in_flight_groups are in flight or finished-unbatched,
    and only groups that can still land in a batch under the off-policy bound m;
  - `follow_weights`: loads each new STABLE weights version into every server
    (orchestrator/servers/weights_follower.py);
  - `pool.heal`: retries servers taken out of rotation and lets joining ones in;
  - `pool.discover`: adds the servers that announce themselves in the run directory, drops those
    whose heartbeat stops (orchestrator.servers.discover);
  - `run` (the main loop), for n = 1..max_steps: waits until version >= n-1-k serves on every
    server in rotation, takes the oldest fresh finished groups, checkpoints batch n and hands it
    over (orchestrator/hand_over.py), and cancels in-flight groups that batch n+1 could no longer
    accept (aborted on their server, prompts requeued).
Beside them: `watch_trainer` (orchestrator/servers/trainer_watch.py), the batch sender's `redeliver`, the
evaluations (orchestrator/evaluation/held_out.py) and, with wandb or TensorBoard on, `track`
(orchestrator/reporting/batch_report.py, which also writes each batch's metrics record).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import aiohttp

from orchestrator.async_rule import can_hand_over, is_fresh, min_serving_version
from orchestrator.bounded_wait import wait_visibly
from orchestrator.evaluation import EvaluationRunner
from orchestrator.flight import Flight, InFlight
from orchestrator.hand_over import HandOver
from orchestrator.prompts import Curriculum, PromptQueue, Rows
from orchestrator.reporting import Reporting
from orchestrator.rollout import Group, Rollouts
from orchestrator.servers import ServerPool, WeightsFollower, watch_trainer
from rl.config import RunConfig
from rl.heartbeat import set_phase
from rl.rundir import RunDir

log = logging.getLogger("orchestrator")


class Orchestrator:
    def __init__(self, cfg: RunConfig, session: aiohttp.ClientSession):
        self.cfg, self.settings = cfg, cfg.orchestrator
        self.run_dir = RunDir(cfg.run_dir)
        self.changed = asyncio.Condition()  # a group finished, a batch left, a version serves
        self.pool = ServerPool.for_run(cfg, session, on_fail=lambda server: self.flight.requeue_from(server))
        self.delivery = self.pool.delivery  # files, broadcast or LoRA adapters, chosen once
        # Request ids must not collide with a previous orchestrator's still running on a server.
        self.tag = secrets.token_hex(3)
        self.rows = Rows.for_run(cfg)  # the datasets, or the environment's dataset
        self.rollouts = Rollouts.from_config(cfg, session, self.rows)
        self.evaluations = EvaluationRunner.for_run(cfg, session, self.rollouts, self.pool, self.run_dir,
                                                    self.wait_until, self.tag)
        self.hand_over = HandOver(cfg, self.run_dir)
        self.sender = self.hand_over.sender
        self.next_step, cursor, pending, record, self.unsent = self.hand_over.resume()
        self.curriculum = (Curriculum(self.settings.curriculum, cfg.seed, record)
                           if self.settings.curriculum.enabled else None)
        self.queue = PromptQueue(self.rows.draws(cfg.seed), self.rows.fetch, cursor, pending,
                                 admit=self.curriculum.admit if self.curriculum else None)
        self.flight = Flight(self.settings, self.pool, self.delivery, self.rollouts, self.queue, self.curriculum,
                             self.changed, self.tag)
        self.streaks = self.flight.outcomes.streaks  # what would make the run spin ends it
        self.weights = WeightsFollower(
            self.run_dir, cfg.model, self.pool, self.delivery, self.settings.scheduling.poll_interval_s, self.changed,
            handed_over=lambda: self.next_step - 1, hold=self.evaluations.baseline_done,
            in_use=lambda: [*self.flight.pins(), *self.evaluations.pins])
        self.background: list[asyncio.Task] = []
        self.reporting = Reporting(cfg, self.run_dir, self.pool, per_dataset=len(self.rows.sources) > 1)
        if self.next_step > 1:  # resumed: its predecessor may have died between checkpoint and record
            last = self.next_step - 1
            self.reporting.recover(last, lambda: self.unsent if self.unsent is not None
                                   else self.hand_over.checkpointed(last))

    @property
    def in_flight(self) -> dict[str, InFlight]:
        return self.flight.in_flight

    @property
    def finished(self) -> list[Group]:
        return self.flight.finished

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

    # --- groups ----------------------------------------------------------------------------

    def may_start_group(self) -> bool:
        queued = len(self.flight)
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
            self.flight.start(self.pool.pick())

    async def cancel_hopeless(self) -> None:
        """Cancel in-flight groups the next batch could no longer accept (orchestrator/flight.py)."""
        await self.flight.cancel_hopeless(self.next_step, self.cfg.off_policy_steps)

    # --- batches ---------------------------------------------------------------------------

    def batch_ready(self, step: int) -> bool:
        return self.flight.ready(step, self.cfg.off_policy_steps)

    async def make_batch(self, step: int) -> None:
        k = self.cfg.max_async_level

        def versions_ok() -> bool:
            return can_hand_over(step, self.pool.serving_versions(), k)

        set_phase(f"making batch {step}")
        trainer_wait = await self.wait_until(
            versions_ok, f"version {min_serving_version(step, k)} to serve on every server "
            f"(max_async_level={k}) before batch {step}", self.settings.timeouts.weights_s)
        group_wait = await self.wait_until(
            lambda: self.batch_ready(step), f"{self.settings.scheduling.prompts_per_step} groups for batch {step}",
            self.settings.timeouts.weights_s)
        while True:
            # Both again, at once: a server may have left or rejoined rotation meanwhile.
            await self.wait_until(lambda: versions_ok() and self.batch_ready(step), f"batch {step}",
                                  self.settings.timeouts.weights_s)
            # Ask the servers themselves: one restarted since its last request serves version 0
            # while still counted with the version it had (one /health per server per batch).
            await self.pool.check()
            if versions_ok() and self.batch_ready(step):
                break
        groups = self.flight.take()
        # From here on new groups are meant for the next batch (the send below yields to them).
        self.next_step = step + 1
        # The prompts drawn but not in this batch go out again after a resume.
        sending = time.monotonic()
        batch = await self.hand_over.send(step, groups, self.queue.cursor, self.flight.pending(),
                                          self.curriculum.state() if self.curriculum else None)
        handover_s = time.monotonic() - sending
        await self.cancel_hopeless()
        await self.notify()
        c = self.flight.take_counters()
        self.reporting.report(batch, groups, c, trainer_wait, group_wait, len(self.in_flight), len(self.finished),
                              self.curriculum.report() if self.curriculum else {}, handover_s)
        if c.skipped_rows:
            log.warning("%d row(s) skipped since the previous batch (first: %s)", c.skipped_rows, c.first_skip)

    # --- the run ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.background = [asyncio.create_task(
            watch_trainer(self.cfg, self.run_dir, self.sender, lambda: self.next_step), name="watch_trainer")]
        fixed = self.delivery.fixed_members  # a broadcast group: every listed server, none discovered
        if self.settings.servers.discover and not fixed:
            exclude = {self.settings.teacher.url.rstrip("/")} if self.settings.teacher.url else set()
            self.background.append(asyncio.create_task(
                self.pool.discover(self.cfg.output_dir, exclude, self.cfg.timeouts.heartbeat_s), name="discover"))
        await self.pool.connect(self.settings.timeouts.server_wait_s, every=fixed)
        await self.delivery.prepare()  # before any load (a broadcast group forms here)
        version, path = self.weights.latest()
        await self.delivery.load(version, path)
        if not self.pool.in_rotation:
            raise RuntimeError(f"no inference server could load version {version} from {path}")
        log.info("connected to %d server(s) (%s), serving version %d; first batch %d", len(self.pool.in_rotation),
                 ", ".join(s.url for s in self.pool.in_rotation), self.pool.serving_version, self.next_step)
        self.background.append(asyncio.create_task(self.hand_over.redeliver(), name="redeliver"))
        if self.reporting.tracker is not None:
            self.background.append(asyncio.create_task(self.reporting.track(), name="track"))
        self.background += [asyncio.create_task(self.weights.follow(), name="follow_weights"),
                             asyncio.create_task(self.pool.heal(self.settings.timeouts.server_wait_s), name="heal"),
                             asyncio.create_task(self.produce(), name="produce")]

    async def run(self) -> None:
        try:
            await self.start()
            if self.unsent is not None:  # checkpointed, maybe never delivered: the same bytes again
                await self.hand_over.send_again(self.unsent)
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
                                  f"final version {final} to serve", self.settings.timeouts.weights_s)
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
        await self.flight.stop()
        self.hand_over.close()
        # LoRA: the server outlives this run: free its adapter slots for other runs. The final
        # adapter stays on disk (weights/step_n) for anyone to load again.
        await self.delivery.unload_all()

