"""Keys that moved: a config written before a table was regrouped is refused with one line that
names the new place of the key (`moved_key`), not with a bare "unknown key". Paths are dotted
from the config's top; `[]` stands for each entry of a list of tables ([[orchestrator.datasets]])."""

from __future__ import annotations

import json
from typing import Any

# [orchestrator]'s keys: the first group became table keys (2026-11); the second grouped
# [orchestrator] by the stations of the orchestrator (issue 53); then the environment's keys.
_ORCHESTRATOR = {
    "server_urls": "servers.urls", "discover_servers": "servers.discover",
    "server_retry_max_s": "servers.retry_max_s", "teacher_url": "teacher.url", "teacher_coef": "teacher.coef",
    "tool_parser": "tools.parser", "overlong_buffer": "overlong.buffer", "overlong_penalty": "overlong.penalty",

    **{key: f"prompts.{key}" for key in ("chat", "chat_template", "chat_template_kwargs", "system_prompt")},
    **{key: f"sampling.{key}" for key in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                                          "record_kept_sets")},
    **{key: f"scheduling.{key}" for key in ("prompts_per_step", "group_size", "min_group_episodes",
                                            "normalize_advantages", "filter_zero_variance", "max_in_flight_groups",
                                            "max_off_policy_steps", "in_flight_updates", "poll_interval_s",
                                            "max_futile_streak")},
    "reward_timeout_s": "timeouts.reward_s", "trainer_timeout_s": "timeouts.weights_s",
    "request_timeout_s": "timeouts.request_s", "servers.request_timeout_s": "timeouts.request_s",
    "server_wait_timeout_s": "timeouts.server_wait_s", "servers.wait_timeout_s": "timeouts.server_wait_s",
    "tool_timeout_s": "timeouts.tool_s", "tools.timeout_s": "timeouts.tool_s",
    "environment_args": "environment.args", "max_turns": "environment.max_turns",
    # issue 61: one way to say each thing
    "timeouts.trainer_s": "timeouts.weights_s", "eval.timeout_s": "timeouts.eval_s",
}

# The trainer's flat keys grouped by concern, its and the orchestrator's checkpoints made one table,
# and every timeout named `<what>_s` in a `timeouts` table (issue 61).
_TRAINER = {
    **{key: f"model.{key}" for key in ("dtype", "attention", "compile", "activation_checkpointing",
                                       "reference_offload", "logits_chunk_tokens")},
    **{key: f"batching.{key}" for key in ("pack", "micro_batch_tokens", "micro_batch_size")},
    "sampling_mask": "mismatch.sampling_mask", "routing_replay": "mismatch.routing_replay",
    "mismatch_kl_warn": "mismatch.kl_warn",
    **{key: f"files.{key}" for key in ("weights_shard_mb", "keep_weights", "keep_rollouts")},
    "batch_timeout_s": "timeouts.batch_s", "lora.run_timeout_s": "timeouts.run_s",
}

MOVED = {
    **{f"orchestrator.{old}": f"orchestrator.{new}" for old, new in _ORCHESTRATOR.items()},
    "orchestrator.keep_checkpoints": "checkpoints.keep", "orchestrator.checkpoints.keep": "checkpoints.keep",
    **{f"trainer.{old}": f"trainer.{new}" for old, new in _TRAINER.items()},
    "trainer.checkpoint_every": "checkpoints.every", "trainer.keep_checkpoints": "checkpoints.keep",
    "heartbeat_timeout_s": "timeouts.heartbeat_s", "weight_sync.timeout_s": "timeouts.broadcast_s",
    "inference.reload_timeout_s": "inference.timeouts.reload_s",
    # A dataset's own sampling and system prompt: sub-tables named as the orchestrator's.
    **{f"{entries}[].{key}": f"{entries}[].{table}.{key}"
       for entries in ("orchestrator.datasets", "orchestrator.eval.datasets", "sft.datasets", "sft.eval_datasets")
       for table, keys in (("sampling", ("temperature", "top_p", "top_k", "min_p", "max_tokens", "stop")),
                           ("prompts", ("system_prompt",)))
       for key in keys},
    # [[orchestrator.eval.environments]] renamed with [orchestrator.environment]'s keys.
    "orchestrator.eval.environments[].environment": "orchestrator.eval.environments[].class",
    "orchestrator.eval.environments[].environment_args": "orchestrator.eval.environments[].args",
}

# Keys that are gone, with what says the same thing now.
GONE = {
    "orchestrator.dataset": "orchestrator.dataset is gone: list the dataset as an [[orchestrator.datasets]] "
                            "entry (function = ..., with its reward = ...)",
    "orchestrator.reward": "orchestrator.reward is gone: set reward = ... in each [[orchestrator.datasets]] entry",
}

# Keys that were a string and are a table now: the key the string became.
STRING_FORMS = {"orchestrator.environment": "class", "orchestrator.overlong": "mode"}

# Values renamed: (key, old value) -> new value.
VALUES = {("transport.kind", "filesystem"): "files", ("weight_sync.kind", "filesystem"): "files"}


def _found(data: Any, path: str) -> list[tuple[str, Any]]:
    """Where `path` is set in `data`: (the path as found, with [i] for entries, its value)."""
    head, dot, rest = path.partition(".")
    entries = head.endswith("[]")
    name = head.removesuffix("[]")
    if not isinstance(data, dict) or name not in data:
        return []
    values = [(f"{name}[{i}]", v) for i, v in enumerate(data[name])] if entries and isinstance(data[name], list) \
        else [] if entries else [(name, data[name])]
    if not dot:
        return values
    return [(f"{at}.{sub}", v) for at, value in values for sub, v in _found(value, rest)]


def _where(new: str) -> str:
    if "[]" in new:
        entries, inner = new.split("[]")
        table, _, key = inner.strip(".").rpartition(".")
        return f"`{key} = ...` " + (f"under `{table}` " if table else "") + f"in each [[{entries}]] entry"
    table, _, key = new.rpartition(".")
    return f"`{key} = ...` under [{table}] (or --{new})" if table else f"`{key} = ...` at the top (or --{new})"


def moved_key(data: Any) -> str | None:
    """One line for the first key of the config written where it lived before, or in a form
    it no longer takes (None when there is none)."""
    if not isinstance(data, dict):
        return None
    for path, key in STRING_FORMS.items():
        for at, value in _found(data, path):
            if isinstance(value, str):
                return (f"{at} is a table now: write `{key} = {json.dumps(value)}` under [{at}] "
                        f"(or --{at}.{key})")
    for path, line in GONE.items():
        if _found(data, path):
            return line
    for old, new in MOVED.items():
        for at, _ in _found(data, old):
            new_at = at[:at.index("]") + 1] + new.split("[]")[1] if "[]" in new else new
            return f"{at} is now {new_at}: write it as {_where(new)}"
    for (path, old), new in VALUES.items():
        if any(value == old for _, value in _found(data, path)):
            return f'{path} = "{old}" is now "{new}": write {path} = "{new}"'
    return None
