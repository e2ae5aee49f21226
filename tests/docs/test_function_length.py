"""No function in src/ over ~80 lines (GUIDE.md, "How we build"): a function a reader cannot hold
on one screen hides its steps; split it by meaning (one function per step it takes), not by line
count. A definition is counted from its `def` line to its last line, docstring and comments
included, nested functions inside their parent: what a reader has to hold.

A function that must stay longer is named in LONG with the reason; an entry that no longer
names a long function fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast

from conftest import ROOT

MAX_LINES = 80

# "path:Qualified.name" -> why it stays longer than MAX_LINES. Empty: every function fits.
LONG: dict[str, str] = {}


def long_functions(path: str, source: str, max_lines: int = MAX_LINES) -> dict[str, int]:
    """{"path:Qualified.name": lines} for each function or method of `source` longer than
    `max_lines`."""
    out = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                if lines > max_lines:
                    out[f"{path}:{prefix}{child.name}"] = lines
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def src_functions(max_lines: int = MAX_LINES) -> dict[str, int]:
    found = {}
    for file in sorted((ROOT / "src").rglob("*.py")):
        path = file.relative_to(ROOT).as_posix()
        found |= long_functions(path, file.read_text(), max_lines)
    return found


def test_no_function_in_src_is_over_80_lines():
    long = {name: n for name, n in src_functions().items() if name not in LONG}
    assert not long, (f"functions over {MAX_LINES} lines (split by meaning, or name one in LONG with the "
                      "reason):\n" + "\n".join(f"{name}: {n} lines" for name, n in sorted(long.items())))


def test_every_allowed_long_function_is_still_long():
    stale = sorted(set(LONG) - set(src_functions()))
    assert not stale, f"LONG names functions that are gone or now fit in {MAX_LINES} lines: drop them: {stale}"


def test_the_check_reports_a_long_function_method_and_nested_one():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    source = (f"def long():\n{body}"
              f"def short():\n    return 1\n"
              f"class C:\n    async def method(self):\n{''.join('    ' + line for line in body.splitlines(True))}"
              f"def outer():\n    def inner():\n{''.join('    ' + line for line in body.splitlines(True))}")
    found = long_functions("src/x.py", source)
    assert found == {"src/x.py:long": MAX_LINES + 1, "src/x.py:C.method": MAX_LINES + 1,
                     "src/x.py:outer": MAX_LINES + 2, "src/x.py:outer.inner": MAX_LINES + 1}, found
    assert long_functions("src/x.py", "def f():\n" + "    x = 1\n" * (MAX_LINES - 1)) == {}


def test_the_walk_reads_the_source_tree():
    """A walk that read nothing would pass: with a lower bound it finds src/'s longer functions,
    in each program."""
    found = src_functions(max_lines=30)
    for program in ("inference", "orchestrator", "trainer", "rl"):
        assert any(name.startswith(f"src/{program}/") for name in found), (program, sorted(found))
