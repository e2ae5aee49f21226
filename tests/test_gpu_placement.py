"""GPU placement and the engine's device-chosen defaults, each decision on CPU with the device faked:
which GPUs the server and the trainer get for 0, 1, 2, 3 and 8 visible GPUs, the shared GPU's
memory share, the refusals (one line naming the key, exit 2 at start-up), the children's command
lines and environments, and the engine flags a GPU build would get."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference import device_defaults
from inference.server import vllm_args
from rl import gpu_placement as gp
from rl.config import ConfigError, load_config
from rl.cli.launcher import command

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "models" / "tiny-reverse"


def cfg(*overrides: str):
    return load_config(["--model", str(TINY_MODEL), *overrides])[0]


def ids(n: int) -> tuple[str, ...]:
    return tuple(str(i) for i in range(n))


@pytest.mark.parametrize("n, inference, trainer", [
    (1, (0,), (0,)),
    (2, (0,), (1,)),
    (3, (0, 1), (2,)),
    (8, (0, 1, 2, 3), (4, 5, 6, 7)),
])
def test_the_default_split_by_gpu_count(n, inference, trainer):
    plan = gp.plan(cfg(), ids(n))
    assert (plan.inference, plan.trainer) == (inference, trainer)
    assert plan.shared == (() if n > 1 else (0,))
    assert plan.data_parallel == len(inference)


def test_no_gpu_no_plan_and_gpus_keys_refused_there():
    assert gp.plan(cfg(), ()) is None
    with pytest.raises(ConfigError, match=r"^inference\.gpus = \[0\]: no GPU is visible"):
        gp.plan(cfg("--inference.gpus", "[0]"), ())


def test_one_list_given_the_other_takes_the_rest():
    plan = gp.plan(cfg("--inference.gpus", "[6,7]"), ids(8))
    assert plan.inference == (6, 7) and plan.trainer == (0, 1, 2, 3, 4, 5)
    plan = gp.plan(cfg("--trainer.gpus", "[0]"), ids(4))
    assert plan.trainer == (0,) and plan.inference == (1, 2, 3)
    with pytest.raises(ConfigError, match=r"^inference\.gpus = \[0, 1\] takes every visible GPU"):
        gp.plan(cfg("--inference.gpus", "[0,1]"), ids(2))
    with pytest.raises(ConfigError, match=r"^trainer\.gpus = \[4\]: GPU index\(es\) \[4\] not among the 4"):
        gp.plan(cfg("--trainer.gpus", "[4]"), ids(4))
    with pytest.raises(ConfigError, match="listed twice"):
        gp.plan(cfg("--trainer.gpus", "[1,1]"), ids(4))


def test_tensor_parallel_divides_the_servers_gpus_into_replicas():
    plan = gp.plan(cfg("--inference.tensor_parallel", "2"), ids(8))
    assert plan.data_parallel == 2 and "2 data-parallel x 2 tensor-parallel" in plan.describe()
    with pytest.raises(ConfigError, match=r"^inference\.tensor_parallel = 3 does not divide"):
        gp.plan(cfg("--inference.tensor_parallel", "3"), ids(8))
    with pytest.raises(ConfigError, match=r"^inference\.extra_args sets --tensor-parallel-size"):
        gp.plan(cfg("--inference.extra_args", '["--tensor-parallel-size", "2"]'), ids(8))


def test_a_shared_gpu_leaves_the_trainer_room():
    # 0.5B parameters, full fine-tuning: 16 bytes each with 25% headroom = 9.3 GiB of an 80 GiB GPU.
    plan = gp.plan(cfg(), ids(1), total_gib=80, params=500_000_000)
    need = 500_000_000 * 16 * 1.25 / 2**30
    assert plan.memory_share == 0.88 and plan.memory_share <= 1 - need / 80
    assert plan.overrides()[-2:] == ["--inference.gpu_memory_utilization", "0.88"]
    # A small model: vLLM's own 0.9, never more.
    assert gp.plan(cfg(), ids(1), total_gib=80, params=1_000_000).memory_share == 0.9
    # A given share that fits is kept (no override), one that does not is refused naming it.
    assert gp.plan(cfg("--inference.gpu_memory_utilization", "0.5"), ids(1), 80, 500_000_000).memory_share is None
    with pytest.raises(ConfigError, match=r"^inference\.gpu_memory_utilization = 0\.9 leaves the trainer 8\.0 GiB"):
        gp.plan(cfg("--inference.gpu_memory_utilization", "0.9"), ids(1), 80, 500_000_000)
    # 7B on one 80 GiB GPU with full fine-tuning cannot share; with LoRA it can.
    with pytest.raises(ConfigError, match=r"^trainer\.gpus: the trainer needs ~130\.4 GiB"):
        gp.plan(cfg(), ids(1), 80, 7_000_000_000)
    lora = gp.plan(cfg("--trainer.lora.rank", "8"), ids(1), 80, 7_000_000_000)
    assert 0.5 < lora.memory_share < 0.9
    # Memory unknown (no nvidia-smi): the config's share as it is.
    assert gp.plan(cfg(), ids(1)).memory_share is None


def test_refusals_on_the_placement():
    broadcast = cfg("--weight_sync.kind", "broadcast")
    with pytest.raises(ConfigError, match=r'^weight_sync\.kind = "broadcast" with the trainer and the server on GPU'):
        gp.refusals(broadcast, gp.plan(broadcast, ids(1)))
    gp.refusals(broadcast, gp.plan(broadcast, ids(2)))  # a GPU each: fine
    with pytest.raises(ConfigError, match=r'into a server of 4 data-parallel ranks'):
        gp.refusals(broadcast, gp.plan(broadcast, ids(8)))
    one_replica = cfg("--weight_sync.kind", "broadcast", "--inference.tensor_parallel", "4")
    gp.refusals(one_replica, gp.plan(one_replica, ids(8)))
    # A server started by hand with vLLM's own flag is refused by its own start-up check.
    dp = cfg("--weight_sync.kind", "broadcast", "--inference.extra_args", '["--data-parallel-size", "2"]')
    with pytest.raises(ConfigError, match="2 data-parallel ranks"):
        gp.broadcast_into_data_parallel(dp)
    gp.broadcast_into_data_parallel(cfg("--inference.extra_args", '["--data-parallel-size", "2"]'))


def test_children_get_their_gpus_and_the_trainer_torchrun():
    plan = gp.plan(cfg(), ("GPU-a", "GPU-b", "GPU-c", "GPU-d"))
    cmd, env = command("inference", ["@", "x.toml"], plan)
    assert cmd[1:4] == ["-m", "rl", "inference"] and env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert cmd[-4:] == ["--inference.gpus", "[0,1]", "--trainer.gpus", "[2,3]"]
    cmd, env = command("trainer", ["@", "x.toml"], plan)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert cmd[5:7] == ["-m", "trainer"] and env["CUDA_VISIBLE_DEVICES"] == "GPU-c,GPU-d"
    assert env[gp.PLACED_ENV] == "1"
    cmd, env = command("orchestrator", [], plan)
    assert "CUDA_VISIBLE_DEVICES" not in env
    one = gp.plan(cfg(), ("0", "1"))
    assert command("trainer", [], one)[0][1:4] == ["-m", "rl", "trainer"]
    assert command("trainer", ["a"], None) == ([sys.executable, "-m", "rl", "trainer", "a"], {})


def test_visible_gpus_follow_cuda_visible_devices_then_the_driver(tmp_path):
    assert gp.visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}) == ("3", "5")
    assert gp.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert gp.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,4"}) == ("2",)  # CUDA stops at an invalid id
    for i in range(3):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    assert gp.visible_gpus({}, driver=tmp_path) == ("0", "1", "2")
    assert gp.visible_gpus({}, driver=tmp_path / "none") == ()


def test_a_program_started_by_hand_applies_its_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.delenv(gp.PLACED_ENV, raising=False)
    gp.apply(cfg("--trainer.gpus", "[1,3]"), "trainer")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"
    # Placed already (by `rl run`, or just now): indices are not mapped a second time.
    gp.apply(cfg("--trainer.gpus", "[1,3]"), "trainer")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"


def test_model_params_from_the_safetensors_headers():
    import safetensors.torch

    params = gp.model_params(TINY_MODEL)
    tensors = safetensors.torch.load_file(next(TINY_MODEL.glob("*.safetensors")))
    assert params == sum(t.numel() for t in tensors.values()) > 0


def test_engine_defaults_by_device():
    plain = cfg()
    assert device_defaults.eager(plain, gpu=False) and not device_defaults.eager(plain, gpu=True)
    routing = cfg("--inference.record_routing", "true")
    assert device_defaults.eager(routing, gpu=True)  # graph replays would skip the routing capture
    assert not device_defaults.eager(cfg("--inference.enforce_eager", "false"), gpu=False)
    # torch.compile off only where the engine is eager on CPU (a GPU engine compiles and captures
    # graphs; a CPU engine asked to compile keeps it).
    assert device_defaults.compile_off(plain, gpu=False) and not device_defaults.compile_off(plain, gpu=True)
    assert not device_defaults.compile_off(routing, gpu=True)
    assert not device_defaults.compile_off(cfg("--inference.enforce_eager", "false"), gpu=False)
    gpu_flags = vllm_args(plain, gpu=True)
    assert "--enforce-eager" not in gpu_flags and "--no-async-scheduling" not in gpu_flags
    assert "--enforce-eager" in vllm_args(plain, gpu=False)
    parallel = vllm_args(cfg("--inference.gpus", "[0,1,2,3]", "--inference.tensor_parallel", "2"), gpu=True)
    at = parallel.index("--tensor-parallel-size")
    assert parallel[at:at + 4] == ["--tensor-parallel-size", "2", "--data-parallel-size", "2"]


def test_routing_with_graphs_refused_on_a_gpu_build(monkeypatch):
    routing = cfg("--inference.record_routing", "true", "--inference.enforce_eager", "false")
    monkeypatch.setattr(device_defaults, "cpu_build", lambda: False)
    with pytest.raises(ConfigError, match=r"^inference\.enforce_eager = false with inference\.record_routing"):
        device_defaults.routing_needs_eager(routing)
    device_defaults.routing_needs_eager(cfg("--inference.record_routing", "true"))  # unset: eager
    monkeypatch.setattr(device_defaults, "cpu_build", lambda: True)
    device_defaults.routing_needs_eager(routing)  # no CUDA graphs on CPU: nothing to skip


def test_rl_run_refuses_a_placement_at_start_up_and_dry_run_shows_it(tmp_path):
    """The real CLI, with GPUs faked through CUDA_VISIBLE_DEVICES (nothing reads them before the
    plan): exit 2 and one line naming the key; --dry-run prints the placement."""
    base = [sys.executable, "-m", "rl", "run", "--model", str(TINY_MODEL), "--output_dir", str(tmp_path / "run"),
            "--dry-run"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    bad = subprocess.run([*base, "--weight_sync.kind", "broadcast"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2, bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('rl run: weight_sync.kind = "broadcast" with the trainer'), lines
    env["CUDA_VISIBLE_DEVICES"] = "0,1,2,3"
    good = subprocess.run(base, env=env, capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, good.stderr
    assert "GPU placement of 4 visible: server on GPU(s) [0, 1] (2 data-parallel x 1 tensor-parallel), " \
           "trainer on GPU(s) [2, 3] (2 ranks, torchrun)" in good.stderr, good.stderr
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
