"""When can a waiting request hang, and how long does draining the scheduler take?

vLLM 0.33.0 has no runtime "this request can never be served" rejection (PR 52530 proposed one and
was closed): a waiting request whose full-sequence gate (``scheduler_reserve_full_isl``) can never
pass stays at the head of the waiting queue and the waiting loop stops on it every step, so it and
everyone behind it wait forever (vLLM #39734, #35541). The only guard is the startup invariant
(docs/invariants.md S4/S5): the pool holds one ``max_model_len`` request besides the null block,
counted with the same per-group caps the gate uses. :func:`startup_consistent` is that check for a
:class:`PoolConfig` + :class:`SchedulerConfig`.

Liveness (checked by ``kvref.models.machines.scheduler`` on generated traces, reference and vLLM):
with a startup-consistent config, distinct ``(priority, arrival_time)`` keys and no new arrivals,
every live request finishes within :func:`drain_bound` ``schedule()`` calls. The argument:

* *Alone, everyone fits.* Only running requests hold blocks (waiting ones hold none; cached free
  blocks are evictable). A request alone in ``running`` with ``num_tokens <= max_model_len``
  needs at most ``Σ_g cap_g(max_model_len) <= num_blocks - 1`` blocks, so its allocation succeeds
  (the watermark is waived when nothing is running), and a waiting head passes the gate on an
  empty pool (S5).
* *The first claimant progresses.* Let ``c = min(step budget, long_prefill_token_threshold
  or ∞)``. The first request of ``running`` gets its tokens before anyone else; if its blocks do not
  fit it preempts others, never itself unless alone (FCFS preempts ``running[-1]``; PRIORITY the
  largest key). So it completes within ``T_r = cdiv(min(P_r + max_tokens_r, M), c) + max_tokens_r``
  steps (+2 for async scheduling's pipeline), recompute of its outputs included.
* *FCFS.* ``running[0]`` finishes within ``T_r``; the next one becomes ``running[0]``. A step with
  nothing running admits the waiting head. Drain ≤ ``Σ_r (T_r + 1)``.
* *PRIORITY.* Let ``X`` be the live request with the smallest key. While ``X`` waits it is the
  head of the (sorted) waiting queue and, not fitting, stops every admission (head-of-line), so
  ``running`` only shrinks: within ``S·T`` steps (``S = max_num_seqs``, one ``T`` per first
  claimant, which finishes or is preempted away) ``X`` fits. Running, ``X`` is never the victim
  (largest key) unless alone; the requests ahead of it in ``running`` only leave (new ones are
  appended after it), within ``(S-1)·T``; then ``X`` is first and finishes within ``T``. Drain ≤
  ``N·(2·S·T_max + 1)``.

Distinct keys matter. vLLM picks the PRIORITY victim with ``max(running, key=(priority,
arrival_time))``, the *first* maximal request: on a tie, the oldest running one (the waiting queue
breaks ties by request id; the victim choice does not). With ``scheduler_reserve_full_isl=False``
tied requests are re-admitted chunk by chunk behind each other and preempt each other forever —
a livelock kvref's search found and vLLM 0.33.0 reproduces
(``test_priority_ties_livelock_without_the_full_sequence_gate``). With the gate on, 1500
generated tied traces drained.

Partial prefix hits break "alone, everyone fits" (a finding about vLLM 0.33.0, docs/proofs.md
Findings 3). With prefix caching on and a group whose block is larger than ``hash_block_size``, a
cached prefix can end inside a block; the gate then counts, per such group, the touched hits that
sit in the free queue *and* a copy-on-write block for the shared tail — one block more than the
startup count. A pool sized exactly for one ``max_model_len`` request then never re-admits a
request whose own earlier (preempted) blocks are cached with such a tail: it waits at the head of
the queue forever with the whole pool free, on vLLM as on the reference
(``test_partial_hit_copy_on_write_hangs_a_startup_consistent_pool``).
A Mamba "align" split whose prefill cap (``max_num_scheduled_tokens``) is larger than the step's
input budget breaks "the first claimant progresses" (docs/proofs.md Findings 4): a block between the
two is never reached by one chunk and every chunk is floored back to its start
(:func:`align_split_stalls`). :func:`liveness_guaranteed` is the precondition of the drain bound:
startup-consistent, no such stall, plus one free block per group that can take a partial hit
(:func:`liveness_hazard` names which one is missing).

The bounds count ``schedule()`` calls of an engine that schedules whenever a batch slot is free
and otherwise settles the oldest batch (vLLM's ``step_with_batch_queue``), plus the pipeline
depth.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request
from kvref.spec.kv_cache_interface import MambaSpec
from kvref.spec.mathutil import cdiv

from kvref.impl.scheduler_types import PRIORITY, SchedulerConfig, engine_config_for
from kvref.spec.errors import InvalidFieldError


def _check_setup(pool: object, config: object) -> None:
    if not isinstance(pool, PoolConfig):
        raise InvalidFieldError("pool", pool, "a PoolConfig")
    if not isinstance(config, SchedulerConfig):
        raise InvalidFieldError("config", config, "a SchedulerConfig")


def max_blocks_per_request(pool: PoolConfig, config: SchedulerConfig) -> int:
    """``Σ_g`` blocks one ``max_model_len`` request may hold: the startup sizing's per-request count
    (``max_memory_usage_blocks``, with the sliding-window/chunked caps of
    ``max_admission_blocks_per_request`` at ``max_in_flight_tokens``)."""
    _check_setup(pool, config)
    engine = engine_config_for(config, groups=pool.groups, max_model_len=pool.max_model_len,
                               scheduler_block_size=pool.scheduler_block_size,
                               hash_block_size=pool.hash_block_size, enable_caching=pool.enable_caching)
    return sum(g.kv_cache_spec.max_memory_usage_blocks(engine, pool.max_model_len) for g in pool.groups)


def startup_consistent(pool: PoolConfig, config: SchedulerConfig) -> bool:
    """True when vLLM's startup checks would accept this pool for this scheduler.

    * the pool holds one ``max_model_len`` request besides the null block (S4, PR 47272), and
    * a Mamba group outside "align" mode has a block of at least ``max_model_len`` tokens, and
    * without chunked prefill, one step can hold a whole prompt (vLLM's ``SchedulerConfig``
      requires ``max_num_batched_tokens >= max_model_len`` then; otherwise the waiting loop stops
      on a long prompt forever, the same head-of-line hang). A smaller ``max_num_scheduled_tokens``
      caps the step the same way and vLLM's startup does not compare it with ``max_model_len``:
      the step's budget (:attr:`SchedulerConfig.step_token_budget`) is what must hold a prompt.
    """
    _check_setup(pool, config)
    if not config.enable_chunked_prefill and config.step_token_budget < pool.max_model_len:
        return False
    for g in pool.groups:
        spec = g.kv_cache_spec
        if isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "align" and spec.block_size < pool.max_model_len:
            # vLLM's MambaManager charges cdiv(num_tokens, block_size) blocks at runtime while
            # startup sizing charges one state; vLLM's hybrid config makes the Mamba block the
            # whole context, which is what this assumes.
            return False
    return max_blocks_per_request(pool, config) <= pool.num_blocks - 1


def partial_hit_groups(pool: PoolConfig) -> int:
    """Groups whose prefix-cache hit can end inside one of their blocks (hits are found per
    ``hash_block_size`` tokens): each needs a copy-on-write block beyond the startup count."""
    if not isinstance(pool, PoolConfig):
        raise InvalidFieldError("pool", pool, "a PoolConfig")
    if not pool.enable_caching:
        return 0
    return sum(1 for g in pool.groups
               if g.kv_cache_spec.prefix_cacheable and g.kv_cache_spec.block_size > pool.hash_block_size)


def _align_block_size(pool: PoolConfig) -> int | None:
    """The block size vLLM's Mamba "align" split rounds chunks to (the first Mamba group's, as
    ``scheduler_mamba_split``), or None without an align-mode Mamba group."""
    mamba = [spec for spec in (getattr(g.kv_cache_spec, "first_spec", g.kv_cache_spec) for g in pool.groups)
             if isinstance(spec, MambaSpec)]
    if not any(spec.mamba_cache_mode == "align" for spec in mamba):
        return None
    return mamba[0].block_size


def _align_prefill_cap(config: SchedulerConfig) -> int:
    """vLLM's ``max_prefill_tokens`` in ``_mamba_block_aligned_split``: ``max_num_scheduled_tokens``
    (not the input budget), capped by ``long_prefill_token_threshold``."""
    cap = config.scheduled_tokens_cap
    return min(cap, config.long_prefill_token_threshold) if config.long_prefill_token_threshold > 0 else cap


def align_split_stalls(pool: PoolConfig, config: SchedulerConfig) -> bool:
    """True when vLLM's Mamba "align" split can cut every prefill chunk to zero tokens (docs/proofs.md
    Findings 4).

    The split floors a non-final chunk to a block boundary whenever the block fits
    ``max_prefill_tokens``, which vLLM takes from ``max_num_scheduled_tokens``; the chunk itself is
    bounded by the step budget, the smaller of that and ``max_num_batched_tokens``. With
    ``--max-num-scheduled-tokens`` above ``--max-num-batched-tokens`` and the Mamba block between
    them, a chunk of at most ``max_num_batched_tokens`` tokens never reaches the next boundary and is
    floored back to its start: a prompt longer than the input budget waits at the head of the queue
    forever with the whole pool free (vLLM 0.33.0 accepts the config at startup). Found by the
    Mamba-align scheduler machine's liveness check (CI, 2026-11-28)."""
    _check_setup(pool, config)
    block = _align_block_size(pool)
    budget = config.step_token_budget
    if config.long_prefill_token_threshold > 0:
        budget = min(budget, config.long_prefill_token_threshold)
    return block is not None and budget < block <= _align_prefill_cap(config) and pool.max_model_len > budget


def liveness_hazard(pool: PoolConfig, config: SchedulerConfig) -> str | None:
    """Why :func:`drain_bound` may not hold for this setup, or None when it does.

    * ``"startup-inconsistent"``: vLLM's startup would refuse the pool (:func:`startup_consistent`);
    * ``"align-split-stall"``: :func:`align_split_stalls` (Findings 4);
    * ``"partial-hit-tail"``: a group that can take a partial prefix hit has no block beyond the
      startup count for the copy-on-write tail the gate counts on top of the touched hits
      (Findings 3; vLLM 0.33.0 hangs without it)."""
    if not startup_consistent(pool, config):
        return "startup-inconsistent"
    if align_split_stalls(pool, config):
        return "align-split-stall"
    if max_blocks_per_request(pool, config) + partial_hit_groups(pool) > pool.num_blocks - 1:
        return "partial-hit-tail"
    return None


def liveness_guaranteed(pool: PoolConfig, config: SchedulerConfig) -> bool:
    """True when :func:`drain_bound` holds: no :func:`liveness_hazard`."""
    return liveness_hazard(pool, config) is None


def steps_alone(request: Request, pool: PoolConfig, config: SchedulerConfig) -> int:
    """``T_r``: schedule() calls the first claimant of the budget needs to finish from scratch."""
    _check_setup(pool, config)
    if not isinstance(request, Request):
        raise InvalidFieldError("request", request, "a kvref.impl.request.Request")
    c = config.step_token_budget
    if config.long_prefill_token_threshold > 0:
        c = min(c, config.long_prefill_token_threshold)
    length = min(request.num_prompt_tokens + request.max_tokens, pool.max_model_len)
    prefill = cdiv(length, c)
    block = _align_block_size(pool)
    if block is not None and c >= 1:
        # Mamba "align": a non-final chunk is floored to whole blocks when a block fits the prefill
        # cap, else it advances sub-block and stops at the next boundary (cdiv(block, c) steps per
        # block); the checkpoint, prompt-tail and shared-prefix stops cut at most one chunk each,
        # and each may leave the next chunk starting mid-block (one more)
        per_step = (c // block) * block if block <= _align_prefill_cap(config) else 0
        prefill = (cdiv(length, per_step) if per_step else cdiv(length, block) * cdiv(block, c)) + 8
    return prefill + request.max_tokens + (2 if config.async_scheduling else 0)


def drain_bound(requests: Iterable[Request], pool: PoolConfig, config: SchedulerConfig) -> int:
    """Schedule calls within which every live request finishes when nothing new arrives
    (on a setup for which :func:`liveness_guaranteed` holds)."""
    _check_setup(pool, config)
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise InvalidFieldError("requests", requests, "a collection of Requests")
    requests = list(requests)
    if not all(isinstance(r, Request) for r in requests):
        raise InvalidFieldError("requests", requests, "a collection of Requests")
    reqs = [r for r in requests if not r.is_finished]
    if not reqs:
        return config.max_concurrent_batches
    ts = [steps_alone(r, pool, config) for r in reqs]
    if config.policy == PRIORITY:
        return len(reqs) * (2 * config.max_num_seqs * max(ts) + 1) + config.max_concurrent_batches
    return sum(t + 1 for t in ts) + config.max_concurrent_batches
