"""docs/architecture.md walks one rollout through the code and says where a change goes: every
file it names exists, and every `file.py: Name` or `file.py: Class.method` it points at is
defined there. A rename that forgets the doc fails here, not in a reader's head."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"
SRC = ROOT / "src"
NAMED = re.compile(r"`((?:[\w]+/)*[\w]+\.py)(?::\s*([\w.]+))?`")


def resolve(name: str) -> list[Path]:
    """A path as the doc writes it: from src/ ("rl/batch.py"), or a bare file name that some
    program's folder holds ("prompts.py")."""
    if "/" in name:
        return [p for p in (SRC / name, ROOT / name) if p.is_file()]
    return sorted(SRC.glob(f"**/{name}"))


def defines(path: Path, dotted: str) -> bool:
    """Whether `path` defines `Name`, or `Class.member` (a method, or an assignment in the class body)."""
    tree = ast.parse(path.read_text())
    scope: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


def test_every_file_and_definition_the_architecture_doc_names_exists():
    text = DOC.read_text()
    named = NAMED.findall(text)
    assert len(named) > 30, "the doc names its files as `dir/file.py`: has the format changed?"
    missing, undefined = [], []
    for name, symbol in named:
        paths = resolve(name)
        if not paths:
            missing.append(name)
        elif symbol and not any(defines(p, symbol) for p in paths):
            undefined.append(f"{name}: {symbol}")
    assert not missing, f"docs/architecture.md names files that do not exist: {sorted(set(missing))}"
    assert not undefined, f"docs/architecture.md names definitions that do not exist: {sorted(set(undefined))}"


def test_the_check_sees_a_wrong_name():
    """The check itself: a file or a definition that is not there is found."""
    assert not resolve("orchestrator/no_such_file.py")
    assert resolve("groups.py") == [SRC / "orchestrator" / "rollout" / "groups.py"]
    assert defines(SRC / "orchestrator" / "orchestrator.py", "Orchestrator.produce")
    assert not defines(SRC / "orchestrator" / "orchestrator.py", "Orchestrator.no_such_method")
    assert defines(SRC / "orchestrator" / "rollout" / "registry.py", "KINDS")
    assert stations_in_doc("## The orchestrator, station by station\n\n### prompts/\n\n### nowhere/\n\n## Next") == \
        {"prompts", "nowhere"}


def stations_in_doc(text: str) -> set[str]:
    """The folders the doc's "station by station" section has a heading for."""
    section = text.split("## The orchestrator, station by station", 1)[1].split("\n## ", 1)[0]
    return {line[4:].strip().rstrip("/") for line in section.splitlines() if line.startswith("### ")}


def test_every_station_folder_has_its_section_and_every_section_its_folder():
    """The doc is the map of src/orchestrator/: a folder added without its section, or a section
    left for a folder that went away, fails here."""
    folders = {p.parent.name for p in (SRC / "orchestrator").glob("*/__init__.py")}
    assert folders == stations_in_doc(DOC.read_text())
    for folder in folders:  # and each says what it holds, where a reader opens it
        assert (SRC / "orchestrator" / folder / "__init__.py").read_text().startswith('"""'), folder
