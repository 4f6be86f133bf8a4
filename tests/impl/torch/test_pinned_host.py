"""Issue #24, fix 1: the offload copier's host side on CUDA is pinned, and the Triton copy kernel
accepts it.

On a GPU, ``OffloadCopier(..., backend="triton").store(job)`` raised "unpinned host tensor": the
check asked the *CUDA* tensor whether it was pinned. What a CPU run can show: the host-buffer
factory asks torch for pinned memory when the device is CUDA (the allocation is intercepted:
this machine has no pinned allocator), and the copy kernel's device check, given a CUDA tensor
(a ``FakeTensor`` on ``cuda``: shape and device, no memory) beside a host tensor that reports
pinned, launches on CUDA, and refuses an unpinned one naming the host side. That the kernel then
copies the right bytes over PCIe is the ``gpu``-marked test's job
(``test_offload_copy.py::test_cuda_round_trip_uses_pinned_host_and_events``, both back-ends).
"""

from __future__ import annotations

import pytest
import torch

from kvref.impl.torch import offload_copy
from kvref.spec.errors import InvalidFieldError


@pytest.mark.parametrize("device,pinned", [("cuda", True), ("cuda:1", True), ("cpu", False),
                                           (torch.device("cuda", 0), True)])
def test_host_buffer_requests_pinned_memory_exactly_for_cuda(monkeypatch, device, pinned):
    seen = []
    real = torch.zeros

    def zeros(*shape, **kw):
        seen.append(kw.get("pin_memory"))
        kw.pop("pin_memory", None)
        return real(*shape, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    buf = offload_copy.host_buffer((3, 8), torch.bfloat16, device)
    assert seen == [pinned]
    assert buf.shape == (3, 8) and buf.dtype == torch.bfloat16 and buf.device.type == "cpu"
    assert bool((buf == 0).all())


def test_the_copier_builds_its_host_side_with_the_factory(monkeypatch):
    from kvref.impl.torch.kv_cache_tensors import KVCacheTensors
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    calls = []
    real = offload_copy.host_buffer
    monkeypatch.setattr(offload_copy, "host_buffer", lambda *a: calls.append(a) or real(*a))
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=4, dtype="float32")
    cache = KVCacheTensors((KVCacheGroupSpec(("l",), spec),), 5, 3, torch.float32)
    copier = offload_copy.OffloadCopier(cache, 7)
    assert [(shape, dt, torch.device(dev)) for shape, dt, dev in calls] == \
        [((7, cache.block_stride), torch.float32, cache.device)] * 3
    assert len(copier.host) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_a_cuda_host_buffer_without_a_gpu_is_refused_naming_the_device():
    with pytest.raises(InvalidFieldError, match="CUDA device present") as exc:
        offload_copy.host_buffer((2, 4), torch.float32, "cuda")
    assert exc.value.field == "device"


def _fake_cuda(*shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(*shape, device="cuda")


def test_the_copy_kernel_launches_on_cuda_beside_a_pinned_host_tensor(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    from kvref.impl.torch.triton_kernels.block_copy import launch_device

    dev = _fake_cuda(4, 8)
    pinned, pageable = torch.zeros(3, 8), torch.zeros(3, 8)
    real = torch.Tensor.is_pinned
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True if self is pinned else real(self))
    assert dev.is_cuda and not dev.is_pinned()  # what the first version asked, and why it refused
    assert launch_device(dev, pinned) == torch.device("cuda", 0)      # store: device -> host
    assert launch_device(pinned, dev) == torch.device("cuda", 0)      # load: host -> device
    assert launch_device(dev, _fake_cuda(2, 8)) == torch.device("cuda", 0)
    assert launch_device(pinned, pageable) == torch.device("cpu")     # the interpreter's case
    for src, dst in ((dev, pageable), (pageable, dev)):
        with pytest.raises(InvalidFieldError, match="unpinned host tensor"):
            launch_device(src, dst)


@pytest.mark.parametrize("shape", [(0, 10**30), (10**30,), (2**63,)])
def test_a_size_torch_cannot_even_represent_is_refused_naming_the_shape(shape):
    """Found by the API fuzz suite (ci profile): ``(0, 10**30)`` escaped as torch's TypeError (sizes
    are int64 inside torch), not an InvalidFieldError."""
    from kvref.impl.torch import offload_copy
    from kvref.spec.errors import InvalidFieldError

    with pytest.raises(InvalidFieldError, match="shape"):
        offload_copy.host_buffer(shape, torch.float32, "cpu")
