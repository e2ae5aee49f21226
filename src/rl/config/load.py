"""Reading a run's config: `@ a.toml @ b.toml --table.key value` composed left to right into
`RunConfig`, every problem one line (ConfigError) naming the key or file at fault."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rl.config.delivery import KINDS
from rl.config.moved import moved_key
from rl.config.run import RunConfig


class ConfigError(Exception):
    """A config problem, with a one-line message naming the key or file at fault."""


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse_value(raw: str) -> Any:
    """A CLI value is read as a TOML value when it parses as one (numbers, booleans, lists),
    otherwise as a plain string, so `--model some/path` needs no quotes."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a TOML file") from None
    except PermissionError:
        raise ConfigError(f"config file {path}: permission denied") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}): save it as UTF-8 TOML") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    return data


def parse_args(argv: list[str]) -> tuple[dict, bool]:
    """Split `@ a.toml @ b.toml --x.y v --dry-run` into one merged dict and the dry-run flag."""
    merged: dict = {}
    dry_run = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@" or arg.startswith("@"):
            name = arg[1:] or (argv[i + 1] if i + 1 < len(argv) else "")
            if not name:
                raise ConfigError("'@' must be followed by a config file")
            merged = _merge(merged, _read_toml(Path(name)))
            i += 1 if arg[1:] else 2
        elif arg == "--dry-run":
            dry_run = True
            i += 1
        elif arg == "--resume" and (i + 1 >= len(argv) or argv[i + 1].startswith(("--", "@"))):
            merged["resume"] = True
            i += 1
        elif arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"--{key}: missing value")
                value = argv[i + 1]
                i += 1
            i += 1
            node = merged
            *parents, leaf = key.replace("-", "_").split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    # (a key that is a table now, written the old way: its new place)
                    raise ConfigError(moved_key(merged) or f"--{key}: {part} is not a table")
            node[leaf] = _parse_value(value)
        else:
            raise ConfigError(f"unexpected argument {arg!r} (expected '@ file.toml' or --key value)")
    return merged, dry_run


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = list(first["loc"])
    kind = loc.pop(1) if len(loc) > 1 and loc[0] in KINDS and loc[1] in KINDS[loc[0]] else None
    key = ".".join(str(p) for p in loc) or "config"
    if first["type"] == "extra_forbidden":
        return _other_kinds_key(loc, kind) or f"unknown config key: {key}"
    if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        return f"config key {key}.kind: expected one of {list(KINDS[key])} (got {first['ctx'].get('tag')!r})"
    if first["type"] == "missing":
        return f"missing config key: {key}"
    msg = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:
        return f"config error: {msg}"
    return f"config key {key}: {msg} (got {first.get('input')!r})"


def _other_kinds_key(loc: list, kind: str | None) -> str | None:
    """A key of one kind (weight_sync.bucket_mb) set under another: the kind it needs."""
    if kind is None or len(loc) != 2:
        return None
    table, key = loc
    owners = [name for name, model in KINDS[table].items() if key in model.model_fields]
    if not owners:
        return None
    return (f"{table}.{key} applies to {table}.kind = {json.dumps(owners[0])} only (this config's kind: "
            f"{json.dumps(kind)}): set {table}.kind = {json.dumps(owners[0])}, or remove {table}.{key}")


def load_config(argv: list[str]) -> tuple[RunConfig, bool]:
    data, dry_run = parse_args(argv)
    hint = moved_key(data)
    if hint:
        raise ConfigError(hint)
    try:
        return RunConfig.model_validate(data), dry_run
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def to_toml_dict(cfg: RunConfig) -> dict:
    """The resolved config as TOML-writable data (no None values, paths as strings)."""

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if x is not None}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return clean(cfg.model_dump(mode="json"))
