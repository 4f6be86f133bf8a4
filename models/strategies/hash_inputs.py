"""Strategies for what goes into vLLM's block hashes besides the tokens (issue #23).

``hashing_settings`` draws a pool's hashing: vLLM's ``prefix_caching_hash_algo`` (sha256 mostly,
the CBOR and xxhash variants sometimes; xxhash only where its package is installed), the NONE_HASH
seed (always given for xxhash, whose default seed is random per process), the hash lookahead of
EAGLE block drop and whether prefix-cache stats are kept.

``request_hash_inputs`` draws a request's block-hash inputs: multimodal items (one or two, at
drawn positions, often spanning blocks), a LoRA adapter (two names, one of them with two paths:
re-pointing a name must not reuse KV), prompt embeddings derived from the tokens (so requests
sharing a prompt share embeddings and still hit, unless their variant byte differs), a session id
and ``skip_reading_prefix_cache``. Half the requests get none, so prefix hits between plain
requests stay as frequent as before. Few draws per request: Hypothesis' per-draw cost dominates.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from hypothesis import strategies as st

_ALGOS = ("sha256",) * 5 + ("sha256_cbor",) + (
    ("xxhash", "xxhash_cbor") if importlib.util.find_spec("xxhash") is not None else ())

_LORAS = (None, ["lora-a", 1, "/adapters/a"], ["lora-a", 1, "/adapters/a-v2"], ["lora-b", 2, "/adapters/b"])


@st.composite
def hashing_settings(draw) -> dict[str, Any]:
    """``PoolConfig`` fields for the pool's hashing (``dataclasses.replace`` them in).

    Hash lookahead is vLLM's ``num_prefill_lookahead_tokens`` under EAGLE block drop: 1 for EAGLE
    (a hash then exists for every block a hit may cover: ``(num_tokens - 1) // block_size``);
    with it the scheduler turns the block drop off (``use_eagle=False``), which the machine
    applies. Pools with Mamba groups get none from the machine: the reference's Mamba checkpoint
    positions do not read it yet (docs/coverage.md)."""
    algo = draw(st.sampled_from(_ALGOS), label="hash_algo")
    seed = (draw(st.sampled_from(("0", "kvref-seed")), label="none_hash_seed") if algo.startswith("xxhash")
            else draw(st.sampled_from((None, None, None, "1")), label="none_hash_seed"))
    return dict(prefix_caching_hash_algo=algo, none_hash_seed=seed,
                num_hash_lookahead_tokens=draw(st.sampled_from((0, 0, 0, 1)), label="hash_lookahead"),
                log_stats=draw(st.sampled_from((True, True, True, False)), label="log_stats"))


def embeds_rows(prompt: list[int], variant: int) -> list[str]:
    """One 4-byte embedding row per token (hex), a function of the token and ``variant``."""
    return [bytes((t & 0xFF, (t >> 8) & 0xFF, variant, 0x3F)).hex() for t in prompt]


@st.composite
def request_hash_inputs(draw, prompt: list[int]) -> dict[str, Any]:
    """The ``add`` op's optional fields ``mm``, ``lora``, ``embeds``, ``session_id``, ``skip_reading``,
    ``report_full`` (``kv_cache_report_mode="full"``: hits announced in KV events)."""
    n = len(prompt)
    kind = draw(st.integers(0, 15), label="hash_inputs_kind")
    out: dict[str, Any] = {}
    if kind < 8:
        # plain requests (the ones that hit) announce their hits in "full" mode one time in four:
        # vLLM's emit_cached_block_events runs only on a hit in that mode (#22)
        if kind >= 6:
            out["report_full"] = True
        return out
    if kind in (8, 9, 10, 14, 15):  # multimodal items at drawn positions
        offset = draw(st.integers(0, n - 1), label="mm_offset")
        length = draw(st.integers(1, max(1, min(12, n - offset))), label="mm_length")
        items = [[draw(st.sampled_from(("img-a", "img-b")), label="mm_id"), offset, length]]
        if kind == 10 and offset + length < n:
            items.append(["img-a", offset + length, n - offset - length])
        out["mm"] = items
    if kind in (11, 14):
        out["lora"] = draw(st.sampled_from(_LORAS[1:]), label="lora")
    if kind in (12, 15):
        out["embeds"] = embeds_rows(prompt, draw(st.sampled_from((0, 0, 1)), label="embeds_variant"))
    if kind == 13:
        out["skip_reading"] = True
    if kind >= 14:
        out["session_id"] = "session-1"
    if kind in (9, 15):
        out["report_full"] = True
    return out
