"""The vLLM 0.33.0 formulas the theorems are about, written once for both back-ends.

Each method takes an ``ops`` object first (:class:`~kvref.proofs.ops.PyOps` or
:class:`~kvref.proofs.ops.Z3Ops`), so the same text is evaluated on numbers and encoded for Z3.
:class:`Formulas` is the reference (vLLM 0.33.0 / ``kvref.spec``); historic variants
(:mod:`kvref.proofs.variants`) subclass it and override the one rule that was wrong before a fix.

The agreement tests (``tests/proofs/test_agreement.py``) evaluate these encodings — in Python and
through Z3 models — against ``kvref.spec``'s functions on Hypothesis-generated inputs, so an
encoding cannot drift from the code it is about. Where the method mirrors a vLLM function, its
docstring names it.
"""

from __future__ import annotations


class Formulas:
    """Reference semantics (vLLM 0.33.0)."""

    name = "reference"

    # ---------------------------------------------------------------- specs (kv_cache_interface.py)

    def max_in_flight_tokens(self, o, k, B):
        """``VllmConfig.max_in_flight_tokens = max_concurrent_batches * max_num_batched_tokens``."""
        return k * B

    def swa_cap(self, o, sw, extra, bs, F, M):
        """``SlidingWindowSpec.max_admission_blocks_per_request(F, M)``:
        ``cdiv(min(sw - 1 + extra + F, M), bs) + 1`` (vLLM #40946)."""
        return o.cdiv(o.min(sw - 1 + extra + F, M), bs) + 1

    def cl_cap(self, o, chunk, bs, F, M):
        """``ChunkedLocalAttentionSpec.max_admission_blocks_per_request(F, M)``:
        ``cdiv(min(chunk + F, M), bs)``."""
        return o.cdiv(o.min(chunk + F, M), bs)

    def startup_swa_blocks(self, o, sw, extra, bs, k, B, M):
        """Blocks ``SlidingWindowSpec.max_memory_usage_bytes`` charges: the cap at
        ``F = vllm_config.max_in_flight_tokens``."""
        return self.swa_cap(o, sw, extra, bs, self.max_in_flight_tokens(o, k, B), M)

    def startup_cl_blocks(self, o, chunk, bs, k, B, M):
        """Blocks ``ChunkedLocalAttentionSpec.max_memory_usage_bytes`` charges."""
        return self.cl_cap(o, chunk, bs, self.max_in_flight_tokens(o, k, B), M)

    def swa_memory_bytes(self, o, sw, extra, bs, page, k, B, M):
        """``SlidingWindowSpec.max_memory_usage_bytes``."""
        return self.startup_swa_blocks(o, sw, extra, bs, k, B, M) * page

    def cl_memory_bytes(self, o, chunk, bs, page, k, B, M):
        """``ChunkedLocalAttentionSpec.max_memory_usage_bytes``."""
        return self.startup_cl_blocks(o, chunk, bs, k, B, M) * page

    def full_pages(self, o, M, bs, dcp):
        """Blocks of a full-attention group: ``cdiv(cdiv(M, dcp), bs)`` (``dcp`` = 1 unless the
        spec is DCP-sharded; ``FullAttentionSpec.max_memory_usage_bytes / page``)."""
        return o.cdiv(o.cdiv(M, dcp), bs)

    def mamba_pages(self, o, align, spec_blocks, ckpt_blocks):
        """``MambaSpec.max_memory_usage_bytes / page``: ``2 + spec + ckpt`` in align mode, else
        ``1 + spec``."""
        return o.ite(align, 2 + spec_blocks + ckpt_blocks, 1 + spec_blocks)

    def pages_from_bytes(self, o, mem_bytes, page):
        """``cdiv(max_memory_usage_bytes, page_size_bytes)``, as ``_max_memory_usage_bytes_from_groups``
        and the concurrency report count a group."""
        return o.cdiv(mem_bytes, page)

    # ------------------------------------------------------- runtime (single_type_kv_cache_manager.py)

    def runtime_swa_cap(self, o, sw, extra, bs, k, B, M):
        """Cap ``get_manager_for_kv_cache_spec`` hands the manager: the same method, with the
        scheduler's ``vllm_config.max_in_flight_tokens`` and the final ``max_model_len``."""
        return self.swa_cap(o, sw, extra, bs, self.max_in_flight_tokens(o, k, B), M)

    def runtime_cl_cap(self, o, chunk, bs, k, B, M):
        return self.cl_cap(o, chunk, bs, self.max_in_flight_tokens(o, k, B), M)

    def swa_skipped(self, o, n, sw, extra):
        """``SlidingWindowManager.get_num_skipped_tokens``: ``max(0, n - sw + 1 - extra)``."""
        return o.max(0, n - sw + 1 - extra)

    def cl_skipped(self, o, n, chunk):
        """``ChunkedLocalAttentionManager.get_num_skipped_tokens``: ``n // chunk * chunk``."""
        return o.fdiv(n, chunk) * chunk

    def removal_basis(self, o, c, f, M):
        """Tokens ``remove_skipped_blocks`` is called with in ``allocate_slots``: the processed
        basis ``max(0, min(c, M) - num_in_flight_tokens)``."""
        return o.max(0, o.min(c, M) - f)

    def held_after_step(self, o, c, f, n, M, bs, skipped_tokens):
        """Non-null blocks a windowed request holds after one ``allocate_slots`` call.

        The table covers the ``c`` computed tokens (``cdiv(c, bs)`` entries); removal nulls
        ``min(skipped // bs, len(table))`` leading entries; allocation grows the table to
        ``cdiv(min(c + n, M), bs)``.
        """
        nulls = o.min(o.fdiv(skipped_tokens, bs), o.cdiv(c, bs))
        return o.max(o.cdiv(o.min(c + n, M), bs), o.cdiv(c, bs)) - nulls

    def step_predicted_blocks(self, o, need_slot, bs, table_len, cap):
        """``get_num_blocks_to_allocate`` for a running request in a per-step call
        (``apply_admission_cap=False``): ``max(cdiv(need_slot, bs) - len(table), 0)``."""
        return o.max(o.cdiv(need_slot, bs) - table_len, 0)

    def step_pulled_blocks(self, o, need_slot, bs, table_len):
        """Blocks ``allocate_new_blocks`` then takes from the pool."""
        return o.max(o.cdiv(need_slot, bs) - table_len, 0)

    # ----------------------------------------------------------- full-sequence gate (fresh request)

    def gate_full(self, o, L, bs, dcp):
        return o.cdiv(L, bs * dcp)

    def gate_swa(self, o, L, bs, cap):
        """Gate on an empty table: ``min(cdiv(L, bs), cap)`` (``apply_admission_cap=True``)."""
        return o.min(o.cdiv(L, bs), cap)

    def gate_cl(self, o, L, bs, cap):
        return o.min(o.cdiv(L, bs), cap)

    def gate_mamba(self, o, L, bs, align, spec_blocks, ckpt_flag):
        """``MambaManager.get_num_blocks_to_allocate`` for a fresh request without hits.

        Align: ``min(cdiv(L, bs) + spec, 1 + ckpt_flag + spec)`` (the physical cap); otherwise the
        base count with ``bs * spec`` extra tokens: ``cdiv(L + bs*spec, bs)``.
        """
        return o.ite(align, o.min(o.cdiv(L, bs) + spec_blocks, 1 + ckpt_flag + spec_blocks),
                     o.cdiv(L + bs * spec_blocks, bs))

    def mamba_held_nonalign(self, o, c, n, M, bs, spec_blocks):
        """Non-align Mamba after a step: ``cdiv(min(c+n, M) + bs*spec, bs)`` entries, none skipped
        below ``bs`` (``get_num_skipped_tokens(p) = p - 1 < M <= bs``)."""
        return o.cdiv(o.min(c + n, M) + bs * spec_blocks, bs)

    # ---------------------------------------------------------------- pool sizing (kv_cache_planning.py)

    def available_memory(self, o, profiled, override_set, override, bpb):
        """``get_kv_cache_configs`` step 1: an override becomes ``override * bpb`` bytes (vLLM #41069)."""
        return o.ite(override_set, override * bpb, profiled)

    def check_memory(self, o, avail, bpb):
        """Step 2: memory the check and auto-fit see, one block withheld for the null block
        (PRs 47272 / 48724)."""
        return avail - bpb

    def num_blocks(self, o, profiled, override_set, override, bpb):
        """Blocks the pool really gets: ``avail // bpb``, then ``may_override_num_blocks``."""
        return o.ite(override_set, override, o.fdiv(profiled, bpb))

    def check_passes(self, o, need_bytes, check_mem):
        """``_check_enough_kv_cache_memory``: raises unless ``0 < check_mem`` and
        ``need <= check_mem``."""
        return o.And(check_mem > 0, need_bytes <= check_mem)

    # ---------------------------------------------------------------- async-load reservations

    def async_load_reserved(self, o, inflight_remaining, spec_step_blocks):
        """``Scheduler._inflight_prefill_reserved_blocks() + _spec_decode_step_blocks``."""
        return inflight_remaining + spec_step_blocks

    # ---------------------------------------------------------------- HiSparse (issue #23)

    def hisparse_source_admission(self, o, required, host_free, num_gpu_blocks):
        """``HiSparseSourceManager.get_num_blocks_to_allocate``: ``num_gpu_blocks + 1`` when the
        host pool cannot back the pages, else 0 (``kvref.spec.hisparse.source_admission_count``)."""
        return o.ite(required > host_free, num_gpu_blocks + 1, 0)

    def hisparse_steady_gpu(self, o, num_blocks, admission_blocks, steady_blocks):
        """The GPU part of ``get_hisparse_steady_state_concurrency`` as a fraction ``(num, den)``:
        ``nb / A`` below one admission window, else ``1 + (nb - A) / S`` = ``(S + nb - A) / S``
        (``kvref.spec.planning_hisparse.hisparse_steady_state_concurrency``; issue #22)."""
        below = num_blocks < admission_blocks
        return (o.ite(below, num_blocks, steady_blocks + num_blocks - admission_blocks),
                o.ite(below, admission_blocks, steady_blocks))

    # ---------------------------------------------------------------- pipeline parallel (issue #22)

    def pp_workers_checked(self, o, checks):
        """``get_kv_cache_configs`` checks every worker's projected groups against its own memory
        (``kvref.spec.planning_parallel.plan_kv_cache_workers``)."""
        return o.And(*checks)

    def pp_common_num_blocks(self, o, own):
        """Every worker is re-planned with the smallest worker's ``memory // bytes_per_block``."""
        acc = own[0]
        for x in own[1:]:
            acc = o.min(acc, x)
        return acc

    # ---------------------------------------------------------------- block sizes (kv_cache_utils.py)

    def hash_block_size(self, o, sizes, cacheable, unit_set, unit, cache_block_size):
        """``resolve_kv_cache_block_sizes``' hash size: ``prefix_match_unit`` or the gcd of the
        prefix-cacheable groups' (DCP-scaled) block sizes. ``sizes[0]`` is a prefix-cacheable
        group (gcd is symmetric, so any order will do); ``cache_block_size`` is only read by the
        pre-#42992 variant."""
        # One gcd per subset of the other groups, chosen by the flags: gcd is applied to plain
        # sizes only, which keeps the Z3 encoding's witnesses directly usable.
        def subset_gcd(i, acc):
            if i == len(sizes):
                return acc
            return o.ite(cacheable[i], subset_gcd(i + 1, o.gcd(acc, sizes[i])), subset_gcd(i + 1, acc))

        g = subset_gcd(1, sizes[0])
        return o.ite(unit_set, unit, g)

    def scheduler_block_size(self, o, sizes):
        """``math.lcm`` of every group's (DCP-scaled) block size."""
        acc = sizes[0]
        for s in sizes[1:]:
            acc = o.lcm(acc, s)
        return acc

    # ---------------------------------------------------------------- offloading (offloading/config.py)

    def offload_window_swa(self, o, sw, extra, tpc):
        """``get_sliding_window_size_in_chunks`` for SWA:
        ``max(cdiv(sw, tpc), cdiv(sw - 1 + extra, tpc))``."""
        return o.max(o.cdiv(sw, tpc), o.cdiv(sw - 1 + extra, tpc))

    def offload_window_cl(self, o, chunk, tpc):
        """... for chunked-local: ``cdiv(attention_chunk_size, tpc)`` (vLLM #51161)."""
        return o.cdiv(chunk, tpc)

    #: whether ``get_sliding_window_size_in_chunks`` accepts a chunked-local spec at all
    offload_supports_chunked_local = True


REFERENCE = Formulas()
