"""bubblewrap's side of a sandboxed run: its command line (namespaces, the read-only interpreter
and libraries, tmpfs scratch, prlimit's process limit), the seccomp filter it loads, and the probe
that finds, once, an interpreter bwrap can isolate, or says why none (sandbox.py's docstring has
the whole picture)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import shutil
import struct
import subprocess
import sys

from orchestrator.sandbox.sandbox_limits import Limits, confine
from orchestrator.sandbox.sandbox_users import slot

INSIDE_ID = 65534  # the user and group a program sees itself as ("nobody")
INSTALL = "apt-get install bubblewrap"
# Syscalls a program has no business making (x86_64 numbers): ptrace and reading other processes'
# memory, keyrings, mounts and namespaces, bpf, perf, userfaultfd, io_uring, kernel modules and
# kexec, swap, reboot, clocks, accounting, quotas, file handles, the kernel log, I/O ports,
# anonymous memory files. clone/clone3 with CLONE_NEWUSER are not here (a filter cannot read
# clone3's flags): bwrap's --disable-userns refuses those.
DENIED_X86_64 = (101, 310, 311, 312, 248, 249, 250, 165, 166, 155, 161, 272, 308, 321, 298, 323, 425, 426, 427,
                 175, 313, 176, 246, 320, 167, 168, 169, 163, 179, 103, 164, 227, 159, 305, 303, 304, 172, 173, 134,
                 428, 429, 430, 431, 432, 433, 442, 300, 212, 153,
                 319)  # memfd_create: memory bounded by no rlimit but the file size, times open files


def bwrap_argv(python: str, lim: Limits, code: str, seccomp: int | None) -> list[str]:
    """bwrap's command line for one run of `code`; `seccomp`: the filter's fd (seccomp_pipe)."""
    argv = [_bwrap(), *(["--seccomp", str(seccomp)] if seccomp is not None else []),
            "--unshare-all", "--unshare-user", "--uid", str(INSIDE_ID), "--gid", str(INSIDE_ID),
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox"]
    if "--disable-userns" in _bwrap_help():
        argv.append("--disable-userns")
    size = "--size" in _bwrap_help()
    argv += [*_interpreter_mounts(python), "--proc", "/proc", "--dev", "/dev",
             *(["--size", str(lim.scratch_mb * 2**20)] if size else []), "--tmpfs", "/tmp",
             *(["--size", str(2**20)] if size else []), "--tmpfs", "/dev/shm",
             # bwrap's / and /dev are tmpfs mounts without a size: read-only, they cannot fill memory
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
             "--", _prlimit(), f"--nproc={lim.processes}", "--", os.path.realpath(python), "-I", "-c", code]
    return argv


def _interpreter_mounts(python: str) -> list[str]:
    """bwrap's arguments that show, read-only, the interpreter, its standard library, the shared
    libraries (the system's library directories) and prlimit, and nothing else of the host: no
    other program (no shell, no compiler), no site-packages. An interpreter outside /usr (pyenv)
    shows its whole prefix, its site-packages hidden under an empty read-only tmpfs."""
    real = os.path.realpath(python)
    prefix, stdlib, platstdlib, purelib, multiarch = _layout(real)
    args: list[str] = []
    bound = []  # top-level library directories of a /usr not merged, shown whole
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # a merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top) and top.startswith("/lib"):  # the loader and libraries, not /bin's programs
            args += ["--ro-bind", top, top]
            bound.append(top)
    shown = [prefix] if not real.startswith("/usr/") else [real, stdlib, platstdlib]
    libraries = [f"/usr/lib/{multiarch}" if multiarch else "/usr/lib", "/usr/lib64", "/usr/lib32"]
    for path in dict.fromkeys(os.path.realpath(p) for p in [*shown, *libraries, _prlimit()]):
        if os.path.exists(path) and not any(path.startswith(top + "/") for top in bound):
            args += ["--ro-bind", path, path]
    for packages in dict.fromkeys([purelib, os.path.join(stdlib, "site-packages")]):
        if os.path.isdir(packages) and any(packages.startswith(p.rstrip("/") + "/") for p in shown):
            args += ["--tmpfs", packages, "--remount-ro", packages]
    return args


@functools.cache
def _layout(python: str) -> tuple[str, str, str, str, str]:
    """(prefix, stdlib, platstdlib, purelib, multiarch) of an interpreter, asked of it (trusted
    code, run once, outside any sandbox)."""
    ask = ("import json, sys, sysconfig; p = sysconfig.get_paths(); print(json.dumps([sys.base_prefix, p['stdlib'], "
           "p['platstdlib'], p['purelib'], sysconfig.get_config_var('MULTIARCH') or '']))")
    return tuple(json.loads(subprocess.run([python, "-I", "-c", ask], capture_output=True, text=True, timeout=30,
                                           check=True).stdout))


@functools.cache
def _bwrap() -> str | None:
    return shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")


@functools.cache
def _prlimit() -> str | None:
    return shutil.which("prlimit", path="/usr/bin:/bin")


@functools.cache
def _bwrap_help() -> str:
    return subprocess.run([_bwrap(), "--help"], capture_output=True, text=True, timeout=30).stdout


@functools.cache
def bwrap_version() -> str:
    return subprocess.run([_bwrap(), "--version"], capture_output=True, text=True, timeout=30).stdout.split()[-1]


@functools.cache
def probe() -> tuple[str | None, str | None]:
    """(the interpreter isolated runs use, None), or (None, why runs cannot be isolated and the
    fix). Asked once, by running each candidate in bwrap as runs will."""
    if not sys.platform.startswith("linux"):
        return None, f"code runs without isolation on {sys.platform} (bubblewrap is Linux only): limits only"
    if _bwrap() is None:
        return None, f"bubblewrap not found: {INSTALL}"
    if _prlimit() is None:
        return None, "prlimit not found (util-linux): apt-get install util-linux"
    why = "no Python to run"
    # The real file: a virtual environment's python is a link, and its packages stay out of sight.
    for candidate in dict.fromkeys([os.path.realpath(sys.executable), "/usr/bin/python3"]):
        if os.path.exists(candidate):
            try:
                probe = _try(candidate)
            except (OSError, subprocess.SubprocessError) as e:
                why = str(e)
                continue
            if probe.stdout.strip() == "3":
                return candidate, None
            why = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
    return None, (f"bubblewrap cannot isolate runs here ({why}): it needs unprivileged user namespaces "
                  "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; in a container, "
                  "a seccomp/AppArmor profile that allows them)")


def _try(python: str) -> subprocess.CompletedProcess:
    """`python` run in bwrap as runs are, printing its major version."""
    with slot() if os.geteuid() == 0 else contextlib.nullcontext() as uid:
        seccomp = seccomp_pipe()
        try:
            return subprocess.run(bwrap_argv(python, Limits(), "import sys; print(sys.version_info[0])", seccomp),
                                  env={"PATH": "/usr/bin:/bin"}, timeout=30, capture_output=True, text=True,
                                  pass_fds=() if seccomp is None else (seccomp,),
                                  preexec_fn=lambda: confine(Limits(), uid))
        finally:
            if seccomp is not None:
                os.close(seccomp)


@functools.cache
def seccomp_filter() -> bytes:
    """A classic BPF program for bwrap --seccomp: another architecture or the x32 ABI is killed,
    DENIED_X86_64 answer EPERM, everything else is allowed. Empty (no filter) off x86_64."""
    if platform.machine() != "x86_64":
        return b""
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    n = len(DENIED_X86_64)
    program = [(ld_abs, 0, 0, 4), (jeq, 1, 0, 0xC000003E), (ret, 0, 0, 0x80000000),  # arch: x86_64 or killed
               (ld_abs, 0, 0, 0), (jge, n + 2, 0, 0x40000000)]  # x32 syscalls: killed (KILL below)
    program += [(jeq, n - i, 0, nr) for i, nr in enumerate(DENIED_X86_64)]  # jump to EPERM
    program += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | 1), (ret, 0, 0, 0x80000000)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


def seccomp_pipe() -> int | None:
    """A pipe's read end holding the filter, for bwrap to read (and close) once; None without one."""
    if not seccomp_filter():
        return None
    r, w = os.pipe()
    os.write(w, seccomp_filter())  # a few hundred bytes: the pipe's buffer holds them
    os.close(w)
    return r


