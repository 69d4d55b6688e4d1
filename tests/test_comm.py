"""Which device a process group's tensors must be on, from its backend (no processes)."""

import pytest
import torch

from pt_ray.runtime.comm import Comm, backend_devices

pytestmark = pytest.mark.unit


def test_backend_strings_name_the_devices_they_serve():
    assert backend_devices("nccl") == {"cuda": "nccl"}
    assert backend_devices("gloo") == {"cpu": "gloo"}
    assert backend_devices("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}


def test_cpu_ranks_communicate_on_the_cpu():
    assert Comm(torch.device("cpu"), backend="gloo").device == torch.device("cpu")
    # gloo on a GPU rank: tensors go through the host.
    assert Comm(torch.device("cuda", 0), backend="gloo").device == torch.device("cpu")


def test_gpu_ranks_use_cuda_where_the_backend_serves_it():
    cuda = torch.device("cuda", 1)
    assert Comm(cuda, backend="nccl").device == cuda
    assert Comm(cuda, backend="cpu:gloo,cuda:nccl").device == cuda


def test_an_nccl_group_on_a_cpu_rank_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="serves only cuda tensors.*'cpu:gloo,cuda:nccl'"):
        Comm(torch.device("cpu"), backend="nccl")
