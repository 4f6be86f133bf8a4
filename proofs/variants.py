"""Pre-fix behaviours of real vLLM KV-cache bugs, and deliberately broken formulas.

Each variant is the reference :class:`~kvref.proofs.formulas.Formulas` with the one rule that was
wrong before a fix (``historic``), or with a rule broken on purpose (``broken``: the sibling check
that shows a theorem can fail). ``kvref prove --variant NAME`` re-runs the theorem it breaks and
must find a counterexample; the tests check that it does, and that the reproducer file written for
it fails on the variant and passes on the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from .formulas import Formulas


@dataclass(frozen=True)
class Variant:
    """A named formula set.

    Args:
        name: the ``--variant`` name.
        kind: ``"historic"`` (a real vLLM bug) or ``"broken"`` (a sibling check).
        theorem: id of the theorem it must break.
        refs: vLLM issues/PRs (``"#39734"``, ``"PR 40946"``).
        summary: what was wrong, in one or two sentences.
        formulas: the formula set.
    """

    name: str
    kind: str
    theorem: str
    refs: tuple[str, ...]
    summary: str
    formulas: Formulas


# ----------------------------------------------------------------------------- historic bugs

class Pre40946Gate(Formulas):
    """#39734: the full-sequence gate charged SWA/chunked-local groups for the whole sequence."""

    name = "pre-40946-gate"

    def gate_swa(self, o, L, bs, cap):
        return o.cdiv(L, bs)

    def gate_cl(self, o, L, bs, cap):
        return o.cdiv(L, bs)


class Pr40946BatchedTokensCap(Formulas):
    """PR 40946 as merged: the cap reserved ``max_num_batched_tokens`` (one step), not the tokens of
    every step in flight, so async scheduling / PP could exceed it."""

    name = "pr40946-batched-tokens-cap"

    def max_in_flight_tokens(self, o, k, B):
        return B


class Pre41069OverrideIgnored(Formulas):
    """#35541: the check and auto-fit used the profiled memory, ignoring num_gpu_blocks_override."""

    name = "pre-41069-override-ignored"

    def available_memory(self, o, profiled, override_set, override, bpb):
        return profiled


class Pre47272NullBlock(Formulas):
    """Before PRs 47272 / 48724: the check and auto-fit did not withhold the null block."""

    name = "pre-47272-null-block"

    def check_memory(self, o, avail, bpb):
        return avail


class Pr40027CappedPerStep(Formulas):
    """PR 40027 / the PR-era cap of 40946 (applied unconditionally): the per-step predictor was
    capped, so allocate_new_blocks took more than was checked — "Cannot get N free blocks from the
    pool" (#45856)."""

    name = "pr40027-capped-per-step"

    def step_predicted_blocks(self, o, need_slot, bs, table_len, cap):
        return o.max(o.min(o.cdiv(need_slot, bs), cap) - table_len, 0)


class Pr41228OffloadWindow(Formulas):
    """PR 41228's ``get_sliding_window_size_in_blocks = cdiv(sw, block)`` ignored the extra
    retained tokens that vLLM later keeps for multi-token prediction."""

    name = "pr41228-offload-window"

    def offload_window_swa(self, o, sw, extra, tpc):
        return o.cdiv(sw, tpc)


class Pr39866CoordinatorCap(Formulas):
    """PR 39866 (closed): a coordinator-level cap of ``cdiv(min(sw + F, M), bs)`` tokens -> blocks,
    without the ``+1`` block for a window that starts mid-block."""

    name = "pr39866-cap-without-plus-one"

    def swa_cap(self, o, sw, extra, bs, F, M):
        return o.cdiv(o.min(sw + extra + F, M), bs)


class Pre51161ChunkedLocalOffload(Formulas):
    """#51150: get_sliding_window_size_in_chunks asserted FullAttentionSpec for chunked-local
    specs (Llama 4), killing the engine at startup; fixed by #51161."""

    name = "pre-51161-chunked-local-offload"
    offload_supports_chunked_local = False


class Pr28176MambaSpecBlocks(Formulas):
    """PR 28176 review: the lighter Mamba cache sized one block per request, ignoring the
    num_speculative_blocks the allocation reserves."""

    name = "pr28176-mamba-speculative-blocks"

    def mamba_pages(self, o, align, spec_blocks, ckpt_blocks):
        return o.ite(align, 2 + spec_blocks + ckpt_blocks, 1)


class Pre42992StaleHashBlockSize(Formulas):
    """#43093 / PR 42992: the offloading spec took ``cache_config.block_size`` as the hash block
    size; with groups of smaller block sizes (DeepSeek-V4: 64 vs 256) divisibility fails."""

    name = "pre-42992-stale-hash-block-size"

    def hash_block_size(self, o, sizes, cacheable, unit_set, unit, cache_block_size):
        return o.ite(unit_set, unit, cache_block_size)


class Pre44560NoAsyncReservation(Formulas):
    """#45388: async KV loads were admitted against all free blocks, so a parked load could take
    blocks that running prefills still needed (deadlock under KV pressure)."""

    name = "pre-44560-async-load-no-reservation"

    def async_load_reserved(self, o, inflight_remaining, spec_step_blocks):
        return 0


# ----------------------------------------------------------------------------- broken on purpose

class BrokenStartupBatchedTokens(Formulas):
    name = "broken-startup-uses-batched-tokens"

    def startup_swa_blocks(self, o, sw, extra, bs, k, B, M):
        return self.swa_cap(o, sw, extra, bs, B, M)


class BrokenCapIgnoresExtra(Formulas):
    name = "broken-cap-ignores-extra-retained"

    def swa_cap(self, o, sw, extra, bs, F, M):
        return o.cdiv(o.min(sw - 1 + F, M), bs) + 1


class BrokenSchedulerBlockSizeMax(Formulas):
    name = "broken-scheduler-block-size-max"

    def scheduler_block_size(self, o, sizes):
        acc = sizes[0]
        for s in sizes[1:]:
            acc = o.max(acc, s)
        return acc


class BrokenOffloadWindowFloor(Formulas):
    name = "broken-offload-window-floor"

    def offload_window_swa(self, o, sw, extra, tpc):
        return o.max(o.fdiv(sw, tpc), o.fdiv(sw - 1 + extra, tpc))


class BrokenPredictorOffByOne(Formulas):
    name = "broken-predictor-off-by-one"

    def step_predicted_blocks(self, o, need_slot, bs, table_len, cap):
        return o.max(o.cdiv(need_slot, bs) - table_len - 1, 0)


class BrokenFullPagesFloor(Formulas):
    name = "broken-full-pages-floor"

    def full_pages(self, o, M, bs, dcp):
        return o.fdiv(o.cdiv(M, dcp), bs)


class BrokenReservationHalf(Formulas):
    name = "broken-reservation-half"

    def async_load_reserved(self, o, inflight_remaining, spec_step_blocks):
        return o.fdiv(inflight_remaining, 2)


class BrokenHiSparseSentinelShort(Formulas):
    name = "broken-hisparse-sentinel-short"

    def hisparse_source_admission(self, o, required, host_free, num_gpu_blocks):
        return o.ite(required > host_free, num_gpu_blocks - 1, 0)


class BrokenHiSparseSteadyNoWindowBranch(Formulas):
    name = "broken-hisparse-steady-no-window-branch"

    def hisparse_steady_gpu(self, o, num_blocks, admission_blocks, steady_blocks):
        return steady_blocks + num_blocks - admission_blocks, steady_blocks


class BrokenPPFirstWorkerOnly(Formulas):
    name = "broken-pp-first-worker-only"

    def pp_workers_checked(self, o, checks):
        return checks[0]


class BrokenAutoFitNoNull(Formulas):
    name = "broken-num-blocks-plus-one"

    def num_blocks(self, o, profiled, override_set, override, bpb):
        return o.ite(override_set, override - 1, o.fdiv(profiled, bpb))


VARIANTS: tuple[Variant, ...] = (
    Variant("pre-40946-gate", "historic", "T3", ("#39734", "PR 40946"),
            "The full-sequence admission gate charged SWA/chunked-local groups cdiv(L, bs) blocks while startup "
            "sized them with the recycling-aware bound: startup accepted max_model_len, the gate never admitted "
            "a long request (scheduler waits forever).", Pre40946Gate()),
    Variant("pr40946-batched-tokens-cap", "historic", "T2", ("PR 40946 (as merged)", "#39734"),
            "The cap reserved max_num_batched_tokens; with async scheduling (2 batches in flight) frees lag "
            "one step behind and a request holds more blocks than its cap.", Pr40946BatchedTokensCap()),
    Variant("pre-41069-override-ignored", "historic", "T4", ("#35541", "PR 41069"),
            "num_gpu_blocks_override was ignored by the enough-memory check and auto-fit: a max_model_len the "
            "overridden pool cannot hold was accepted and the scheduler hung.", Pre41069OverrideIgnored()),
    Variant("pre-47272-null-block", "historic", "T4", ("PR 47272", "PR 48724"),
            "The check and auto-fit counted the null block as usable: a pool of exactly the needed blocks has "
            "only needed - 1 usable ones.", Pre47272NullBlock()),
    Variant("pr40027-capped-per-step", "historic", "T7", ("PR 40027", "#45856", "PR 40946"),
            "The admission cap was applied to the per-step predictor, so allocate_new_blocks took more blocks "
            "than the check allowed: 'Cannot get N free blocks from the pool'.", Pr40027CappedPerStep()),
    Variant("pr41228-offload-window", "historic", "T6", ("PR 41228",),
            "get_sliding_window_size_in_blocks = cdiv(sw, block) ignored extra retained tokens, so the offload "
            "scheduler restored too few chunks for MTP models.", Pr41228OffloadWindow()),
    Variant("pr39866-cap-without-plus-one", "historic", "T2", ("PR 39866", "#39734"),
            "A cap of cdiv(min(sw + F, M), bs) misses the block a window starting mid-block spans; a request can "
            "hold one block more than it was admitted for.", Pr39866CoordinatorCap()),
    Variant("pre-51161-chunked-local-offload", "historic", "T6", ("#51150", "PR 51161"),
            "get_sliding_window_size_in_chunks asserted FullAttentionSpec for chunked-local specs: the "
            "offloading connector crashed at startup on Llama 4.", Pre51161ChunkedLocalOffload()),
    Variant("pr28176-mamba-speculative-blocks", "historic", "T3", ("PR 28176",),
            "The lighter Mamba cache sized one block per request while allocation reserves "
            "1 + num_speculative_blocks: startup accepted a pool the gate cannot admit into.",
            Pr28176MambaSpecBlocks()),
    Variant("pre-42992-stale-hash-block-size", "historic", "T5", ("#43093", "PR 42992", "#56396"),
            "cache_config.block_size was used as the hash block size; a group with a smaller block size is not "
            "a multiple of it (AssertionError at startup).", Pre42992StaleHashBlockSize()),
    Variant("pre-44560-async-load-no-reservation", "historic", "T8", ("#45388", "PR 44560"),
            "Async KV loads were admitted without reserving what in-flight prefills still need: a parked load "
            "starves them (Running 0, Waiting N, forever).", Pre44560NoAsyncReservation()),
    Variant("broken-startup-uses-batched-tokens", "broken", "T1", (),
            "Startup sizes SWA with max_num_batched_tokens while the runtime cap uses in-flight tokens.",
            BrokenStartupBatchedTokens()),
    Variant("broken-cap-ignores-extra-retained", "broken", "T2", (),
            "The SWA cap forgets extra_retained_tokens.", BrokenCapIgnoresExtra()),
    Variant("broken-full-pages-floor", "broken", "T3", (),
            "Full-attention pages rounded down instead of up.", BrokenFullPagesFloor()),
    Variant("broken-num-blocks-plus-one", "broken", "T4", (),
            "The pool gets one block fewer than the override says.", BrokenAutoFitNoNull()),
    Variant("broken-scheduler-block-size-max", "broken", "T5", (),
            "scheduler_block_size = max of the group block sizes instead of their lcm.",
            BrokenSchedulerBlockSizeMax()),
    Variant("broken-offload-window-floor", "broken", "T6", (),
            "Window in chunks rounded down.", BrokenOffloadWindowFloor()),
    Variant("broken-predictor-off-by-one", "broken", "T7", (),
            "The per-step predictor forgets one block.", BrokenPredictorOffByOne()),
    Variant("broken-reservation-half", "broken", "T8", (),
            "Async loads reserve only half of what in-flight prefills need.", BrokenReservationHalf()),
    Variant("broken-hisparse-sentinel-short", "broken", "T9", (),
            "The host-short sentinel is num_gpu_blocks - 1: a free GPU pool admits a request the host pool cannot "
            "back (its host get_new_blocks then fails).", BrokenHiSparseSentinelShort()),
    Variant("broken-hisparse-steady-no-window-branch", "broken", "T10", (),
            "The steady-state figure charges one admission window even when the pool holds less than one: "
            "below A blocks it reports fewer requests than admission does (negative when nb < A - S).",
            BrokenHiSparseSteadyNoWindowBranch()),
    Variant("broken-pp-first-worker-only", "broken", "T11", (),
            "Only the first worker's memory is checked: a later pipeline stage with less memory sets the common "
            "block count below one max-length request.", BrokenPPFirstWorkerOnly()),
)

BY_NAME = {v.name: v for v in VARIANTS}
HISTORIC = tuple(v for v in VARIANTS if v.kind == "historic")
BROKEN = tuple(v for v in VARIANTS if v.kind == "broken")


def get_variant(name: str) -> Variant:
    from kvref.spec.errors import InvalidFieldError

    if not isinstance(name, str) or name not in BY_NAME:
        raise InvalidFieldError("variant", name, "one of " + ", ".join(BY_NAME))
    return BY_NAME[name]
