"""vLLM's CPU offload shared region (``SharedOffloadRegion``) against kvref's layout of it (#22).

Each generated case builds one engine's region for 1-3 workers (threads meeting at a barrier, or
one after the other without), over 1-6 chunk rows, split into up to 4 backing files or not, with
per-worker slots or the canonical shared layout, pre-faulted per worker or per shard; some cases
have the first creator's memory check refuse, some keep a view of the region exported when it is
cleaned up. The oracle (:mod:`kvref.impl.reference.offload.shared_region_layout` and what follows
from it) checks:

* the backing files (paths, offsets, lengths) and each worker's pre-fault ranges;
* every tensor view's offset, shape and stride, and which ones vLLM refuses (slot or row full);
* the bytes: every worker writes its views, and every worker's mapping must show exactly the
  image the layout predicts (a segment mapped at the wrong offset or a view one slot off shows);
* the files: gone once all workers passed the barrier, else kept until the creator cleans up,
  gone after cleanup, gone after a refused creation (whose error is the refusal itself);
* cleanup: the descriptor closed, the mapping released unless a view is still exported, and a
  second cleanup changes nothing;
* the host's pre-faulting: on a kernel without ``MADV_POPULATE_WRITE`` vLLM touches page by page
  and must keep the bytes an earlier worker already wrote (each case without a barrier fills the
  first worker's region before the others map it); a ``madvise`` that fails otherwise surfaces
  as that error;
* failed constructions leave nothing behind: a collective that fails at the barrier, a creator
  that fails after joiners opened its file (they must give up with vLLM's "creator failed"
  error, not wait out the 30 s), a refused pre-fault: every worker raises the first error (a
  failing barrier on the way out must not replace it), and no file, descriptor or mapping of the
  region remains; workers finding the never-sized file of a creator that died (killed between
  creating and sizing it) time out rather than map it, and leave that file as they found it.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from kvref.impl.reference.offload.shared_region_layout import (
    canonical_view_offsets,
    region_segments,
    worker_slot_ranges,
    worker_view_offsets,
)
from kvref.spec.mathutil import cdiv

_COUNTER = [0]
#: how long a worker waits on a dead creator's never-sized file here (vLLM: 30 s)
_STUB_WAIT_S = 0.05


def random_region_case(rng) -> dict:
    page = mmap.PAGESIZE
    workers = rng.randint(1, 3)
    cpu_page = rng.choice([page // 2, page, page + 1024, 2 * page, 3000])
    row_stride = cdiv(workers * cpu_page, page) * page
    barrier = rng.random() < 0.5
    rankless = rng.random() < 0.15
    sizes = [[rng.choice([cpu_page // 2, cpu_page // 3, cpu_page - 8, 64, cpu_page + 1]) for _ in range(rng.randint(1, 3))]
             for _ in range(workers)]
    populate_shard = rng.random() < 0.3
    fail = not barrier and rng.random() < 0.15
    # how construction goes wrong, if it does: a collective failing at the barrier, the creator
    # failing once the joiners opened its file, madvise refusing (inside the guarded section only
    # with per-shard pre-faulting: vLLM's per-worker pre-fault runs after it, unguarded)
    trouble = rng.choice(["none"] * 6 + ["collective", "stale_stub"] + ["late_creator"] * (barrier and workers > 1)
                         + ["madvise"] * (populate_shard and not fail))
    populate = "error" if trouble == "madvise" else rng.choice(["kernel", "kernel", "fallback"])
    return dict(workers=workers, cpu_page=cpu_page, row_stride=row_stride, num_chunks=rng.randint(1, 6),
                num_segments=rng.choice([1, 2, 3, 4]), min_segment_bytes=rng.choice([row_stride, 2 * row_stride, 1 << 30]),
                barrier=barrier, populate_shard=populate_shard, rankless=rankless,
                canonical=rankless or rng.random() < 0.3, sizes=sizes, retain=rng.random() < 0.2,
                fail=fail and trouble != "collective", trouble=trouble, populate=populate,
                twice=rng.random() < 0.3)


_CYCLE = bytes(range(251)) * 40  # longer than any view row here


def _pattern(rank: int, tensor: int, chunk: int, size: int) -> bytes:
    """A row of bytes that differs per worker, tensor and chunk."""
    start = (7 * rank + 31 * tensor + 13 * chunk) % 251
    return _CYCLE[start:start + size]


def compare_region_case(case: dict) -> tuple[str | None, dict]:
    """None when vLLM's regions behave as the layout says, else what differs; and tallies."""
    from kvref.impl.vllm import shared_region as V

    _COUNTER[0] += 1
    engine = f"kvref-{os.getpid()}-{_COUNTER[0]}"
    path = f"/dev/shm/vllm_offload_{engine}.mmap"
    w, rows, stride, cpu_page = case["workers"], case["num_chunks"], case["row_stride"], case["cpu_page"]
    ranks = [None] * w if case["rankless"] else list(range(w))
    where = f"region case {case}"
    tally = {"regions": 0, "segmented": 0, "views": 0, "refused_views": 0, "bytes_checked": 0, "retained": 0,
             "refused_creations": 0, "prefilled": 0, "fallback_populate": 0, "failed_collectives": 0,
             "late_creator_failures": 0, "refused_populates": 0, "second_cleanups": 0, "stale_stubs": 0}
    trouble = case.get("trouble", "none")
    first_image: list[bytes] = []

    def fill_first(region) -> None:
        """What an earlier worker wrote before the later ones map the region: a known image."""
        n = rows * stride
        data = (bytes(range(1, 252)) * (n // 251 + 1))[:n]  # no zero byte: a lost page shows
        V.write_base(region, data)
        first_image.append(data)

    if trouble == "stale_stub":  # a creator killed between creating the file and sizing it
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    regions = V.build_regions(engine, rows, ranks, stride, cpu_page, barrier=case["barrier"],
                              populate_shard=case["populate_shard"], num_segments=case["num_segments"],
                              min_segment_bytes=case["min_segment_bytes"], fail_first_creator=case["fail"],
                              creator_fails_late=trouble == "late_creator", barrier_fails=trouble == "collective",
                              populate=case.get("populate", "kernel"),
                              after_first=None if case["barrier"] or trouble != "none" else fill_first,
                              join_timeout_s=_STUB_WAIT_S if trouble == "stale_stub" else None)
    segments = region_segments(path, rows, stride, case["num_segments"], case["min_segment_bytes"])
    paths = [p for p, _, _ in segments]
    try:
        if trouble != "none":
            return _compare_failed_construction(case, regions, paths, path, where, tally), tally
        if case["fail"]:
            if not isinstance(regions[0], MemoryError):
                return f"{where}: the refused creator gave {regions[0]!r}, not the refusal", tally
            tally["refused_creations"] += 1
            regions, ranks = regions[1:], ranks[1:]
        bad = [r for r in regions if isinstance(r, BaseException)]
        if bad:
            return f"{where}: construction failed: {bad[0]!r}", tally
        if not regions:
            leftover = [p for p in paths if os.path.exists(p)]
            return (f"{where}: a refused creation left {leftover}" if leftover else None), tally
        tally["regions"] += len(regions)
        tally["segmented"] += len(segments) > 1
        exists = [os.path.exists(p) for p in paths]
        if exists != [not case["barrier"]] * len(paths):
            return f"{where}: files {paths} exist {exists} after construction (barrier={case['barrier']})", tally
        image = bytearray(first_image[0]) if first_image else bytearray(rows * stride)
        tally["prefilled"] += bool(first_image)
        tally["fallback_populate"] += case.get("populate") == "fallback"
        if first_image:
            for region, rank in zip(regions, ranks):
                if V.base_bytes(region) != first_image[0]:
                    return (f"{where}: rank {rank} does not see the bytes the first worker wrote before it "
                            f"mapped the region (pre-faulting with populate={case.get('populate')} lost them)"), tally
        views_alive = []
        for region, rank in zip(regions, ranks):
            got = V.region_segments(region)
            if got != segments:
                return f"{where}: rank {rank}: segments {got}, reference {segments}", tally
            if rank is not None:
                got_slots = V.slot_ranges(region)
                want = worker_slot_ranges(rank, rows, stride, cpu_page, mmap.PAGESIZE, len(segments) > 1)
                if got_slots != want:
                    return f"{where}: rank {rank}: pre-fault ranges {got_slots}, reference {want}", tally
            sizes = case["sizes"][rank or 0]
            canonical = case["canonical"]
            want_offsets = canonical_view_offsets(stride, sizes) if canonical else \
                worker_view_offsets(rank, cpu_page, sizes)
            views = V.add_views(region, sizes, canonical)
            got_offsets = [None if v is None else v.storage_offset() for v in views]
            if got_offsets != want_offsets:
                return f"{where}: rank {rank}: view offsets {got_offsets}, reference {want_offsets}", tally
            for t, (v, size) in enumerate(zip(views, sizes)):
                if v is None:
                    tally["refused_views"] += 1
                    continue
                tally["views"] += 1
                if tuple(v.shape) != (rows, size) or tuple(v.stride()) != (stride, 1):
                    return f"{where}: rank {rank} view {t}: shape {tuple(v.shape)} stride {v.stride()}", tally
                if canonical and rank not in (None, 0):
                    continue  # canonical views are shared: one worker writes them here
                import torch

                for c in range(rows):
                    data = _pattern(rank or 0, t, c, size)
                    v[c].copy_(torch.frombuffer(bytearray(data), dtype=torch.int8))
                    start = c * stride + want_offsets[t]
                    image[start:start + size] = data
            views_alive.append(views)
        for region, rank in zip(regions, ranks):
            seen = V.base_bytes(region)
            tally["bytes_checked"] += len(seen)
            if seen != bytes(image):
                first = next(i for i, (a, b) in enumerate(zip(seen, image)) if a != b)
                return (f"{where}: rank {rank} sees byte {first} (chunk {first // stride}, offset {first % stride}) as "
                        f"{seen[first]}, the layout puts {image[first]} there"), tally
        held = V.kv_memoryview(regions[-1]) if case["retain"] else None
        views_alive.clear()
        v = views = None  # noqa: F841 - no view of ours may outlive this point (cleanup would keep the mapping)
        for i, region in enumerate(regions):
            kept, closed = V.cleanup(region)
            want_kept = held is not None and i == len(regions) - 1
            tally["retained"] += kept
            if (kept, closed) != (want_kept, True):
                return f"{where}: rank {ranks[i]} after cleanup: mapping kept {kept}, fd closed {closed}", tally
            try:
                region.base_tensor  # noqa: B018 - released: must refuse
                return f"{where}: rank {ranks[i]}: base_tensor still served after cleanup", tally
            except RuntimeError:
                pass
            if case.get("twice"):
                tally["second_cleanups"] += 1
                again = V.cleanup(region)
                if again != (kept, closed):
                    return f"{where}: rank {ranks[i]}: a second cleanup gave {again}, the first {(kept, closed)}", tally
        fds = V.open_fds(path)
        if fds and held is None:  # a mapping vLLM keeps holds its own descriptor (mmap dups it)
            return f"{where}: {fds} descriptors of the region's files still open after every worker cleaned up", tally
        if held is None and V.mapped(path):
            return f"{where}: the region is still mapped after every worker cleaned up (nothing exports it)", tally
        if held is not None:
            held.release()
        leftover = [p for p in paths if os.path.exists(p)]
        if leftover:
            return f"{where}: files {leftover} left after every worker cleaned up", tally
        return None, tally
    finally:
        for p in paths:  # never leave /dev/shm files behind, whatever failed
            if os.path.exists(p):
                os.unlink(p)


def _compare_failed_construction(case: dict, regions: list, paths: list[str], path: str, where: str,
                                 tally: dict) -> str | None:
    """A construction that cannot succeed: every worker raises the error the trouble predicts (the
    first one, never one from releasing its peers), and nothing of the region is left."""
    trouble, n = case["trouble"], len(regions)
    got = [type(r).__name__ + ": " + str(r) if isinstance(r, BaseException) else "a region" for r in regions]
    if trouble == "collective":
        tally["failed_collectives"] += 1
        want = [f"RuntimeError: kvref: collective failed (worker {i}, call 1)" for i in range(n)]
        if got != want:
            return f"{where}: a failing collective gave {got}, expected {want}"
    elif trouble == "stale_stub":
        tally["stale_stubs"] += 1
        want = [f"TimeoutError: Timed out waiting for mmap file to reach {_first_length(case)} bytes"] * n
        if got != want:
            return f"{where}: workers finding a never-sized file of a dead creator gave {got}, expected {want}"
        # nobody created it, so nobody removes it: the dead creator's stub stays (and nothing else)
        extra = [p for p in paths[1:] if os.path.exists(p)]
        if not os.path.exists(path) or extra:
            return f"{where}: after a dead creator's stub: the stub exists {os.path.exists(path)}, other files {extra}"
        paths = paths[1:]
    elif trouble == "late_creator":
        tally["late_creator_failures"] += 1
        refused = [g for g in got if g.startswith("MemoryError: kvref: planted refusal")]
        gave_up = [g for g in got if g == "RuntimeError: Shared offload region creator failed during initialization."]
        if len(refused) != 1 or len(gave_up) != n - 1:
            return f"{where}: a creator failing after {n - 1} joiners opened its file gave {got}"
    else:
        tally["refused_populates"] += 1
        import errno

        ok = all(isinstance(r, OSError) and r.errno == errno.EPERM for r in regions)
        if not ok:
            return f"{where}: a refused madvise gave {got}, expected that OSError (EPERM) from every worker"
    leftover = [p for p in paths if os.path.exists(p)]
    if leftover:
        return f"{where}: failed construction ({trouble}) left files {leftover}"
    from kvref.impl.vllm import shared_region as V

    fds = V.open_fds(path)
    if fds:
        return f"{where}: failed construction ({trouble}) left {fds} descriptors of the region's files open"
    if V.mapped(path):
        return f"{where}: failed construction ({trouble}) left the region mapped"
    return None


#: the first cases' failure paths (a creator failing under joiners needs a barrier and peers; a
#: refused madvise the guarded per-shard pre-fault), so that a small budget reaches each
_FORCED = (
    dict(trouble="late_creator", barrier=True, workers=3, rankless=False, fail=False, populate="kernel",
         sizes=[[64], [64], [64]]),
    dict(trouble="madvise", populate_shard=True, fail=False, populate="error"),
    dict(trouble="collective", fail=False),
    dict(trouble="stale_stub", fail=False, populate="kernel"),
    dict(trouble="none", barrier=False, fail=False, populate="fallback", rankless=False, populate_shard=False,
         retain=True, twice=True),
)


def _first_length(case: dict) -> int:
    """The first backing file's size, which a joiner waits for."""
    return region_segments("x", case["num_chunks"], case["row_stride"], case["num_segments"],
                           case["min_segment_bytes"])[0][2]


def run_region_cases(seed: int, n: int) -> dict[str, Any]:
    """``n`` generated cases through :func:`compare_region_case`; raises ``AssertionError`` at the
    first difference."""
    import random

    rng = random.Random(f"shared-offload-region-{seed}")
    totals: dict[str, int] = {"cases": 0}
    for i in range(n):
        case = random_region_case(rng)
        if i < len(_FORCED):  # every failure path in the first cases, whatever the budget
            case.update(_FORCED[i])
        bad, tally = compare_region_case(case)
        if bad:
            raise AssertionError(f"vLLM's SharedOffloadRegion: {bad}")
        totals["cases"] += 1
        for k, v in tally.items():
            totals[k] = totals.get(k, 0) + v
    return totals
