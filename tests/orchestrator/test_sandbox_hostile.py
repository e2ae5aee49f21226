"""orchestrator/sandbox/sandbox.py against a hostile program, as root and as an unprivileged user (issue
52; docs/tools.md's hostile table). Each case plants a canary on the host (a process with a secret
in its command line and environment, files in the repository and in a run directory, a listening
port, unix sockets, IPC objects, an inherited descriptor), checks that it is there from outside,
then that a sandboxed program cannot reach it, and what the program left behind.

The driver below is this file run as a script (standard library only): once as root, once as
`nobody` through setpriv with the system's python3 (CI runs as root; the project's interpreter may
lie under /root). It runs from a copy, this file and the sandbox's modules in a directory of
their own that anyone may read, so that `nobody` reaches them wherever the checkout lies (a root
home is 0700). Each mode runs all cases at once, a few seconds in all. On a machine where
bubblewrap cannot isolate, the cases are skipped, saying why (start-up refuses such a run).

Each layer against nested user namespaces is shown to hold alone: the driver runs on copies of
the sandbox with one layer removed, and only that layer's case turns.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import json
import os
import platform
import shutil
import signal
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(os.environ.get("HOSTILE_REPO", Path(__file__).resolve().parents[2]))  # the copy's: where it came from
# The sandbox's modules to drive: another directory of them, for checking that the suite fails
# with a protection removed (HOSTILE_SANDBOX_DIR=...).
SANDBOX_DIR = Path(os.environ.get("HOSTILE_SANDBOX_DIR", ROOT / "src" / "orchestrator" / "sandbox"))
NOBODY = 65534
CLONE_NEWUSER, PTRACE_ATTACH, IPC_CREAT, IPC_RMID = 0x10000000, 16, 0o1000, 0

# Each case: a program run in the sandbox, given the canaries as C (a dict), printing what it found
# as one JSON line.
CASES = {
    "host processes": """
import os
pids = [p for p in os.listdir('/proc') if p.isdigit()]
seen = ''
for p in pids:
    for f in ('cmdline', 'environ'):
        try:
            seen += open(f'/proc/{p}/{f}', errors='replace').read()
        except OSError:
            pass
try:
    environ = open(f"/proc/{C['pid']}/environ").read()
except OSError as e:
    environ = type(e).__name__
try:
    os.kill(C['pid'], 0); signal = 'sent'
except OSError as e:
    signal = type(e).__name__
out(pids=len(pids), secret_seen=C['secret'] in seen, init=open('/proc/1/cmdline').read(), environ=environ,
    signal=signal)
""",
    "ptrace": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
found = {}
for name, pid in (('host', C['pid']), ('own init', 1)):
    found[name] = libc.ptrace(16, pid, 0, 0) == 0 and 'attached' or os.strerror(ctypes.get_errno())
out(**found)
""",
    "files": """
out(**{p: os.path.exists(p) for p in C['files']})
""",
    "sysv shm": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
host = libc.shmget(C['shm_key'], 0, 0)
mine = libc.shmget(C['shm_key'] + 1, 1 << 20, 0o1000 | 0o600)
address = libc.shmat(mine, None, 0)
ctypes.memset(address, 1, 1 << 20)  # touched: the pages exist
out(host_segment=host, created=mine >= 0)
""",
    "posix mqueue": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.mq_open(C['mq'].encode(), os.O_RDWR)
out(opened=fd >= 0, error=os.strerror(ctypes.get_errno()))
""",
    "loopback ports and network": """
import socket
found = {}
for host, port in (('127.0.0.1', C['port']), ('1.1.1.1', 53)):
    try:
        socket.create_connection((host, port), timeout=2); found[host] = 'connected'
    except OSError as e:
        found[host] = e.strerror
out(**found)
""",
    "unix sockets": """
import socket
found = {}
for name, address in (('abstract', '\\0' + C['secret']), ('path', C['unix_path'])):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(address); found[name] = 'connected'
    except OSError as e:
        found[name] = e.strerror
out(**found)
""",
    "setsid and kill(-1)": """
import signal
try:
    os.kill(-1, signal.SIGKILL); sent = 'sent'  # to every process it may signal
except OSError as e:
    sent = e.strerror  # none but its own namespace's init, which kill(-1) skips
out(sent=sent)
""",
    "setsid children outlive the run": """
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', C['sleep']])
        os._exit(0)
out(started=True)
""",
    "inherited descriptor": """
try:
    os.write(C['fd'], b'forged'); wrote = 'yes'
except OSError as e:
    wrote = e.strerror
out(fds=sorted(os.listdir('/proc/self/fd')), wrote=wrote)
""",
    "memory through shared memory": """
found = {}
try:
    open('/dev/shm/fill', 'wb').write(b'0' * (8 << 20)); found['dev_shm'] = 'wrote 8 MB'
except OSError as e:
    found['dev_shm'] = e.strerror
try:
    fd = os.memfd_create('fill'); found['memfd'] = 'created'
except OSError as e:
    found['memfd'] = e.strerror
out(**found)
""",
    "privileges": """
import ctypes
status = dict(line.split(':\\t', 1) for line in open('/proc/self/status').read().splitlines() if ':\\t' in line)
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
nested = libc.unshare(0x10000000) == 0 and 'made' or os.strerror(ctypes.get_errno())
writes = {}
for path in ('/proc/sys/kernel/hostname', '/escape', '/usr/escape'):
    try:
        open(path, 'w'); writes[path] = 'opened'
    except OSError as e:
        writes[path] = e.strerror
out(hostname=open('/proc/sys/kernel/hostname').read().strip(), no_new_privs=status['NoNewPrivs'].strip(),
    seccomp=status['Seccomp'].strip(), caps=status['CapEff'].strip(), user_namespace=nested, writes=writes)
""",
    "user namespaces through clone": """
import ctypes, signal, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def made(pid):
    if pid == 0:  # the child, in its new user namespace
        os._exit(0)
    if pid < 0:
        return os.strerror(ctypes.get_errno())
    os.waitpid(pid, 0)
    return 'made'

# clone(CLONE_NEWUSER | SIGCHLD) like fork; clone3 with struct clone_args {flags, ..., exit_signal}
args = ctypes.create_string_buffer(struct.pack('=11Q', 0x10000000, 0, 0, 0, signal.SIGCHLD, 0, 0, 0, 0, 0, 0))
out(clone=made(libc.syscall(56, 0x10000000 | signal.SIGCHLD, 0, 0, 0, 0)),
    clone3=made(libc.syscall(435, args, 88)))
""",
}
PRELUDE = "import json, os, sys\nC = json.loads(sys.stdin.read())\n" \
          "def out(**found):\n    print(json.dumps(found), flush=True)\n"


# --- the driver: run as a script, as root or as nobody -------------------------------------------


def _sandbox_module():
    """The sandbox from the copy beside this file (orchestrator/sandbox/sandbox*.py), not the
    checkout's: the copy is what `nobody` can read."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return importlib.import_module("orchestrator.sandbox.sandbox")


def _copied(sandbox_dir: Path, into: Path) -> Path:
    """This file and the sandbox's modules copied into `into`, readable by anyone: the driver's
    script, and the package it imports (empty __init__ files: nothing else of the project)."""
    package = into / "orchestrator" / "sandbox"
    package.mkdir(parents=True)
    for name in ("orchestrator/__init__.py", "orchestrator/sandbox/__init__.py"):
        (into / name).write_text("")
    for module in sandbox_dir.glob("sandbox*.py"):
        shutil.copy(module, package / module.name)
    shutil.copy(__file__, into / "hostile_driver.py")
    for path in (into, *into.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return into / "hostile_driver.py"


def _alive(marker: str) -> int:
    """Host processes whose command line holds `marker` (zombies excepted: dead, being reaped)."""
    n = 0
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker in (p / "cmdline").read_text(errors="replace") \
                    and "\nState:\tZ" not in (p / "status").read_text():
                n += 1
        except OSError:
            pass
    return n


def _shm_keys() -> set[int]:
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return {int(line.split()[0]) for line in lines}


class Canaries:
    """What the host holds, each checked from outside first: found[case] says what was seen."""

    def __init__(self, run_dir: Path):
        self.secret = f"hostile-canary-{os.getpid()}-{time.time_ns()}"
        self.run_file = run_dir / "rollouts.jsonl"
        self.run_file.write_text(self.secret)
        self.process = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)",
                                         self.secret], env={"CANARY": self.secret}, stdout=subprocess.PIPE)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind("\0" + self.secret)
        self.abstract.listen()
        self.unix_path = str(run_dir / "admin.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        self.unix.listen()
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.shm_key = 0x5A000000 + os.getpid() % 0x100000 * 2
        self.shm = self.libc.shmget(self.shm_key, 4096, IPC_CREAT | 0o600)
        self.mq = f"/{self.secret}"
        small = (ctypes.c_long * 8)(0, 1, 8)  # mq_attr: 1 message of 8 bytes, little of the user's queue budget
        self.mq_fd = self.libc.mq_open(self.mq.encode(), os.O_CREAT | os.O_RDWR, 0o600, small)
        self.fd = os.open(self.run_file, os.O_WRONLY | os.O_APPEND)
        os.set_inheritable(self.fd, True)  # what a careless parent would hand on
        here = Path(__file__).resolve().parent  # the copy the driver runs from: readable by whoever runs it
        repository = [str(ROOT / "pyproject.toml"), str(ROOT / "src")] if os.access(ROOT / "src", os.R_OK) else []
        self.files = [*repository, str(here / "orchestrator" / "sandbox" / "sandbox.py"), str(here), str(self.run_file),
                      str(run_dir), "/root", "/home", "/etc/passwd", "/bin/sh"]  # the host's accounts, a shell

    def outside(self) -> dict:
        """The canaries as the host sees them: each there."""
        # The canary process runs (its environ is readable once it does): it says so.
        ready, _, _ = select.select([self.process.stdout], [], [], 60)
        assert ready and self.process.stdout.readline() == b"up\n", "the canary process did not start in 60 s"
        connected = {}
        for name, family, address in (("loopback", socket.AF_INET, self.listener.getsockname()),
                                      ("abstract", socket.AF_UNIX, "\0" + self.secret),
                                      ("path", socket.AF_UNIX, self.unix_path)):
            with socket.socket(family) as s:
                s.connect(address)
                connected[name] = True
        return {"environ": self.secret in Path(f"/proc/{self.process.pid}/environ").read_text(errors="replace"),
                "init": Path("/proc/1/cmdline").read_text(errors="replace"),
                "files": {f: os.path.exists(f) and (not os.path.isfile(f) or bool(Path(f).read_bytes()))
                          for f in self.files},
                "connected": connected, "shm": self.shm_key in _shm_keys(), "mq": self.mq_fd >= 0,
                "no_new_privs": Path("/proc/self/status").read_text().split("NoNewPrivs:\t")[1][0]}

    def context(self) -> dict:
        return {"secret": self.secret, "pid": self.process.pid, "files": self.files, "shm_key": self.shm_key,
                "mq": self.mq, "port": self.listener.getsockname()[1], "unix_path": self.unix_path, "fd": self.fd,
                "sleep": f"{4000 + os.getpid() % 1000}.{time.time_ns() % 10**6}"}

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdout.close()
        for s in (self.listener, self.abstract, self.unix):
            s.close()
        self.libc.shmctl(self.shm, IPC_RMID, None)
        self.libc.mq_unlink(self.mq.encode())
        os.close(self.fd)


def drive(cases: list[str]) -> dict:
    sandbox = _sandbox_module()
    if why := sandbox.Sandbox.isolation():
        return {"skip": why}
    run_dir = Path(tempfile.mkdtemp(prefix="hostile-run-"))
    canaries = Canaries(run_dir)
    try:
        found = {"uid": os.getuid(), "outside": canaries.outside(), "describe": sandbox.Sandbox.describe()}
        context = canaries.context()
        box = sandbox.Sandbox(sandbox.Limits(wall_s=20))

        async def all_cases():
            runs = [box.run(PRELUDE + CASES[name], json.dumps(context)) for name in cases]
            return await asyncio.gather(*runs)

        for name, result in zip(cases, asyncio.run(all_cases())):
            lines = result.stdout.strip().splitlines()
            found[name] = {"outcome": result.outcome, "stderr": result.stderr[-500:],
                           "inside": json.loads(lines[-1]) if lines else None}
        found["after"] = {"canary_alive": canaries.process.poll() is None, "sleepers": _alive(context["sleep"]),
                          "shm_left": canaries.shm_key + 1 in _shm_keys(), "run_file": canaries.run_file.read_text()}
        return found
    finally:
        canaries.close()
        shutil.rmtree(run_dir, ignore_errors=True)


# --- the tests ------------------------------------------------------------------------------------


def _driven(mode: str, sandbox_dir: Path = SANDBOX_DIR, cases: tuple[str, ...] = tuple(CASES)) -> dict:
    """The driver's findings in `mode` ("root", "user") against the sandbox in `sandbox_dir`."""
    import pytest

    if mode == "root" and os.geteuid() != 0:
        return {"skip": "not root: the root mode needs CI's root"}
    with tempfile.TemporaryDirectory(prefix="hostile-driver-") as into:
        script = _copied(sandbox_dir, Path(into))
        argv = [sys.executable, str(script), "--driver", *cases]
        if mode == "user" and os.geteuid() == 0:  # drop to nobody; the project's python may lie under /root
            python = shutil.which("python3", path="/usr/bin:/bin")
            if python is None or shutil.which("setpriv") is None:
                pytest.skip("no /usr/bin/python3 or setpriv to run the driver as nobody")
            argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python,
                    str(script), "--driver", *cases]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the copy's package, not the checkout's
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd="/",
                              env={**env, "HOSTILE_REPO": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _report(mode: str) -> dict:
    """The driver's findings in `mode`, run once per session and kept."""
    import pytest

    if mode not in _reports:
        _reports[mode] = _driven(mode)
    report = _reports[mode]
    if "skip" in report:
        pytest.skip(report["skip"])
    return report


_reports: dict[str, dict] = {}


def pytest_generate_tests(metafunc):
    if "mode" in metafunc.fixturenames:
        metafunc.parametrize("mode", ["root", "user"])
    if "layer" in metafunc.fixturenames:
        metafunc.parametrize("layer", list(LAYERS))


def needs_seccomp() -> None:
    import pytest

    if platform.machine() != "x86_64":
        pytest.skip("the sandbox's seccomp filter is for x86_64 only (orchestrator/sandbox/sandbox.py)")


def inside(mode: str, case: str) -> dict:
    found = _report(mode)[case]
    assert found["inside"] is not None, found
    return found["inside"]


def test_it_runs_as_the_mode_says_and_isolated(mode):
    report = _report(mode)
    assert report["uid"] == (0 if mode == "root" else NOBODY if os.geteuid() == 0 else os.getuid())
    assert report["describe"].startswith("bubblewrap"), report["describe"]


def test_host_processes_are_out_of_sight(mode):
    outside, found = _report(mode)["outside"], inside(mode, "host processes")
    assert outside["environ"]  # the canary: its secret is in its environment, readable from outside
    assert not found["secret_seen"] and found["pids"] <= 3, found  # bwrap's init, the program, its listing
    assert found["init"] != outside["init"] and found["init"].split("\0")[0].endswith("bwrap")
    assert (found["environ"], found["signal"]) == ("FileNotFoundError", "ProcessLookupError")


def test_ptrace_reaches_nothing(mode):
    needs_seccomp()
    found = inside(mode, "ptrace")
    assert found["host"] in ("No such process", "Operation not permitted") and found["own init"] != "attached", found


def test_the_repository_the_run_directory_homes_etc_and_programs_are_not_there(mode):
    outside, found = _report(mode)["outside"], inside(mode, "files")
    assert all(outside["files"].values()), outside["files"]  # the canaries exist, readable outside
    assert not any(found.values()), found


def test_ipc_objects_are_its_own_and_die_with_it(mode):
    report = _report(mode)
    assert report["outside"]["shm"] and report["outside"]["mq"]  # the host's segment and queue exist
    shm, mq = inside(mode, "sysv shm"), inside(mode, "posix mqueue")
    assert shm == {"host_segment": -1, "created": True}, shm  # its own segment, made and touched ...
    assert not report["after"]["shm_left"]  # ... gone with it
    assert mq == {"opened": False, "error": "No such file or directory"}


def test_host_sockets_are_unreachable(mode):
    assert _report(mode)["outside"]["connected"] == {"loopback": True, "abstract": True, "path": True}
    assert inside(mode, "loopback ports and network") == {"127.0.0.1": "Connection refused",
                                                          "1.1.1.1": "Network is unreachable"}
    assert inside(mode, "unix sockets") == {"abstract": "Connection refused", "path": "No such file or directory"}


def test_kill_minus_one_and_setsid_reach_nothing_and_leave_nothing(mode):
    report = _report(mode)
    assert inside(mode, "setsid and kill(-1)") == {"sent": "No such process"}
    assert report["after"]["canary_alive"]
    assert inside(mode, "setsid children outlive the run") == {"started": True}
    assert report["after"]["sleepers"] == 0, "a setsid child outlived its run"


def test_an_inherited_descriptor_is_not_inherited(mode):
    report = _report(mode)
    found = inside(mode, "inherited descriptor")
    assert found["wrote"] == "Bad file descriptor" and found["fds"] == ["0", "1", "2", "3"], found  # 3: the listing's
    assert report["after"]["run_file"].startswith("hostile-canary-") and "forged" not in report["after"]["run_file"]


def test_memory_cannot_be_pinned_through_shared_memory(mode):
    needs_seccomp()
    assert inside(mode, "memory through shared memory") == {"dev_shm": "No space left on device",
                                                            "memfd": "Operation not permitted"}


def test_no_privileges_no_nested_namespaces_nothing_writable_but_scratch(mode):
    needs_seccomp()
    report, found = _report(mode), inside(mode, "privileges")
    assert report["outside"]["no_new_privs"] == "0"  # the host's process may gain privileges; the sandbox's not
    assert (found["no_new_privs"], found["seccomp"], found["caps"]) == ("1", "2", "0000000000000000"), found
    assert found["user_namespace"] == "Operation not permitted"  # unshare: the seccomp filter
    # /proc/sys is there (it reads it) and the host's root owns it: not the namespace's root's to change.
    assert found["writes"] == {"/proc/sys/kernel/hostname": "Permission denied",
                               "/escape": "Read-only file system", "/usr/escape": "Read-only file system"}
    assert found["hostname"] == "sandbox"


def test_no_user_namespace_through_clone_or_clone3(mode):
    """What the seccomp filter cannot see (clone3's flags lie in memory) bwrap's --disable-userns
    refuses: the user namespace count inside is 0."""
    found = inside(mode, "user namespaces through clone")
    assert found == {"clone": "No space left on device", "clone3": "No space left on device"}, found


# Each layer against nested user namespaces, removed alone from a copy of the sandbox: the case it
# holds turns, and only that one.
LAYERS = {
    "seccomp's unshare": ("sandbox_bwrap.py", "161, 272, 308,", "161, 308,",
                          {"privileges": ("user_namespace", "No space left on device")}),
    "--disable-userns": ("sandbox_bwrap.py", 'argv.append("--disable-userns")', "pass",
                         {"user namespaces through clone": ("clone", "made")}),
}


def test_each_layer_against_nested_user_namespaces_holds_alone(layer, tmp_path):
    needs_seccomp()
    module, old, new, turned = LAYERS[layer]
    for path in SANDBOX_DIR.glob("sandbox*.py"):
        text = path.read_text()
        if path.name == module:
            assert text.count(old) == 1, f"{old!r} not once in {module}"
            text = text.replace(old, new)
        (tmp_path / path.name).write_text(text)
    cases = ("privileges", "user namespaces through clone")
    whole, without = _report("root"), _driven("root", tmp_path, cases)
    for case in cases:
        if case in turned:
            key, value = turned[case]
            assert whole[case]["inside"][key] != value, whole[case]  # the whole sandbox holds ...
            assert without[case]["inside"][key] == value, (layer, without[case])  # ... and this layer did
        else:
            assert without[case]["inside"] == whole[case]["inside"], (layer, case, without[case])


if __name__ == "__main__" and sys.argv[1:2] == ["--driver"]:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    print(json.dumps(drive(sys.argv[2:] or list(CASES))))
