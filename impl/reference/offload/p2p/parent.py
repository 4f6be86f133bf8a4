"""The producer's tiering manager as the P2P server role sees it (vLLM ``tiering/base.py`` ``ParentManager``).

A symmetric consumer's lookups are answered by the producer's tiering manager, through the
``ParentManager`` handle the engine passes to ``serve_external_requests``. Its contract (vLLM's
docstring): per remote request ``on_new_request``, then ``lookup`` per key and
``create_store_job`` to pin the hits (interleaved), then ``on_request_finished`` — always, even
when nothing was found.

:class:`ScriptedParent` is that manager reduced to what the tier observes: a *catalogue* of the
keys the engine's primary tier holds (each with its primary slot) and, per key, how many more
lookups answer ``HIT_PENDING`` (a chunk still being promoted) before it is a ``HIT``; a key not in
the catalogue is a ``MISS``. ``create_store_job`` pins the keys under a fresh job id
(:data:`FIRST_PIN_JOB` upward) with their slots. Every call is logged in a form both worlds share
(:func:`ctx_key`), so the calls the tier makes are compared call by call; ``open`` is the set of
synthetic requests not yet finished (a leak is one left open).
"""

from __future__ import annotations

from kvref.spec.errors import InvalidFieldError, check_int

#: the first job id a pin gets (above any job id the traces submit)
FIRST_PIN_JOB = 1_000_000


def ctx_key(ctx: str) -> tuple[str, str]:
    """``(kv_request_id, lookup number)`` of a synthetic lookup request ``p2p:<peer>:<kv>:lu<n>``
    (the peer's address differs between worlds; the rest is the protocol's)."""
    parts = ctx.rsplit(":", 2)
    return (parts[-2], parts[-1]) if len(parts) == 3 else ("", ctx)


class ScriptedParent:
    def __init__(self) -> None:
        self.catalogue: dict[bytes, tuple[int, int]] = {}  # key -> (primary slot, HIT_PENDING answers left)
        self.log: list[tuple] = []
        self.open: set[str] = set()
        self.next_job = FIRST_PIN_JOB

    def hold(self, key: bytes, chunk_id: int, pending: int) -> None:
        """The primary tier holds ``key`` at ``chunk_id``; the next ``pending`` lookups of it answer
        HIT_PENDING. ``pending < 0`` drops the key (a MISS from now on)."""
        if not isinstance(key, bytes) or not key:
            raise InvalidFieldError("key", key, "non-empty bytes")
        check_int("chunk_id", chunk_id, minimum=0)
        if isinstance(pending, bool) or not isinstance(pending, int):
            raise InvalidFieldError("pending", pending, "an int (negative: drop the key)")
        if pending < 0:
            self.catalogue.pop(key, None)
        else:
            self.catalogue[key] = (chunk_id, pending)

    def on_new_request(self, ctx: str) -> None:
        self.log.append(("on_new_request", ctx_key(ctx)))
        self.open.add(ctx)

    def lookup(self, key: bytes, ctx: str) -> str:
        entry = self.catalogue.get(key)
        if entry is None:
            result = "MISS"
        elif entry[1] > 0:
            self.catalogue[key] = (entry[0], entry[1] - 1)
            result = "HIT_PENDING"
        else:
            result = "HIT"
        self.log.append(("lookup", ctx_key(ctx), key, result))
        return result

    def create_store_job(self, keys: list[bytes], ctx: str) -> tuple[int, list[bytes], list[int]]:
        job, self.next_job = self.next_job, self.next_job + 1
        slots = [self.catalogue[k][0] for k in keys]
        self.log.append(("create_store_job", ctx_key(ctx), tuple(keys), job))
        return job, list(keys), slots

    def on_request_finished(self, ctx: str) -> None:
        self.log.append(("on_request_finished", ctx_key(ctx)))
        self.open.discard(ctx)
