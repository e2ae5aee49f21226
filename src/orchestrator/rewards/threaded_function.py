"""A sync reward function run on the reward's own worker threads (the default for sync
functions): a slow or hung reward cannot stall the event loop. A sync reward that hangs for good
holds its thread for good: those threads are replaced, and leaked, once half are stuck
(orchestrator/rewards/reward.py)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref

from orchestrator.rewards.reward import FunctionReward, Score

log = logging.getLogger("orchestrator")

REWARD_THREADS = 8  # Python rewards mostly hold the GIL: more threads would help only those waiting on I/O


class ThreadedReward(FunctionReward):
    def __init__(self, spec: str, timeout_s: float, fn):
        super().__init__(spec, timeout_s, fn)
        # Its own threads: hung rewards must never take the loop's default executor, which the
        # batch writes use.
        self.threads = RewardThreads(REWARD_THREADS)

    async def score(self, prompt: str, completions: list[str], row: dict) -> list[Score | None]:
        # One thread hop per group, not per completion. A call that times out fails its rollout
        # only; the group's later completions go on in a fresh job (the hung call keeps its thread).
        scores: list[Score | None] = []
        while len(scores) < len(completions):
            scores += await self._threaded(_Job(self, prompt, completions[len(scores):], row))
        return scores

    async def _threaded(self, job: _Job) -> list[Score | None]:
        """The job's scores, or those before its first call to overrun timeouts.reward_s plus
        None for that one. The clock starts when a call starts, not when the job is queued: a
        job waiting behind slow or hung calls is not the reward's fault (hung threads are
        replaced, see _replace_hung_threads, so the wait is bounded)."""
        # Checked here too: calls of cancelled groups hang unwatched, no timeout reports them.
        self._replace_hung_threads()
        self.threads.submit(job)
        try:
            while not job.done.done():
                late = job.give_up_if_late(self.timeout_s)
                if late is not None:
                    self.timed_out()
                    self._replace_hung_threads()
                    return late
                if job.started is None:  # still queued: perhaps behind hung calls
                    self._replace_hung_threads()
                await asyncio.wait([job.done], timeout=job.time_left(self.timeout_s))
            return job.done.result()
        except asyncio.CancelledError:  # the group was cancelled: its remaining calls need not run
            job.give_up()
            raise

    def _replace_hung_threads(self) -> None:
        """Once half the threads are stuck in calls past timeouts.reward_s, start a fresh set and
        move the queued jobs over. Half, not all: a reward hanging on some inputs would
        otherwise run on ever fewer threads (one at the end) before anything is done; the cost
        of acting early is only starting the threads. The hung threads are leaked either way
        (Python cannot stop a thread); the old set's healthy ones exit after their call."""
        hung = self.threads.hung(self.timeout_s)
        if 2 * hung < self.threads.size:
            return
        log.warning("reward %s: %d calls hung past orchestrator.timeouts.reward_s (%g s) hold %d of %d reward "
                    "threads; starting %d fresh ones, the hung threads are leaked", self.spec, hung,
                    self.timeout_s, hung, self.threads.size, self.threads.size)
        old, self.threads = self.threads, RewardThreads(self.threads.size)
        for job in old.retire():
            self.threads.submit(job)


class _Job:
    """Some of one group's sync reward calls, made one after another in one worker thread. The
    loop reads `started` to time each call on its own; a job it gave up on stops before its next
    call and delivers nothing."""

    def __init__(self, reward: ThreadedReward, prompt: str, completions: list[str], row: dict):
        self.reward, self.prompt, self.completions, self.row = reward, prompt, completions, row
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future = self.loop.create_future()
        self.lock = threading.Lock()  # the loop's verdict "late" and the thread's next result exclude each other
        self.scores: list[Score | None] = []
        self.started: float | None = None
        """When the call now running started (None: queued, or between two calls)."""
        self.given_up = False

    def run(self) -> None:  # in a worker thread
        for c in self.completions:
            with self.lock:
                if self.given_up:
                    return
                self.started = time.monotonic()
            try:
                score = self.reward.call(self.prompt, c, self.row)
            except BaseException as e:  # SystemExit and kin, which call() lets by: they would end the thread
                self.reward.failed(f"raised {type(e).__name__}: {e}")
                score = None
            with self.lock:
                if self.given_up:
                    return
                self.scores.append(score)
                self.started = None
        try:
            self.loop.call_soon_threadsafe(self._settle)
        except RuntimeError:  # the loop is closed: nobody is waiting
            pass

    def _settle(self) -> None:
        if not self.done.done():
            self.done.set_result(self.scores)

    def overdue(self, timeout_s: float) -> bool:
        started = self.started
        return started is not None and time.monotonic() - started >= timeout_s

    def time_left(self, timeout_s: float) -> float:
        started = self.started
        return timeout_s if started is None else max(0.0, started + timeout_s - time.monotonic())

    def give_up_if_late(self, timeout_s: float) -> list[Score | None] | None:
        """If the running call is overdue: stop the job, return the scores so far plus None."""
        with self.lock:
            if not self.overdue(timeout_s):
                return None
            self.given_up = True
            return [*self.scores, None]

    def give_up(self) -> None:
        with self.lock:
            self.given_up = True


class RewardThreads:
    """Worker threads for sync rewards. Daemon threads rather than a ThreadPoolExecutor's:
    concurrent.futures joins its threads at interpreter exit, so a single reward call hung for
    good would keep `rl orchestrator` from ever exiting after its last batch."""

    def __init__(self, size: int):
        self.size = size
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.running: list[_Job | None] = [None] * size
        for i in range(size):
            threading.Thread(target=_work, args=(self.jobs, self.running, i), name=f"reward-{i}", daemon=True).start()
        # Idle threads leave once this set is dropped (a test makes many orchestrators).
        weakref.finalize(self, _stop, self.jobs, size)

    def submit(self, job: _Job) -> None:
        self.jobs.put(job)

    def hung(self, timeout_s: float) -> int:
        return sum(1 for job in list(self.running) if job is not None and job.overdue(timeout_s))

    def retire(self) -> list[_Job]:
        """Take no more work: hand back the queued jobs and let each thread exit once free."""
        queued = []
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                queued.append(job)
        _stop(self.jobs, self.size)
        return queued


def _work(jobs: queue.SimpleQueue, running: list, i: int) -> None:
    # Holds no reference to its RewardThreads, so that the set can be collected (and stopped).
    while (job := jobs.get()) is not None:
        running[i] = job
        try:
            job.run()
        finally:
            running[i] = None


def _stop(jobs: queue.SimpleQueue, size: int) -> None:
    for _ in range(size):
        jobs.put(None)
