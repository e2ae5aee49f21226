"""A dataset's rows, loaded from where the config says (rl/config/datasets.py): a .jsonl or
.parquet file, a directory saved by `datasets`' save_to_disk, data files read with `datasets`,
or a reasoning-gym task. Each becomes a `Table`: rows by position, every row a dict with a
prompt (text or chat messages). The start-up check (rl/preflight.py) loads them too, so a
missing file or column stops the run before any engine starts.

Bad rows: a row with neither a prompt string nor a messages list is left out and counted, with
its position in the file, so a long file with a few broken rows still trains; a file where no
row (or the whole column) is usable is a ConfigError naming the file and the field.
"""

from __future__ import annotations

import glob
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from rl.config import ConfigError
from rl.config.datasets import DatasetConfig

log = logging.getLogger("orchestrator")

SHOWN_BAD_ROWS = 5


@dataclass
class Table:
    """Rows of one dataset; `numbers[i]` is row i's position in its source (for messages)."""

    where: str
    rows: list[dict] | object  # a list, or anything indexable with len() (an HF dataset)
    numbers: list[int] | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows) if self.numbers is None else len(self.numbers)

    def __getitem__(self, i: int) -> dict:
        return dict(self.rows[i if self.numbers is None else self.numbers[i]])

    def source_row(self, i: int) -> int:
        return i if self.numbers is None else self.numbers[i]


def content_parts(content) -> bool:
    """OpenAI's content parts ({"type": "text" | "image_url", ...}): image chats
    (orchestrator/rendering/images.py)."""
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)


def row_problem(row, spec: DatasetConfig) -> str | None:
    """Why a row cannot make a prompt, or None."""
    if not isinstance(row, dict):
        return f"is a {type(row).__name__}, not an object"
    messages = row.get(spec.messages_key)
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and (
                    isinstance(m.get("content"), str) or m.get("tool_calls") and m.get("content") is None
                    or content_parts(m.get("content")))
                for m in messages):  # an assistant turn that calls tools may have no content (OpenAI's form)
            return f"field {spec.messages_key!r} is not a list of {{role, content}} messages"
        return None
    if not isinstance(row.get(spec.prompt_key), str):
        return f"has neither a {spec.prompt_key!r} string nor a {spec.messages_key!r} list"
    return None


def _validated(where: str, rows: list, spec: DatasetConfig, first_line: int = 0) -> Table:
    good, skipped = [], []
    for i, row in enumerate(rows):
        problem = row_problem(row, spec)
        if problem is None:
            good.append(i)
        else:
            skipped.append((i + first_line, problem))
    if not good:
        if not rows:
            raise ConfigError(f"dataset {spec.label}: {where} has no rows")
        index, problem = skipped[0]
        raise ConfigError(f"dataset {spec.label}: {where} row {index} {problem} (and so does every other row; "
                          f"set prompt_key / messages_key to the fields that hold the prompt)")
    if skipped:
        shown = ", ".join(f"row {i}: {p}" for i, p in skipped[:SHOWN_BAD_ROWS])
        log.warning("dataset %s: %s: %d unusable row(s) skipped (%s%s)", spec.label, where, len(skipped), shown,
                    ", ..." if len(skipped) > SHOWN_BAD_ROWS else "")
    numbers = None if len(good) == len(rows) else good
    return Table(where, rows, numbers, skipped)


def _read_jsonl(path: Path, spec: DatasetConfig) -> Table:
    rows, bad = [], []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                rows.append(None)  # keeps row numbers = line numbers - 1 for the report
                bad.append((line_no, str(e)))
    for line_no, e in bad[:SHOWN_BAD_ROWS]:
        log.warning("dataset %s: %s line %d is not JSON (%s): skipped", spec.label, path, line_no, e)
    return _validated(str(path), rows, spec)


def _read_parquet(path: Path, spec: DatasetConfig) -> Table:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own error types for damaged files
        raise ConfigError(f"dataset {spec.label}: {path} is not a readable parquet file: {e}") from None
    _check_columns(str(path), table.column_names, spec)
    return _validated(str(path), table.to_pylist(), spec)


def _check_columns(where: str, columns, spec: DatasetConfig) -> None:
    if spec.messages_key not in columns and spec.prompt_key not in columns:
        raise ConfigError(f"dataset {spec.label}: {where} has no column {spec.prompt_key!r} or "
                          f"{spec.messages_key!r} (columns: {', '.join(columns)}); set prompt_key or messages_key")


def _read_hf(path: str, spec: DatasetConfig) -> Table:
    """save_to_disk output (memory-mapped: nothing is read until used), else data files."""
    import datasets

    local = Path(path)
    if local.is_dir() and any((local / name).is_file() for name in ("dataset_info.json", "dataset_dict.json")):
        loaded = datasets.load_from_disk(str(local))
        if isinstance(loaded, datasets.DatasetDict):
            if spec.split not in loaded:
                raise ConfigError(f"dataset {spec.label}: {path} has no split {spec.split!r} "
                                  f"(splits: {', '.join(loaded)}); set split")
            loaded = loaded[spec.split]
    else:
        files = sorted(glob.glob(str(local / "*") if local.is_dir() else path))
        kinds = {Path(f).suffix for f in files} & {".jsonl", ".json", ".parquet"}
        if len(kinds) != 1:
            raise ConfigError(f"dataset {spec.label}: path = {path}: expected .jsonl or .parquet data files "
                              f"of one kind, found {sorted({Path(f).suffix for f in files}) or 'none'}")
        builder = "parquet" if kinds == {".parquet"} else "json"
        loaded = datasets.load_dataset(builder, data_files=[f for f in files if Path(f).suffix in kinds],
                                       split="train")
    _check_columns(path, loaded.column_names, spec)
    # Rows are checked as they are drawn (orchestrator/prompts/dataset_mix.py): scanning a large
    # memory-mapped dataset here would read all of it at every start.
    return Table(path, loaded)


def _reasoning_gym(spec: DatasetConfig, seed: int) -> Table:
    import reasoning_gym

    try:
        data = reasoning_gym.create_dataset(spec.reasoning_gym, size=spec.size, seed=seed, **spec.task_config)
    except Exception as e:  # unknown task, or a config field it does not have
        raise ConfigError(f"dataset {spec.label}: reasoning_gym = {spec.reasoning_gym!r} with task_config "
                          f"{spec.task_config}: {type(e).__name__}: {e}") from None
    return Table(f"reasoning_gym {spec.reasoning_gym}", _GymRows(data))


class _GymRows:
    """A reasoning-gym dataset's entries as rows: generated on demand by position (each entry is
    a function of the seed and the position), the question as the prompt."""

    def __init__(self, data):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        entry = self.data[i]
        return {"prompt": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}


def load_table(spec: DatasetConfig, seed: int) -> Table:
    """The rows of a path or reasoning_gym dataset (function datasets are streams: no table)."""
    seed = seed if spec.seed is None else spec.seed
    if spec.reasoning_gym:
        return _reasoning_gym(spec, seed)
    path = Path(spec.path)
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            return _read_jsonl(path, spec)
        if path.suffix == ".parquet":
            return _read_parquet(path, spec)
        raise ConfigError(f"dataset {spec.label}: path = {path}: unknown file kind {path.suffix!r} "
                          "(expected .jsonl, .parquet, or a datasets directory)")
    if path.is_dir() or glob.glob(spec.path):
        return _read_hf(spec.path, spec)
    raise ConfigError(f"dataset {spec.label}: path = {spec.path}: no such file or directory")
