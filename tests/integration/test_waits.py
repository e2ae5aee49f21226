"""Every wait names what it waits for, says so again while it lasts, and ends at its timeout
(docs/reliability.md): checked on the real programs, each waiting for a peer that never comes.

What the code guarantees, and so what is checked (no allowance for a loaded machine needed):
- it does not give up early: the wait starts after the program does, so the give-up line
  arrives at least the timeout after the test started the program;
- it beats at its interval: beat k comes more than k intervals after the wait started, so two
  beats are more than an interval apart (on the program's own clock, its log timestamps);
- it does not wait on past its timeout: each turn of the wait loop checks the deadline before
  it considers a beat, so no beat comes after the deadline: at most timeout // interval beats,
  then the give-up. (How soon after the deadline the give-up comes depends on how busy the
  machine is: not checked.)
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import TINY_MODEL, free_port, rl_command

pytestmark = pytest.mark.slow


def timed_lines(cmd: list[str], limit_s: float) -> tuple[list[tuple[float, str]], int | None]:
    """(seconds since start, line) for each output line, and the exit code (None if the program
    outlived limit_s and was killed)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    reader.join(timeout=10)
    return lines, code


def beats(lines: list[tuple[float, str]], pattern: str) -> list[float]:
    return [t for t, line in lines if re.search(pattern, line)]


def stamped(lines: list[tuple[float, str]], pattern: str) -> list[int]:
    """The program's own timestamps (asyncrl/main.py: "%H:%M:%S program LEVEL message", whole seconds,
    counted on from the first line across midnight) of the lines matching `pattern`."""
    out, first = [], None
    for _, line in lines:
        m = re.match(r"(\d\d):(\d\d):(\d\d) ", line)
        if m is None:
            continue
        t = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])
        first = t if first is None else first
        if re.search(pattern, line):
            out.append(t if t >= first else t + 86400)
    return out


def apart(stamps: list[int], interval_s: int) -> bool:
    """Consecutive events more than interval_s apart, from timestamps truncated to whole seconds:
    b - a > interval_s makes floor(b) - floor(a) >= interval_s."""
    return all(b - a >= interval_s for a, b in zip(stamps, stamps[1:]))


@pytest.fixture(scope="module")
def waited(tmp_path_factory) -> dict:
    """Both programs wait at once, each timed from its own start in a thread of its own: the
    file holds its test worker for the longer wait, not for the sum of the two.
    {program: (lines, exit code)}, and "url": where the orchestrator's server should be."""
    tmp = tmp_path_factory.mktemp("waits")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    orchestrator = tmp / "orchestrator.toml"
    orchestrator.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp / "orchestrator"}"\nmax_steps = 2\n'
                            f'seq_len = 64\n[orchestrator.servers]\nurls = ["{url}"]\n[orchestrator.timeouts]\nserver_wait_s = 25\n')
    trainer = tmp / "trainer.toml"
    trainer.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp / "trainer"}"\nmax_steps = 2\nseq_len = 64\n'
                       "timeouts.heartbeat_s = 5\n[trainer]\ntimeouts.batch_s = 40\ntorch_threads = 1\n")
    with ThreadPoolExecutor(2) as pool:
        runs = {"orchestrator": pool.submit(timed_lines, rl_command("orchestrator", "@", str(orchestrator)), 60),
                "trainer": pool.submit(timed_lines, rl_command("trainer", "@", str(trainer)), 90)}
        return {"url": url, **{name: run.result() for name, run in runs.items()}}


def test_the_orchestrator_waiting_for_servers_says_so_and_gives_up_at_its_wait_timeout(waited):
    url, (lines, code) = waited["url"], waited["orchestrator"]
    text = "\n".join(line for _, line in lines)
    beat = rf"waiting for inference server\(s\) {re.escape(url)} to come up"
    gave = rf"{re.escape(url)} \(.+\) not healthy after 25 s \(orchestrator.timeouts.server_wait_s\)"
    # servers.py connect(): a beat once more than 10 s passed since the last (or the start), the
    # deadline checked first: beats at > 10 s and (a turn of the loop permitting) > 20 s, none
    # after 25 s.
    assert 1 <= len(beats(lines, beat)) <= 25 // 10, text
    assert apart(stamped(lines, beat), 10), text
    assert code not in (None, 0), text
    gave_up = beats(lines, gave)
    assert gave_up, text
    assert gave_up[0] >= 25, (gave_up, text)  # not before its timeout
    assert max(beats(lines, beat)) < gave_up[0]  # and nothing waited on after it


def test_the_trainer_waiting_for_a_batch_says_so_and_gives_up_at_batch_timeout_s(waited):
    lines, code = waited["trainer"]
    text = "\n".join(line for _, line in lines)
    # The batch wait beats every 30 s (rl/transport/interface.py). (The watch on the orchestrator's
    # heartbeat speaks only of an orchestrator that was there and went silent: tests/faults.)
    beat = r"waiting for batch 1 for (\d+) s"
    gave = r"no batch 1 at .* after 40 s \(trainer.timeouts.batch_s\); is the orchestrator running\?"
    # transport.py receive(): the deadline first, then a beat once more than 30 s passed: one
    # beat (> 30 s in, saying so), none after 40 s: the loop must take one turn in those 10 s,
    # which the program's own polling (a look at least every second) does even on a loaded machine.
    waiting = [(t, int(re.search(beat, line)[1])) for t, line in lines if re.search(beat, line)]
    assert len(waiting) == 40 // 30, text
    assert waiting[0][1] >= 30, text  # "%.0f" of more than 30 s
    assert code not in (None, 0), text
    gave_up = beats(lines, gave)
    assert gave_up, text
    assert gave_up[0] >= 40, (gave_up, text)  # not before its timeout
    # On the program's own clock too: the beat said N s (N - 0.5 s at least) into the wait, the
    # give-up came more than 40 s in: more than 39.5 - N s later, >= 39 - N in whole seconds.
    (beat_at,), (gave_at,) = stamped(lines, beat), stamped(lines, gave)[:1]
    assert gave_at - beat_at >= 39 - waiting[0][1], text
    assert waiting[0][0] < gave_up[0]
