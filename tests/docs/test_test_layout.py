"""tests/ as docs/architecture.md ("A new test") lays it out: test modules in the folder of the
program they test (or integration/, faults/, docs/), and what several of them use in shared
modules beside conftest.py. A test module importing another's helpers ties the two together
(collecting one imports the other, with its module-level fixtures and constants) and hides
where a helper lives; every such import was moved into a shared module on 2026-12-02."""

from __future__ import annotations

import ast

from conftest import ROOT

TESTS = ROOT / "tests"
FOLDERS = {"rl", "asyncrl", "orchestrator", "trainer", "inference", "tasks", "integration", "faults", "docs"}


def imported_modules(path) -> list[tuple[int, str]]:
    """Every module `path` imports (at the top or inside a function), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return out


def test_no_module_of_the_suite_imports_a_test_module():
    offenders = [f"{path.relative_to(ROOT)}:{line} imports {module}"
                 for path in sorted(TESTS.rglob("*.py")) for line, module in imported_modules(path)
                 if module.split(".")[0].startswith("test_")]
    assert not offenders, "move what they use into a shared module beside conftest.py:\n" + "\n".join(offenders)


def test_test_modules_live_in_a_program_folder():
    stray = [str(p.relative_to(ROOT)) for p in TESTS.rglob("test_*.py")
             if p.parent == TESTS or p.relative_to(TESTS).parts[0] not in FOLDERS]
    assert not stray, stray


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\n\ndef f():\n    from test_other import helper\n    return helper\n")
    assert (5, "test_other") in imported_modules(module)
