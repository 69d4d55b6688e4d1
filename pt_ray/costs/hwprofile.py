"""Hardware profiles: what the cost model knows about a cluster, the shipped YAML profiles, and
calibration of a profile's efficiency against measurements.

Pure module (stdlib, yaml). Profiles live in ``pt_ray/costs/hardware/*.yaml``; each documents where
its numbers come from (spec sheets, or a fit to measurements).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import yaml

from pt_ray.core.plan import CostTable
from pt_ray.core.shapes import ModelShape, layer_shapes

__all__ = ["HardwareProfile", "calibrate", "fit_efficiency", "list_hardware", "load_hardware",
           "profile_for_gpu"]

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
    """Names of the profiles shipped in ``pt_ray/costs/hardware/``."""
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


# Spec-sheet figures of known GPUs, dense (no sparsity): name pattern (lower case), bf16 peak,
# fp32 peak (no tensor cores), memory bandwidth, NVLink bandwidth per direction per GPU on the
# SXM board (None: PCIe-only part), host PCIe bandwidth per direction (x16 Gen5 / Gen4, what is
# usable in practice). First match wins, so the specific patterns come first.
_GPU_PARTS: tuple[tuple[str, float, float, float, float | None, float], ...] = (
    (r"\bh200\b", 989e12, 67e12, 4.8e12, 450e9, 50e9),
    (r"\bh100\b.*\bpcie\b", 756e12, 51e12, 2.0e12, None, 50e9),
    (r"\bh100\b", 989e12, 67e12, 3.35e12, 450e9, 50e9),
    (r"\ba100\b.*\bpcie\b", 312e12, 19.5e12, 1.935e12, None, 25e9),
    (r"\ba100\b", 312e12, 19.5e12, 2.039e12, 300e9, 25e9),
    (r"\bl40s\b", 362e12, 91.6e12, 864e9, None, 25e9),
    (r"\bl4\b", 121e12, 30.3e12, 300e9, None, 25e9),
)
# An unknown part: about a T4 (65 TFLOP/s fp16, 8.1 fp32, 320 GB/s) rounded down, on PCIe 3.0.
_UNKNOWN_GPU = ("", 50e12, 8e12, 300e9, None, 12e9)


def profile_for_gpu(name: str, memory_bytes: int, count_on_node: int,
                    precision: str = "bf16") -> HardwareProfile:
    """A profile for the GPU a worker detected (``pipeline.hardware=auto`` on GPU workers).

    The planner needs the device's memory, its links and its overheads; the per-layer costs
    profiled on the device replace the compute figures, which are kept honest anyway:

    1. Known parts (H200, H100, A100, L40S, L4; matched in ``name``, case-insensitive) get
       their spec-sheet peaks: ``device_flops`` is the dense bf16 tensor-core peak (989e12 for
       H100/H200 SXM, 312e12 for A100), or the plain fp32 peak when ``precision="fp32"``.
       (An H100 NVL takes the SXM figures.) Any other name gets a conservative default: 50e12
       (16-bit) or 8e12 (fp32) FLOP/s and 300 GB/s, about a T4 rounded down.
    2. Links: an H100/H200/A100 whose name says neither ``PCIe`` nor ``NVL`` is taken to be an
       SXM board on NVSwitch (NVLink 4: 450 GB/s, NVLink 3: 300 GB/s per direction); every
       other part, and unknown ones, talk over PCIe (50, 25 or 12 GB/s per direction for
       Gen5, Gen4, or an unknown part taken as Gen3). The object-store cache reads over the
       same PCIe link.
    3. Between nodes nothing is known here: one 100 Gb/s NIC per node (12.5 GB/s, 20 us) is
       assumed, well below the 8-NIC nodes of the shipped ``a100-80g-nvlink`` and
       ``h100-nvlink`` profiles. Name one of those (or a YAML file) in ``pipeline.hardware``
       to plan with better figures.
    4. Efficiency (0.4), per-micro-batch overhead (0.3 ms) and regrouping cost (2 s) are the
       shipped GPU profiles' assumptions.

    Args:
        name: the device name, as ``torch.cuda.get_device_properties(d).name`` gives it
            (``"NVIDIA H200"``, ``"NVIDIA A100-SXM4-80GB"``).
        memory_bytes: the device's total memory, bytes.
        count_on_node: GPU workers on this node (devices per node for the link model).
        precision: the run's concrete precision (``fp32``, ``bf16`` or ``fp16``); sets the
            peak and the activation bytes per element.
    """
    low = name.lower()
    part = next((p for p in _GPU_PARTS if re.search(p[0], low)), _UNKNOWN_GPU)
    _, bf16, fp32, mem_bw, nvlink, pcie = part
    if re.search(r"\b(pcie|nvl)\b", low):
        nvlink = None
    half = precision in ("bf16", "fp16")
    known = part is not _UNKNOWN_GPU
    return HardwareProfile(
        name=name,
        device_flops=bf16 if half else fp32,
        efficiency=0.4,
        device_memory_bytes=float(memory_bytes),
        memory_bandwidth=mem_bw,
        devices_per_node=max(1, count_on_node),
        intra_node_bandwidth=nvlink or pcie,
        intra_node_latency=3e-6 if nvlink else 1e-5,
        inter_node_bandwidth=12.5e9,
        inter_node_latency=2e-5,
        per_microbatch_overhead_s=3e-4,
        cache_bandwidth=pcie,
        activation_bytes_per_element=2 if half else 4,
        group_setup_s=2.0,
        description=(f"{count_on_node} x {name}, {memory_bytes / 2**30:.0f} GiB, "
                     f"{'NVLink' if nvlink else 'PCIe'}; {precision}; "
                     f"{'spec-sheet peaks' if known else 'unknown part: conservative peaks'}, "
                     f"detected by the worker"),
    )


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
