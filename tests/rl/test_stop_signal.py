"""rl/stop_signal.py: a SIGTERM whose handler runs inside a finalizer is not lost.

The script below SIGTERMs itself from inside a `__del__` and stays there until the handler has
run (Python runs handlers between bytecodes, so inside the finalizer): the handler's exception is
then dropped by Python. With a plain handler the process goes on (the hazard, shown so that the
test of the fix cannot pass for want of it); with raise_on_sigterm it is sent again and the
process exits 143 before its main loop ends.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = r'''
import os, signal, sys, time
sys.path.insert(0, sys.argv[2])
from rl.stop_signal import raise_on_sigterm

handled = []
if sys.argv[1] == "fixed":
    raise_on_sigterm(lambda: (handled.append(1), SystemExit(143))[1])
else:
    def plain(*_):
        handled.append(1)
        raise SystemExit(143)
    signal.signal(signal.SIGTERM, plain)


class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        while not handled:  # bytecodes, so the handler runs here, inside the finalizer
            pass


Finalized()  # collected at once: the stop lands in its __del__ and is dropped
print("dropped once", flush=True)
for _ in range(200):  # up to 10 s for the resent stop to end the process
    time.sleep(0.05)
print("survived", flush=True)
'''


@pytest.mark.parametrize("mode, code, survived", [("plain", 0, True), ("fixed", 143, False)])
def test_a_stop_dropped_by_a_finalizer_is_sent_again(mode, code, survived):
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(ROOT / "src")], capture_output=True,
                          text=True, timeout=60)
    assert "dropped once" in done.stdout and "Exception ignored" in done.stderr, done.stderr
    assert done.returncode == code and ("survived" in done.stdout) is survived, (done.stdout, done.stderr)
