"""Every wait names what it waits for, says so again while it lasts, and ends at its timeout
(docs/reliability.md): checked on the real programs, each waiting for a peer that never comes.

The lines are timed as they arrive on the program's output, so the test sees the gaps a person
watching the terminal would see. A wait's beat is a fixed interval checked about once a second:
the gap between two lines is that interval plus up to ~1 s, plus scheduling delay on a loaded
machine; the bounds below leave 4 s for that.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time

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


def test_the_orchestrator_waiting_for_servers_says_so_and_gives_up_at_server_wait_timeout_s(tmp_path, write_toml):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = write_toml(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 2\nseq_len = 64\n'
                     f'[orchestrator]\nserver_urls = ["{url}"]\nserver_wait_timeout_s = 25\n', "cfg.toml")
    lines, code = timed_lines(rl_command("orchestrator", "@", str(cfg)), limit_s=60)
    text = "\n".join(line for _, line in lines)
    waiting = beats(lines, rf"waiting for inference server\(s\) {re.escape(url)} to come up")
    assert len(waiting) >= 2, text
    gaps = [b - a for a, b in zip(waiting, waiting[1:])]
    assert all(g <= 10 + 1 + 4 for g in gaps), gaps  # servers.py: every 10 s, polled each second
    assert code not in (None, 0), text
    gave_up = beats(lines, rf"{re.escape(url)} not healthy after 25 s \(orchestrator.server_wait_timeout_s\)")
    assert gave_up, text
    # It gave up at its timeout (counted from when it started waiting, after start-up), not later.
    assert gave_up[0] - waiting[0] <= 25 - 10 + 4, (waiting, gave_up)


def test_the_trainer_waiting_for_a_batch_says_so_and_gives_up_at_batch_timeout_s(tmp_path, write_toml):
    cfg = write_toml(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 2\nseq_len = 64\n'
                     "heartbeat_timeout_s = 5\n[trainer]\nbatch_timeout_s = 36\ntorch_threads = 1\n", "cfg.toml")
    lines, code = timed_lines(rl_command("trainer", "@", str(cfg)), limit_s=90)
    text = "\n".join(line for _, line in lines)
    # The batch wait beats every 30 s (rl/transport.py). (The watch on the orchestrator's
    # heartbeat speaks only of an orchestrator that was there and went silent: tests/faults.)
    waiting = beats(lines, r"waiting for batch 1 for \d+ s")
    assert waiting, text
    assert code not in (None, 0), text
    gave_up = beats(lines, r"no batch 1 at .* after 36 s \(trainer.batch_timeout_s\); is the orchestrator running\?")
    assert gave_up, text
    assert gave_up[0] - waiting[0] <= 36 - 30 + 4, (waiting, gave_up)
