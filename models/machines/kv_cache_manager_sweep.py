"""Every group set, every run: the KV cache manager machine once per group set (issue #22).

One Hypothesis run draws the group set of each trace like any other input, and a short run (the
default profile's 25 examples) mutates the first traces it finds: seeded runs of
``conform-kv-manager`` met five of the eleven group sets, so whole managers of vLLM (the circular
buffer's ring block, the sliding-window hit search off the alignment grid, Mamba prefix caching)
ran in one run and not in the next. The sweep runs the same machine, with the same options, on each
group set in turn for a few traces, so every manager kind is compared with vLLM on every run,
whatever the main run drew; then the sliding-window and Mamba "align" sets again with EAGLE and
sparse prefix-cache retention on every pool, asking for the Mamba shared-prefix checkpoint one
pool in two; then the fine-grained Mamba set with the checkpoint on every pool (issue #23), so that
vLLM's junction states are compared on every run (:func:`sweep_every_group_set`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvref.models.machines.kv_cache_manager import MachineRun, MachineStats, run_machine
from kvref.models.conformance.accepted import signature
from kvref.models.machines.block_index_programs import run_block_index_programs
from kvref.models.machines.free_queue_programs import run_free_queue_programs
from kvref.models.machines.mamba_junction_programs import run_junction_programs
from kvref.models.strategies.pools import GROUP_SETS
from kvref.spec.errors import InvalidFieldError, check_int


#: the group sets whose hit searches and retention masks depend on EAGLE and sparse retention
#: (sliding-window and Mamba "align" groups)
SPARSE_GROUP_SETS = ("fa+swa", "fa+swa+swa", "swa", "fa+mamba_align", "fa+mamba_fine")


@dataclass
class SweepRun:
    """What :func:`run_group_set_sweep` saw: traces per group set, and the first failing run."""

    traces: dict[str, int] = field(default_factory=dict)
    ops: int = 0
    prefix_hits: int = 0
    failure: MachineRun | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def run_group_set_sweep(kinds: tuple[str, ...], examples_per_set: int, *, group_sets: tuple[str, ...] = GROUP_SETS,
                        seed: int | None = None, **run_kwargs) -> SweepRun:
    """:func:`run_machine` on each of ``group_sets`` alone, ``examples_per_set`` examples each;
    stops at the first failing run (its :class:`MachineRun`, with the saved trace, is ``failure``).
    ``run_kwargs`` go to :func:`run_machine` (``out_dir``, ``shrink``, machine options)."""
    check_int("examples_per_set", examples_per_set, minimum=1)
    if (not isinstance(group_sets, tuple) or not group_sets
            or not all(isinstance(g, str) and g in GROUP_SETS for g in group_sets)):
        raise InvalidFieldError("group_sets", group_sets, f"a non-empty tuple of group sets from {GROUP_SETS}")
    sweep = SweepRun()
    for group_set in group_sets:
        run = run_machine(kinds, examples_per_set, seed=seed, group_sets=(group_set,), **run_kwargs)
        sweep.traces[group_set] = len(run.stats.steps)
        sweep.ops += run.stats.ops_applied
        sweep.prefix_hits += run.stats.prefix_hits
        if not run.ok:
            sweep.failure = run
            break
    return sweep


def sweep_every_group_set(kinds: tuple[str, ...], examples_per_set: int, *, seed: int | None = None,
                          **run_kwargs) -> SweepRun:
    """conform-kv-manager's sweep: every group set with the main run's drawn options (sparse
    retention one pool in two, EAGLE one in six), then the :data:`SPARSE_GROUP_SETS` with EAGLE
    wherever a pool allows it and sparse retention on every pool (the sliding-window hit search's
    dropped block and off-grid trimming, the retention masks; the Mamba shared-prefix checkpoint
    asked for one pool in two), then ``fa+mamba_fine`` with the checkpoint asked for on every pool
    (EAGLE one pool in two: vLLM's narrowing is compared too), then ``30 * examples_per_set``
    generated sibling programs that build junctions on purpose
    (:mod:`~kvref.models.machines.mamba_junction_programs`). One :class:`SweepRun` for all (the
    later passes' sets are named ``"<set> (EAGLE, sparse)"``, ``"<set> (shared-prefix
    checkpoint)"``, ``"fa+mamba_fine (junction programs)"``); with vLLM among ``kinds``, last,
    generated op sequences on vLLM's free block queue beside the reference's
    (:mod:`~kvref.models.machines.free_queue_programs`, ``"free block queue (programs)"``) and on
    vLLM's prefix-cache index beside the reference's
    (:mod:`~kvref.models.machines.block_index_programs`, ``"prefix-cache index (programs)"``)."""
    sweep = run_group_set_sweep(kinds, examples_per_set, seed=seed, retention=True, **run_kwargs)
    if not sweep.ok:
        return sweep
    sparse = run_group_set_sweep(kinds, examples_per_set, group_sets=SPARSE_GROUP_SETS, seed=seed,
                                 retention="always", eagle="always", shared_prefix_checkpoint=True, **run_kwargs)
    _merge(sweep, sparse, "EAGLE, sparse")
    if not sweep.ok:
        return sweep
    junctions = run_group_set_sweep(kinds, 2 * examples_per_set, group_sets=("fa+mamba_fine",), seed=seed,
                                    retention=True, shared_prefix_checkpoint="always", **run_kwargs)
    _merge(sweep, junctions, "shared-prefix checkpoint")
    if not sweep.ok:
        return sweep
    # the junction built on purpose: siblings of a computed prompt, chunks clipped at the junction
    failure, path, sig, seen = run_junction_programs(kinds, 30 * examples_per_set, seed=seed or 0,
                                                     out_dir=run_kwargs.get("out_dir"))
    sweep.traces["fa+mamba_fine (junction programs)"] = seen["programs"] + bool(failure)
    sweep.ops += seen["ops"]
    sweep.prefix_hits += seen["prefix_hits"]
    if failure:
        sweep.failure = MachineRun(MachineStats(), 0.0, failure=failure, trace_path=path, signature=sig)
        return sweep
    if "vllm" in kinds:  # the free block queue's whole API, vLLM's queue beside the reference's (#22)
        from kvref.impl.vllm.free_block_queue import VllmFreeBlockQueue

        failure, seen = run_free_queue_programs(VllmFreeBlockQueue, 10 * examples_per_set, seed=seed or 0)
        sweep.traces["free block queue (programs)"] = 10 * examples_per_set
        sweep.ops += sum(seen.values())
        if failure:
            sweep.failure = MachineRun(MachineStats(), 0.0, failure=failure, signature=signature(failure))
            return sweep
        # the prefix-cache index's whole API, vLLM's map beside the reference's (#22)
        from kvref.impl.vllm.block_hash_map import VllmBlockHashToBlockMap

        failure, seen = run_block_index_programs(VllmBlockHashToBlockMap, 10 * examples_per_set, seed=seed or 0)
        sweep.traces["prefix-cache index (programs)"] = 10 * examples_per_set + 1
        sweep.ops += sum(seen.values())
        if failure:
            sweep.failure = MachineRun(MachineStats(), 0.0, failure=failure, signature=signature(failure))
    return sweep


def _merge(sweep: SweepRun, later: SweepRun, label: str) -> None:
    sweep.traces.update({f"{k} ({label})": v for k, v in later.traces.items()})
    sweep.ops += later.ops
    sweep.prefix_hits += later.prefix_hits
    sweep.failure = later.failure
