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
* cleanup: the descriptor closed, the mapping released unless a view is still exported.
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


def random_region_case(rng) -> dict:
    page = mmap.PAGESIZE
    workers = rng.randint(1, 3)
    cpu_page = rng.choice([page // 2, page, page + 1024, 2 * page, 3000])
    row_stride = cdiv(workers * cpu_page, page) * page
    barrier = rng.random() < 0.5
    rankless = rng.random() < 0.15
    sizes = [[rng.choice([cpu_page // 2, cpu_page // 3, cpu_page - 8, 64, cpu_page + 1]) for _ in range(rng.randint(1, 3))]
             for _ in range(workers)]
    return dict(workers=workers, cpu_page=cpu_page, row_stride=row_stride, num_chunks=rng.randint(1, 6),
                num_segments=rng.choice([1, 2, 3, 4]), min_segment_bytes=rng.choice([row_stride, 2 * row_stride, 1 << 30]),
                barrier=barrier, populate_shard=rng.random() < 0.3, rankless=rankless,
                canonical=rankless or rng.random() < 0.3, sizes=sizes, retain=rng.random() < 0.2,
                fail=not barrier and rng.random() < 0.15)


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
             "refused_creations": 0}
    regions = V.build_regions(engine, rows, ranks, stride, cpu_page, barrier=case["barrier"],
                              populate_shard=case["populate_shard"], num_segments=case["num_segments"],
                              min_segment_bytes=case["min_segment_bytes"], fail_first_creator=case["fail"])
    segments = region_segments(path, rows, stride, case["num_segments"], case["min_segment_bytes"])
    paths = [p for p, _, _ in segments]
    try:
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
        image = bytearray(rows * stride)
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


def run_region_cases(seed: int, n: int) -> dict[str, Any]:
    """``n`` generated cases through :func:`compare_region_case`; raises ``AssertionError`` at the
    first difference."""
    import random

    rng = random.Random(f"shared-offload-region-{seed}")
    totals: dict[str, int] = {"cases": 0}
    for _ in range(n):
        case = random_region_case(rng)
        bad, tally = compare_region_case(case)
        if bad:
            raise AssertionError(f"vLLM's SharedOffloadRegion: {bad}")
        totals["cases"] += 1
        for k, v in tally.items():
            totals[k] = totals.get(k, 0) + v
    return totals
