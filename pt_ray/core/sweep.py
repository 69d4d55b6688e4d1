"""Alpha sweeps, the pure part: which trials to run and how many fit the cluster at once.

No torch, no Ray: :mod:`pt_ray.tune` runs the trials on Ray Tune, and
:mod:`pt_ray.reporting.sweep_report` turns what they report into the table, ``sweep.json`` and
``sweep.png``. Every trial is a whole pt-ray run on the same data and seed; each alpha run is
compared with the no-freeze baseline run (``freeze.policy=none``) that shares its grid values.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pt_ray.core.config import ConfigError

__all__ = [
    "BASELINE",
    "ClusterTooSmallError",
    "Variant",
    "build_variants",
    "check_alphas",
    "fitting_cpus_per_worker",
    "parse_alphas",
    "parse_grid",
    "trial_concurrency",
    "trial_need",
]

BASELINE = "baseline"
"""Name (and label) of the no-freeze trial; with a grid, ``baseline_<grid values>``."""

_ALPHA_HINT = "give numbers in (0, 1], e.g. --alpha 0.2,0.25,0.33"


class ClusterTooSmallError(ConfigError):
    """Not even one trial fits the cluster's free resources."""


# -- the trials ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One trial of a sweep.

    Attributes:
        name: trial name, also its folder under the sweep folder (``alpha-0.25``, ``baseline``,
            ``alpha-0.25_pipeline.schedule-gpipe``).
        label: the same for people (``alpha=0.25``, ``baseline``, ``alpha=0.25 pipeline...``).
        alpha: ``freeze.alpha`` of the trial; None for a baseline.
        grid: ``(key, value)`` of the grid fields this trial takes.
        overrides: ``key=value`` strings that turn the sweep's base config into this trial's.
        baseline: name of the baseline trial it is compared with (None: a baseline, or no
            baseline in the sweep).
    """

    name: str
    label: str
    alpha: float | None
    grid: tuple[tuple[str, str], ...] = ()
    overrides: tuple[str, ...] = ()
    baseline: str | None = None

    @property
    def is_baseline(self) -> bool:
        return self.alpha is None


def _alpha_text(alpha: float) -> str:
    return f"{alpha:g}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def check_alphas(alphas: Iterable[Any]) -> list[float]:
    """The alphas as floats, each in (0, 1], none twice.

    Raises:
        ConfigError: an empty list, a value that is not a number, outside (0, 1], or repeated.
    """
    out: list[float] = []
    for a in alphas:
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            raise ConfigError(f"alpha {a!r} is not a number; {_ALPHA_HINT}")
        a = float(a)
        if not 0 < a <= 1:  # NaN fails too
            raise ConfigError(
                f"alpha={a:g} is outside (0, 1]: alpha is the largest fraction of the active "
                f"blocks one freeze may take; {_ALPHA_HINT}")
        if any(_alpha_text(a) == _alpha_text(b) for b in out):
            raise ConfigError(f"alpha={a:g} is given twice; give each value once")
        out.append(a)
    if not out:
        raise ConfigError(f"no alpha values; {_ALPHA_HINT}")
    return out


def parse_alphas(text: str) -> list[float]:
    """``"0.2,0.25,0.33"`` -> ``[0.2, 0.25, 0.33]`` (see :func:`check_alphas`).

    Raises:
        ConfigError: a value that is not a number, outside (0, 1], repeated, or none at all.
    """
    values: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            values.append(float(part))
        except ValueError:
            raise ConfigError(f"alpha {part!r} is not a number; {_ALPHA_HINT}") from None
    return check_alphas(values)


def parse_grid(items: Iterable[str]) -> dict[str, list[str]]:
    """``["data.batch_size=32,64", ...]`` -> ``{"data.batch_size": ["32", "64"], ...}``.

    Values stay text: they are parsed as YAML where they become ``--set`` overrides.

    Raises:
        ConfigError: not ``key=v1,v2``, an empty key or value, a key given twice, a value
            repeated, or ``freeze.alpha`` (the sweep's own axis: use ``--alpha``).
    """
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--grid {item!r} is not key=v1,v2; write e.g. "
                              f"--grid pipeline.schedule=gpipe,1f1b")
        values = [v.strip() for v in text.split(",")]
        if not any(values) or not all(values):
            raise ConfigError(f"--grid {item!r} has an empty value; write e.g. "
                              f"--grid {key}=a,b")
        grid[_check_grid_key(key, grid)] = _check_grid_values(key, values)
    return grid


def _check_grid_key(key: str, grid: Mapping[str, Any]) -> str:
    if key == "freeze.alpha":
        raise ConfigError("freeze.alpha cannot be a --grid field: it is the sweep's own axis; "
                          "give its values with --alpha")
    if key in grid:
        raise ConfigError(f"--grid {key} is given twice; list all its values in one "
                          f"--grid {key}=v1,v2")
    return key


def _check_grid_values(key: str, values: Sequence[str]) -> list[str]:
    if len(set(values)) != len(values):
        raise ConfigError(f"--grid {key} repeats a value ({', '.join(values)}); give each once")
    return list(values)


def _value_text(value: Any) -> str:
    """A grid value as the text of a ``key=value`` override (parsed back as YAML)."""
    return value if isinstance(value, str) else json.dumps(value)


def build_variants(
    alphas: Sequence[float],
    grid: Mapping[str, Sequence[Any]] | None = None,
    baseline: bool = True,
) -> list[Variant]:
    """Every trial of a sweep: each alpha at each point of the grid, then the baselines.

    A baseline (``freeze.policy=none``) runs once per combination of the grid's fields outside
    ``freeze.*`` (freeze fields do not change a run that never freezes); each alpha trial is
    compared with the baseline that shares those values.

    Raises:
        ConfigError: see :func:`check_alphas`; ``freeze.alpha`` in the grid or a field without
            values.
    """
    alphas = check_alphas(alphas)
    items: list[tuple[str, list[str]]] = []
    seen: dict[str, Any] = {}
    for key, values in (grid or {}).items():
        texts = [_value_text(v) for v in values]
        if not texts:
            raise ConfigError(f"grid field {key} has no values; give at least one")
        items.append((_check_grid_key(key, seen), _check_grid_values(key, texts)))
        seen[key] = texts
    non_freeze = [k for k, _ in items if not k.startswith("freeze.")]

    def base_name(point: tuple[tuple[str, str], ...]) -> str:
        rest = [(k, v) for k, v in point if k in non_freeze]
        return "_".join([BASELINE, *(_slug(f"{k}-{v}") for k, v in rest)])

    points = [tuple(zip([k for k, _ in items], combo))
              for combo in itertools.product(*(v for _, v in items))]
    out: list[Variant] = []
    for alpha in alphas:
        for point in points:
            a = _alpha_text(alpha)
            out.append(Variant(
                name="_".join([f"alpha-{a}", *(_slug(f"{k}-{v}") for k, v in point)]),
                label=" ".join([f"alpha={a}", *(f"{k}={v}" for k, v in point)]),
                alpha=alpha,
                grid=point,
                overrides=(*(f"{k}={v}" for k, v in point), f"freeze.alpha={alpha!r}"),
                baseline=base_name(point) if baseline else None,
            ))
    if baseline:
        done: set[str] = set()
        for point in points:
            rest = tuple((k, v) for k, v in point if k in non_freeze)
            name = base_name(point)
            if name in done:
                continue
            done.add(name)
            out.append(Variant(
                name=name,
                label=" ".join([BASELINE, *(f"{k}={v}" for k, v in rest)]),
                alpha=None,
                grid=rest,
                overrides=(*(f"{k}={v}" for k, v in rest), "freeze.policy=none"),
            ))
    return out


# -- resources -----------------------------------------------------------------------------------


def trial_need(*, trial_cpus: float, num_workers: int, cpus_per_worker: float,
               gpus_per_worker: float = 0.0, engine: str = "ray") -> dict[str, float]:
    """Resources one trial holds at its peak: the Tune trial actor plus its Ray Train workers.

    The reference engine trains inside the trial actor, which then takes one whole CPU.
    pt-ray's controller and cache actors and Ray Train's controller take no CPU.
    """
    if engine == "reference":
        return {"CPU": max(1.0, trial_cpus)}
    need = {"CPU": trial_cpus + num_workers * cpus_per_worker}
    if gpus_per_worker:
        need["GPU"] = num_workers * gpus_per_worker
    return need


def _fmt_need(need: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in need.items())


def trial_concurrency(
    available: Mapping[str, float],
    need: Mapping[str, float],
    num_trials: int,
    requested: int | None = None,
) -> tuple[int, str]:
    """How many trials may run at once without any waiting on resources another holds.

    ``floor(available / need)`` for each resource one trial needs, the smallest of those, at
    most ``num_trials`` and at most ``requested``. A Tune trial holds its own CPU while its Ray
    Train run waits for workers, so starting more trials than fit lets each hold a part and
    none get all: Ray Train then waits (and retries) forever.

    Returns:
        The concurrency and a sentence saying why.

    Raises:
        ClusterTooSmallError: not even one trial fits (the message names the shortfall and the
            fix).
        ConfigError: ``requested`` below 1.
    """
    if requested is not None and requested < 1:
        raise ConfigError(f"max_concurrent={requested}: at least 1 trial must run; give 1 or "
                          f"more (or leave it unset to fit the cluster)")
    fits: dict[str, int] = {}
    for res, amount in need.items():
        if amount <= 0:
            continue
        free = float(available.get(res, 0.0))
        fits[res] = math.floor(free / amount + 1e-9)
    limit = min(fits.values()) if fits else num_trials
    if limit < 1:
        short = [f"{need[r]:g} {r} (the cluster has {float(available.get(r, 0.0)):g} free)"
                 for r, n in fits.items() if n < 1]
        raise ClusterTooSmallError(
            f"one trial needs {_fmt_need(need)} but the cluster cannot give "
            f"{' and '.join(short)}; lower pipeline.num_workers or pipeline.cpus_per_worker "
            f"(e.g. --set pipeline.cpus_per_worker=0.5), or add nodes")
    per = "; ".join(f"{float(available.get(r, 0.0)):g} {r} free / {need[r]:g} per trial = {n}"
                    for r, n in fits.items())
    k = min(limit, num_trials)
    why = per
    if num_trials < limit:
        why += f"; only {num_trials} trials"
    if requested is not None and requested < k:
        k = requested
        why += f"; capped at max_concurrent={requested}"
    elif requested is not None and requested > k:
        why += f"; max_concurrent={requested} lowered to what fits"
    return k, why


def fitting_cpus_per_worker(free_cpus: float, trial_cpus: float, num_workers: int) -> float:
    """The largest ``pipeline.cpus_per_worker`` (to 0.01) with which one trial fits in
    ``free_cpus``; 0 when none does."""
    return max(0.0, math.floor((free_cpus - trial_cpus) / num_workers * 100 + 1e-9) / 100)
