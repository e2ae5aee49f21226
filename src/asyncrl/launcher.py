"""`rl run @ cfg.toml`: the three programs as local child processes, one log each, one status
line per step, fail-fast.

Each child gets exactly the launcher's own arguments, so it resolves the same config a user would
get starting it by hand. Children run in their own sessions: Ctrl-C reaches only the launcher,
which then stops them in order (SIGTERM, then SIGKILL of the whole process group, which takes
vLLM's engine processes along).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from rl import quiet_tracker
from asyncrl.plots import write_plots
from rl.config import ConfigError, RunConfig
from rl.gpu_placement import GpuPlan
from rl.gpu_placement import check as gpu_placement
from rl.heartbeat import SERVING, PeerWatch, heartbeat_path
from rl.config.parallel_layout import cpu_world, mesh_sizes
from rl.rundir import RunDir
from rl.stop_signal import die_with_parent, raise_on_sigterm

PROGRAMS = ("inference", "trainer", "orchestrator")
STOP_GRACE_S = 15.0
# What a killed program's helper processes print as they go down with it: triton's nanobind
# reference-leak report and multiprocessing's resource tracker cleaning up vLLM's shared memory.
# Neither says anything about why the program died, so the tail shown skips them (the log keeps
# them), and the children's resource trackers are told not to warn at all (rl/quiet_tracker.py).
EXIT_NOISE = re.compile(r"^nanobind: |^\s*- leaked |^\s*- \.\.\. skipped remainder|nanobind\.readthedocs\.io"
                        r"|UserWarning: resource_tracker: There appear to be|warnings\.warn\('resource_tracker: ")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    heartbeat: PeerWatch


def trainer_ranks(cfg: RunConfig, gpu_plan: GpuPlan | None) -> int:
    """How many trainer ranks `rl run` starts: one per trainer GPU; on CPU, [trainer.parallel]'s
    product (rl/config/parallel_layout.py)."""
    return len(gpu_plan.trainer) if gpu_plan is not None else cpu_world(cfg.trainer.parallel)


def command(name: str, argv: list[str], gpu_plan: GpuPlan | None, cpu_ranks: int = 1
            ) -> tuple[list[str], dict[str, str]]:
    """A child's command line and the environment it adds: the launcher's own arguments plus the
    GPU placement's overrides (so that every child resolves the one plan), its GPUs, and for a
    trainer with several GPUs torchrun, one rank per GPU; on CPU, `cpu_ranks` trainer ranks
    ([trainer.parallel]) under torchrun when several."""
    if gpu_plan is None:
        if name == "trainer" and cpu_ranks > 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cpu_ranks}",
                    "-m", "trainer", *argv], {}
        return [sys.executable, "-m", "asyncrl", name, *argv], {}
    argv = [*argv, *gpu_plan.overrides()]
    # The orchestrator's environment is left as it is: a reward of the user's may use a GPU.
    env = gpu_plan.env(name) if name in ("inference", "trainer") else {}
    if name == "trainer" and len(gpu_plan.trainer) > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={len(gpu_plan.trainer)}", "-m", "trainer", *argv], env
    return [sys.executable, "-m", "asyncrl", name, *argv], env


def _start(name: str, argv: list[str], run: RunDir, cfg: RunConfig, gpu_plan: GpuPlan | None) -> Child:
    log = run.logs / f"{name}.log"
    warnings = quiet_tracker.pythonwarnings()
    cmd, env = command(name, argv, gpu_plan, trainer_ranks(cfg, gpu_plan))
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent,
            env={**os.environ, "PYTHONWARNINGS": warnings, **env},
        )
    return Child(name, proc, log, PeerWatch(heartbeat_path(cfg, name), name, cfg.timeouts.heartbeat_s))


def _stop(children: list[Child]) -> None:
    for c in children:
        if c.proc.poll() is None:
            os.killpg(c.proc.pid, signal.SIGTERM)
            os.killpg(c.proc.pid, signal.SIGCONT)  # a frozen (stopped) one handles it too
    deadline = time.monotonic() + STOP_GRACE_S
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever is left of the group (vLLM's engine core, workers)
            os.killpg(c.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        c.proc.wait()


def _tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log that say something (EXIT_NOISE skipped)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join([line for line in text.splitlines() if not EXIT_NOISE.search(line)][-lines:])


class MetricsFollower:
    """Reads the lines appended to metrics.jsonl since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new_records(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class Eta:
    """Time left, from the steps' pace since the first one (the server start is not a step)."""

    def __init__(self, total: int):
        self.total, self.first = total, None

    def update(self, step: int) -> str:
        now = time.monotonic()
        if self.first is None:
            self.first = (step, now)
            return ""
        done, elapsed = step - self.first[0], now - self.first[1]
        if done <= 0:
            return ""
        left = (self.total - step) * elapsed / done
        return f", {done / elapsed:.1f} steps/s, ETA {int(left // 60)}:{int(left % 60):02d}"


def status_line(step: int, total: int, orch: dict, train: dict) -> str:
    line = (
        f"step {step}/{total} | reward {orch.get('reward_mean', float('nan')):.3f} "
        f"| staleness {orch.get('staleness_mean', float('nan')):.2f} "
        f"| {orch.get('tokens_per_s', 0):.0f} tok/s "
        f"| loss {train.get('loss', float('nan')):+.4f} "
        f"| waits: trainer {train.get('wait_s', 0):.2f}s, orchestrator {orch.get('wait_s', 0):.2f}s "
        f"| inference idle {100 * orch.get('inference_idle_frac', 0):.0f}%"
    )
    if "routing_agreement" in train:  # a mixture-of-experts model whose engine records its routing
        line += f" | routing agreement {train['routing_agreement']:.3f}"
    # Only when something went wrong or was thrown away: the usual line stays short.
    extra = {k: orch.get(k, 0) for k in ("cancelled", "episodes_failed_scored", "failed_requests", "requeued", "filtered",
                                          "dropped_stale")}
    if any(extra.values()):
        line += " | " + " ".join(f"{k} {v}" for k, v in extra.items() if v)
    return line


def summarize(run: RunDir, console: Console) -> None:
    """First-5 vs last-5 mean reward, the first and last held-out evaluation, and the plots
    (asyncrl/plots.py) in the run directory."""
    everything = MetricsFollower(run.metrics).new_records()
    records = [r for r in everything if r.get("program") == "orchestrator"]
    if not records:
        return
    rewards = [r["reward_mean"] for r in sorted(records, key=lambda r: r["step"])]
    first, last = sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-5:]) / len(rewards[-5:])
    console.print(f"mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f} ({last - first:+.3f})")
    evals = sorted((r for r in everything if r.get("program") == "eval"), key=lambda r: r["step"])
    if len(evals) >= 2:
        before, after = evals[0], evals[-1]
        for key in (k for k in after if k.startswith("eval/") and not k.endswith("/rows")):
            console.print(f"held-out greedy {key.removeprefix('eval/')}: version {before['version']} "
                          f"{before.get(key, float('nan')):.3f} -> version {after['version']} {after[key]:.3f}")
    written = write_plots(run.root)
    console.print(f"plots: {', '.join(str(p) for p in written)}")


def _trainer_finished(run: RunDir) -> bool:
    """Multi-run: the trainer (which serves other runs too, and keeps going) is done with ours."""
    try:
        return json.loads(run.trainer_status.read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return False


def stopped(children: list[Child], console: Console) -> bool:
    """Whether a child died (any exit of the server, a failed exit of the others) or went silent;
    says which, and why, once."""
    done = {c.name: c.proc.poll() for c in children}
    failed = [c for c in children if done[c.name] not in (None, 0)
              or (c.name == "inference" and done[c.name] is not None)]
    if failed:
        c = failed[0]
        console.print(f"[red]rl run: {c.name} exited with code {done[c.name]}; "
                      f"stopping the others. Last lines of {c.log}:[/red]")
        console.print(_tail(c.log), markup=False, highlight=False)
        return True
    # Alive but silent: frozen (SIGSTOP, swapped out, a stuck interpreter) or its
    # storage gone. Nothing will come of waiting; the run resumes with --resume.
    silent = [s for c in children if done[c.name] is None and (s := c.heartbeat.poll()).state == "silent"]
    if silent:
        console.print(f"[red]rl run: {escape(silent[0].describe())}; stopping all programs "
                      "(continue with --resume)[/red]", markup=True, highlight=False)
        return True
    return False


def serving(children: list[Child]) -> bool:
    """Whether the server has declared that it serves (its engine sized its KV cache by then)."""
    return any(c.name == "inference" and c.heartbeat.phase() == SERVING for c in children)


def launch(cfg: RunConfig, argv: list[str]) -> int:
    multi = cfg.trainer.lora.multi_run
    if multi and not cfg.run_name:
        print("rl run: trainer.lora.multi_run = true needs a run to start: compose a config that sets "
              "run_name (docs/lora.md)", file=sys.stderr)
        return 2
    gpu_plan = gpu_placement(cfg)  # checked by asyncrl.main's start-up checks: no error left here
    try:  # the trainer checks it too, but only once started: with GPUs, after the engine
        mesh_sizes(cfg.trainer.parallel, trainer_ranks(cfg, gpu_plan))
    except ConfigError as e:
        print(f"rl run: {e}", file=sys.stderr)
        return 2  # before anything is written
    run = RunDir(cfg.run_dir)  # a multi-run's run: its own logs and metrics under runs/<name>/
    run.make()
    console = Console(stderr=True)
    # On a shared GPU the trainer's model must not arrive while vLLM profiles the memory it may take.
    deferred = "trainer" if gpu_plan is not None and gpu_plan.shared else None

    raise_on_sigterm(KeyboardInterrupt)  # stop the children as Ctrl-C would
    # A script that starts `rl run ... &` hands it SIGINT ignored (POSIX: background commands
    # without job control), and Python then installs no handler: `kill -INT` did nothing (found
    # when a benchmark's Ctrl-C left a run going). Ctrl-C always stops the run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    children: list[Child] = []
    follower = MetricsFollower(run.metrics)
    eta = Eta(cfg.max_steps)
    latest: dict[str, dict] = {"orchestrator": {}, "trainer": {}}
    shown = 0
    code = 0
    try:  # from the first start on: a Ctrl-C at any moment stops what was started
        for name in PROGRAMS:
            if name != deferred:
                children.append(_start(name, argv, run, cfg, gpu_plan))
        console.print(f"started {', '.join(f'{c.name} (pid {c.proc.pid})' for c in children)}; logs in {run.logs}")
        if gpu_plan is not None:
            console.print(gpu_plan.describe(), markup=False, highlight=False)
        with console.status("waiting for the first batch (vLLM takes ~30 s to start)") as spinner:
            while True:
                if deferred and serving(children):
                    children.append(_start(deferred, argv, run, cfg, gpu_plan))
                    console.print(f"the server serves: started {deferred} (pid {children[-1].proc.pid})")
                    deferred = None
                for rec in follower.new_records():
                    latest[rec.get("program", "")] = rec
                train = latest["trainer"]
                if train.get("step", 0) > shown:
                    shown = train["step"]
                    orch = latest["orchestrator"]
                    console.print(f"{time.strftime('%H:%M:%S')} {status_line(shown, cfg.max_steps, orch, train)}",
                                  soft_wrap=True, highlight=False, markup=False)
                    spinner.update(f"training: step {shown}/{cfg.max_steps}{eta.update(shown)}")
                if stopped(children, console):
                    code = 1
                    break
                done = {c.name: c.proc.poll() for c in children}
                if done.get("orchestrator") == 0 and (done.get("trainer") == 0 or multi and _trainer_finished(run)):
                    break
                time.sleep(0.5)
    except KeyboardInterrupt:
        # Stopping is bounded (_stop's timeouts, then SIGKILL): a second SIGINT, or a SIGTERM the
        # stop_signal resend sends again, must not cut it short and leave children running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        console.print("interrupted: stopping all programs")
        code = 130
    finally:
        _stop(children)
    if code == 130:
        # The exit status must be ours. CPython 3.11 marks a KeyboardInterrupt as unhandled when it
        # is raised inside code run from a string (exec/eval: the dataclasses and namedtuples a lazy
        # import defines), even once caught above, and `python -m asyncrl` then ends by re-sending
        # itself SIGINT: exit -2, no traceback (test_launcher_signals, when the Ctrl-C landed
        # there). Everything is stopped and said: leave without the interpreter's exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code == 0:
        summarize(run, console)
    return code
