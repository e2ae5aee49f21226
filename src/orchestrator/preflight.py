"""The orchestrator's start-up checks (rl/preflight.py runs them, with the shared ones, for `rl
orchestrator`, `rl eval` and `rl run`): its code imports and takes the arguments it will be given,
its datasets and environment render prompts that fit, its trackers import, and the run
directory's state suits a fresh start or --resume."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import jinja2

from orchestrator import sandbox as sandboxing  # its Sandbox read when asked: see executes_code
from orchestrator.callables import load_callable
from orchestrator.rendering import (ChatTemplate, dataset_fits, environment_fits, error_line, images_at_start_up,
                                    measure, sample, tokenizer_of)
from orchestrator.rollout import kind_of
from orchestrator.sft import sft_setup
from rl.config import ConfigError, RunConfig
from rl.config.datasets import BUILTIN_REWARDS, Dataset
from rl.inference_api import kept_set_bound
from rl.preflight import cores, metrics_endpoint, model_config, output_dir, seq_len_fits, tokenizer_files
from rl.rundir import RunDir


def orchestrator_state_refusal(run: RunDir) -> str | None:
    """Why an orchestrator must not start on `run`, or None: batches without its checkpoint."""
    if run.rollout_steps() and not run.checkpoint_steps("orchestrator"):
        return f"output_dir {run.root} holds batches but no orchestrator checkpoint: remove it or choose another output_dir"
    return None


def orchestrator_run_state(cfg: RunConfig) -> None:
    if refusal := orchestrator_state_refusal(RunDir(cfg.run_dir)):
        raise ConfigError(refusal)


def model_for_scoring(cfg: RunConfig) -> None:
    """Orchestrator: the tokenizer (it decodes completions, counts prompt tokens)."""
    seq_len_fits(cfg, model_config(cfg))
    tokenizer_files(cfg)


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
    if o.environment.class_:
        built_environment(cfg, o.environment.class_, o.environment.args, "orchestrator.environment.class")
    for spec in o.eval.environments:
        # Checked as the evaluation runs it: its class, args and max_turns in [orchestrator.environment]'s place.
        built_environment(cfg.model_copy(update={"orchestrator": o.for_eval_environment(spec)}), spec.class_, spec.args,
                          f"orchestrator.eval.environments {spec.name}: class", "its args")
    for ds, listed, _ in _datasets(cfg):  # beside an environment: its eval datasets
        if ds.spec.function:
            key = _function_key(ds, listed)
            dataset = load_callable(ds.spec.function, key)
            _takes(dataset, key, ds.spec.function, (cfg.seed,), "function(seed)")
        if ds.reward and "://" not in ds.reward:
            key = f"dataset {ds.name}: reward"
            reward = load_callable(BUILTIN_REWARDS.get(ds.reward, ds.reward), key)
            _takes(reward, key, ds.reward, ("", "", {}), "function(prompt, completion, row)")


def kept_sets_fit(cfg: RunConfig) -> None:
    """orchestrator.sampling.record_kept_sets: each truncated sampling's kept sets fit in the logprobs the
    server reports per token (inference.max_logprobs), or the server would refuse every request."""
    o = cfg.orchestrator
    if not o.sampling.record_kept_sets:
        return
    config = model_config(cfg)
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0)
    samplings = ([("orchestrator", o.sampling)] if o.environment.class_ else
                 [(f"dataset {ds.name}" if o.datasets else "orchestrator", ds.sampling) for ds in o.resolved_datasets()])
    for where, s in samplings:
        truncated = s.top_k > 0 or s.top_p < 1 or s.min_p > 0
        if truncated and vocab and (need := kept_set_bound(s.top_k, vocab)) > cfg.inference.max_logprobs:
            raise ConfigError(f"orchestrator.sampling.record_kept_sets: {where} samples with top_k {s.top_k} over a vocabulary "
                              f"of {vocab}, so a kept set may hold {need} tokens, more than inference.max_logprobs "
                              f"{cfg.inference.max_logprobs}: set top_k below it, or raise inference.max_logprobs")


def executes_code(obj) -> bool:
    """The rule for "this run executes model-written code": the module that defines `obj` (a
    reward, a dataset function, an environment class or one of its tools) imports
    orchestrator.sandbox, holding its Sandbox class or a Sandbox (tasks/coding.py,
    tasks/python_tool.py)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    box = sandboxing.Sandbox
    return module is not None and any(v is box or isinstance(v, box) for v in vars(module).values())


def _code_runners(cfg: RunConfig) -> list[str]:
    """The config keys whose code executes model-written code (executes_code)."""
    o = cfg.orchestrator
    found = []
    for key, spec in [("orchestrator.environment.class", o.environment.class_),
                      *((f"orchestrator.eval.environments {e.name}: class", e.class_) for e in o.eval.environments)]:
        if spec:
            env = load_callable(spec, key)
            tools = getattr(env, "tools", None)  # a class's list; a property where they are built (verifiers)
            if executes_code(env) or any(executes_code(t) for t in (tools if isinstance(tools, (list, tuple)) else ())):
                found.append(f"{key} = {spec!r}")
    for ds, listed, _ in _datasets(cfg):
        reward_key = f"dataset {ds.name}: reward"
        for key, spec in ((reward_key, ds.reward), (_function_key(ds, listed), ds.spec.function)):
            if spec and "://" not in spec and executes_code(load_callable(BUILTIN_REWARDS.get(spec, spec), key)):
                found.append(f"{key} = {spec!r}")
    return found


def sandbox_isolation(cfg: RunConfig) -> None:
    """A run that executes model-written code starts only where it is isolated
    (orchestrator/sandbox/sandbox.py), or where the config says orchestrator.sandbox.isolation = "none";
    either way one line says which isolation the run gets (--dry-run shows it)."""
    runners = _code_runners(cfg)
    if not runners:
        return
    why = sandboxing.Sandbox.isolation()
    if why is None:
        print(f"orchestrator: {runners[0]} runs model-written code, isolated: {sandboxing.Sandbox.describe()}",
              file=sys.stderr)
    elif cfg.orchestrator.sandbox.isolation == "none":
        print(f"orchestrator: UNSAFE: {runners[0]} runs model-written code unisolated, limits only "
              f"(orchestrator.sandbox.isolation = \"none\"): {why}", file=sys.stderr)
    else:
        raise ConfigError(f"{runners[0]} runs model-written code: {why}, or set "
                          "orchestrator.sandbox.isolation = \"none\" to run it unisolated")


def trackers(cfg: RunConfig) -> None:
    import importlib.util

    for key, module in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if getattr(cfg.tracking, key) and importlib.util.find_spec(module) is None:
            raise ConfigError(f"tracking.{key} = true: the {module} package is not installed "
                              f"(pip install {module}, or set tracking.{key} = false)")


def orchestrator_data(cfg: RunConfig) -> None:
    """Each training and eval dataset: its file and columns exist (reasoning-gym tasks too), the
    chat template (if any) renders the first row the run draws, and the first rows drawn leave
    room for max_tokens (orchestrator/rendering/fit.py). One table load and one pass per dataset."""
    _datasets_data(cfg, _datasets(cfg))


def built_environment(cfg: RunConfig, spec: str, args: dict, key: str,
                      args_key: str = "orchestrator.environment.args") -> None:
    """An environment loads, is built with its arguments, passes its kind's checks, and its first
    rows leave room for max_tokens."""
    env = load_callable(spec, key)
    try:
        inspect.signature(env).bind(**args)
    except TypeError as e:
        raise ConfigError(f"{key} = {spec!r}: it is built with {args_key} {args}, which its signature "
                          f"{inspect.signature(env)} does not accept ({e})") from None
    except ValueError:
        pass  # no signature to inspect: let the call tell
    try:  # built here too: an environment that cannot be built (a taskset id not found) is bad input
        instance = env(**args)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{key} = {spec!r}: building it failed: {error_line(e)}") from None
    kind = kind_of(instance)
    # Measured here: building it again could be costly (a verifiers taskset).
    environment_fits(cfg, instance, kind.start_up(cfg, instance), kind.fit_keys)


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
        images_at_start_up(cfg.model, ds.name, rows, ds.spec.messages_key)
        row, where = rows[0]
        if template is None and isinstance(row, dict) and row.get(ds.spec.messages_key) is not None:
            raise ConfigError(f"dataset {ds.name}: {where} holds chat messages but {cfg.model} has no chat "
                              "template (set orchestrator.prompts.chat_template)")
        try:
            longest = measure(cfg, ds, rows, template, tokenizer)
        except jinja2.TemplateError as e:
            raise ConfigError(f"dataset {ds.name}: the chat template ({template.origin}) fails on {where}: {e}") from None
        if tokenizer is not None:
            dataset_fits(cfg, what, ds, longest, template)


def _datasets(cfg: RunConfig, training: bool = True) -> list[tuple[Dataset, bool, str]]:
    """Training (unless `training` is false, or an environment makes the rows) and eval datasets,
    each with whether the config lists it (False: the built-in reversal task a config listing no
    datasets trains on) and how messages about its prompts name it."""
    o = cfg.orchestrator
    train = o.resolved_datasets() if training and not o.environment.class_ else []
    return [(ds, bool(o.datasets), f"dataset {ds.name}") for ds in train] + \
        [(ds, True, f"eval dataset {ds.name}") for ds in o.resolved_datasets(evaluation=True)]


def _function_key(ds: Dataset, listed: bool) -> str:
    return f"dataset {ds.name}: function"


def _sample(cfg: RunConfig, ds: Dataset, listed: bool) -> list[tuple[object, str]]:
    """The first rows the run draws from a dataset (orchestrator/rendering/fit.py sample), at least one."""
    key = _function_key(ds, listed)
    try:
        rows = sample(cfg, ds, f"dataset {ds.name}")  # its rows: "dataset <name> row <i>"
    except ConfigError:
        raise
    except Exception as e:
        if not ds.spec.function:
            raise
        raise ConfigError(f"{key} = {ds.spec.function!r}: its first rows raised {error_line(e)}") from None
    if not rows:
        raise ConfigError(f"{key} = {ds.spec.function!r} yields no rows")
    return rows


CHECKS = (cores("orchestrator"), metrics_endpoint("orchestrator"), output_dir, model_for_scoring, orchestrator_code,
          sandbox_isolation, orchestrator_data, kept_sets_fit, trackers, orchestrator_run_state)
# `rl eval`: its own server's checks (inference/preflight.py SERVING), then these.
EVAL_CHECKS = (orchestrator_code, sandbox_isolation, eval_data)
# `rl sft`: its data step's, beside the trainer's own (asyncrl/main.py).
SFT_CHECKS = (sft_setup,)
