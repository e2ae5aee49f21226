"""Groups in flight: each started on a server, its requests tracked so they can be aborted, and
settled when it ends: among the finished groups the next batch takes from, or filtered, retried
or dropped (group_outcomes.py). Groups are withdrawn, their prompts back to the queue, when their
server stops answering or the next batch could no longer accept them (the async rule).

The scheduling loop (orchestrator.py) decides when a group starts and when a batch is taken; this
is what happens to the groups between.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from orchestrator import prometheus
from orchestrator.async_rule import is_fresh, oldest_usable_version
from orchestrator.group_outcomes import GroupOutcomes
from orchestrator.prompts import Curriculum, Prompt, PromptQueue, RowError
from orchestrator.reporting import Counters
from orchestrator.rollout import Aborted, Group, Rollouts
from orchestrator.servers import Server, ServerPool, WeightDelivery
from rl.inference_api import GenerateRequest, GenerateResponse, InferenceError
from rl.config.orchestrator import OrchestratorConfig

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


class Flight:
    def __init__(self, settings: OrchestratorConfig, pool: ServerPool, delivery: WeightDelivery, rollouts: Rollouts,
                 queue: PromptQueue, curriculum: Curriculum | None, changed: asyncio.Condition, tag: str):
        self.settings, self.pool, self.delivery, self.rollouts = settings, pool, delivery, rollouts
        self.queue, self.curriculum, self.changed = queue, curriculum, changed
        # Request ids must not collide with a previous orchestrator's still running on a server.
        self.tag, self.seq = tag, 0
        self.in_flight: dict[str, InFlight] = {}
        self.finished: list[Group] = []
        self.counters = Counters()  # since the last batch (taken by take_counters)
        self.chores: set[asyncio.Task] = set()
        # What would make the run spin ends it.
        self.outcomes = GroupOutcomes(settings, rollouts.kind, queue, has_teacher=rollouts.teacher is not None)
        self.bad_images: set[str] = set()  # each said once per run (a table's rows come back every pass)

    def __len__(self) -> int:
        """Groups that count against max_in_flight_groups: in flight or finished, not batched."""
        return len(self.in_flight) + len(self.finished)

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def start(self, server: Server) -> None:
        """Start a group of the queue's next prompt on `server`."""
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
            self.outcomes.streaks.rendered(who)  # its row made a request: the dataset has usable rows
            if g.cancelled:  # a multi-turn episode's next turn, after its group was aborted
                raise Aborted(request.request_id)
            # Every turn on the adapter the group started on (None: the base weights, full tuning).
            request = request.model_copy(update={"lora": adapter})
            g.requests.add(request.request_id)
            self.pool.begin(g.server)
            try:
                sent = time.monotonic()
                response = await g.server.client.generate(request, self.settings.timeouts.request_s)
                prometheus.REQUEST_SECONDS.observe(time.monotonic() - sent)
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
            # A cancelled group's prompt was requeued by whoever withdrew it: whatever it raised
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
            n = self.settings.scheduling.group_size
            self.outcomes.retry_or_drop(gid, g.prompt, f"{group.failed} of {n} rollouts failed, last: "
                                        f"{group.error or 'no error recorded'}")
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
        elif isinstance(e, RowError):  # said once per batch, with the count (the batch's report), not per row
            self.counters.skipped_rows += 1
            self.counters.skipped_image_rows += e.image
            if e.image and str(e) not in self.bad_images and len(self.bad_images) < 10_000:
                self.bad_images.add(str(e))
                log.warning("row skipped: %s", e)
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
        else:  # said, so that a reader (and tests/integration/test_multi_host.py) knows none was lost
            log.info("no group in flight on %s: nothing to requeue", server.url)
        self.spawn(self.notify())

    async def cancel_hopeless(self, next_step: int, m: int) -> None:
        """Cancel in-flight groups batch `next_step` could no longer accept: their oldest token is
        older than the off-policy bound `m` allows. Their requests are aborted on the server
        (freeing its slots for useful work) and their prompts go back to the queue."""
        doomed = self.withdraw(lambda g: not is_fresh(g.version, next_step, m))
        self.counters.cancelled += len(doomed)
        await asyncio.gather(*(self.abort(g) for g in doomed))
        for g in doomed:
            g.task.cancel()
        if doomed:
            log.info("cancelled %d in-flight group(s) older than version %d (max_off_policy_steps=%d); "
                     "prompts requeued", len(doomed), oldest_usable_version(next_step, m), m)

    async def abort(self, g: InFlight) -> None:
        if not g.requests:
            return
        try:
            await g.server.client.abort(sorted(g.requests))
        except InferenceError as e:  # the client side still lets go; say the server may not have
            log.warning("abort on %s failed: %s", g.server.url, e)

    def ready(self, step: int, m: int) -> bool:
        """Enough finished groups for batch `step`, after those too old for it went back to the queue."""
        keep = []
        for g in self.finished:
            if is_fresh(g.oldest_version, step, m):
                keep.append(g)
            else:
                self.queue.give_back(g.prompt)
                self.counters.dropped_stale += 1
        self.finished = keep
        return len(self.finished) >= self.settings.scheduling.prompts_per_step

    def take(self) -> list[Group]:
        """A batch's groups, oldest first: they are the closest to going stale."""
        n = self.settings.scheduling.prompts_per_step
        self.finished.sort(key=lambda g: g.oldest_version)
        groups, self.finished = self.finished[:n], self.finished[n:]
        return groups

    def take_counters(self) -> Counters:
        c, self.counters = self.counters, Counters()
        return c

    def pins(self) -> Iterator[tuple[Server, int]]:
        """The (server, version) each group in flight started on."""
        return ((g.server, g.version) for g in self.in_flight.values())

    def pending(self) -> list[Prompt]:
        """Prompts drawn but not in a batch yet: they go out again after a resume."""
        return [*self.queue.requeued, *(g.prompt for g in self.in_flight.values()), *(g.prompt for g in self.finished)]

    async def stop(self) -> None:
        """Abort what is still generating (servers outlive the orchestrator) and let the chores end."""
        groups = list(self.in_flight.values())
        for g in groups:
            g.cancelled = True
        await asyncio.gather(*(self.abort(g) for g in groups), return_exceptions=True)
        tasks = [g.task for g in groups if g.task]
        for t in tasks:
            t.cancel()
        # Pending aborts are let finish (each has its own short timeout): they free server slots.
        await asyncio.gather(*tasks, *self.chores, return_exceptions=True)
