"""Parts a reader can hold: no class over 300 lines and no function body over 60 lines in the
package, the benchmarks and the job entry points, except argparse set-up (a function whose
statements are mostly ``add_argument`` calls)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
MAX_CLASS_LINES = 300
MAX_BODY_LINES = 60


def _sources() -> list[Path]:
    return sorted([*(ROOT / "pt_ray").rglob("*.py"), *(ROOT / "bench").glob("*.py"),
                   *(ROOT / "jobs").glob("*.py")])


def _is_argparse_setup(body: list[ast.stmt]) -> bool:
    """Whether most statements of ``body`` are ``<parser>.add_argument(...)`` calls."""
    calls = [s for s in body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
             and isinstance(s.value.func, ast.Attribute)
             and s.value.func.attr in ("add_argument", "add_mutually_exclusive_group")]
    return len(calls) * 2 >= len(body)


def _body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    """The function's statements, its docstring left out."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def oversized(path: Path) -> list[str]:
    """The classes and function bodies of ``path`` over the limits."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_CLASS_LINES:
                found.append(f"class {node.name}: {lines} lines")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = _body(node)
            if not body or _is_argparse_setup(body):
                continue
            lines = body[-1].end_lineno - body[0].lineno + 1
            if lines > MAX_BODY_LINES:
                found.append(f"def {node.name}: a {lines}-line body")
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{where}: {item}" for item in found]


def test_no_class_or_function_body_outgrows_a_reading():
    assert [item for path in _sources() for item in oversized(path)] == []


def test_the_limits_are_measured_as_the_rule_says(tmp_path):
    long_body = "\n".join(f"    x{i} = {i}" for i in range(61))
    setup = "\n".join(f"    p.add_argument('--a{i}')" for i in range(70))
    source = tmp_path / "sample.py"
    source.write_text(
        f'def long():\n    """Docs are not body."""\n{long_body}\n\n'
        f'def short():\n    """Docs."""\n' + "\n".join(f"    y{i} = {i}" for i in range(60))
        + f"\n\ndef parser(p):\n{setup}\n    return p\n\n"
        "class Big:\n" + "\n".join(f"    z{i} = {i}" for i in range(300)) + "\n")
    assert [item.split(": ", 1)[1] for item in oversized(source)] == [
        "def long: a 61-line body", "class Big: 301 lines"]
