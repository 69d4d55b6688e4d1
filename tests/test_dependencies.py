"""Every third-party package that pt_ray/ imports is declared in pyproject.toml."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _normalise(name: str) -> str:
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules() -> dict[str, str]:
    """Top-level third-party modules imported anywhere in pt_ray/ (lazily too), each with one
    file that imports it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "pt_ray").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("pt_ray", "__future__"):
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _declared() -> set[str]:
    """Distributions pyproject.toml declares: the dependencies and every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return {_normalise(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group()) for r in reqs}


def test_every_imported_package_is_declared():
    """An import that works only because another dependency happens to pull its package in
    (tqdm came with transformers, Pillow with torchvision) breaks when that one drops it:
    each distribution behind a third-party import in pt_ray/ must be declared itself."""
    declared = _declared()
    providers = importlib.metadata.packages_distributions()
    missing = []
    for module, where in sorted(_imported_modules().items()):
        dists = providers.get(module)
        if not dists:
            missing.append(f"{module} (imported in {where}) is not installed")
        elif not any(_normalise(d) in declared for d in dists):
            missing.append(f"{module} (imported in {where}) comes from {', '.join(dists)}, "
                           "which pyproject.toml does not declare")
    assert not missing, "declare these in pyproject.toml:\n  " + "\n  ".join(missing)
