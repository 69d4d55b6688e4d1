"""The layering: each folder of ``pt_ray`` imports only the folders below it (a table, checked
module by module, so no two folders import each other), the pure folders never import torch or
Ray, the torch runtime never imports Ray, the entry points load torch and Ray only inside
the functions that need them, and only the entry and the service floor take the whole
``RunConfig``."""

import ast
from pathlib import Path

import pytest


PKG = Path(__file__).resolve().parents[1] / "pt_ray"
# A package whose modules sit on different floors: each of its modules is a unit of its own
# (``cache.policy``), with its own row in the table and its own purity below.
SPLIT = {"cache"}
_CACHE_PURE = {"core", "cache.policy", "cache.size"}
_RUNTIME_FLOOR = {"core", "control", "costs", "reporting", "models", "data"}
_CACHE_TORCH = {"cache.store", "cache.rows", "cache.prefix"}
_CACHE = _CACHE_PURE - {"core"} | _CACHE_TORCH | {"cache.owners"}
# What each folder (or root module, or module of a SPLIT package) may import from pt_ray,
# besides itself. Every pair below is one-way: test_no_two_folders_import_each_other checks the
# table has no cycle.
ALLOWED = {
    "core": set(),
    # The cache's decision and sizing read the config only, so every planner can ask them.
    "cache.__init__": set(),
    "cache.policy": {"core"},
    "cache.size": {"core"},
    "costs": {"core", "cache.policy"},
    "reporting": {"core"},
    "control": {"core", "costs", "reporting", "cache.policy", "cache.size"},
    "models": {"core"},
    "data": {"core"},
    # The cache's torch modules sit on the runtime's floor, below the runtime that runs them.
    "cache.store": _RUNTIME_FLOOR,
    "cache.rows": _RUNTIME_FLOOR,
    "cache.prefix": _RUNTIME_FLOOR | {"cache.policy", "cache.size", "cache.store", "cache.rows"},
    "runtime": _RUNTIME_FLOOR | _CACHE_PURE | _CACHE_TORCH,
    # The cache's Ray owners sit on the service's floor.
    "cache.owners": _RUNTIME_FLOOR | {"runtime"} | _CACHE - {"cache.owners"},
    "service": _RUNTIME_FLOOR | {"runtime"} | _CACHE,
    "api": _RUNTIME_FLOOR | {"runtime", "service"} | _CACHE,
    "tune": _RUNTIME_FLOOR | {"runtime", "service", "api"} | _CACHE,
    "cli": _RUNTIME_FLOOR | {"runtime", "service", "api", "tune"} | _CACHE,
    "__init__": {"core", "reporting", "api"},
}
# Folders, and modules of SPLIT packages, that never import torch or Ray, ...
PURE = ["core", "costs", "reporting", "control", "cache/policy.py", "cache/size.py"]
# ... that import torch but never Ray, ...
TORCH_ONLY = ["models", "data", "runtime", "cache/store.py", "cache/rows.py", "cache/prefix.py"]
# ... and the modules of SPLIT packages that may import Ray (the service's floor).
RAY = ["cache/owners.py"]
# Above the layers: the command line and api.py import torch and Ray only inside functions, so a
# bad argument or config fails before either loads. tune.py (pt_ray.sweep) is Ray Tune's driver
# side, loaded by them only when a sweep runs.
ENTRY = ["cli"]
ROOT_MODULES = {"__init__.py", "api.py", "tune.py"}


def modules_in(folder: str) -> list[Path]:
    """The modules of a folder, or the one module ``folder`` names (``cache/policy.py``)."""
    if folder.endswith(".py"):
        assert (PKG / folder).is_file(), f"{folder} is missing"
        return [PKG / folder]
    files = sorted((PKG / folder).rglob("*.py"))
    assert files, f"{folder} is empty"
    return files


def imported_modules(path: Path, top_level_only: bool = False) -> set[str]:
    """Modules ``path`` imports; ``top_level_only``: those imported at import time (module-level
    statements, not those inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def offending(names: set[str], banned: tuple[str, ...]) -> set[str]:
    return {n for n in names if any(n == b or n.startswith(b + ".") for b in banned)}


def unit_of(path: Path) -> str:
    """The unit a module of pt_ray belongs to: its folder, a root module's stem, or for a
    module of a SPLIT package, ``package.module``."""
    rel = path.relative_to(PKG)
    if len(rel.parts) == 1:
        return rel.stem
    if rel.parts[0] in SPLIT:
        return f"{rel.parts[0]}.{Path(rel.parts[1]).stem}"
    return rel.parts[0]


def unit_of_name(name: str) -> str | None:
    """The unit of pt_ray a dotted module name imports (None: not pt_ray's)."""
    parts = name.split(".")
    if parts[0] != "pt_ray" or len(parts) < 2:
        return None
    if parts[1] in SPLIT:
        return f"{parts[1]}.{parts[2] if len(parts) > 2 else '__init__'}"
    return parts[1]


def folder_imports(paths) -> dict[str, set[str]]:
    """unit -> the other units of pt_ray its modules import (at any depth)."""
    edges: dict[str, set[str]] = {}
    for path in paths:
        unit = unit_of(path)
        for name in imported_modules(path):
            other = unit_of_name(name)
            if other is not None and other != unit:
                edges.setdefault(unit, set()).add(other)
    return edges


def cycle_in(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph ``edges`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


@pytest.mark.unit
def test_package_root_holds_only_the_entry_modules_and_the_layer_folders():
    modules = {p.name for p in PKG.glob("*.py")}
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert modules == ROOT_MODULES
    units = {unit_of(p) for f in folders & SPLIT for p in (PKG / f).glob("*.py")}
    assert folders - SPLIT | units | {m.removesuffix(".py") for m in modules} == set(ALLOWED)


@pytest.mark.unit
def test_each_module_of_a_split_package_has_its_floor_and_its_purity():
    for folder in SPLIT:
        assert not [p for p in (PKG / folder).iterdir() if p.is_dir()
                    and p.name != "__pycache__"], f"{folder} keeps its modules flat"
        checked = {unit_of(PKG / m) for m in PURE + TORCH_ONLY + RAY if m.startswith(folder)}
        assert checked | {f"{folder}.__init__"} == {unit_of(p) for p in modules_in(folder)}


@pytest.mark.unit
def test_each_folder_imports_only_what_the_table_allows():
    edges = folder_imports(sorted(PKG.rglob("*.py")))
    extra = {unit: sorted(used - ALLOWED[unit]) for unit, used in edges.items()
             if used - ALLOWED[unit]}
    assert extra == {}


@pytest.mark.unit
def test_no_two_folders_import_each_other():
    assert cycle_in({unit: set(allowed) for unit, allowed in ALLOWED.items()}) is None
    assert cycle_in(folder_imports(sorted(PKG.rglob("*.py")))) is None


def edges_in(folder: Path) -> dict[str, set[str]]:
    """The folder imports of a tree of ``pt_ray`` stand-ins written under ``folder``."""
    global PKG
    real, PKG = PKG, folder
    try:
        return folder_imports(sorted(folder.rglob("*.py")))
    finally:
        PKG = real


@pytest.mark.unit
def test_the_cycle_check_finds_a_cycle_between_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.py").write_text("from pt_ray.b.y import f\n")
    (tmp_path / "b" / "y.py").write_text("def f():\n    from pt_ray.a import x\n")
    edges = edges_in(tmp_path)
    assert edges == {"a": {"b"}, "b": {"a"}}
    assert cycle_in(edges) in (["a", "b", "a"], ["b", "a", "b"])
    assert cycle_in({"a": {"b"}, "b": {"c"}}) is None


@pytest.mark.unit
@pytest.mark.parametrize("folder", PURE)
def test_pure_core_has_no_torch_or_ray(folder):
    for path in modules_in(folder):
        assert not offending(imported_modules(path), ("ray", "torch", "pt_ray.service",
                                                      "pt_ray.runtime", "pt_ray.models",
                                                      "pt_ray.data", "pt_ray.cli",
                                                      *(f"pt_ray.{m}" for m in _CACHE_TORCH),
                                                      "pt_ray.cache.owners")), path


@pytest.mark.unit
@pytest.mark.parametrize("folder", TORCH_ONLY)
def test_torch_runtime_has_no_ray(folder):
    for path in modules_in(folder):
        assert not offending(imported_modules(path), ("ray", "pt_ray.service", "pt_ray.cli",
                                                      "pt_ray.cache.owners")), path


@pytest.mark.unit
@pytest.mark.parametrize("package", sorted(SPLIT))
def test_a_split_package_root_imports_nothing(package):
    # Importing pt_ray.cache.policy loads pt_ray/cache/__init__.py first: it must not pull in
    # the package's torch or Ray modules.
    assert imported_modules(PKG / package / "__init__.py") == set()


@pytest.mark.unit
@pytest.mark.parametrize("folder", ENTRY)
def test_command_line_loads_torch_and_ray_only_when_a_command_needs_them(folder):
    for path in modules_in(folder):
        at_import = imported_modules(path, top_level_only=True)
        assert not offending(at_import, ("ray", "torch", "pt_ray.service", "pt_ray.runtime",
                                         "pt_ray.models", "pt_ray.data", "pt_ray.tune")), path


@pytest.mark.unit
def test_checker_places_a_split_package_module_on_its_own_floor(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "policy.py").write_text("from pt_ray.cache.store import X\n")
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "engine.py").write_text("import pt_ray.cache.owners\n")
    edges = edges_in(tmp_path)
    assert edges == {"cache.policy": {"cache.store"}, "runtime": {"cache.owners"}}
    assert "cache.store" not in ALLOWED["cache.policy"]
    assert "cache.owners" not in ALLOWED["runtime"]


@pytest.mark.unit
def test_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nfrom ray import train\n")
    assert offending(imported_modules(bad), ("ray", "torch")) == {"torch.distributed", "ray"}


@pytest.mark.unit
def test_checker_tells_import_time_from_call_time(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import argparse\n\ndef run():\n    import ray\n")
    assert imported_modules(lazy, top_level_only=True) == {"argparse"}
    assert imported_modules(lazy) == {"argparse", "ray"}


# torch.distributed calls that move tensors or objects: only pt_ray/runtime/comm.py makes them,
# on the groups' device (the pipelining schedules make their own, with the stage's tensors).
_COMMUNICATION = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
    "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "barrier", "monitored_barrier", "all_gather_object", "send_object_list", "recv_object_list",
    "broadcast_object_list", "gather_object", "scatter_object_list", "all_to_all",
    "all_to_all_single",
}


def communication_calls(path: Path) -> list[str]:
    """``dist.<call>`` / ``torch.distributed.<call>`` calls of communication functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed") and node.func.attr in _COMMUNICATION:
                found.append(f"{path.name}:{node.lineno} {owner}.{node.func.attr}")
    return found


@pytest.mark.unit
def test_only_the_comm_module_communicates():
    files = [p for folder in ("runtime", "service", "cache")
             for p in sorted((PKG / folder).rglob("*.py"))
             if p.name != "comm.py"]
    assert [c for p in files for c in communication_calls(p)] == []
    # The checker sees a real call.
    assert communication_calls(PKG / "runtime" / "comm.py")


@pytest.mark.proc
@pytest.mark.parametrize(("module", "banned", "loaded"), [
    # The controller actor starts beside the training workers at every run's start, on the
    # same CPUs: torch there would add a second or two of CPU to the start-up.
    ("pt_ray.service.controller", ("torch", "timm", "transformers"), ()),
    # A timm run's workers (and the driver's preflight) never need transformers, which takes
    # seconds of CPU to import: only model.family=hf loads it. Nor torch's pipelining: only a
    # plan with K > 1 loads it. torch._dynamo, which every run loads (timm's torchvision
    # imports it, and so does transformers), comes with the module, while Ray Train still sets
    # the worker up, not inside the training function, where it would compete for the CPU with
    # Ray Train's helper actors and lengthen start-up.
    ("pt_ray.service.worker", ("transformers", "torch.distributed.pipelining"),
     ("torch._dynamo",)),
])
def test_what_a_run_starts_imports_only_what_it_needs(module, banned, loaded):
    import subprocess
    import sys

    names = (*banned, *loaded)
    code = f"import sys, {module}; print(sorted(set({names!r}) & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == repr(sorted(loaded))


# The whole user-facing config stops at the entry (api.py, tune.py, the command line) and the
# service floor: below it each part takes the config sections it reads, or a small frozen
# settings dataclass that pt_ray.service.settings.run_settings builds once per run.
RUN_CONFIG_FLOORS = ("api.py", "tune.py", "cli/", "service/")
MAX_RUN_CONFIG_PARAMETERS = 10


def run_config_parameters(root: Path = PKG) -> list[str]:
    """``path:line function(parameter)`` for every parameter annotated with ``RunConfig`` (alone,
    in a union, or inside a ``Callable``) under ``root``; ``ray.train``'s ``TrainRunConfig`` is
    another class."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is None or arg.annotation is None:
                    continue
                names = {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(arg.annotation) if isinstance(n, ast.Attribute)}
                if "RunConfig" in names or "RunConfig" in _string_names(arg.annotation):
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} "
                                 f"{node.name}({arg.arg})")
    return found


def _string_names(annotation: ast.expr) -> set[str]:
    """Names inside string annotations (``"RunConfig | None"``)."""
    names = set()
    for n in ast.walk(annotation):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                inner = ast.parse(n.value, mode="eval")
            except SyntaxError:
                continue
            names |= {m.id for m in ast.walk(inner) if isinstance(m, ast.Name)}
    return names


@pytest.mark.unit
def test_only_the_entry_and_the_service_take_the_whole_config():
    found = run_config_parameters()
    below = [f for f in found if not f.startswith(RUN_CONFIG_FLOORS)]
    assert below == [], "below the service floor, take the sections or a settings dataclass"
    assert len(found) <= MAX_RUN_CONFIG_PARAMETERS, "\n".join(found)


@pytest.mark.unit
def test_the_config_parameter_count_sees_every_form(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "m.py").write_text(
        "def a(cfg: RunConfig): ...\n"
        "def b(x: int, *, c: 'RunConfig | None' = None): ...\n"
        "def c(f: Callable[[config.RunConfig], None]): ...\n"
        "def d(t: TrainRunConfig, cfg: FreezeConfig, untyped): ...\n")
    assert run_config_parameters(tmp_path) == [
        "runtime/m.py:1 a(cfg)", "runtime/m.py:2 b(c)", "runtime/m.py:3 c(f)"]
