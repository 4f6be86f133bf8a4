"""SWA bounded replay at admission (DeepSeek-V4.1; vLLM 0.33.0 ``Scheduler``, issue #22).

A :class:`~kvref.spec.kv_cache_interface.SlidingWindowMLASpec` with ``bounded_replay=True`` keeps
no prefix cache of its own: its window's KV is rebuilt by recomputing the hit's last window. vLLM's
scheduler does this on every fresh admission (a waiting request whose prefix-cache lookup ran):

* ``Scheduler.__init__`` collects the groups with ``prefix_replay_tokens > 0`` and requires one
  window for all of them (``prefix_replay_tokens``, 0 without such a group);
* a hit of ``0 < hit <= window`` tokens is dropped (it would be recomputed in full and save
  nothing): no computed blocks are adopted and the request starts from token 0;
* a longer hit is adopted whole (``allocate_slots`` gets ``num_new_computed_tokens = hit`` and the
  hit's blocks), but the request's computed count is rewound by the window
  (``_mark_prefix_replay``: ``replay_start = hit - window``), so the window's tokens are scheduled
  again; ``allocate_slots`` is asked only for the tokens past the hit
  (``max(num_new_tokens - num_replay_tokens, 0)``: a chunk ending inside the replayed range needs
  no new slot).

Beside a KV connector (:mod:`.scheduler_connector`, vLLM's waiting loop and
``_update_waiting_for_remote_kv``) the connector's answer to ``get_loaded_kv_cache_group_ids``
decides whether a load carries the window (``_load_restores_replay_window``: every replay group is
among the loaded ones -- a P/D transfer of the request's own blocks; a hash-addressed store, the
connector default, loads the prefix-cacheable groups only, never the window):

* a load that does not carry it has its external tokens cut to whole blocks (an async load left
  with none is no load), and the hit (local + external) is dropped when no longer than the window
  and rewound by the window otherwise -- at admission for a sync load, after it landed for an async
  one (with no drop there: the admission already dropped the short ones);
* a load that carries it is taken whole and replays nothing (``replay_start = 0``);
* a failed async load replays its (valid) remainder as a load without the window.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvref.impl.interface import PoolConfig
from kvref.spec.errors import InvalidFieldError, check_int


def prefix_replay_tokens(pool: PoolConfig) -> int:
    """The one replay window of the pool's groups (vLLM ``Scheduler.prefix_replay_tokens``): 0
    without a bounded-replay group; groups with different windows are refused (vLLM asserts "Prefix
    replay windows should agree"), since one rewind must match every group's allocation."""
    if not isinstance(pool, PoolConfig):
        raise InvalidFieldError("pool", pool, "a PoolConfig")
    windows = {g.kv_cache_spec.prefix_replay_tokens for g in pool.groups if g.kv_cache_spec.prefix_replay_tokens > 0}
    if len(windows) > 1:
        raise InvalidFieldError("pool.groups", sorted(windows), "bounded-replay groups with one replay window")
    return windows.pop() if windows else 0


@dataclass(frozen=True)
class ReplayAdmission:
    """What a fresh admission's prefix hit becomes under bounded replay.

    ``hit_tokens`` / ``hit_kept``: the hit handed to ``allocate_slots`` (0 / False when it was
    dropped); ``num_computed_tokens``: where the request's computation starts (the hit less the
    replay); ``num_replay_tokens``: hit tokens recomputed; ``replay_start``: vLLM's
    ``Request.replay_start`` (the position the replay starts from).
    """

    hit_tokens: int
    hit_kept: bool
    num_computed_tokens: int
    num_replay_tokens: int
    replay_start: int

    def __post_init__(self) -> None:
        for name in ("hit_tokens", "num_computed_tokens", "num_replay_tokens", "replay_start"):
            check_int(f"ReplayAdmission.{name}", getattr(self, name), minimum=0)
        if not isinstance(self.hit_kept, bool) or self.hit_kept != (self.hit_tokens > 0):
            raise InvalidFieldError("ReplayAdmission.hit_kept", self.hit_kept, f"{self.hit_tokens > 0} (hit_tokens > 0)")
        if self.num_computed_tokens + self.num_replay_tokens != self.hit_tokens \
                or self.replay_start != self.num_computed_tokens:
            raise InvalidFieldError("ReplayAdmission.num_replay_tokens", self.num_replay_tokens,
                                    f"hit_tokens - num_computed_tokens = {self.hit_tokens - self.num_computed_tokens}, "
                                    "with replay_start = num_computed_tokens")


def drop_short_hit(window: int, num_hit: int) -> bool:
    """Whether a hit is dropped: a replay window is set and ``0 < num_hit <= window`` (vLLM: the
    replay would recompute the whole hit; the admission starts from scratch instead)."""
    check_int("window", window, minimum=0)
    check_int("num_hit", num_hit, minimum=0)
    return bool(window) and 0 < num_hit <= window


def replay_admission(window: int, num_hit: int) -> ReplayAdmission:
    """The admission of a request whose prefix-cache lookup hit ``num_hit`` tokens (vLLM's
    ``window_loaded = False`` path: no KV connector)."""
    if drop_short_hit(window, num_hit):
        num_hit = 0
    kept = num_hit > 0
    num_replay = min(window, num_hit) if window else 0
    return ReplayAdmission(hit_tokens=num_hit, hit_kept=kept, num_computed_tokens=num_hit - num_replay,
                           num_replay_tokens=num_replay, replay_start=num_hit - num_replay)


def mark_prefix_replay(window: int, num_hit: int, window_loaded: bool) -> tuple[int, int]:
    """vLLM ``Scheduler._mark_prefix_replay``: ``(num_replay_tokens, replay_start)`` of a hit of
    ``num_hit`` tokens under a replay window ``window > 0``: nothing when the hit's KV load carried
    the window (``replay_start = 0``), else the hit's last ``min(window, num_hit)`` tokens, replayed
    from ``num_hit - num_replay``. No drop here: the caller drops short hits at admission."""
    check_int("window", window, minimum=1)
    check_int("num_hit", num_hit, minimum=0)
    if not isinstance(window_loaded, bool):
        raise InvalidFieldError("window_loaded", window_loaded, "True or False")
    if window_loaded:
        return 0, 0
    num_replay = min(window, num_hit)
    return num_replay, num_hit - num_replay


def load_restores_window(replay_group_ids: tuple[int, ...], loaded_group_ids: tuple[int, ...]) -> bool:
    """vLLM ``Scheduler._load_restores_replay_window``: a pool with replay groups, every one of them
    among the groups the connector's load restores (``get_loaded_kv_cache_group_ids``)."""
    for name, ids in (("replay_group_ids", replay_group_ids), ("loaded_group_ids", loaded_group_ids)):
        if not isinstance(ids, tuple):
            raise InvalidFieldError(name, ids, "a tuple of KV cache group indices")
        for i in ids:
            check_int(f"{name}[i]", i, minimum=0)
    return bool(replay_group_ids) and set(replay_group_ids) <= set(loaded_group_ids)


def trim_external_hit(block_size: int, num_external: int, load_async: bool, window_loaded: bool) -> tuple[int, bool]:
    """vLLM's waiting loop with a replay window: an external hit whose load does not carry the
    window is cut to whole blocks (the replay starts in the block holding the hit's first replayed
    token; a hit ending one token short of a block would let the sliding-window group retire that
    block), and an async load left with no token is no load. Returns ``(num_external, load_async)``."""
    check_int("block_size", block_size, minimum=1)
    check_int("num_external", num_external, minimum=0)
    for name, value in (("load_async", load_async), ("window_loaded", window_loaded)):
        if not isinstance(value, bool):
            raise InvalidFieldError(name, value, "True or False")
    if window_loaded and num_external:
        return num_external, load_async
    num_external -= num_external % block_size
    return num_external, load_async and num_external > 0


def slots_past_hit(num_new_tokens: int, num_replay_tokens: int) -> int:
    """Tokens ``allocate_slots`` is asked for at a replayed admission: the replayed tokens already
    have slots in the adopted hit (vLLM ``num_tokens_past_hit``)."""
    check_int("num_new_tokens", num_new_tokens, minimum=0)
    check_int("num_replay_tokens", num_replay_tokens, minimum=0)
    return max(num_new_tokens - num_replay_tokens, 0)
