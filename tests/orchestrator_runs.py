"""The real `rl orchestrator` as its own process, on a config a test writes, against the stand-in
server of tests/fake_inference.py run as a process a test can kill (StandIn), with rows made to
come to nothing (ROWS): its output lines, the one error that stopped it, and the rows its
batches and last checkpoint account for. Shared by the no-spin tests on the stand-in and on vLLM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import tomli_w

from conftest import TINY_MODEL, free_port, rl_command
from orchestrator.prompts.queue import decode_state
from rl.batch import Batch
from rl.rundir import RunDir


TESTS = Path(__file__).resolve().parent  # tests/, where fake_inference.py lives
GOOD_ROWS = 64  # the start-up check measures the first 64 rows: those are short, the later ones long
STREAK = 20

ROWS = f'''
from fake_inference import row_name


def rows(seed):
    """Rows 0..{GOOD_ROWS - 1} fit seq_len 64; later ones do not (100 letters)."""
    i = 0
    while True:
        yield {{"prompt": row_name(i) + ("" if i < {GOOD_ROWS} else "a" * 100) + "="}}
        i += 1


def zero(prompt, completion, row):
    return 0.0


def short(seed):
    """Rows that all fit."""
    i = 0
    while True:
        yield {{"prompt": row_name(i) + "="}}
        i += 1


def mixed(seed):
    """9 rows in 20 are too long for seq_len 64 (the first 9 of each 20): under half, so the start-up
    check lets the run start (with a warning), but 32 slots filled at once draw ~26 of them before
    any group finishes."""
    i = 0
    while True:
        yield {{"prompt": row_name(i) + ("a" * 100 if i % 20 < 9 else "") + "="}}
        i += 1


def broken(prompt, completion, row):
    raise ValueError("no answer in this row")
'''


def orchestrator_config(tmp: Path, url: str, async_level: int = 1, rows: str = "spin_rows:rows",
                        reward: str = "fake_inference:reward", **tables) -> Path:
    """`async_level`: max_async_level (no trainer runs: batches 1..async_level+1 go out, then the
    orchestrator waits for version 1). `rows` and `reward`: the one dataset's; `tables`: tables of
    [orchestrator], whose keys join the defaults here."""
    (tmp / "spin_rows.py").write_text(ROWS)
    orchestrator = {"servers": {"urls": [url], "discover": False},
                    "datasets": [{"name": "data", "function": rows, "reward": reward}],
                    "scheduling": {"prompts_per_step": 4, "group_size": 2, "max_in_flight_groups": 8,
                                   "max_futile_streak": STREAK},
                    "sampling": {"max_tokens": 6}, "timeouts": {"weights_s": 300}}
    for table, keys in tables.items():
        orchestrator[table] = {**orchestrator.get(table, {}), **keys}
    path = tmp / "cfg.toml"
    path.write_text(tomli_w.dumps({"model": str(TINY_MODEL), "output_dir": str(tmp / "run"), "seq_len": 64,
                                   "max_steps": 40, "max_async_level": async_level, "orchestrator": orchestrator}))
    return path


def env_with_tests() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


class StandIn:
    """tests/fake_inference.py's null server as its own process (instant generation)."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "fake_inference.py"), str(self.port)],
                                     env=env_with_tests(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).read()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    raise RuntimeError("the stand-in server did not come up within 60 s")
                time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def run_orchestrator(cfg: Path, cwd: Path, limit_s: float = 180, on_line=None, stop_when=None) -> tuple[list[str], int]:
    """Its output lines and exit code; `on_line(line)` sees each line as it comes; a line for which
    `stop_when(line)` is true stops it (SIGTERM)."""
    proc = subprocess.Popen(rl_command("orchestrator", "@", str(cfg)), cwd=cwd, env=env_with_tests(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if on_line is not None:
                on_line(line)
            if stop_when is not None and stop_when(line):
                proc.terminate()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=10)
        raise AssertionError("the orchestrator outlived its limit (it spins):\n" + "\n".join(lines[-30:])) from None
    reader.join(timeout=10)
    return lines, code


def the_error(lines: list[str]) -> str:
    """The one line that stopped the run: the last error, said once (a prompt dropped after three
    failed groups is an error line of its own, before it)."""
    errors = [line for line in lines if " ERROR " in line]
    assert errors, "\n".join(lines[-30:])
    said = [line for line in lines if errors[-1].partition(" ERROR ")[2] in line]
    assert len(said) == 1, "\n".join(lines[-30:])
    return errors[-1]


def drawn_rows(run: RunDir) -> tuple[list[int], list[int], int]:
    """(rows in the batches on disk, rows pending in the last checkpoint, rows drawn by then):
    a row is named by its prompt (fake_inference.row_name)."""
    from fake_inference import row_name
    from tokenizers import Tokenizer

    names = {row_name(i): i for i in range(5000)}
    tokenizer = Tokenizer.from_file(str(TINY_MODEL / "tokenizer.json"))
    last = run.checkpoint_steps("orchestrator")[-1]
    step, cursor, pending, _ = decode_state((run.checkpoint_dir(last) / "orchestrator" / "state.json").read_bytes())
    batched = []
    for n in range(1, step + 1):
        batch = Batch.read(run.rollout_dir(n))
        for s in batch.sample_slices()[::2]:  # group_size 2: one prompt per two samples
            prompt = batch.tokens[s][: int(batch.loss_mask[s].argmax())].tolist()
            batched.append(names[tokenizer.decode(prompt).replace(" ", "").rstrip("=")])
    return batched, [names[p.row["prompt"].rstrip("=")] for p in pending if len(p.row["prompt"]) < 50], cursor


# --- at start-up ---------------------------------------------------------------------------------
