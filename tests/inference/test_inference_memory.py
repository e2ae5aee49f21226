"""A CPU engine that cannot fit beside what already runs is refused at start, in one line naming
the key and the memory found (inference/preflight.py inference_memory), before vLLM loads anything:
vLLM itself checks only the KV cache, once its engine has started and loaded the model.

inference.gpu_memory_utilization (unset: vLLM's 0.9) is not what a CPU engine needs: measured
here, `rl inference` with gpu_memory_utilization = 0.99 started with 9 GiB of 23.5 GiB available
(vLLM 0.32's CPU worker weighs it only when no KV size is given; the server always gives
cpu_kv_cache_gib), so it reaches vLLM only when set.
"""

from __future__ import annotations

import math
import os
import subprocess

import pytest

from conftest import TINY_MODEL, free_port, rl_command
from inference.server import vllm_args
from inference import preflight
from rl.config import ConfigError, load_config


def test_the_refusal_names_the_key_what_is_available_and_what_it_needs():
    line = preflight.memory_refusal("inference.cpu_kv_cache_gib = 4", 4, 0.8, 3.1, 23.5)
    assert line == ("inference.cpu_kv_cache_gib = 4: this machine has 3.1 GiB of memory available (of 23.5 GiB), "
                    "and the KV cache (4 GiB) with the model's weights (0.80 GiB) needs 4.8 GiB: lower it, or stop "
                    "what holds the memory")
    line = preflight.memory_refusal("inference.cpu_kv_cache_gib = 30", 30, 0.8, 3.1, 23.5)
    assert line == ("inference.cpu_kv_cache_gib = 30: this machine has 23.5 GiB of memory in all, and the KV cache "
                    "(30 GiB) with the model's weights (0.80 GiB) needs 30.8 GiB: lower it")
    assert preflight.memory_refusal("k", 4, 0.8, 4.8, 23.5) is None  # exactly fits


def start(tmp_path, kv: int, *flags: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\nseq_len = 64\n'
                   f"[inference]\nport = {free_port()}\ncpu_kv_cache_gib = {kv}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "ASYNCRL_API_TOKEN")}
    return subprocess.run(rl_command("inference", "@", str(cfg), *flags), capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env=env)


def one_line(result: subprocess.CompletedProcess, tmp_path) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert "vLLM" not in result.stdout + result.stderr and not (tmp_path / "run").exists()
    return lines[0]


def test_a_kv_cache_beyond_the_machine_is_one_line_and_exit_2(tmp_path):
    """More KV cache than the machine has in all: refused whatever runs beside it, before
    anything is written or vLLM says a word."""
    _, total = preflight._memory_gib()
    kv = math.ceil(total) + 1
    line = one_line(start(tmp_path, kv), tmp_path)
    assert line.startswith(f"rl inference: inference.cpu_kv_cache_gib = {kv}: this machine has {total:.1f} GiB of "
                           f"memory in all, and the KV cache ({kv} GiB) with the model's weights"), line


def test_a_kv_cache_beyond_the_memory_available_is_refused(monkeypatch):
    """Less than the machine has, more than the other programs leave. In-process, with the memory
    reading fixed: the machine's own "available" moves as other programs (other tests' engines)
    start and exit, by more than any margin a test could leave between its reading and a
    subprocess's. (That a start runs this check, in one line and exit 2: the test above.)"""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(preflight, "_memory_gib", lambda: (3.1, 23.5))
    cfg = load_config(["--model", str(TINY_MODEL), "--inference.cpu_kv_cache_gib", "4"])[0]
    weights = sum(f.stat().st_size for f in TINY_MODEL.glob("*.safetensors")) / 2**30
    with pytest.raises(ConfigError) as e:
        preflight.inference_memory(cfg)
    assert str(e.value) == preflight.memory_refusal("inference.cpu_kv_cache_gib = 4", 4, weights, 3.1, 23.5)
    assert str(e.value).startswith("inference.cpu_kv_cache_gib = 4: this machine has 3.1 GiB of memory available "
                                   "(of 23.5 GiB), and the KV cache (4 GiB)"), e.value
    assert str(e.value).endswith("lower it, or stop what holds the memory"), e.value
    # What fits passes; the environment's VLLM_CPU_KVCACHE_SPACE is what the server would use.
    monkeypatch.setattr(preflight, "_memory_gib", lambda: (4.1 + weights, 23.5))
    preflight.inference_memory(cfg)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "5")
    with pytest.raises(ConfigError, match=r"^VLLM_CPU_KVCACHE_SPACE = 5 \(the environment's, in place of "
                                          r"inference.cpu_kv_cache_gib = 4\): this machine has"):
        preflight.inference_memory(cfg)


def test_gpu_memory_utilization_reaches_vllm_only_when_set():
    unset = vllm_args(load_config(["--model", str(TINY_MODEL)])[0])
    assert "--gpu-memory-utilization" not in unset
    shared = vllm_args(load_config(["--model", str(TINY_MODEL), "--inference.gpu_memory_utilization", "0.35"])[0])
    assert shared[shared.index("--gpu-memory-utilization") + 1] == "0.35"
