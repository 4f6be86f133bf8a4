"""``conform-offload``'s partial-tail part (#22): vLLM's OffloadingConnector on full-attention +
Mamba "align" pools with request hashes finer than the blocks, against the reference after every
operation (:mod:`kvref.models.offload.offloading_partial_tails`): partial-tail stores (the COW-ed
state and the attention block holding the boundary, fenced at once), lookups past the complete
chunks with the bridge chunk, loads of the tail, and their self-describing KV events; and the same
pools with an EAGLE drafter group (:func:`kvref.models.offload.offloading_eagle.eagle_partial_tail_cases`:
tails keyed at the drafter's proof margin, two blocks searched, the bridge chunk loaded, tails stored
only by requests that loaded from the CPU tier once their proof is computed).

The traces run in a child process started with ``PYTHONHASHSEED`` pinned to the check's seed, so
one seed gives one trace in every run. Why a process: vLLM 0.33.0's OffloadingConnector keeps a
job's keys in a ``set`` (``TransferJob.keys``) and ``CPUOffloadingManager.complete_store`` walks it,
marking the chunks evictable - and publishing their ``BlockStored`` events - in that set's order,
which follows ``hash(bytes)``, salted per process unless ``PYTHONHASHSEED`` is set. Two runs of the
same command then evict different chunks from a full CPU pool (the reference mirrors the order, so
each run still agrees with vLLM, but the traces and the counts in the summary differed: 40/39/12,
41/40/11, 41/39/9 stores/flushes/loads). The salt is fixed at interpreter start, so only a fresh
process can pin it; the pinned value also becomes NONE_HASH's seed on both sides
(``init_none_hash`` and the reference read ``PYTHONHASHSEED``). vLLM itself is left as it is. The
child is a :mod:`multiprocessing` ``spawn`` process, which ``--reach`` measures (coverage.py's
``concurrency = multiprocessing``), under the check's context; it inherits the environment (a
planted-fault overlay on ``PYTHONPATH`` included)."""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import replace

from .check_context import VerifyContext
from .report import CheckResult
from .verify_offload_retention import connector_divergence, with_retention


def _tails_child(seed: int, n: int, conn, quiet: bool = False, n_eagle: int = 0) -> None:
    """The child's body: run the ``n`` partial-tail cases of ``seed`` (then its ``n_eagle`` EAGLE
    partial-tail cases) and send back ``("ok", stats, coverage, digest)``, ``("diverged", message)`` or ``("error", message)``.
    ``quiet``: the parent silenced third-party logging, so the child does too (a spawned
    interpreter starts with none of the parent's logger levels)."""
    import hashlib

    if quiet:
        from kvref.quiet import quiet_third_party

        quiet_third_party()

    from kvref.models.offload.offloading_eagle import (TAIL_COVERAGE, eagle_partial_tail_cases,
                                                       run_eagle_partial_tail_traces)
    from kvref.models.offload.offloading_partial_tails import COVERAGE, partial_tail_cases, run_partial_tail_traces
    from kvref.models.offload.world_common import OffloadInvariantError

    try:
        digest = hashlib.sha256()
        stats = run_partial_tail_traces(partial_tail_cases(seed, n), digest=digest)
        counts = dict(COVERAGE)
        if n_eagle:
            eagle = run_eagle_partial_tail_traces(eagle_partial_tail_cases(seed, n_eagle), digest=digest)
            stats.update({f"eagle_{k}": v for k, v in eagle.items()})
            counts.update({f"eagle_{k}": v for k, v in TAIL_COVERAGE.items()})
        conn.send(("ok", stats, counts, digest.hexdigest()))
    except OffloadInvariantError as exc:
        conn.send(("diverged", str(exc)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_pinned_partial_tails(seed: int, n: int, n_eagle: int = 0) -> tuple[dict[str, int], dict[str, int], str]:
    """The ``n`` partial-tail cases of ``seed`` (and ``n_eagle`` EAGLE partial-tail cases, their
    stats and counts under ``eagle_`` names) in a child process whose ``PYTHONHASHSEED`` is
    ``seed`` (mod 2**32). Returns ``(stats, coverage counts, trace digest)``; raises
    :class:`~kvref.models.offload.world_common.OffloadInvariantError` when reference and vLLM
    differ, RuntimeError when the child fails otherwise."""
    from kvref.models.offload.world_common import OffloadInvariantError
    from kvref.quiet import quieted

    if not isinstance(seed, int) or isinstance(seed, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"seed {seed!r} / n {n!r}: seed must be an int, n an int >= 0")
    if not isinstance(n_eagle, int) or isinstance(n_eagle, bool) or n_eagle < 0:
        raise ValueError(f"n_eagle {n_eagle!r}: an int >= 0")
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    old = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = str(seed % 2**32)  # the spawned interpreter reads it at start
    try:
        proc = ctx.Process(target=_tails_child, args=(seed, n, sender, quieted(), n_eagle), name="kvref-partial-tails")
        proc.start()
    finally:
        if old is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = old
    sender.close()
    try:
        msg = receiver.recv()
    except EOFError:
        msg = ("error", "the child process died without a result")
    proc.join()
    if msg[0] == "diverged":
        raise OffloadInvariantError(msg[1])
    if msg[0] != "ok":
        raise RuntimeError(f"partial-tail traces (exit code {proc.exitcode}): {msg[1]}")
    return msg[1], msg[2], msg[3]


def with_partial_tails(ctx: VerifyContext, result: CheckResult) -> CheckResult:
    """``result`` (conform-offload's, passed) extended by the partial-tail traces, or the failure
    they found; then by the retention-interval part (:mod:`.verify_offload_retention`)."""
    from kvref.models.offload.offloading_partial_tails import COVERAGE
    from kvref.models.offload.world_common import OffloadInvariantError

    COVERAGE.clear()
    try:
        stats, counts, _ = run_pinned_partial_tails(ctx.seed, ctx.examples(8, 80), ctx.examples(4, 40))
    except OffloadInvariantError as exc:
        return connector_divergence(result, "on a pool with partial tails", "partial tails", exc)
    COVERAGE.update(counts)
    c = COVERAGE
    result = replace(result, summary=f"{result.summary}; {stats['traces']} OffloadingConnector traces with partial "
                     f"tails ({stats['ops']} ops: {c['tail_stores']} partial-tail stores, {c['tail_flushes']} "
                     f"flushed, {c['tail_loads']} loaded) agree; {stats.get('eagle_traces', 0)} with an EAGLE drafter group "
                     f"({stats.get('eagle_ops', 0)} ops: {c['eagle_tail_stores']} tails stored at the proof margin, "
                     f"{c['eagle_unloaded_skips'] + c['eagle_proof_skips']} skipped by it, {c['eagle_tail_hits']} hit, "
                     f"{c['eagle_bridge_hits']} with the bridge chunk) agree",
                     examined=result.examined + stats["ops"] + stats.get("eagle_ops", 0))
    return with_retention(ctx, result)
