"""Start-up checks: everything a config names that can be checked without starting an engine or
loading a model. Paths exist and are of the right kind, the run directory can be written,
modules and functions import, ports are free, lengths fit the model, cores exist, the run
directory's state suits the start (fresh or --resume).

Each program runs the checks of the keys it uses (`rl run`: all three programs') right after its
config parses, before it writes anything, imports torch or vLLM, or starts a heartbeat;
`--dry-run` runs them too. A failed check raises ConfigError: one line naming the key, the value
and what would fix it, which the CLI prints before exiting with code 2. The schema (rl/config/)
already checked the forms (URLs, ranges, cross-key rules): here is what needs the machine.

Here are the checks two or more programs share (the run directory, the model's files and
positions, binding an address, cores); each program keeps its own in its preflight.py
(inference/, orchestrator/, trainer/), and asyncrl/main.py picks the list for the program it starts.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from rl import placement
from rl.config import ConfigError, RunConfig

Check = Callable[[RunConfig], None]
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
MODEL_HINT = "a local HF-format model directory (config.json, tokenizer, *.safetensors)"


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"  # torchrun sets it; other ranks leave shared state to rank 0


# --- the run directory ------------------------------------------------------------------------


def output_dir(cfg: RunConfig) -> None:
    """It exists as a writable directory, or can be created: tried in its deepest existing
    ancestor with a scratch directory removed at once (root passes any permission test)."""
    path = cfg.output_dir.absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError(f"output_dir = {cfg.output_dir}: cannot be created, {existing} is not a directory; "
                          "choose another output_dir")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rl-check-", dir=existing))
    except OSError as e:
        where = "" if existing == path else f" (in {existing})"
        raise ConfigError(f"output_dir = {cfg.output_dir}: cannot write there{where}: {e.strerror}; "
                          "choose a writable output_dir") from None


# --- the model --------------------------------------------------------------------------------


def model_config(cfg: RunConfig) -> dict:
    m = cfg.model
    if not m.exists():
        raise ConfigError(f"model = {m}: no such directory; expected {MODEL_HINT}")
    if not m.is_dir():
        raise ConfigError(f"model = {m}: is a file; expected {MODEL_HINT}")
    try:
        data = json.loads((m / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"model = {m}: no config.json; expected {MODEL_HINT}") from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"model = {m}: config.json is unreadable ({e})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"model = {m}: config.json names no model_type; expected {MODEL_HINT}")
    return data


def weight_files(cfg: RunConfig) -> list[Path]:
    files = [p for pattern in WEIGHT_GLOBS for p in sorted(cfg.model.glob(pattern))]
    if not files:
        raise ConfigError(f"model = {cfg.model}: no weights (*.safetensors); expected {MODEL_HINT}")
    return files


def safetensors_header(path: Path) -> dict:
    """A safetensors file's header (8-byte length, then JSON: each tensor's dtype, shape and
    offsets) without reading a tensor. Raises OSError, ValueError or struct.error."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 1 << 28:  # a damaged length must not make us read the whole file
            raise ValueError(f"{path.name}: header length {size}")
        return json.loads(f.read(size))


# config.json keys that count a model's routed experts (Qwen2/3-MoE, Mixtral, DeepSeek).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def routed_experts(data: dict) -> int:
    """How many routed experts a model's MoE layers have (its config.json); 0: a dense model."""
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    return max([int(text.get(k) or 0) for k in EXPERT_KEYS])


def mixture_of_experts(key: str):
    """A check that, where the config key `key` is on, the model is a mixture of experts: routing
    is recorded and replayed only there."""

    def check(cfg: RunConfig) -> None:
        on = cfg
        for part in key.split("."):
            on = getattr(on, part)
        if on and not routed_experts(model_config(cfg)):
            raise ConfigError(f"{key}: model = {cfg.model} is not a mixture-of-experts model "
                              f"(its config.json has none of {', '.join(EXPERT_KEYS)})")

    check.__name__ = f"mixture_of_experts({key})"
    return check


def positions(data: dict) -> int | None:
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    n = text.get("max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else None


def tokenizer_files(cfg: RunConfig) -> None:
    if not any((cfg.model / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model = {cfg.model}: no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}); "
                          f"expected {MODEL_HINT}")


def seq_len_fits(cfg: RunConfig, data: dict) -> None:
    n = positions(data)
    if n is not None and cfg.seq_len > n:
        raise ConfigError(f"seq_len = {cfg.seq_len} exceeds the model's max_position_embeddings ({n}, "
                          f"{cfg.model}/config.json): lower seq_len")


# --- code the config names --------------------------------------------------------------------


def slurm_template(cfg: RunConfig) -> None:
    t = cfg.slurm.template
    if t is not None and not t.is_file():
        raise ConfigError(f"slurm.template = {t}: no such file")


# --- the machine: ports and cores ------------------------------------------------------------


def bindable(key: str, host: str, port: int) -> None:
    """Binding host:port now works (a taken port, or an address not of this machine, fails)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"{key}: host {host!r} does not resolve ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no conflict
        try:
            s.bind(address)
        except OSError as e:
            raise ConfigError(f"{key}: cannot listen on {host or '*'}:{port} ({e.strerror}): "
                              "choose another port or stop what holds it") from None


def metrics_endpoint(program: str) -> Check:
    """The program's Prometheus port ([<program>] metrics_port; the trainer's local rank r takes
    port + r), when on."""
    def check(cfg: RunConfig) -> None:
        section = getattr(cfg, program)
        if section.metrics_port:
            rank = int(os.environ.get("LOCAL_RANK", "0")) if program == "trainer" else 0
            bindable(f"{program}.metrics_port", section.metrics_host, section.metrics_port + rank)

    return check


def cores(program: str) -> Check:
    def check(cfg: RunConfig) -> None:
        placement.check(f"{program}.cpus", getattr(cfg, program).cpus)

    return check


def check(cfg: RunConfig, checks: tuple[Check, ...]) -> None:
    """Run the checks in order (a program's own, asyncrl/main.py preflight_checks); the first failure
    raises ConfigError."""
    for one in checks:
        one(cfg)
