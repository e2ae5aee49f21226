"""orchestrator/sandbox/sandbox.py against hostile code, for real: each case is contained, answered with
its outcome, and leaves nothing running. On a machine where runs cannot be isolated (no
bubblewrap, or no unprivileged user namespaces) the isolation cases are skipped, saying why; CI's
machine runs them. tests/orchestrator/test_sandbox_hostile.py holds the isolation cases against canaries, as
root and as a user."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT
from orchestrator.sandbox.sandbox import Limits, RunResult, Sandbox

ISOLATION = Sandbox.isolation()
isolated = pytest.mark.skipif(ISOLATION is not None, reason=ISOLATION or "")


def run(code: str, **limits) -> RunResult:
    return asyncio.run(Sandbox(Limits(**limits)).run(code))


def marked(code: str) -> tuple[str, str]:
    """`code` with a mark of its own, which every process of its run carries in its command line
    (bwrap's and the interpreter's `-c`, children forked without exec): runs of other tests, on
    other workers at the same time, do not count."""
    mark = f"sandbox-test-{uuid.uuid4().hex}"
    return f"{code}\n# {mark}\n", mark


def left_running(mark: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            # A zombie is dead, waiting for init (this machine's reaps slowly) to collect it.
            if proc.name.isdigit() and mark in (proc / "cmdline").read_text(errors="replace") \
                    and "\nState:\tZ" not in (proc / "status").read_text():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def test_ordinary_code_runs_and_answers():
    result = run("import sys; print(sum(range(10))); print('oops', file=sys.stderr)")
    assert (result.stdout, result.stderr.strip(), result.exit_code, result.outcome) == ("45\n", "oops", 0, "ok")
    assert run("raise SystemExit(3)").outcome == "error"
    failed = run("1/0")
    assert failed.outcome == "error" and "ZeroDivisionError" in failed.stderr
    assert "[exit code 1]" in failed.for_model()


def test_an_infinite_loop_is_stopped_by_its_cpu_limit_or_the_clock():
    busy = run("while True: pass", cpu_s=1, wall_s=20)
    assert busy.outcome in ("cpu", "killed"), busy  # SIGXCPU at 1 s, SIGKILL at the hard limit
    code, mark = marked("import time; time.sleep(60)")
    sleeping = run(code, wall_s=1)
    assert sleeping.outcome == "timeout" and "[timed out]" in sleeping.for_model()
    assert not left_running(mark)


def test_a_memory_hog_gets_a_memory_error():
    result = run("x = bytearray(2 * 1024**3)", memory_mb=256)
    assert result.outcome == "memory", result
    assert "[out of memory]" in result.for_model()


def test_huge_output_is_truncated_and_a_flood_is_stopped():
    big = run("print('x' * 50_000)", output_bytes=1000)  # under OUTPUT_FLOOD x 1000: read to its end
    assert big.outcome == "ok" and big.truncated and len(big.stdout) == 1000
    code, mark = marked("while True: print('y' * 10_000)")
    flood = run(code, output_bytes=1000, wall_s=30)
    assert flood.outcome == "output" and len(flood.stdout) == 1000
    assert not left_running(mark)


@isolated
def test_a_fork_bomb_is_contained_and_nothing_is_left_running():
    code, mark = marked("import os\n"
                        "for _ in range(1000):\n"
                        "    try:\n"
                        "        if os.fork() == 0:\n"
                        "            os.setsid()\n"  # out of the process group: only the PID namespace takes it
                        "            import time; time.sleep(600)\n"
                        "    except OSError as e:\n"
                        "        print('fork failed:', e.strerror); break\n")
    result = run(code, processes=8, wall_s=20)
    assert "fork failed: Resource temporarily unavailable" in result.stdout, result
    # Its children slept on, holding its output open: killed once it exited, not at the timeout.
    assert result.outcome == "ok", result
    assert not left_running(mark), "a sandboxed process outlived its run"


@isolated
def test_files_outside_the_scratch_directory_cannot_be_written_or_seen():
    victim = Path("/tmp") / f"sandbox-escape-{os.getpid()}"
    hidden = (ROOT, Path.home(), Path(sys.executable).parent)  # the repository, ~, the project's venv
    assert all(p.is_dir() for p in hidden)  # the canaries: there outside
    code = (f"import os\n"
            f"open('mine.txt', 'w').write('ok'); print('cwd', os.getcwd(), os.listdir('.'))\n"
            f"for path in ('/escape', '/usr/escape', '/dev/escape'):\n"
            f"    try:\n        open(path, 'w')\n    except OSError as e:\n        print(path, e.strerror)\n"
            f"print('visible', [p for p in {tuple(map(str, hidden))} if os.path.exists(p)])\n"
            f"open('{victim}', 'w').write('x')\n")
    result = run(code)
    assert result.outcome == "ok", result
    assert "cwd /tmp ['mine.txt']" in result.stdout
    for path in ("/escape", "/usr/escape", "/dev/escape"):  # each a mount of its own, each read-only
        assert f"{path} Read-only file system" in result.stdout, result.stdout
    assert "visible []" in result.stdout
    assert not victim.exists()  # its /tmp was its own, and is gone


@isolated
def test_the_network_is_a_loopback_of_its_own():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # the canary: reachable here
        code = (f"import socket\n"
                f"for host in ('127.0.0.1', '1.1.1.1'):\n"
                f"    try:\n        socket.create_connection((host, {port}), timeout=2)\n        print(host, 'connected')\n"
                f"    except OSError as e:\n        print(host, e.strerror)\n")
        result = run(code)
    assert "127.0.0.1 Connection refused" in result.stdout and "1.1.1.1 Network is unreachable" in result.stdout


def test_runs_side_by_side_do_not_share_a_directory():
    async def both():
        box = Sandbox(Limits())
        code = ("import os, sys, time; open(sys.stdin.read(), 'w').close(); time.sleep(1)\n"
                "print(sorted(os.listdir('.')))")  # a name of its own: the other's file would show
        return await asyncio.gather(box.run(code, "a"), box.run(code, "b"))

    a, b = asyncio.run(both())
    assert a.outcome == b.outcome == "ok", (a, b)
    assert (a.stdout.strip(), b.stdout.strip()) == ("['a']", "['b']")


def test_without_isolation_a_run_says_so_and_a_run_that_requires_it_refuses(monkeypatch):
    from orchestrator.sandbox import sandbox

    monkeypatch.setattr(sandbox, "_probe", lambda: (None, "bubblewrap not found: apt-get install bubblewrap"))
    assert Sandbox.isolation() == "bubblewrap not found: apt-get install bubblewrap"
    plain = run("print('hi')")
    assert (plain.stdout, plain.isolated) == ("hi\n", False)
    with pytest.raises(RuntimeError, match="bubblewrap not found"):
        asyncio.run(Sandbox(Limits(), isolation="bwrap").run("print('hi')"))


@isolated
def test_a_run_dies_with_the_process_that_started_it():
    """The orchestrator killed mid-run (SIGKILL: nothing of it runs after) leaves nothing of the
    run behind, children that called setsid included (bwrap's --die-with-parent, the PID namespace)."""
    code, mark = marked("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
                        "        break\ntime.sleep(60)")
    starter = subprocess.Popen([sys.executable, "-c", "import asyncio, sys\nfrom orchestrator.sandbox.sandbox import Limits, "
                                "Sandbox\nasyncio.run(Sandbox(Limits(wall_s=60)).run(sys.argv[1]))", code],
                               env={**os.environ, "PYTHONPATH": str(ROOT / "src")})

    def run_s() -> list[int]:  # bwrap's two processes, the program and its three children
        return [pid for pid in left_running(mark) if pid != starter.pid]

    try:
        for _ in range(200):  # until the run has started its children (a few hundred ms)
            if len(run_s()) == 6:
                break
            time.sleep(0.05)
        assert len(run_s()) == 6, run_s()  # the canary: they run while the run does
    finally:
        starter.kill()
        starter.wait()
    for _ in range(100):  # the kernel takes the namespace down as it goes
        if not run_s():
            break
        time.sleep(0.05)
    assert not run_s(), "a sandboxed process outlived the process that started it"


def test_runs_cancelled_while_starting_end_and_leave_nothing_running(monkeypatch):
    """A reward's timeout may cancel a run while asyncio starts its process, or waits for room:
    the cancel returns and nothing of the run is left."""
    from orchestrator.sandbox.sandbox_budget import BUDGET

    monkeypatch.setattr(BUDGET, "limit_mb", 10**6)  # all at once: many are starting when cancelled
    code, mark = marked("import time; time.sleep(30)")

    async def cancelled():
        box = Sandbox(Limits(wall_s=60))
        runs = [asyncio.ensure_future(box.run(code)) for _ in range(40)]
        await asyncio.sleep(0.3)  # some started, some starting
        for r in runs:
            r.cancel()
        async with asyncio.timeout(60):
            done = await asyncio.gather(*runs, return_exceptions=True)
        for _ in range(200):  # the starts still under way finish, and are killed
            if not left_running(mark):
                break
            await asyncio.sleep(0.05)
        return done

    assert all(isinstance(r, asyncio.CancelledError) for r in asyncio.run(cancelled()))
    assert not left_running(mark), "a run cancelled while starting was left running"


# A process that starts RUNS at once and returns after STEPS turns of its event loop: asyncio.run
# then cancels the runs, as they start (STEPS 1: the processes exist, asyncio has not yet connected
# their pipes) or later. It prints how many marked processes ran at that point, then "shut down".
SHUTDOWN_WHILE_STARTING = """
import asyncio, os, sys
from pathlib import Path
from orchestrator.sandbox.sandbox import Limits, Sandbox
from orchestrator.sandbox.sandbox_budget import BUDGET

runs, steps, wall_s, code, mark = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
BUDGET.configure(10**7)  # every run starts at once: none waits for room


def marked_processes():
    found = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):  # this one's command line holds the mark too
            try:
                found += mark in (proc / "cmdline").read_text(errors="replace")
            except OSError:
                pass
    return found


async def main():
    box = Sandbox(Limits(wall_s=wall_s))
    for _ in range(runs):
        asyncio.ensure_future(box.run(code))
    for _ in range(steps):
        await asyncio.sleep(0)
    print(marked_processes(), flush=True)

asyncio.run(main())
print("shut down", flush=True)
"""


@pytest.mark.parametrize("steps", [1, 3, 40])
def test_a_shutdown_while_runs_start_ends_before_their_clock_and_leaves_nothing(steps):
    """asyncio.run returning while runs start their processes cancels them: the shutdown ends
    (asyncio's own subprocesses hung here forever: a start cancelled before its pipes were
    connected is never woken), sooner than the runs' wall clock would have stopped them, and
    nothing of any run is left running, nor its cgroup."""
    from orchestrator.sandbox.sandbox_cgroup import PREFIX, Bound

    runs, wall_s = 32, 30.0
    code, mark = marked("import time; time.sleep(3600)")  # longer than anything here waits
    child = subprocess.Popen([sys.executable, "-c", SHUTDOWN_WHILE_STARTING, str(runs), str(steps), str(wall_s),
                              code, mark], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        started = int(child.stdout.readline())  # the cancel point (start-up itself is not timed)
        try:
            child.wait(timeout=wall_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"asyncio.run's shutdown, cancelling {runs} runs as they start, still hung after the "
                        f"runs' own wall clock ({wall_s:.0f} s)")
    finally:
        child.kill()
        child.wait()
        rest = child.stdout.read()
        child.stdout.close()
        leftovers = [pid for pid in left_running(mark) if pid != child.pid]
        for pid in leftovers:  # a failed run of this test leaves nothing either
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert started >= runs, started  # each run's process existed when the cancellation came
    assert (child.returncode, rest) == (0, "shut down\n")
    assert not leftovers, "a run cancelled by the shutdown was left running"
    bound = Bound.detect()
    if isinstance(bound, Bound):
        assert not list(bound.memory.glob(f"{PREFIX}{child.pid}-*")), "a cancelled run's cgroup was left"


@isolated
def test_the_scratch_disk_holds_a_file_of_scratch_mb_and_scratch_mb_in_all():
    """docs/tools.md's scratch-disk row: one file stops at the file-size limit (File too large),
    files together at the tmpfs's size (No space left on device)."""
    code = ("import os\n"
            "def fill(name, mb):\n"
            "    try:\n"
            "        with open(name, 'wb') as f:\n"
            "            f.write(b'0' * (mb << 20))\n"
            "        return 'wrote'\n"
            "    except OSError as e:\n"
            "        return e.strerror\n"
            "print(fill('big', 200), os.path.getsize('big') >> 20)\n"
            "os.remove('big')\n"
            "print(fill('a', 40), fill('b', 40))\n")
    result = run(code, scratch_mb=64)
    assert result.outcome == "ok", result
    assert result.stdout.splitlines() == ["File too large 64", "wrote No space left on device"], result.stdout


@isolated
def test_open_files_stop_at_the_limit():
    code = ("files = []\n"
            "try:\n"
            "    while True:\n"
            "        files.append(open('/dev/null'))\n"
            "except OSError as e:\n"
            "    print(len(files), e.strerror)\n")
    result = run(code, open_files=32)
    n, error = result.stdout.split(" ", 1)
    assert error.strip() == "Too many open files" and 24 <= int(n) < 32, result.stdout  # 3 standard, a few of Python's


@isolated
def test_no_core_dumps_and_the_limit_cannot_be_raised():
    code = ("import os, resource\n"
            "print(resource.getrlimit(resource.RLIMIT_CORE), flush=True)\n"
            "try:\n"
            "    resource.setrlimit(resource.RLIMIT_CORE, (2**20, 2**20))\n"
            "    print('raised')\n"
            "except (ValueError, OSError) as e:\n"
            "    print('refused', flush=True)\n"
            "os.abort()\n")
    result = run(code)
    assert result.stdout.splitlines() == ["(0, 0)", "refused"], result
    assert (result.exit_code, result.outcome) == (-6, "killed"), result  # SIGABRT, and no core written
