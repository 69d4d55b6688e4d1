"""Hardware profiles: what the cost model knows about a cluster, the shipped YAML profiles, and
calibration of a profile's efficiency against measurements.

Pure module (stdlib, yaml). Profiles live in ``pt_ray/hardware/*.yaml``; each documents where its
numbers come from (spec sheets, or a fit to measurements).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import yaml

from pt_ray.plan import CostTable
from pt_ray.shapes import ModelShape, layer_shapes

__all__ = ["HardwareProfile", "calibrate", "fit_efficiency", "list_hardware", "load_hardware"]

HARDWARE_DIR = Path(__file__).resolve().parent / "hardware"
_MAY_BE_ZERO = ("per_microbatch_overhead_s", "group_setup_s", "intra_node_latency",
                "inter_node_latency")


@dataclass(frozen=True)
class HardwareProfile:
    """What the cost model needs to know about a cluster.

    Attributes:
        name: profile name.
        device_flops: peak FLOP/s of one device at the training precision.
        efficiency: fraction of ``device_flops`` dense layers reach (calibrated).
        device_memory_bytes: memory of one device.
        memory_bandwidth: device memory bandwidth, B/s (optimizer step, memory-bound layers).
        devices_per_node: devices per node.
        intra_node_bandwidth: point-to-point bandwidth between devices of a node, B/s.
        intra_node_latency: its latency, s.
        inter_node_bandwidth: bandwidth out of one node, B/s, shared by the traffic leaving it.
        inter_node_latency: its latency, s.
        per_microbatch_overhead_s: fixed cost of one forward or backward of one micro-batch on
            one stage (launches, scheduling, synchronisation).
        cache_bandwidth: rate one device reads or writes cached activations, B/s.
        activation_bytes_per_element: 4 (fp32) or 2 (16-bit autocast).
        group_setup_s: fixed cost of a transition (regrouping, rebuilding stages).
        description: where the numbers come from.
    """

    name: str
    device_flops: float
    efficiency: float
    device_memory_bytes: float
    memory_bandwidth: float
    devices_per_node: int
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    per_microbatch_overhead_s: float = 0.0
    cache_bandwidth: float = 10e9
    activation_bytes_per_element: int = 4
    group_setup_s: float = 1.0
    description: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "description"):
                continue
            nonneg = f.name in _MAY_BE_ZERO
            if not (isinstance(value, (int, float)) and math.isfinite(value)
                    and (value >= 0 if nonneg else value > 0)):
                raise ValueError(f"hardware {self.name!r}: {f.name}={value!r} must be a number "
                                 f"{'>= 0' if nonneg else '> 0'}")
        if self.efficiency > 1:
            raise ValueError(f"hardware {self.name!r}: efficiency={self.efficiency} must lie "
                             f"in (0, 1]")

    @property
    def sustained_flops(self) -> float:
        """``device_flops * efficiency``."""
        return self.device_flops * self.efficiency

    def node_of(self, rank: int) -> int:
        """The node a rank runs on (ranks fill nodes in order)."""
        return rank // self.devices_per_node

    def link(self, a: int, b: int) -> tuple[float, float]:
        """``(bandwidth, latency)`` between ranks ``a`` and ``b``."""
        if self.node_of(a) == self.node_of(b):
            return self.intra_node_bandwidth, self.intra_node_latency
        return self.inter_node_bandwidth, self.inter_node_latency

    def to_dict(self) -> dict:
        return asdict(self)


def list_hardware() -> list[str]:
    """Names of the profiles shipped in ``pt_ray/hardware/``."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (``paper-rtx5000``) or a YAML file of the same fields.

    Raises:
        ValueError: an unknown name (listing the shipped ones), unknown or missing fields.
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = HARDWARE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown hardware profile {str(name_or_path)!r}; shipped profiles: "
                         f"{', '.join(list_hardware())} (or pass a YAML file path)")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of HardwareProfile fields")
    data.setdefault("name", path.stem)
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown fields {unknown}; allowed: {sorted(known)}")
    for f in fields(HardwareProfile):
        value = data.get(f.name)
        if f.name not in ("name", "description") and isinstance(value, str):
            try:  # YAML 1.1 reads 15.75e9 (no sign in the exponent) as a string
                data[f.name] = int(value) if f.type == "int" else float(value)
            except ValueError:
                raise ValueError(f"{path}: {f.name}={value!r} is not a number") from None
    try:
        return HardwareProfile(**data)
    except TypeError as err:
        raise ValueError(f"{path}: {err}") from None


def calibrate(measured: CostTable, shape: ModelShape, base: HardwareProfile,
              name: str | None = None) -> HardwareProfile:
    """Fit ``efficiency`` so the analytic block times match a profiled table.

    ``efficiency = analytic block FLOPs (forward + backward) / (device_flops * measured block
    time)``, summed over the blocks (the embedding and head are small and memory-bound).
    """
    _, block, _ = layer_shapes(shape)
    seconds = sum(b.forward_s + b.backward_s for b in measured.blocks)
    if seconds <= 0:
        raise ValueError("the measured table has no block time to calibrate against")
    flops = 3 * block.flops * measured.samples * measured.num_layers
    eff = min(1.0, flops / (base.device_flops * seconds))
    return replace(base, efficiency=eff, name=name or base.name)


def fit_efficiency(hw: HardwareProfile, predict: Callable[[HardwareProfile], float],
                   target: float, tol: float = 1e-6) -> HardwareProfile:
    """The profile whose ``efficiency`` makes ``predict`` (a time, falling as efficiency rises)
    equal ``target``, by bisection on ``(0, 1]``."""
    lo, hi = 1e-4, 1.0
    if predict(replace(hw, efficiency=hi)) > target:
        raise ValueError(f"even efficiency 1 predicts more than {target} s")
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if predict(replace(hw, efficiency=mid)) > target:
            lo = mid
        else:
            hi = mid
    return replace(hw, efficiency=hi)
