"""Rewrite the table of folders in docs/architecture.md from the tree (each folder's own .py files,
__init__.py not counted, and their lines), in the doc's order, new folders at the end;
tests/docs/test_architecture_doc.py checks the same counts.

    .venv/bin/python scripts/make_architecture_table.py
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC, DOC = ROOT / "src", ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\| `src/([\w/]+)/` \| \d+ \| [\d.]+k \|$", re.M)


def counted(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
    return len(files), sum(len(p.read_text().splitlines()) for p in files)


def main() -> None:
    text = DOC.read_text()
    rows = ROW.findall(text)
    packages = {str(p.parent.relative_to(SRC)) for p in SRC.glob("*/*.py")}
    packages |= {str(p.parent.relative_to(SRC)) for p in SRC.glob("*/*/__init__.py")}
    order = [f for f in rows if f in packages] + sorted(packages - set(rows))
    table = "\n".join(f"| `src/{f}/` | {n} | {lines / 1000:.1f}k |" for f in order for n, lines in [counted(SRC / f)])
    first, last = ROW.search(text), list(ROW.finditer(text))[-1]
    DOC.write_text(text[:first.start()] + table + text[last.end():])


if __name__ == "__main__":
    main()
