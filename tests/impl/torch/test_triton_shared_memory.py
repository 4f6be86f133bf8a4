"""Issue #24, fix 2: every configuration the attention wrapper can choose fits the shared memory
of the GPU targets (sm_80: 163 KiB per block, sm_90: 227 KiB), checked on CPU.

DeepSeek-V2 at TP 1 (GQA 128, the 576-wide MLA latent, block 64) compiled but did not launch on
an H200: ``OutOfResources: shared memory, Required: 329920, Hardware limit: 232448``. Compiling
is not launching: Triton refuses at launch a kernel whose ``metadata.shared`` exceeds the device.
Here: (1) for every attention shape of the packaged fixtures x dtype x split x arch, the
configuration the wrapper picks has a shared-memory bound within the arch's limit; (2) the bound
is not below what the compiler actually allocates (``triton.compile`` for sm_80 / sm_90 on CPU,
a sample at ci, every candidate of every fixture shape nightly); (3) an explicit tuning that
cannot fit is refused naming the limit; (4) should a compiler still ask for more than the device
has, the launch steps down to the next candidate instead of failing.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0, requirements/test.txt)")

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

from kvref.impl.torch.triton_kernels.aot import real_shapes  # noqa: E402
from kvref.impl.torch.triton_kernels.attention import (  # noqa: E402
    SHARED_LIMIT,
    candidate_configs,
    kernel_config,
)
from kvref.spec.errors import InvalidFieldError  # noqa: E402

NIGHTLY = settings._current_profile == "nightly"  # type: ignore[attr-defined]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def test_sm80_and_sm90_limits_are_the_documented_ones():
    # CUDA C Programming Guide, Technical Specifications per Compute Capability: maximum shared
    # memory per thread block (opt-in) 163 KB on 8.0, 227 KB on 9.0; the H200 reported 232448.
    assert SHARED_LIMIT == {80: 166912, 90: 232448}


@pytest.mark.parametrize("arch", sorted(SHARED_LIMIT))
def test_the_chosen_configuration_of_every_fixture_shape_fits_the_arch(arch):
    limit = SHARED_LIMIT[arch]
    checked = 0
    for kind, _, dt, hq, hkv, d, bs in real_shapes():
        for dtype in {DTYPES[dt], torch.float32, torch.float64}:
            for split in (False, True):
                cands = candidate_configs(dtype, kind, hq, hkv, d, bs, True, split)
                cfg = kernel_config(dtype, kind, hq, hkv, d, bs, True, split, shared_limit=limit)
                assert cfg.shared_bytes <= limit, (dt, hq, hkv, d, bs, cfg)
                # the first candidate that fits: a larger tile / more stages only when it does not fit
                assert all(c.shared_bytes > limit for c in cands[:cands.index(cfg)]), (d, bs, cfg)
                assert cfg.num_warps in (4, 8) and cfg.num_stages in (1, 2)
                checked += 1
    assert checked >= 100


def test_the_widest_shape_gets_a_configuration_that_launches_on_both_arches():
    for arch, limit in SHARED_LIMIT.items():
        cfg = kernel_config(torch.bfloat16, "causal", 128, 1, 576, 64, True, False, shared_limit=limit)
        assert (cfg.consts["HEAD_A"], cfg.consts["HEAD_B"], cfg.consts["GROUP_P"]) == (512, 64, 16)
        assert cfg.shared_bytes <= limit < 329920


def test_an_explicit_tuning_that_cannot_fit_is_refused_naming_the_limit():
    with pytest.raises(InvalidFieldError, match="166912 B per block") as exc:
        kernel_config(torch.float32, "causal", 128, 1, 576, 64, True, False, tile=256, num_stages=4,
                      shared_limit=SHARED_LIMIT[80])
    assert exc.value.field == "tile/num_stages/group_block"
    # the same tile with the stages left to the wrapper steps down to one stage if that fits
    cfg = kernel_config(torch.bfloat16, "causal", 32, 8, 128, 16, True, False, tile=128,
                        shared_limit=SHARED_LIMIT[80])
    assert cfg.consts["TILE"] == 128 and cfg.shared_bytes <= SHARED_LIMIT[80]
    with pytest.raises(InvalidFieldError, match="num_stages"):
        kernel_config(torch.bfloat16, "causal", 32, 8, 128, 16, True, False, num_stages=0)


def test_the_bound_is_not_below_the_compilers_shared_memory():
    """A sample compiled for sm_80 / sm_90 (about 20 s in a subprocess): the MLA shape's chosen
    configuration per arch, every candidate of the decode default, float32 and float64 at head 256."""
    from kvref.impl.torch.triton_kernels.aot import compile_in_subprocess

    rows = compile_in_subprocess(candidates=True)
    assert len(rows) >= 8 and {r.arch for r in rows} == {80, 90}
    for r in rows:
        assert r.shared_bound is not None and r.shared_bytes <= r.shared_bound, r
        # and the configurations chosen do not spill (float32 at head 256 with 4 warps spilled 72 B)
        assert r.stack_bytes == 0 and r.load_bits == 128, r
    mla = [r for r in rows if "d576" in r.label]
    assert len(mla) == 2 and all(r.shared_bytes <= SHARED_LIMIT[r.arch] and not r.spills for r in mla), mla


@pytest.mark.skipif(not NIGHTLY, reason="every candidate of every fixture shape for sm_80 and sm_90 (minutes): "
                                        "nightly profile")
def test_the_bound_holds_for_every_candidate_of_every_fixture_shape():
    from kvref.impl.torch.triton_kernels.aot import compile_in_subprocess

    rows = compile_in_subprocess(candidates=True, full=True, timeout=3600)
    assert len(rows) >= 100
    bad = [(r.label, r.arch, r.shared_bytes, r.shared_bound) for r in rows if r.shared_bytes > r.shared_bound]
    assert not bad, bad


def test_a_launch_refused_for_shared_memory_steps_down_to_the_next_candidate(monkeypatch):
    """The safety net behind the bound: a compiler laying out more than the bound (another Triton
    version) gets ``OutOfResources`` at launch; the wrapper retries the next candidate."""
    from triton.runtime.errors import OutOfResources

    import kvref.impl.torch.triton_kernels.attention as attn

    launched = []

    class FakeKernel:
        def __getitem__(self, grid):
            def run(*args, **kw):
                launched.append((grid, kw["TILE"], kw["num_stages"], kw["SPLIT"]))
                if len(launched) < 3:
                    raise OutOfResources(300000, 232448, "shared memory")
            return run
    monkeypatch.setattr(attn, "_paged_attention_kernel", FakeKernel())
    args = (torch.bfloat16, "causal", 32, 8, 128, 16, True, False, None, None, None, None)
    cfg = kernel_config(*args, shared_limit=SHARED_LIMIT[90])
    attn._launch_pass1(cfg, args, SHARED_LIMIT[90], True, (5, 8, 3), ())
    assert [x[1:] for x in launched] == [(32, 2, True), (32, 1, True), (16, 2, True)]
    assert all(grid == (5, 8, 3) for grid, *_ in launched)
    launched.clear()
    monkeypatch.setattr(attn, "candidate_configs", lambda *a: [cfg])
    with pytest.raises(OutOfResources):
        attn._launch_pass1(cfg, args, SHARED_LIMIT[90], False, (5, 8, 1), ())
