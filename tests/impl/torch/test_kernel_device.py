"""Issue #24, fix 3: the kernel tests run compiled on CUDA tensors wherever a GPU is present; the
interpreter is forced only where none is (or when the caller asks)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import interpreter_wanted


def test_the_interpreter_is_forced_only_without_a_gpu_and_without_a_caller_setting():
    asked = []

    def probe(answer):
        return lambda: asked.append(answer) or answer
    assert interpreter_wanted({}, probe(False)) is True
    assert interpreter_wanted({}, probe(True)) is False
    assert asked == [False, True]
    for value in ("0", "1", ""):  # a caller's setting wins: the device is not even asked
        assert interpreter_wanted({"TRITON_INTERPRET": value}, probe(False)) is False
    assert asked == [False, True]


def test_kernel_tensors_go_where_the_kernels_run():
    pytest.importorskip("triton", reason="triton is not installed")
    from kvref.impl.torch.triton_kernels import interpreted
    from tests.impl.torch.triton_support import USABLE, kernel_device

    if not USABLE:
        pytest.skip("the kernels cannot run here")
    assert kernel_device() == ("cpu" if interpreted() else "cuda")


@pytest.mark.gpu
def test_on_a_gpu_the_kernel_tests_run_compiled_unless_the_caller_asked_for_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed")
    from tests.impl.torch.triton_support import kernel_device

    if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes"):
        pytest.skip("TRITON_INTERPRET=1 was set by the caller")
    assert kernel_device() == "cuda"


def test_triton_language_helpers_are_interpreted_when_the_kernels_are():
    """Stop 36's CI: vLLM's import (collecting tests/conformance) imported triton.language before
    the interpreter was switched on, so ``tl.zeros`` stayed a compiled-mode function and every
    interpreted kernel that called it failed. Run inside the whole suite, this checks the process
    the kernel tests share: the language's own helpers are interpreted exactly when ours are."""
    pytest.importorskip("triton", reason="triton is not installed")
    import triton.language as tl

    from kvref.impl.torch.triton_kernels.attention import _paged_attention_kernel

    ours = type(_paged_attention_kernel).__name__
    assert type(tl.zeros).__name__ == ours, (type(tl.zeros), ours)
