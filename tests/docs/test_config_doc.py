"""docs/config.md is the schema's own text: regenerated here, it must equal the committed page
(a key added, renamed or re-documented without `scripts/make_config_doc.py` fails this)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("make_config_doc", ROOT / "scripts" / "make_config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_page_matches_the_schema():
    script = _script()
    assert (ROOT / "docs" / "config.md").read_text() == script.render(), (
        "docs/config.md is stale: run `.venv/bin/python scripts/make_config_doc.py`")


def test_config_page_lists_every_table_and_key():
    from rl.config import RunConfig
    page = (ROOT / "docs" / "config.md").read_text()
    for table in _script().tables():
        assert f"[{table}]" in page, table
    for name in RunConfig.model_fields:  # the top-level keys, as flags
        if name not in _script().tables():
            assert f"--{name} " in page, name
    assert "--trainer.optim.lr FLOAT" in page and "--orchestrator.sampling.max_tokens" in page
