"""The orchestrator: keeps groups in flight on the inference servers, scores them, and hands
batches to the trainer under the async rule.

    rl orchestrator @ configs/demo.toml

Three concurrent loops share one event loop:
  - `produce`: keeps up to max_in_flight_groups groups generating (one request of n=group_size
    completions per prompt), each tagged with the version serving when it was sent;
  - `sync_weights`: watches weights/ for a new STABLE version and loads it into every server;
  - `run` (the main loop): for n = 1..max_steps, waits for the async bound, takes the freshest
    finished groups, drops stale ones (their prompts go back to the queue), writes batch n.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from orchestrator.advantages import group_advantages
from orchestrator.scoring import load_callable, score
from rl.admin_client import AdminClient, AdminError
from rl.async_rule import can_hand_over, is_fresh, min_serving_version
from rl.batch import Batch, Sample
from rl.config import RunConfig
from rl.rundir import RunDir

log = logging.getLogger("orchestrator")

HEARTBEAT_S = 30.0


@dataclass
class Server:
    admin: AdminClient
    version: int = 0
    in_flight: int = 0

    @property
    def url(self) -> str:
        return self.admin.url


@dataclass
class Group:
    row: dict
    version: int
    samples: list[Sample]
    completion_tokens: int


@dataclass
class Counters:
    """Since the previous batch."""
    completion_tokens: int = 0
    dropped_stale: int = 0
    failed: int = 0
    started: float = field(default_factory=time.monotonic)


class Orchestrator:
    def __init__(self, cfg: RunConfig, client: httpx.AsyncClient):
        self.cfg = cfg
        self.ocfg = cfg.orchestrator
        self.run_dir = RunDir(cfg.output_dir)
        self.client = client
        token = cfg.inference.api_token
        self.servers = [Server(AdminClient(url, client, token)) for url in cfg.urls]
        self.reward_fn = load_callable(self.ocfg.reward, "orchestrator.reward")
        self.rows = iter(load_callable(self.ocfg.dataset, "orchestrator.dataset")(cfg.seed))
        self.requeued: collections.deque[dict] = collections.deque()
        self.finished: list[Group] = []
        self.in_flight: set[asyncio.Task] = set()
        self.changed = asyncio.Condition()  # a group finished or a new version serves
        self.next_step = 1
        self.model_name = ""
        self.counters = Counters()
        self.background: list[asyncio.Task] = []

    # --- state everyone waits on ---------------------------------------------------------

    @property
    def serving_version(self) -> int:
        return min(s.version for s in self.servers)

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, predicate, what: str, timeout_s: float) -> float:
        """Wait for `predicate()`, logging what it waits for; returns seconds waited."""
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

    # --- servers and weights -------------------------------------------------------------

    async def connect(self) -> None:
        deadline = time.monotonic() + self.ocfg.server_wait_timeout_s
        for server in self.servers:
            last_beat = 0.0
            while True:
                try:
                    server.version = (await server.admin.health())["version"]
                    break
                except AdminError as e:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"inference server {server.url} not healthy after "
                            f"{self.ocfg.server_wait_timeout_s:.0f} s "
                            f"(orchestrator.server_wait_timeout_s): {e}") from None
                    if time.monotonic() - last_beat > 10:
                        log.info("waiting for inference server %s to come up", server.url)
                        last_beat = time.monotonic()
                    await asyncio.sleep(1.0)
        self.model_name = await self.servers[0].admin.model_name()
        await self.load_current_version()
        log.info("connected to %d server(s), serving version %d, model %s",
                 len(self.servers), self.serving_version, self.model_name)

    async def load_current_version(self) -> None:
        """Make every server serve this run's current version (the newest STABLE weights, or
        the base model): a server kept from an earlier run may report any version."""
        latest = self.run_dir.latest_stable_weights()
        version, path = (0, self.cfg.model) if latest is None else (latest, self.run_dir.weights_dir(latest))
        for s in self.servers:
            if s.version != version:
                log.info("server %s reports version %d; loading version %d", s.url, s.version, version)
                await s.admin.update_weights(str(Path(path).resolve()), version,
                                             timeout=self.cfg.inference.reload_timeout_s)
                s.version = version

    async def sync_weights(self) -> None:
        """Load each newly STABLE weights version into every server."""
        while True:
            latest = self.run_dir.latest_stable_weights()
            if latest is not None and latest > self.serving_version:
                path = str(self.run_dir.weights_dir(latest).resolve())
                stale = [s for s in self.servers if s.version < latest]
                results = await asyncio.gather(*(
                    s.admin.update_weights(path, latest, timeout=self.cfg.inference.reload_timeout_s)
                    for s in stale))
                for s, r in zip(stale, results):
                    s.version = latest
                log.info("version %d serving on %d server(s) (reload %.3f s)",
                         latest, len(stale), max(r["reload_s"] for r in results))
                await self.notify()
            await asyncio.sleep(self.ocfg.poll_interval_s)

    # --- generation ----------------------------------------------------------------------

    def next_row(self) -> dict:
        return self.requeued.popleft() if self.requeued else next(self.rows)

    def may_start_group(self) -> bool:
        queued = len(self.in_flight) + len(self.finished)
        if queued >= self.ocfg.max_in_flight_groups:
            return False
        # The batch this group will most likely land in: the ones queued ahead fill earlier
        # batches. If the serving version is already too old for that batch the group would
        # only be thrown away, so wait for newer weights instead.
        target = self.next_step + queued // self.ocfg.prompts_per_step
        return is_fresh(self.serving_version, target, self.cfg.off_policy_steps)

    async def produce(self) -> None:
        while True:
            await self.wait_until(self.may_start_group, "room for a new group", float("inf"))
            server = min(self.servers, key=lambda s: s.in_flight)
            task = asyncio.create_task(self.run_group(server, self.next_row()))
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)

    async def run_group(self, server: Server, row: dict) -> None:
        version = server.version
        server.in_flight += 1
        try:
            group = await self.generate(server, row, version)
        except Exception as e:  # a server error, a malformed answer, a reward that raised
            self.counters.failed += 1
            log.warning("group failed on %s (%s: %s); prompt requeued", server.url, type(e).__name__, e)
            self.requeued.append(row)
            await asyncio.sleep(1.0)  # a failing server must not turn this into a busy loop
            return
        finally:
            server.in_flight -= 1
        self.finished.append(group)
        self.counters.completion_tokens += group.completion_tokens
        await self.notify()

    async def generate(self, server: Server, row: dict, version: int) -> Group:
        o = self.ocfg
        r = await self.client.post(f"{server.url}/v1/completions", timeout=o.request_timeout_s, json={
            "model": self.model_name, "prompt": row["prompt"], "n": o.group_size,
            "max_tokens": o.max_tokens, "temperature": o.temperature,
            "logprobs": 0, "return_token_ids": True,
        })
        r.raise_for_status()
        choices = r.json()["choices"]
        rewards = [await score(self.reward_fn, row["prompt"], c["text"], row) for c in choices]
        advantages = group_advantages(rewards, o.normalize_advantages)
        samples = []
        for c, reward, adv in zip(choices, rewards, advantages):
            logprobs = c["logprobs"]["token_logprobs"]
            if len(logprobs) != len(c["token_ids"]):
                raise ValueError(f"{len(logprobs)} logprobs for {len(c['token_ids'])} tokens")
            samples.append(Sample(c["prompt_token_ids"], c["token_ids"], logprobs, adv, reward, version))
        return Group(row, version, samples, sum(len(s.completion_ids) for s in samples))

    # --- batches -------------------------------------------------------------------------

    def drop_stale(self, step: int) -> None:
        keep = []
        for g in self.finished:
            if is_fresh(g.version, step, self.cfg.off_policy_steps):
                keep.append(g)
            else:
                self.requeued.append(g.row)
                self.counters.dropped_stale += 1
        self.finished = keep

    def batch_ready(self, step: int) -> bool:
        self.drop_stale(step)
        return len(self.finished) >= self.ocfg.prompts_per_step

    async def make_batch(self, step: int) -> None:
        k = self.cfg.max_async_level
        waited = await self.wait_until(
            lambda: can_hand_over(step, [s.version for s in self.servers], k),
            f"version {min_serving_version(step, k)} to serve (max_async_level={k}) before batch {step}",
            self.ocfg.trainer_timeout_s)
        waited += await self.wait_until(
            lambda: self.batch_ready(step), f"{self.ocfg.prompts_per_step} groups for batch {step}",
            self.ocfg.trainer_timeout_s)
        # Oldest first: they are the closest to going stale.
        self.finished.sort(key=lambda g: g.version)
        groups = self.finished[: self.ocfg.prompts_per_step]
        self.finished = self.finished[self.ocfg.prompts_per_step:]
        samples = [s for g in groups for s in g.samples]
        Batch.from_samples(step, self.ocfg.temperature, samples).write(self.run_dir.rollout_dir(step))
        self.next_step = step + 1
        await self.notify()
        self.report(step, samples, waited)

    def report(self, step: int, samples: list[Sample], waited: float) -> None:
        c, self.counters = self.counters, Counters()
        elapsed = max(time.monotonic() - c.started, 1e-9)
        staleness = [step - 1 - s.version for s in samples]
        rewards = [s.reward for s in samples]
        record = {
            "program": "orchestrator", "step": step,
            "reward_mean": sum(rewards) / len(rewards),
            "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
            "staleness_hist": dict(collections.Counter(staleness)),
            "tokens_per_s": c.completion_tokens / elapsed, "wait_s": waited,
            "dropped_stale": c.dropped_stale, "failed": c.failed,
            "in_flight": len(self.in_flight), "serving_version": self.serving_version,
        }
        self.run_dir.append_metrics(record)
        log.info("batch %d reward %.3f staleness %.2f (max %d) %.0f tok/s waited %.2fs in-flight %d dropped %d failed %d",
                 step, record["reward_mean"], record["staleness_mean"], record["staleness_max"],
                 record["tokens_per_s"], waited, record["in_flight"], c.dropped_stale, c.failed)

    async def run(self) -> None:
        if self.run_dir.rollout_steps():
            raise SystemExit(f"output_dir {self.run_dir.root} already holds batches from an earlier run; "
                             "remove it or choose another output_dir")
        await self.connect()
        self.background = [asyncio.create_task(self.sync_weights(), name="sync_weights"),
                           asyncio.create_task(self.produce(), name="produce")]
        try:
            for step in range(1, self.cfg.max_steps + 1):
                await self.make_batch(step)
            # Serve the final policy before stopping, so the run ends with it loaded.
            final = self.cfg.max_steps
            await self.wait_until(lambda: self.serving_version >= final,
                                  f"final version {final} to serve", self.ocfg.trainer_timeout_s)
            log.info("done: %d batches; version %d serving", final, self.serving_version)
        finally:
            for t in [*self.background, *self.in_flight]:
                t.cancel()
            await asyncio.gather(*self.background, *self.in_flight, return_exceptions=True)


async def _main(cfg: RunConfig) -> None:
    limits = httpx.Limits(max_connections=cfg.orchestrator.max_in_flight_groups + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        await Orchestrator(cfg, client).run()


def main(cfg: RunConfig) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the log
    RunDir(cfg.output_dir).make()
    asyncio.run(_main(cfg))
