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
from asyncrl.launcher import command

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "models" / "tiny-reverse"


@pytest.fixture(autouse=True)
def nothing_leaks():
    """Every test leaves the placement's environment as it found it (checked after monkeypatch's undo)."""
    keys = (gp.PLACED_ENV, "CUDA_VISIBLE_DEVICES")
    before = {k: os.environ.get(k) for k in keys}
    yield
    assert {k: os.environ.get(k) for k in keys} == before, "a test left the placement's environment changed"


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


# Qwen2.5's shapes (config.json), their parameters and their largest tensor (the embedding, bfloat16).
QWEN_0_5B = gp.ModelShape(params=494_032_768, layers=24, hidden=896, kv_width=128, intermediate=4864, vocab=151_936,
                          largest_tensor_bytes=151_936 * 896 * 2)
QWEN_1_5B = gp.ModelShape(params=1_543_714_304, layers=28, hidden=1536, kv_width=256, intermediate=8960,
                          vocab=151_936, largest_tensor_bytes=151_936 * 1536 * 2)
QWEN_7B = gp.ModelShape(params=7_615_616_512, layers=28, hidden=3584, kv_width=512, intermediate=18944,
                        vocab=152_064, largest_tensor_bytes=152_064 * 3584 * 2)
H200, H100 = 139.8, 79.2  # GiB, as torch reports them


def test_a_shared_gpu_leaves_the_trainer_room():
    plan = gp.plan(cfg(), ids(1), total_gib=H100, shape=QWEN_0_5B)
    need = sum(gp.outside_the_server(cfg(), QWEN_0_5B).values())
    assert 0.1 < plan.memory_share <= 1 - need / H100 < plan.memory_share + 0.01
    assert plan.overrides()[-2:] == ["--inference.gpu_memory_utilization", f"{plan.memory_share:.2f}"]
    # A small model: vLLM's own 0.9, never more.
    tiny = gp.model_shape(TINY_MODEL)
    assert gp.plan(cfg(), ids(1), total_gib=H100, shape=tiny).memory_share == 0.9
    # A given share that fits is kept (no override), one that does not is refused naming it.
    assert gp.plan(cfg("--inference.gpu_memory_utilization", "0.3"), ids(1), H100, QWEN_0_5B).memory_share is None
    with pytest.raises(ConfigError, match=r"^inference\.gpu_memory_utilization = 0\.9 leaves 7\.9 GiB of the shared "
                                          r"GPU's 79 GiB, and beside the server it needs ~\d+\.\d GiB \(0\.49B "
                                          r"parameters; GiB: weights and optimizer 7\.4, optimizer step 1\.8"):
        gp.plan(cfg("--inference.gpu_memory_utilization", "0.9"), ids(1), H100, QWEN_0_5B)
    # 7B on one 80 GiB GPU with full fine-tuning cannot share; with LoRA it can.
    with pytest.raises(ConfigError, match=r"^trainer\.gpus: beside the server the shared GPU's 79 GiB must hold ~"):
        gp.plan(cfg(), ids(1), H100, QWEN_7B)
    lora = gp.plan(cfg("--trainer.lora.rank", "8", "--trainer.model.activation_checkpointing", "true"), ids(1), H100, QWEN_7B)
    assert 0.3 < lora.memory_share < 0.9
    # Memory unknown (no GPU torch can see): the config's share as it is.
    assert gp.plan(cfg(), ids(1)).memory_share is None


def gib(n: float) -> float:
    return n / 2**30


def test_the_shared_share_leaves_what_the_trainer_holds_by_its_config():
    """Issue 60's case: 1.5B on an H200 with a KL reference model. Beside the server's share the
    GPU keeps, counted here from the shape alone: float32 weights, gradients and AdamW's moments
    (16 B a parameter), AdamW's foreach temporaries at the step (4 B), the reference in bfloat16
    (2 B), two CUDA contexts, the reload's copy of the embedding, and the activations of the
    micro-batch's tokens in bfloat16, at least its layers' inputs (what checkpointing keeps)."""
    kl = ["--trainer.loss.kl_coef", "0.01"]
    p = QWEN_1_5B.params
    for extra in ([], ["--trainer.model.activation_checkpointing", "true"],
                  ["--trainer.model.activation_checkpointing", "true", "--trainer.batching.micro_batch_tokens", "32768"]):
        config = cfg(*kl, *extra)
        share = gp.plan(config, ids(1), H200, QWEN_1_5B).memory_share
        tokens = config.trainer.batching.micro_batch_tokens
        floor = (gib(p * (16 + 4 + 2)) + 2 * gp.CUDA_CONTEXT_GIB + gib(QWEN_1_5B.largest_tensor_bytes)
                 + gib(2 * tokens * QWEN_1_5B.hidden * QWEN_1_5B.layers))
        assert (1 - share) * H200 >= floor, (extra, share, floor)
    # Each part of the config moves the share the way it moves the trainer's memory.
    def share(*extra):
        return gp.shared_memory_share(cfg(*extra), H200, QWEN_1_5B)
    assert share(*kl) < share()  # the reference model
    assert share(*kl, "--trainer.loss.kl_target", "inference") == share()  # no reference model then
    assert share(*kl, "--trainer.model.reference_offload", "true") > share(*kl)
    assert share("--trainer.batching.micro_batch_tokens", "16384") < share() < share("--trainer.model.activation_checkpointing", "true")
    with pytest.raises(ConfigError, match=r"^trainer\.gpus: .*activations \d+"):  # 32k tokens without checkpointing
        share(*kl, "--trainer.batching.micro_batch_tokens", "32768")
    assert share("--trainer.lora.rank", "8", *kl) > share()  # LoRA: no optimizer state, its base is the reference
    need = gp.trainer_need(cfg(*kl), QWEN_1_5B)
    assert need["reference model"] == pytest.approx(gib(2 * p)) and need["optimizer step"] == pytest.approx(gib(4 * p))
    two = gp.trainer_need(cfg("--trainer.batching.micro_batch_tokens", "16384"), QWEN_1_5B)
    assert two["activations"] == pytest.approx(2 * gp.trainer_need(cfg(), QWEN_1_5B)["activations"])
    # Two trainer ranks sharing two GPUs with the server: each holds half the sharded state.
    halves = gp.trainer_need(cfg(), QWEN_1_5B, ranks=2)
    assert halves["weights and optimizer"] == pytest.approx(gib(16 * p) / 2)
    outside = gp.outside_the_server(cfg(), QWEN_1_5B)
    assert outside["reload's largest tensor"] == gib(151_936 * 1536 * 2)
    assert outside["CUDA contexts"] == 2 * gp.CUDA_CONTEXT_GIB


def test_model_shape_from_config_and_headers():
    import safetensors.torch

    shape = gp.model_shape(TINY_MODEL)
    tensors = safetensors.torch.load_file(next(TINY_MODEL.glob("*.safetensors")))
    assert shape.params == gp.model_params(TINY_MODEL) == sum(t.numel() for t in tensors.values())
    assert shape.largest_tensor_bytes == max(t.numel() * t.element_size() for t in tensors.values())
    assert (shape.layers, shape.hidden, shape.kv_width, shape.intermediate) == (4, 128, 64, 384)


class FakeCuda:
    """torch.cuda as a process sees it with two visible devices of different sizes."""

    def __init__(self, sizes_gib):
        self.sizes = sizes_gib

    def is_available(self):
        return bool(self.sizes)

    def device_count(self):
        return len(self.sizes)

    def get_device_properties(self, index):
        from types import SimpleNamespace

        return SimpleNamespace(total_memory=int(self.sizes[index] * 2**30))


def test_gpu_memory_is_torchs_view_of_the_visible_devices(monkeypatch):
    """The shared GPU's memory, by its index among the visible devices (torch's numbering follows
    CUDA_VISIBLE_DEVICES; nvidia-smi's lists the machine's GPU 0)."""
    fake = FakeCuda([H100, H200])
    assert gp.torch_memory_gib(fake, 1) == pytest.approx(H200) and gp.torch_memory_gib(fake, 0) == pytest.approx(H100)
    assert gp.torch_memory_gib(fake, 2) is None and gp.torch_memory_gib(FakeCuda([]), 0) is None
    # The real probe in its child process: this machine's torch sees no GPU.
    assert gp.gpu_memory_gib(0) is None
    # rl run's check asks for the shared GPU (here the second visible), not the first.
    asked = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(gp, "gpu_memory_gib", lambda index=0: asked.append(index) or gp.torch_memory_gib(fake, index))
    plan = gp.check(cfg("--inference.gpus", "[0,1]", "--trainer.gpus", "[1]"))
    assert asked == [1] and plan.shared == (1,) and plan.memory_share == 0.9  # the tiny model on 140 GiB
    asked.clear()
    assert gp.check(cfg()).memory_share is None and asked == []  # a GPU each: nothing to size


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
    assert cmd[1:4] == ["-m", "asyncrl", "inference"] and env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert cmd[-4:] == ["--inference.gpus", "[0,1]", "--trainer.gpus", "[2,3]"]
    cmd, env = command("trainer", ["@", "x.toml"], plan)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert cmd[5:7] == ["-m", "trainer"] and env["CUDA_VISIBLE_DEVICES"] == "GPU-c,GPU-d"
    assert env[gp.PLACED_ENV] == "1"
    cmd, env = command("orchestrator", [], plan)
    assert "CUDA_VISIBLE_DEVICES" not in env
    one = gp.plan(cfg(), ("0", "1"))
    assert command("trainer", [], one)[0][1:4] == ["-m", "asyncrl", "trainer"]
    assert command("trainer", ["a"], None) == ([sys.executable, "-m", "asyncrl", "trainer", "a"], {})


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
    # setenv first: delenv of an absent key records nothing, and apply()'s PLACED_ENV = 1 would
    # outlive the test in this worker, turning off later children's placement checks.
    monkeypatch.setenv(gp.PLACED_ENV, "")
    monkeypatch.delenv(gp.PLACED_ENV)
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
    base = [sys.executable, "-m", "asyncrl", "run", "--model", str(TINY_MODEL), "--output_dir", str(tmp_path / "run"),
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
