"""The hardware profile a GPU worker builds from its device (``pipeline.hardware=auto``)."""

import pytest

from pt_ray.core.config import build_config
from pt_ray.control.state import build_control_state
from pt_ray.costs.hwprofile import profile_for_gpu
from pt_ray.core.plan import CostTable, LayerCost
from pt_ray.service.settings import run_settings

pytestmark = pytest.mark.unit


def test_h200_profile_from_its_name_and_memory():
    memory = 141 * 10**9

    hw = profile_for_gpu("NVIDIA H200", memory, count_on_node=8)

    assert hw.name == "NVIDIA H200" and hw.device_memory_bytes == memory
    assert hw.device_flops == 989e12  # dense bf16 tensor-core peak
    assert hw.memory_bandwidth == 4.8e12
    assert (hw.devices_per_node, hw.intra_node_bandwidth) == (8, 450e9)  # NVLink 4
    assert hw.activation_bytes_per_element == 2
    assert profile_for_gpu("NVIDIA H200", memory, 8, precision="fp32").device_flops == 67e12


@pytest.mark.parametrize(
    ("name", "flops", "link"),
    [
        ("NVIDIA A100-SXM4-80GB", 312e12, 300e9),
        ("NVIDIA A100 80GB PCIe", 312e12, 25e9),
        ("NVIDIA H100 80GB HBM3", 989e12, 450e9),
        ("NVIDIA H100 PCIe", 756e12, 50e9),
        ("NVIDIA L40S", 362e12, 25e9),
        ("NVIDIA L4", 121e12, 25e9),
    ],
)
def test_known_parts_get_their_peak_and_link(name, flops, link):
    hw = profile_for_gpu(name, 24 * 2**30, count_on_node=4)
    assert (hw.device_flops, hw.intra_node_bandwidth) == (flops, link)


def test_unknown_gpu_gets_the_conservative_default_and_its_own_memory():
    hw = profile_for_gpu("Some Future GPU", 12 * 2**30, count_on_node=2, precision="fp32")

    assert hw.name == "Some Future GPU" and hw.device_memory_bytes == 12 * 2**30
    assert (hw.device_flops, hw.memory_bandwidth) == (8e12, 300e9)
    assert (hw.devices_per_node, hw.intra_node_bandwidth) == (2, 12e9)  # PCIe 3.0
    assert hw.activation_bytes_per_element == 4
    assert "unknown part" in hw.description
    assert profile_for_gpu("Some Future GPU", 2**30, 1).device_flops == 50e12


def test_controller_plans_with_a_detected_profile_unless_the_user_named_one():
    hw = profile_for_gpu("NVIDIA H200", 141 * 10**9, count_on_node=2)

    state = build_control_state(run_settings(build_config({})).control, num_layers=4, num_workers=2,
                                steps_per_epoch=4, hardware=hw)
    local = build_config({"pipeline": {"hardware": "local-cpu"}})
    named = build_control_state(run_settings(local).control, 4, 2, 4, hardware=hw)

    costs = _flat_costs(4)
    assert state.make_planner(costs).hw is hw
    assert named.make_planner(costs).hw.name == "local-cpu"


def _flat_costs(num_layers: int) -> CostTable:
    layer = LayerCost(forward_s=1e-3, backward_s=2e-3, activation_bytes=1024,
                      param_bytes=4096)
    return CostTable(embed=layer, blocks=(layer,) * num_layers, head=layer, samples=8)
