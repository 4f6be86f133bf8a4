"""vLLM 0.33.0's agreement on the SimpleCPU offload pool size across worker ranks (#22).

Each SimpleCPU worker sizes its CPU pool from its own budget, then the ranks all-reduce (MIN) the
count over the world group's gloo CPU group (``sync_num_offload_blocks_across_workers``), so every
rank allocates the same pool and the scheduler can trust one block id space. Here ``world_size``
ranks are forked from this process (vLLM already imported), each runs vLLM's
``init_distributed_environment`` (gloo over loopback), meets the CPU offload tier's start-up barrier
(``cpu/spec.py``'s ``_all_workers_barrier``) and then vLLM's sizing function with its own count.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any


def _rank(rank: int, world_size: int, port: int, count: int, queue: Any) -> None:
    try:
        from vllm.distributed.parallel_state import init_distributed_environment
        from vllm.v1.kv_offload.cpu.spec import _all_workers_barrier
        from vllm.v1.simple_kv_offload.sizing import sync_num_offload_blocks_across_workers

        init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        _all_workers_barrier()
        queue.put((rank, sync_num_offload_blocks_across_workers(count)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as the rank's outcome
        queue.put((rank, f"{type(exc).__name__}: {exc}"))


def agreed_num_cpu_blocks(counts: list[int], timeout: float = 60.0) -> list[Any]:
    """Per rank, what vLLM's sizing returned for ``counts[rank]`` (or the error it raised)."""
    import vllm.distributed.parallel_state  # noqa: F401 - imported before the fork: children start warm
    import vllm.v1.kv_offload.cpu.spec  # noqa: F401
    import vllm.v1.simple_kv_offload.sizing  # noqa: F401

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, len(counts), port, c, queue)) for r, c in enumerate(counts)]
    for p in procs:
        p.start()
    out: list[Any] = [None] * len(counts)
    try:
        for _ in procs:
            rank, value = queue.get(timeout=timeout)
            out[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
    return out


def unsynced_num_cpu_blocks(count: int) -> int | None:
    """vLLM's sizing in a process without ``torch.distributed`` (this one): the rank keeps its own
    count. None when this process has a process group (then the case cannot be run here)."""
    import torch.distributed as dist
    from vllm.v1.simple_kv_offload.sizing import sync_num_offload_blocks_across_workers

    if dist.is_initialized():
        return None
    return sync_num_offload_blocks_across_workers(count)
