"""The largest rooms of the house: a report of the biggest classes, function bodies and files of
the package, the benchmarks and the job entry points (and of the Markdown a reader reads), for a
reviewer to read; the test fails only on a clear outlier, twice a guide line.

The guide lines (a class of 300 lines, a function body of 60, a module of 500) are where a part
usually stops fitting in one reading. They are smell detectors, not targets: a class of 299
lines is as big as one of 301, so the report ranks the largest by size, whatever side of a guide
line they stand on, and nothing is exempt (argparse set-up counts as any other body). Run
``python tests/test_sizes.py [N]`` for the N largest of each kind (default 15); the test prints
the five largest into the suite's output.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
GUIDE = {"class": 300, "def": 60, "module": 500}
"""Lines at which a part of each kind usually stops fitting in one reading."""
OUTLIER = 2.0
"""How many guides past which a part fails the test: a clear outlier, not a line to sit on."""


@dataclass(frozen=True)
class Room:
    """One measured part: a class (all its lines), a function (its body, the docstring left
    out), a module or a Markdown page (all its lines)."""

    kind: str  # "class", "def", "module" or "page"
    where: str  # the file, relative to the repository, and the part's name
    lines: int

    @property
    def guide(self) -> int | None:
        return GUIDE.get(self.kind)

    def describe(self) -> str:
        ratio = f"  {self.lines / self.guide:.2f}x its guide" if self.guide else ""
        return f"{self.lines:5d}  {self.kind:6s} {self.where}{ratio}"


def _sources() -> list[Path]:
    return sorted([*(ROOT / "pt_ray").rglob("*.py"), *(ROOT / "bench").glob("*.py"),
                   *(ROOT / "jobs").glob("*.py")])


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    """The function's statements, its docstring left out."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name)


def measure(path: Path) -> list[Room]:
    """The module ``path`` and each of its classes and function bodies (nested ones too)."""
    text = path.read_text()
    where = _name(path)
    rooms = [Room("module", where, len(text.splitlines()))]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.ClassDef):
            rooms.append(Room("class", f"{where}: {node.name}",
                              node.end_lineno - node.lineno + 1))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = _body(node)
            if body:
                rooms.append(Room("def", f"{where}: {node.name}",
                                  body[-1].end_lineno - body[0].lineno + 1))
    return rooms


def all_rooms() -> list[Room]:
    rooms = [room for path in _sources() for room in measure(path)]
    rooms += [Room("page", _name(p), len(p.read_text().splitlines())) for p in _pages()]
    return rooms


def report(rooms: list[Room], top: int) -> str:
    """The ``top`` largest rooms of each kind, largest first."""
    out = []
    for kind in ("class", "def", "module", "page"):
        mine = sorted((r for r in rooms if r.kind == kind), key=lambda r: -r.lines)[:top]
        guide = f" (guide {GUIDE[kind]} lines)" if kind in GUIDE else ""
        out += [f"largest {kind}{guide}:", *(r.describe() for r in mine)]
    return "\n".join(out)


def outliers(rooms: list[Room]) -> list[Room]:
    """The rooms more than :data:`OUTLIER` times their guide."""
    return [r for r in rooms if r.guide is not None and r.lines > OUTLIER * r.guide]


def test_the_largest_rooms(capsys):
    """Print the five largest of each kind; fail on a clear outlier, naming it and what to do."""
    rooms = all_rooms()
    with capsys.disabled():
        print("\n" + report(rooms, 5))
    big = outliers(rooms)
    assert not big, (
        "clear outliers, more than twice their guide: split each into parts a reader can "
        "hold (STYLE.md, Layout):\n  " + "\n  ".join(r.describe() for r in big))


def test_the_rooms_are_measured_as_the_docstring_says(tmp_path):
    long_body = "\n".join(f"    x{i} = {i}" for i in range(121))
    setup = "\n".join(f"    p.add_argument('--a{i}')" for i in range(130))
    source = tmp_path / "sample.py"
    source.write_text(
        f'def long():\n    """Docs are not body."""\n{long_body}\n\n'
        f'def short():\n    """Docs."""\n' + "\n".join(f"    y{i} = {i}" for i in range(120))
        + f"\n\ndef parser(p):\n{setup}\n    return p\n\n"
        "class Big:\n" + "\n".join(f"    z{i} = {i}" for i in range(600)) + "\n")
    rooms = measure(source)
    assert [(r.kind, r.where.split(": ")[-1], r.lines) for r in rooms] == [
        ("module", "sample.py", 981), ("def", "long", 121), ("def", "short", 120),
        ("def", "parser", 131), ("class", "Big", 601)]
    # argparse set-up counts as any body; the module (981 lines) is not yet twice 500.
    assert [(r.kind, r.lines) for r in outliers(rooms)] == [
        ("def", 121), ("def", 131), ("class", 601)]
    assert report(rooms, 1).splitlines()[1].split() == ["601", "class", "sample.py:", "Big",
                                                        "2.00x", "its", "guide"]


if __name__ == "__main__":
    print(report(all_rooms(), int(sys.argv[1]) if len(sys.argv) > 1 else 15))
