"""Kill at random, not only at named crash points: rounds of a real `rl run` in which a randomly
chosen program is SIGKILLed at a random moment, each followed by `rl run --resume`. The run must
end as an uninterrupted one would: every batch made once and contiguous, no prompt trained twice
or lost, no process left behind, quiet stops, and final weights equal to a fresh trainer's replay
of the run's own batches (training is exact given the batches; which rollouts land in a batch
depends on timing, so the batches themselves are not compared with another run's).

The seed is printed with every failure (ASYNCRL_KILL_SEED=<seed> repeats a draw).
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from conftest import free_port
from real_run import RealRun, gone, rl_run

pytestmark = pytest.mark.slow

# Each round is a whole `rl run` start (a vLLM server's start is most of it: 30-60 s on a loaded
# 2-core machine), so two kills a run, each drawn anew (program, step, moment) every suite run.
ROUNDS = 2
STEPS = 12
PROGRAMS = ("trainer", "orchestrator", "inference")
# A trainer checkpoint every 4 steps: kills land before the first one (a replay from the base
# model) and after one (a resume from it).
SPARSE = ("--checkpoints.every", "4")
# What a forced stop must not print into the user's terminal.
NOISE = ("resource_tracker", "leaked semaphore", "nanobind: leaked")


def test_random_kills_then_resume_end_like_an_uninterrupted_run(tmp_path):
    seed = int(os.environ.get("ASYNCRL_KILL_SEED", random.SystemRandom().randrange(10**6)))
    rng = random.Random(seed)
    print(f"ASYNCRL_KILL_SEED={seed}")
    r = RealRun(tmp_path, free_port(), max_steps=STEPS)
    out = tmp_path / "rl_run.log"
    kills: list[tuple[str, int]] = []
    for round_ in range(ROUNDS + 1):
        with rl_run(r, out, *SPARSE, *(["--resume"] if round_ else [])) as launcher:
            children = kill_at_random(r, launcher, rng) if round_ < ROUNDS else {}
            if not children:  # the last round, or too late to kill: it finishes
                assert launcher.wait(timeout=400) == 0, f"seed {seed}, kills {kills}:\n{tail(out)}"
                break
            kills.append(children.pop("killed"))
            assert launcher.wait(timeout=90) == 1, f"seed {seed}, kills {kills}:\n{tail(out)}"
        for name, pid in children.items():
            assert gone(pid, timeout=10), f"seed {seed}, kills {kills}: {name} (pid {pid}) outlived rl run"
    assert kills, f"seed {seed}: no kill happened"
    print(f"kills (program, step): {kills}")
    printed = out.read_text()
    assert not [line for line in printed.splitlines() if any(n in line for n in NOISE)], \
        f"seed {seed}, kills {kills}: a stop was noisy:\n{tail(out)}"
    check(r, seed, kills)


def kill_at_random(r: RealRun, launcher, rng: random.Random) -> dict:
    """SIGKILL a random program at a random moment while the run trains: once 1-3 more steps
    are trained, plus up to a step's time (mid-generation, mid-step, mid-update or mid-hand-over).
    Returns the programs' pids and "killed": (program, step), or {} when it is too late to matter."""
    target = min(STEPS - 3, r.trained() + rng.randint(1, 3))
    r.wait_for(f"step {target}", lambda: r.trained() >= target or launcher.poll() is not None, timeout=300)
    assert launcher.poll() is None, "rl run ended before its kill"
    time.sleep(rng.uniform(0, 0.6))
    children = r.pids()
    if r.trained() >= STEPS - 1 or set(children) != set(PROGRAMS):
        return {}
    victim = rng.choice(PROGRAMS)
    os.kill(children[victim], signal.SIGKILL)
    return {**children, "killed": (victim, r.trained())}


def check(r: RealRun, seed: int, kills: list) -> None:
    why = f"seed {seed}, kills {kills}"
    # Exactly one record per step and per batch, in order, whichever program died when: a step
    # replayed after a resume writes none again, one killed before its record gets it from its
    # successor. The replay below is what shows every step trained once.
    trained = [rec["step"] for rec in r.records("trainer")]
    assert trained == list(range(1, STEPS + 1)), f"{why}: trainer records {trained}"
    assert r.run.rollout_steps() == list(range(1, STEPS + 1)), why
    made = [rec["step"] for rec in r.records("orchestrator")]
    assert made == list(range(1, STEPS + 1)), f"{why}: orchestrator records {made}"
    r.check_each_prompt_once()
    r.check_replay()


def tail(path) -> str:
    return path.read_text(errors="replace")[-3000:]
