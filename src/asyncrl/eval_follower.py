"""The generation evaluation beside `rl sft` (sft.eval_generate): `rl eval --follow` as a child
process, which starts a server of its own on the model and evaluates each version the trainer
publishes (orchestrator/evaluation/command.py). rl sft's side: start it before the model loads (its
engine starts while the trainer loads and trains), say at once if it fails (training goes on: the
held-out loss still tells how SFT goes), and after the last step wait, visibly, for the last
version's numbers."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from rl.config import RunConfig
from rl.rundir import RunDir
from rl.stop_signal import die_with_parent

log = logging.getLogger("sft")

HEARTBEAT_S = 30.0


class EvalFollower:
    def __init__(self, cfg: RunConfig, argv: list[str]):
        self.cfg = cfg
        self.log_file = RunDir(cfg.output_dir).logs / "eval.log"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            # SIGTERMed when rl sft dies, even by SIGKILL: it then stops its server (eval_command.py).
            self.proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "eval", *argv, "--follow"], stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=die_with_parent)
        self.finishing = False
        threading.Thread(target=self._watch, name="eval-follower", daemon=True).start()
        log.info("generation evaluation on [orchestrator.eval] started (pid %d, %s)", self.proc.pid, self.log_file)

    def _watch(self) -> None:
        code = self.proc.wait()
        if code != 0 and not self.finishing:
            log.error("the generation evaluation exited with code %d: %s (training goes on; %s)", code,
                      self.last_line(), self.log_file)

    def last_line(self) -> str:
        lines = self.log_file.read_text(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else "(no output)"

    def finish(self) -> int | None:
        """After the last step: wait for the last version's evaluation, saying every HEARTBEAT_S
        what it waits for; the follower's exit code (None: stopped at the bound)."""
        bound = self.cfg.orchestrator.timeouts.server_wait_s + self.cfg.inference.timeouts.reload_s + 600
        start = time.monotonic()
        while self.proc.poll() is None:
            waited = time.monotonic() - start
            if waited > bound:
                log.error("the generation evaluation of step %d took over %.0f s: stopped (%s)",
                          self.cfg.max_steps, bound, self.log_file)
                self.stop()
                return None
            try:
                self.proc.wait(timeout=HEARTBEAT_S)
            except subprocess.TimeoutExpired:
                log.info("waiting for the generation evaluation of step %d (%.0f s; %s)", self.cfg.max_steps,
                         time.monotonic() - start, self.log_file)
        return self.proc.returncode

    def stop(self) -> None:
        """Training failed or was stopped: SIGTERM (the follower stops its server), SIGKILL after 30 s."""
        self.finishing = True
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
