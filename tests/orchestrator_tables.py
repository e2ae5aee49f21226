"""Tests build `[orchestrator]` from flat keywords (config(group_size=2, max_tokens=4)); `grouped`
puts each key into its table (scheduling.group_size, sampling.max_tokens) by the map the config
itself uses to refuse a flat key with its new place (rl/orchestrator_config.py MOVED), so a test's
keywords and a user's config cannot drift apart. A string where a table is now (environment="m:Env",
overlong="mask") becomes that table's key (environment.class, overlong.mode: STRING_FORMS)."""

from rl.orchestrator_config import MOVED, STRING_FORMS


def grouped(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        path = f"{key}.{STRING_FORMS[key]}" if key in STRING_FORMS and isinstance(value, str) else MOVED.get(key, key)
        table, _, name = path.rpartition(".")
        if not table:
            out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        else:
            out.setdefault(table, {})[name] = value
    return out
