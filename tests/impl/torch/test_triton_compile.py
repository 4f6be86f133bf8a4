"""The kernels compile for real GPU targets here, without a GPU (``triton.compile`` to a cubin
with the ptxas in the triton wheel), and the CUDA defaults do not spill registers.

This is the part of "on a CUDA device the same kernels compile" that can be checked where no GPU
is lent: every compiler stage down to the cubin for sm_90 (and, nightly, every dtype x mask x
split for sm_80 and sm_90). Running the cubin is left to the GPU-marked test. The compile runs in
a subprocess without ``TRITON_INTERPRET`` (this process interprets the kernels).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0, requirements/test.txt)")

from hypothesis import settings  # noqa: E402

from kvref.spec.errors import InvalidFieldError  # noqa: E402


def test_the_data_path_kernels_compile_for_sm90_and_the_defaults_do_not_spill():
    from kvref.impl.torch.triton_kernels.aot import compile_in_subprocess

    rows = compile_in_subprocess()
    labels = [r.label for r in rows]
    assert labels == ["attention bfloat16 sliding_window gqa4 d128 bs16 tile32 stages2 bound57344",
                      "attention bfloat16 sliding_window gqa4 d128 bs16 tile32 stages2 split bound57344",
                      "combine bfloat16 d128 splits8", "write_kv bfloat16 8x128",
                      "block_copy 2-byte elements (8-byte words)"], labels
    for r in rows:
        assert r.arch == 90 and r.cubin_bytes > 1000, r
        assert r.registers is not None and r.registers <= 255, r
        assert r.stack_bytes == 0, f"{r.label} spills {r.stack_bytes} bytes of stack per thread"
    # issue #24: K/V tiles are loaded as 16-byte vectors (8 bfloat16 lanes of a row per load), not
    # element by element; and the decode default leaves room for several programs per SM
    attention = [r for r in rows if r.label.startswith("attention")]
    assert rows[-1].load_bits == 128, rows[-1]  # offload pages as 16-byte vectors too
    assert all(r.load_bits == 128 and r.registers <= 112 and r.shared_bytes <= 32 * 1024 for r in attention), \
        attention


@pytest.mark.skipif(settings._current_profile != "nightly",  # type: ignore[attr-defined]
                    reason="the full compile matrix (about 60 variants, minutes) runs under the nightly profile")
def test_every_variant_compiles_for_sm80_and_sm90():
    from kvref.impl.torch.triton_kernels.aot import compile_in_subprocess

    rows = compile_in_subprocess(full=True, timeout=3600)
    assert {r.arch for r in rows} == {80, 90} and len(rows) >= 60
    # At most one 8-byte slot: the split-K kernel's float32 split variants (sliding window,
    # chunked local) on sm_90 keep one register on the stack — in the SASS one STL before the
    # key loop and one LDL after it, nothing inside (BENCHMARKS.md). More would be a real spill.
    spilling = [(r.label, r.arch, r.stack_bytes) for r in rows if r.stack_bytes > 8]
    assert not spilling, spilling


def test_the_widest_real_shape_compiles_for_sm90_without_spills():
    """DeepSeek's MLA latent (576 lanes) with its 128 query heads on one rank: the first
    kernel_config (tile 32, every head of the group in one program, 576 padded to 1024 lanes)
    needed 255 registers and spilled 352 bytes of stack per thread on sm_90; the split-K kernel
    (512 + 64 lanes, head blocks of 16, tile 16, 8 warps) fits in registers and in shared memory."""
    from kvref.impl.torch.triton_kernels.aot import compile_in_subprocess

    rows = compile_in_subprocess(real=True, only="gqa128 d576")
    assert [r.label for r in rows] == ["attention bfloat16 causal gqa128 d576 bs64 tile16 stages2 8 head blocks "
                                       "bound131584"], rows
    assert rows[0].registers is not None and rows[0].stack_bytes == 0, rows[0]
    assert rows[0].shared_bytes <= rows[0].shared_bound <= 232448, rows[0]


@pytest.mark.skipif(settings._current_profile != "nightly",  # type: ignore[attr-defined]
                    reason="every attention shape of the config.json fixtures (about 27 variants, 3 min) runs "
                           "under the nightly profile")
def test_every_fixture_attention_shape_compiles_for_sm90_without_spills():
    from kvref.impl.torch.triton_kernels.aot import compile_in_subprocess, real_shapes

    rows = compile_in_subprocess(real=True, timeout=3600)
    assert len(rows) >= 20 and len(rows) <= len(real_shapes())
    spilling = [(r.label, r.stack_bytes) for r in rows if r.stack_bytes or r.registers is None]
    assert not spilling, spilling


def test_compiling_in_an_interpreting_process_is_refused_with_the_way_out(monkeypatch):
    from kvref.impl.torch.triton_kernels import aot

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(InvalidFieldError, match="compile_in_subprocess"):
        aot.block_copy(2)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(InvalidFieldError, match="arch"):
        aot.block_copy(2, arch=75)
