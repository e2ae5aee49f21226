"""docs/architecture.md's claims, checked against the code: every file it names exists and every
`file.py: Name` it points at is defined there; its table of folders counts their files and lines;
its order of the orchestrator's stations holds for every import between them (read from the code's
syntax trees: none runs from a station to one above it, none reaches past a station's
`__init__.py`); and its walk of one rollout, call by call, is what the code calls. A rename, a
move, a new file or an import that runs the wrong way fails here, not in a reader's head."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"
SRC = ROOT / "src"
ORCH = SRC / "orchestrator"
NAMED = re.compile(r"`((?:[\w]+/)*[\w]+\.py)(?::\s*([\w.]+))?`")
TABLE_ROW = re.compile(r"^\| `src/([\w/]+)/` \| (\d+) \| (\d+(?:\.\d)?)k \|$", re.M)
WALK_STEP = re.compile(r"^- `([\w/]+\.py): ([\w.]+)` -> `([\w/]+\.py): ([\w.]+)`$", re.M)
TOP = "top"


def resolve(name: str) -> list[Path]:
    """A path as the doc writes it: from src/ ("rl/batch.py"), or a bare file name that some
    program's folder holds ("prompts.py")."""
    if "/" in name:
        return [p for p in (SRC / name, ROOT / name) if p.is_file()]
    return sorted(SRC.glob(f"**/{name}"))


def definition(path: Path, dotted: str) -> ast.AST | None:
    """Where `path` defines `Name`, or `Class.member` (a method, or an assignment in the class body)."""
    found: ast.AST | None = ast.parse(path.read_text())
    for part in dotted.split("."):
        scope, found = getattr(found, "body", []), None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return None
    return found


def defines(path: Path, dotted: str) -> bool:
    return definition(path, dotted) is not None


def section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


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


def stations_in_doc(text: str) -> set[str]:
    """The folders the doc's "station by station" section has a heading for."""
    part = section(text, "## The orchestrator, station by station")
    return {line[4:].strip().rstrip("/") for line in part.splitlines() if line.startswith("### ")}


def test_every_station_folder_has_its_section_and_every_section_its_folder():
    """The doc is the map of src/orchestrator/: a folder added without its section, or a section
    left for a folder that went away, fails here."""
    folders = {p.parent.name for p in ORCH.glob("*/__init__.py")}
    assert folders == stations_in_doc(DOC.read_text())
    for folder in folders:  # and each says what it holds, where a reader opens it
        assert (ORCH / folder / "__init__.py").read_text().startswith('"""'), folder


# --- the table of folders ------------------------------------------------------------------------


def counted(folder: Path) -> tuple[int, int]:
    """(files, lines) of a folder's own .py files, its __init__.py not counted."""
    files = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
    return len(files), sum(len(p.read_text().splitlines()) for p in files)


def table_errors(text: str) -> list[str]:
    """Where the doc's table of folders is wrong: a count, lines off by more than a tenth (or
    0.1k), a folder of src/ with Python files (a program, its cli, a station) left out."""
    rows = {folder: (int(files), float(k)) for folder, files, k in TABLE_ROW.findall(text)}
    errors = []
    for folder, (files, k) in rows.items():
        n, lines = counted(SRC / folder)
        if n != files:
            errors.append(f"src/{folder}/: the doc says {files} files, the folder holds {n}")
        if abs(lines / 1000 - k) > max(0.1, k / 10):
            errors.append(f"src/{folder}/: the doc says {k}k lines, the folder holds {lines}")
    packages = {str(p.parent.relative_to(SRC)) for p in SRC.glob("*/*.py")}
    packages |= {str(p.parent.relative_to(SRC)) for p in SRC.glob("*/*/__init__.py")}
    errors += [f"src/{p}/ is not in the doc's table" for p in sorted(packages - set(rows))]
    return errors


def test_the_doc_counts_each_folders_files_and_lines():
    assert TABLE_ROW.findall(DOC.read_text()), "the doc's table of folders: has its format changed?"
    assert not table_errors(DOC.read_text())


def test_the_table_check_sees_a_wrong_count_and_a_folder_left_out():
    text = DOC.read_text()
    n, lines = counted(ORCH / "prompts")
    wrong = text.replace(f"| `src/orchestrator/prompts/` | {n} |", f"| `src/orchestrator/prompts/` | {n + 1} |")
    assert wrong != text and any("orchestrator/prompts/" in e for e in table_errors(wrong))
    left_out = re.sub(r"^\| `src/orchestrator/sandbox/` .*\n", "", text, flags=re.M)
    assert "src/orchestrator/sandbox/ is not in the doc's table" in table_errors(left_out)


# --- the stations' order and their imports -------------------------------------------------------


def station_order(text: str) -> list[str]:
    """The doc's line "Stations, from the ground up: a, b, ...": each may import only those before it."""
    line = next(x for x in text.splitlines() if x.startswith("Stations, from the ground up:"))
    return [s.strip() for s in line.split(":", 1)[1].rstrip(".").split(",")]


def shared_top_files(text: str) -> set[str]:
    """The small files at the orchestrator's top that any station may use (the doc lists them
    after "... small files every station may use, which import no station:")."""
    flat = " ".join(text.split())  # the sentence may break anywhere
    listed = flat.split("small files every station may use, which import no station:", 1)[1].split(". ", 1)[0]
    return {Path(name).stem for name, _ in NAMED.findall(listed)}


@dataclass(frozen=True)
class Import:
    file: str  # as src/ names it: orchestrator/rollout/groups.py
    target: str  # the module imported: orchestrator.prompts, orchestrator.prompts.queue, orchestrator.streaks


def place(module: str) -> tuple[str, bool]:
    """(station, or TOP, or "" outside the orchestrator; whether `module` is inside a station
    folder rather than its package itself)."""
    parts = module.split(".")
    if parts[0] != "orchestrator" or len(parts) == 1:
        return "", False
    if (ORCH / parts[1] / "__init__.py").is_file():
        return parts[1], len(parts) > 2
    return TOP, False


def imports_of(path: Path) -> list[Import]:
    """Every import in a file of the orchestrator, those in functions and under TYPE_CHECKING too;
    `from package import name` of a module counts as importing that module."""
    rel = str(path.relative_to(SRC))
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [Import(rel, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            folder = SRC.joinpath(*node.module.split("."))
            for a in node.names:
                is_module = (folder / f"{a.name}.py").is_file() or (folder / a.name / "__init__.py").is_file()
                out.append(Import(rel, f"{node.module}.{a.name}" if is_module else node.module))
    return out


def station_of_file(rel: str) -> str:
    parts = Path(rel).parts
    return parts[1] if len(parts) > 2 else TOP


def import_errors(imports: list[Import], order: list[str], shared: set[str]) -> list[str]:
    """Imports that break the doc's rules: into a station past its __init__.py, from a station to
    itself-or-above, from a station into the top (other than a shared file), from a shared file
    into any station."""
    rank = {s: i for i, s in enumerate(order)}
    errors = []
    for imp in imports:
        station, past = place(imp.target)
        here = station_of_file(imp.file)
        top_file = Path(imp.file).stem
        if not station or station == here:
            continue
        if station == TOP:
            if here != TOP and imp.target.split(".")[1] not in shared:
                errors.append(f"{imp.file} imports {imp.target}: a station imports the top")
            continue
        if past:
            errors.append(f"{imp.file} imports {imp.target}: past orchestrator/{station}/__init__.py")
        if here == TOP and top_file in shared:
            errors.append(f"{imp.file} imports {imp.target}: a shared file imports a station")
        elif here != TOP and rank[station] >= rank[here]:
            errors.append(f"{imp.file} imports {imp.target}: {here} imports {station}, not before it")
    return errors


def orchestrator_imports() -> list[Import]:
    return [imp for path in sorted(ORCH.rglob("*.py")) for imp in imports_of(path)]


def test_the_stations_import_one_way_and_only_through_their_init():
    text = DOC.read_text()
    order = station_order(text)
    assert sorted(order) == sorted(p.parent.name for p in ORCH.glob("*/__init__.py"))
    shared = shared_top_files(text)
    assert len(shared) == 6 and all((ORCH / f"{name}.py").is_file() for name in shared)
    imports = orchestrator_imports()
    between = [i for i in imports if place(i.target)[0] not in ("", station_of_file(i.file))]
    assert len(between) > 50, "the imports between stations were not found: has the reader broken?"
    assert not import_errors(imports, order, shared)


def test_the_import_check_sees_an_import_upstream_past_an_init_or_into_the_top():
    text = DOC.read_text()
    order, shared = station_order(text), shared_top_files(text)
    assert import_errors([Import("orchestrator/prompts/queue.py", "orchestrator.rendering")], order, shared) == [
        "orchestrator/prompts/queue.py imports orchestrator.rendering: prompts imports rendering, not before it"]
    assert import_errors([Import("orchestrator/rollout/groups.py", "orchestrator.prompts.queue")], order, shared) == [
        "orchestrator/rollout/groups.py imports orchestrator.prompts.queue: past orchestrator/prompts/__init__.py"]
    assert import_errors([Import("orchestrator/rewards/registry.py", "orchestrator.flight")], order, shared) == [
        "orchestrator/rewards/registry.py imports orchestrator.flight: a station imports the top"]
    assert import_errors([Import("orchestrator/streaks.py", "orchestrator.prompts")], order, shared) == [
        "orchestrator/streaks.py imports orchestrator.prompts: a shared file imports a station"]
    fine = [Import("orchestrator/rollout/groups.py", "orchestrator.prompts"),
            Import("orchestrator/rollout/groups.py", "orchestrator.rollout.kind"),
            Import("orchestrator/rollout/groups.py", "orchestrator.streaks"),
            Import("orchestrator/flight.py", "orchestrator.rollout")]
    assert import_errors(fine, order, shared) == []
    # And the reader: `from orchestrator.prompts import queue` is the module queue, past the __init__.
    assert place("orchestrator.prompts.queue") == ("prompts", True)
    assert place("orchestrator.prompts") == ("prompts", False) and place("orchestrator.flight") == (TOP, False)


# --- the walk of one rollout ---------------------------------------------------------------------


def calls_in(node: ast.AST) -> set[str]:
    """The names a definition calls: f(...), x.f(...), await x.f(...)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return out


def walk_errors(text: str, order: list[str]) -> list[str]:
    """The doc's walk, call by call: each caller exists and calls the callee (by its name), and no
    call runs from a station to one above it (the top calls any; rl/ is below all)."""
    steps = WALK_STEP.findall(section(text, "## One rollout, prompt to gradient"))
    rank = {s: i for i, s in enumerate(order)} | {TOP: len(order)}
    errors = []
    for caller_file, caller, callee_file, callee in steps:
        caller_def = definition(SRC / caller_file, caller) if (SRC / caller_file).is_file() else None
        if caller_def is None or not defines(SRC / callee_file, callee):
            errors.append(f"{caller_file}: {caller} or {callee_file}: {callee} is not defined")
        elif callee.split(".")[-1] not in calls_in(caller_def):
            errors.append(f"{caller_file}: {caller} does not call {callee}")
        if caller_file.startswith("orchestrator/") and callee_file.startswith("orchestrator/"):
            up, down = station_of_file(caller_file), station_of_file(callee_file)
            if rank[down] > rank[up]:
                errors.append(f"{caller_file}: {caller} calls up into {down}")
    return errors


def test_the_walk_of_one_rollout_is_what_the_code_calls():
    text = DOC.read_text()
    steps = WALK_STEP.findall(section(text, "## One rollout, prompt to gradient"))
    assert len(steps) >= 10, "the doc's walk, call by call: has its format changed?"
    # It passes the stations of a rollout's data: prompts, rendering, rewards, rollout.
    assert {station_of_file(f) for _, _, f, _ in steps} >= {"prompts", "rendering", "rewards", "rollout", TOP}
    assert not walk_errors(text, station_order(text))


def test_the_walk_check_sees_a_call_that_is_not_made_and_one_that_runs_up():
    text = DOC.read_text()
    order = station_order(text)
    line = "- `orchestrator/flight.py: Flight.start` -> `orchestrator/prompts/queue.py: PromptQueue.take`"
    assert line in text
    not_called = text.replace(line, line.replace("PromptQueue.take", "PromptQueue.give_back"))
    assert walk_errors(not_called, order) == ["orchestrator/flight.py: Flight.start does not call PromptQueue.give_back"]
    upward = text.replace(line, "- `orchestrator/prompts/queue.py: PromptQueue.take` -> "
                                "`orchestrator/rollout/groups.py: Rollouts.group`")
    assert "orchestrator/prompts/queue.py: PromptQueue.take calls up into rollout" in walk_errors(upward, order)


def test_the_check_sees_a_wrong_name():
    """The check itself: a file or a definition that is not there is found."""
    assert not resolve("orchestrator/no_such_file.py")
    assert resolve("groups.py") == [SRC / "orchestrator" / "rollout" / "groups.py"]
    assert defines(SRC / "orchestrator" / "orchestrator.py", "Orchestrator.produce")
    assert not defines(SRC / "orchestrator" / "orchestrator.py", "Orchestrator.no_such_method")
    assert defines(SRC / "orchestrator" / "rollout" / "registry.py", "KINDS")
    assert stations_in_doc("## The orchestrator, station by station\n\n### prompts/\n\n### nowhere/\n\n## Next") == \
        {"prompts", "nowhere"}
