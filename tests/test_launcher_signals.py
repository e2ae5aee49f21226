"""`rl run` stops on SIGINT even when started with SIGINT ignored, as a shell script's background
command is (POSIX: `rl run ... &` without job control)."""

from __future__ import annotations

import signal
import subprocess
import time

from conftest import ROOT, free_port, rl_command


def test_sigint_stops_a_run_started_with_sigint_ignored(tmp_path):
    cmd = rl_command("run", "@", str(ROOT / "configs" / "reverse_demo.toml"), "--output_dir", str(tmp_path / "run"),
                     "--inference.port", str(free_port()))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        seen = ""
        deadline = time.monotonic() + 60
        while "started inference" not in seen and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        assert "started inference" in seen, seen
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)  # the children's stop is bounded by the launcher's own timeouts
        assert proc.returncode == 130, seen + out
        assert "interrupted: stopping all programs" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
