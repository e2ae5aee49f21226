"""trainer.model.dtype = "auto": the compute dtype chosen for the device, once at trainer start-up.

bfloat16 pays only where the hardware computes it: a GPU, or a CPU with the avx512_bf16 or
amx_bf16 instructions. Without them PyTorch emulates it, and a bfloat16 matmul on a 2-core AVX2
EPYC ran at 1.8 GFLOP/s against float32's 58 (issue 51: a first step of 211 s). With them (this
project's AVX512-BF16 EPYC, one thread) matmuls ran 2.5-6x float32's rate (128 x 384: 170 vs 28
GFLOP/s; 896 x 4864: 192 vs 77) and a step of configs/long.toml's shape (hidden 384) took 8.7 s
against 13.7 s. The tiny demo and test models (hidden 128) keep float32 all the same: their steps
take well under a second either way (the demo's: 0.31 vs 0.40 s), and float32 keeps the numerics
the demos were tuned with against a float32 engine (mismatch_kl ~1e-6 on policy).
"""

from __future__ import annotations

from pathlib import Path

NATIVE_BF16 = ("avx512_bf16", "amx_bf16")
# Below this hidden size a CPU trainer keeps float32 even where bfloat16 is native (docstring).
BF16_MIN_HIDDEN = 256


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux); empty where there is no /proc/cpuinfo."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def native_bf16(flags: set[str]) -> bool:
    return any(f in flags for f in NATIVE_BF16)


def resolve_dtype(choice: str, device_type: str, flags: set[str], hidden_size: int, attention: str = "auto") -> str:
    """"float32" or "bfloat16" for trainer.model.dtype = `choice` on `device_type` ("cuda", "cpu")."""
    if choice != "auto":
        return choice
    if attention == "flash_attention_2" or device_type == "cuda":  # flash attention has no float32 kernel
        return "bfloat16"
    return "bfloat16" if native_bf16(flags) and hidden_size >= BF16_MIN_HIDDEN else "float32"


def slow_bf16_warning(choice: str, device_type: str, flags: set[str]) -> str | None:
    """The start-up warning for bfloat16 asked for explicitly on a CPU that emulates it."""
    if choice != "bfloat16" or device_type != "cpu" or native_bf16(flags):
        return None
    return ("trainer.model.dtype = bfloat16: this CPU has no native bf16 (no avx512_bf16/amx_bf16): matmuls run ~30x "
            "slower than float32; use auto or float32")
