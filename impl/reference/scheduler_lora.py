"""LoRA admission in the scheduler: ``max_loras`` (vLLM 0.33.0 ``Scheduler.schedule``, "Check that
adding the request still respects the max_loras constraint").

A step's batch may use at most ``max_loras`` distinct adapters. The adapters of every *running*
request count, scheduled in this step or not (a running request left out of this step can join a
later batch, and its adapter must still have a slot then). A waiting request whose adapter would be
one too many is skipped and requeued ahead of the requests behind it (it does not stall them: a
request with an adapter already in the batch, or with none, is admitted after it); every admitted
request's adapter joins the set. Preemption does not shrink the set within a step (vLLM builds it
once, before the waiting loop, which preemption skips anyway).

LoRA therefore decides *which* waiting requests get KV blocks, and in what order they are
admitted, without touching the token budget.
"""

from __future__ import annotations

from typing import Iterable

from kvref.impl.request import Request
from kvref.spec.errors import check_int


def check_max_loras(max_loras: int | None) -> int | None:
    """``LoRAConfig.max_loras`` (None: LoRA off, as without a ``lora_config``)."""
    if max_loras is not None:
        check_int("max_loras", max_loras, minimum=1)
    return max_loras


def running_loras(running: Iterable[Request]) -> set[int]:
    """The adapters of the running requests, the set the waiting loop starts from."""
    return {r.lora_request.lora_int_id for r in running if r.lora_request is not None}


def exceeds_max_loras(request: Request, scheduled_loras: set[int], max_loras: int | None) -> bool:
    """Admitting ``request`` would put one adapter too many in the batch."""
    return (max_loras is not None and request.lora_request is not None
            and len(scheduled_loras) == max_loras
            and request.lora_request.lora_int_id not in scheduled_loras)
