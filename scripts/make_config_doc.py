"""Writes docs/config.md: every config key with its type, default and documentation, from the
schema itself (the same text as `rl <program> --help`), so the page cannot drift from the code;
tests/docs/test_config_doc.py regenerates it and compares.

    .venv/bin/python scripts/make_config_doc.py          # rewrite docs/config.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from asyncrl.config_help import render_help, table_models
from rl.config import RunConfig

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def tables() -> tuple[str, ...]:
    """The top-level tables, in the schema's order ([inference], [orchestrator], ...)."""
    return tuple(name for name, field in RunConfig.model_fields.items() if table_models(field))


def render() -> str:
    head = ("# Config keys\n\n"
            "Generated from the schema (src/rl/config/) by "
            "`scripts/make_config_doc.py`; `rl <program> --help` prints the same for one program's "
            "tables, `--dry-run` the resolved config. One TOML file configures a run: the top-level keys, "
            "then one table per program. Files compose left to right (`@ base.toml @ mine.toml`), flags "
            "override (`--trainer.optim.lr 1e-4`); an unknown key, or one written where it lived before, "
            "is refused with one line naming it (exit 2).\n\n")
    return head + "```text" + render_help(tables()) + "```\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    sys.exit(0)
