"""`rl orchestrator` as a program stays light and stops quietly: a whole run (against the stand-in
server and trainer of tests/orchestrator/test_scheduling.py) never imports torch, triton, vLLM or transformers,
which it has no use for, and whose native extensions printed ~30 "nanobind: leaked ..." lines at
every exit (orchestrator/rendering/tokenizer.py says where they came from)."""

from __future__ import annotations

import asyncio
import os
import sys

from conftest import ROOT, TINY_MODEL, free_port
from fake_inference import FakeServer, start
from rl.rundir import RunDir
from scenarios import fake_trainer

HEAVY = ("torch", "triton", "vllm", "transformers")
# `python -m asyncrl ...`, plus a report of the heavy modules loaded by the time the interpreter exits
# (atexit: after the run, before the module teardown that printed the leak lines).
PROBE = f"""
import atexit, runpy, sys
atexit.register(lambda: print("heavy modules:", sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr))
runpy.run_module("asyncrl", run_name="__main__")
"""
STEPS = 3


async def run_orchestrator(tmp_path) -> tuple[int, str]:
    port = free_port()
    server = await start(FakeServer(), port)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\nseq_len = 64\nmax_steps = {STEPS}\n'
                   f'[orchestrator]\nservers.urls = ["http://127.0.0.1:{port}"]\n'
                   'datasets = [{name = "data", function = "fake_inference:dataset", reward = "fake_inference:reward"}]\n'
                   '[orchestrator.scheduling]\nprompts_per_step = 4\ngroup_size = 2\npoll_interval_s = 0.01\n'
                   '[orchestrator.sampling]\nmax_tokens = 6\n')
    trainer = asyncio.create_task(fake_trainer(RunDir(tmp_path / "run"), STEPS, lambda: 0.0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", PROBE, "orchestrator", "@", str(cfg),
                                                    env=env, stderr=asyncio.subprocess.PIPE)
        stderr = await asyncio.wait_for(proc.stderr.read(), 120)
        return await proc.wait(), stderr.decode(errors="replace")
    finally:
        trainer.cancel()
        await server.cleanup()


def test_a_running_orchestrator_imports_no_torch_triton_vllm_or_transformers_and_stops_quietly(tmp_path):
    code, stderr = asyncio.run(run_orchestrator(tmp_path))
    assert code == 0, stderr[-3000:]
    assert f"done: {STEPS} batches" in stderr, stderr[-3000:]
    report = [line for line in stderr.splitlines() if line.startswith("heavy modules:")]
    assert report == ["heavy modules: []"], report
    noise = [line for line in stderr.splitlines() if "nanobind" in line or "leaked" in line]
    assert not noise, "\n".join(noise[:5])
