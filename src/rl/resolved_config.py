"""The resolved config as TOML with each key's docstring as a comment: what `--dry-run` prints
and what each program saves as output_dir/config/<program>.toml when it starts. Secrets
(inference.api_token) never appear: run directories get copied and shared. --dry-run shows
"<redacted>"; a saved config leaves the key out, so that composing it again (`@ saved.toml`)
takes the token from ASYNCRL_API_TOKEN instead of sending a placeholder.
"""

from __future__ import annotations

import json
import re

import tomli_w
from pydantic import BaseModel

from rl.config import RunConfig, to_toml_dict
from rl.config.section import key_name
from rl.rundir import RunDir, write_file_atomic


def inline(value) -> str:
    """A value on one line. tomli_w writes a dict (chat_template_kwargs, a dataset's task_config)
    as a [table] of its own, which in a key-by-key listing would swallow the keys after it."""
    if isinstance(value, dict):
        keys = (k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k) for k in value)
        return "{ " + ", ".join(f"{k} = {inline(v)}" for k, v in zip(keys, value.values())) + " }" if value else "{}"
    if isinstance(value, list):
        return "[" + ", ".join(inline(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).strip()[len("v = "):]


def _render(model: BaseModel, data: dict, prefix: str) -> list[str]:
    lines: list[str] = []
    tables: list[tuple[str, BaseModel, dict]] = []
    for name, field in type(model).model_fields.items():
        key = key_name(name, field)
        value, unset = getattr(model, name), key not in data
        if unset and value is not None:
            continue  # left out on purpose: a secret in a saved config
        if isinstance(value, BaseModel):
            tables.append((f"{prefix}{key}", value, data[key]))
            continue
        lines += [f"# {line.strip()}" for line in (field.description or "").splitlines()]
        # Unset: a comment, with its docs (TOML has no null).
        lines.append(f"# {key} = (unset)" if unset else f"{key} = {inline(data[key])}")
    for table, sub, subdata in tables:
        lines += ["", f"[{table}]"] + _render(sub, subdata, f"{table}.")
    return lines


REDACTED = "<redacted>"


def render_toml(cfg: RunConfig, omit_secrets: bool = False) -> str:
    data = to_toml_dict(cfg)
    if "api_token" in data["inference"]:
        if omit_secrets:
            del data["inference"]["api_token"]
        else:
            data["inference"]["api_token"] = REDACTED
    return "\n".join(_render(cfg, data, "")) + "\n"


def save_resolved(cfg: RunConfig, program: str) -> None:
    run = RunDir(cfg.run_dir)  # a multi-run's run saves under runs/<name>/
    run.make()
    write_file_atomic(run.config_file(program), render_toml(cfg, omit_secrets=True).encode())
