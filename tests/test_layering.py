"""DESIGN.md's layering: the pure core never imports torch.distributed or ray; the torch runtime
never imports ray."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PKG = Path(__file__).resolve().parents[1] / "pt_ray"
PURE = ["config.py", "freeze.py", "partition.py", "plan.py", "summary.py", "costmodel.py",
        "costplan.py", "hwprofile.py", "pipesim.py", "shapes.py", "simulate.py", "plan_cli.py",
        "control.py", "logs.py", "report.py", "report_cli.py", "progress.py", "tensorboard.py",
        "sweep.py", "sweep_report.py", "devices.py"]
TORCH_ONLY = ["models", "data", "runtime"]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def offending(names: set[str], banned: tuple[str, ...]) -> set[str]:
    return {n for n in names if any(n == b or n.startswith(b + ".") for b in banned)}


@pytest.mark.parametrize("name", PURE)
def test_pure_core_has_no_torch_or_ray(name):
    path = PKG / name
    assert not offending(imported_modules(path), ("ray", "torch", "pt_ray.service",
                                                  "pt_ray.runtime", "pt_ray.models"))


@pytest.mark.parametrize("folder", TORCH_ONLY)
def test_torch_runtime_has_no_ray(folder):
    files = sorted((PKG / folder).rglob("*.py"))
    assert files, f"{folder} is empty"
    for path in files:
        assert not offending(imported_modules(path), ("ray", "pt_ray.service")), path


def test_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nfrom ray import train\n")
    assert offending(imported_modules(bad), ("ray", "torch")) == {"torch.distributed", "ray"}
