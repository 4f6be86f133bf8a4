"""The run-trace format, version 7: what each line holds, and how a reader checks it.

One header line, then one JSON object per line, each with a type ``"t"``:

========== =========================================================================================
``add``    a request arrived: ``id``, ``prompt`` (base64 of little-endian uint32 token ids),
           ``max_tokens``, ``stop`` (stop token ids, EOS included unless ignored), ``salt``
           (``cache_salt`` or null), ``priority``, ``arrival``; ``x``: features of the request the
           reference does not model (structured output, multimodal, LoRA, ...), if any; version 5
           (issue #28) adds vLLM ``check_stop``'s other inputs: ``eos`` (``SamplingParams.eos_token_id``,
           null with ``ignore_eos``), ``min`` (``min_tokens``, absent: 0), ``rep``
           (``repetition_detection`` as ``[max_pattern_size, min_pattern_size, min_count]``, absent: off);
           version 6 adds ``resumable`` (true: vLLM's ``Request.resumable``, a streaming-input
           session's turn; absent: false). An ``add`` whose ``id`` is a live session's is the
           session's next input (``resumable``) or its end (not). Version 6 also adds ``embeds``
           for a request with prompt embeddings: base64 of an 8-byte BLAKE2b digest of each prompt
           position's embedding row (keyed under the run's anonymizer key when anonymized), which
           the block hashes take as the rows (equal rows, equal digests); ``prompt`` then holds
           vLLM's token ids for those positions (0 where the embedding stands in). Version 7
           adds ``so`` (true: the request uses structured output, vLLM's ``use_structured_output``).
``abort``  ``finish_requests`` from outside the scheduler (client abort): ``ids`` it finished,
           ``status`` (vLLM's ``RequestStatus`` name).
``sched``  one ``schedule()``: ``step`` (0, 1, ... per schedule call); ``ids`` and ``n``: the
           scheduled requests in batch order and their token counts (``n`` and ``cached``'s
           ``num_computed`` are int lists, or the same as base64 uint32 like prompts); ``new``: ``[[id,
           num_computed, block_ids], ...]`` for first admissions (``block_ids``: the whole table
           per KV cache group, hits included; each group an int list or base64 uint32);
           ``cached``: ``[ids, num_computed, block_ids]`` for the others, exactly vLLM's
           ``CachedRequestData`` (``block_ids``: newly allocated ids per group, or null, one per id;
           either a list parallel to ``ids`` or, sparse, ``{"at": int column, "blocks": [...]}``:
           the entries at those indexes, null everywhere else); ``resumed``: which of those resumed after a
           preemption (their ``block_ids`` are the whole new table); ``num_computed`` counts tokens
           before this step. ``pre`` preempted ids, ``fin`` finished ids since the last step;
           optional ``throttle`` (DP prefill throttling was asked for) and ``x`` (step features not
           modelled: spec decode, encoder inputs). Columnar on purpose: the recorder copies vLLM's
           own lists instead of building one Python row per request (see "Why columnar").
``update`` one ``update_from_output``: ``step`` (the ``sched`` it settles), ``ids`` and
           ``sampled``: the model runner's ``req_ids`` and ``sampled_token_ids`` as it returned them
           (empty lists for prefill chunks) — or, compact, ``tok`` (every sampled token, base64
           uint32) and ``len`` (base64 of one byte per id: how many tokens it sampled) instead of
           ``sampled``; ``fin``: ``[[id, reason], ...]`` for requests it
           finished (``stop``, ``length``, ``error``, ``repetition``, ...).
``error``  a recorded call raised inside vLLM (issue #28: a crashed run is never "agrees"):
           ``call`` (``schedule``, ``update_from_output``, ``add_request``, ``finish_requests``),
           ``step`` (the step ``schedule()`` would have had, or the step the update settles),
           ``type`` and ``message`` of the exception, and the call's inputs the replay needs:
           ``add`` (the ``add`` record of the request), ``update`` (the ``update`` record without
           its ``fin``), ``ids`` + ``status`` (``finish_requests``). Written before vLLM's
           exception propagates; a crashed run's ``end`` record counts its ``errors``.
``reset``  ``reset_prefix_cache`` was called: ``running`` (running requests preempted too), ``ok``.
``drafts`` ``update_draft_token_ids``: the drafts a synchronous runner proposed, ``ids`` and ``tokens``.
``pause``  ``set_pause_state`` (the engine's ``pause_generation``): ``state`` 0 UNPAUSED, 1
           PAUSED_NEW, 2 PAUSED_ALL.
``end``    the scheduler shut down: ``steps``, ``records``, ``how``; ``errors`` if any call raised.
========== =========================================================================================

Optional per-step observables (version 3, issue #28), what the metrics endpoint and the
conservation checks read: ``sched.free`` / ``update.free`` / ``abort.free``: vLLM's
``block_pool.get_num_free_blocks()`` after the call; ``sched.pre_why``: ``{id: reason}`` for the
step's preemptions (``kv``: a running request could not get blocks; ``reset_prefix_cache``);
``sched.loading``: requests waiting for a remote KV load (KV-connector runs); ``sched.refused``:
requests ``allocate_slots`` refused during the call, on pools with a windowed group (it frees their
skipped blocks before refusing); ``sched.replay``: ``{id: replay_start}`` of the step's new requests
whose admission rewound a bounded-replay window (SWA bounded replay, #28; absent ids: 0);
``sched.spec``:
``{id: draft ids}`` scheduled for verification (``-1``: placeholders) and ``sched.skip_drafts``
(header ``spec``: ``num_speculative_tokens``, ``method``, ``num_lookahead_tokens``,
``can_skip_drafts``); ``update.stats``:
the ``SchedulerStats`` vLLM's ``update_from_output`` returned for the metrics endpoint —
``usage`` (``kv_cache_usage``), ``req``/``q``/``h`` (prefix-cache requests, queried tokens, hit
tokens), ``preq``/``pq``/``ph`` (the same for resumed preempted requests), ``run``/``wait``; on
KV-connector runs (version 4) ``creq``/``cq``/``ch``/``cpreq``/``cpq``/``cph``/``creset``, the
``connector_prefix_cache_stats`` (tokens the connector was asked for beyond the local hit, and
the external hits).
Header ``log_stats``: whether vLLM made stats at all (``--disable-log-stats`` turns them off).

KV-connector runs (version 4, issue #28): the header's ``connector`` (``kv_role``,
``kv_load_failure_policy``, ``requires_kv_delivery``, ``divergent_local_hybrid_hits``, ``classes``:
the connector's class and, for vLLM's ``MultiConnector``, its children's) and, on the record of the
call during which vLLM's scheduler asked its connector something, ``kv``: the questions and the
answers in call order (:data:`KV_CALLS`) — ``["m", id, local tokens asked, external tokens or null,
load async, kids]`` (``get_num_new_matched_tokens``; ``kids``: each ``MultiConnector`` child's
``[tokens or null, async]`` in the order asked, or null), ``["a", id, block ids per group, external
tokens, kids]`` (``update_state_after_alloc``; ``kids``: the external tokens each child was given),
``["f", id, block ids per group, delay free, params keys, kids]`` (``request_finished``; ``kids``:
each child's delay), ``["p", answer]`` (``has_pending_block_frees``), ``["r", answer]``
(``reset_cache``), ``["w", id, group ids]`` (``get_loaded_kv_cache_group_ids`` as SWA bounded
replay asks it: whether a load carries the replay window, session 20). ``update.kvo``: the worker's ``KVConnectorOutput`` as vLLM iterated it — ``s``
finished_sending, ``r`` finished_recving, ``f`` failed_recving (ids), ``i`` invalid_block_ids;
``reset.connector``: whether the connector's cache was reset too.

Versions: 2 added the base64 groups in ``new`` and the sparse ``cached`` block ids (what the
recorder writes); version 1 traces (dense lists only) read unchanged. A version-1 reader refuses a
version-2 trace by its header instead of misreading it. 3 added ``error`` and ``reset`` records and
the per-step observables above; versions 1 and 2 read unchanged (they simply lack them). 4 added
the connector's answers (``kv``, ``kvo``, header ``connector``): a version-3 connector trace reads
unchanged, and is checked by the properties only, as before. 5 (issue #28, session 14) marks what session 13's
recorder added while still writing 4 (``stats.skip``: a session-12 reader refused it, naming the
line, instead of the version) and adds the stop inputs on ``add`` (``eos``, ``min``, ``rep``): a
version-4 trace reads unchanged (its ``stop`` already holds the EOS id; a request with repetition
detection is named unmodelled there), and a version-4 reader refuses a version-5 trace by its header.
6 (issue #28, session 16) records streaming-input sessions (``add.resumable``, updates as ``add``
records with the session's id) and prompt embeddings (``add.embeds``), which a version-5 recorder
named ``streaming_input`` / ``prompt_embeds`` on the arrival: a version-5 trace reads unchanged
(``stats.skip`` included) and stops its replay at such an arrival as before; a version-5 reader refuses a version-6 trace by its header (it would replay a session's
turn as a plain request).
7 (issue #28) records structured output: ``add.so`` and, on the ``sched``, ``update``, ``drafts``
and ``error`` records, ``gr``: the answers vLLM's scheduler got from the requests' grammars during
the call, in call order (``["g", id, "pending" | "ready" | "error"]`` for a request waiting for its
grammar, ``["v", id, drafts kept]`` from ``validate_tokens``, ``["x", id, accepted]`` from
``accept_tokens``; :mod:`kvref.impl.vllm.record_grammar`). A version-6 recorder named
``structured_output`` on the arrival: a version-6 trace reads unchanged and stops its replay there as
before; a version-6 reader refuses a version-7 trace by its header (it would replay a
structured-output request as an unconstrained one).

Optional record types (:data:`OPTIONAL_RECORD_TYPES`, e.g. ``kv_events`` from the KV-events
recorder) carry extra information a reader may skip; any other unknown type is an error, so a
reader never silently misreads a newer format. A newer *major* ``version`` is refused with the
version named.

Why base64 for prompts: encoding a 4,000-token prompt as a JSON list costs about ten times as
much as ``array.tobytes`` + base64, and recording must cost a few percent of ``schedule()`` at most.

Why columnar: at 128 running requests a row-per-request record cost the engine thread about 5 %
of ``schedule()`` + ``update_from_output()``, most of it building the rows in Python;
vLLM's ``SchedulerOutput`` already holds the columns (``num_scheduled_tokens``,
``CachedRequestData``), and JSON-encoding flat lists runs in C. Readers turn a step back into
rows with :func:`sched_rows`.

Why sparse cached block ids (version 2): in a decode step about one running request in sixteen
gets a new block; the others' entries are null. JSON-encoding 128 entries was the largest single
cost of a ``sched`` record; selecting the non-null ones (``itertools.compress``, in C) and
encoding those is a third of it. Block tables of new requests are base64 for the reason prompts
are: the JSON encoder turns every int into a string object.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
from array import array
from typing import Any

from kvref.spec.errors import InvalidFieldError, check_int

FORMAT = "kvref-run-trace"
VERSION = 7
RECORD_TYPES = ("add", "abort", "sched", "update", "end", "error", "reset", "drafts", "pause")
#: the calls an ``error`` record may name
ERROR_CALLS = ("schedule", "update_from_output", "add_request", "finish_requests")
#: the keys of an ``update`` record's ``stats`` (all ints except ``usage``, a float in [0, 1])
STATS_KEYS = ("usage", "req", "q", "h", "preq", "pq", "ph", "run", "wait",
              # num_skipped_waiting_reqs: vLLM's deferred_waiting, left out of "wait" (#28)
              "skip",
              # the connector's prefix-cache stats (format 4, KV-connector runs): external hits per
              # lookup, and whether a connector cache reset happened since the last stats
              "creq", "cq", "ch", "cpreq", "cpq", "cph", "creset")
#: the connector calls a ``kv`` entry may name (version 4): lookup, allocation, finish, pending
#: frees, cache reset
KV_CALLS = ("m", "a", "f", "p", "r", "w")
#: vLLM's ``KVTransferConfig.kv_role`` values
CONNECTOR_ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: the keys of an ``update`` record's ``kvo`` (the worker's KVConnectorOutput)
KVO_KEYS = ("s", "r", "f", "i")
#: record types a reader may skip (room for the KV-events recorder's records)
OPTIONAL_RECORD_TYPES = ("kv_events",)
KINDS = {"n": "new", "r": "resumed", "c": "running"}
FINISH_REASONS = {
    "FINISHED_STOPPED": "stop", "FINISHED_LENGTH_CAPPED": "length", "FINISHED_ABORTED": "abort",
    "FINISHED_IGNORED": "ignored", "FINISHED_ERROR": "error", "FINISHED_REPETITION": "repetition",
}


class TraceFormatError(InvalidFieldError):
    """A trace file that cannot be read: names the file, the record (line) and the field."""


_BIG_ENDIAN = sys.byteorder == "big"


def encode_tokens(tokens) -> str:
    """Token ids -> base64 of little-endian uint32 (ids must be in [0, 2**32))."""
    if isinstance(tokens, (str, bytes)) or type(tokens) is dict:
        raise InvalidFieldError("tokens", tokens, "a list of token ids (ints in [0, 2**32))")
    try:
        a = array("I", tokens)
    except (TypeError, OverflowError) as exc:
        raise InvalidFieldError("tokens", tokens, "a list of token ids (ints in [0, 2**32))") from exc
    if _BIG_ENDIAN:  # pragma: no cover - the format is little-endian everywhere
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


def decode_tokens(text: str) -> list[int]:
    """Inverse of :func:`encode_tokens`; raises ``InvalidFieldError`` on a malformed string."""
    if not isinstance(text, str):
        raise InvalidFieldError("tokens", text, "base64 of little-endian uint32 token ids (str)")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise InvalidFieldError("tokens", text, f"base64 of little-endian uint32 token ids ({exc})") from exc
    if len(raw) % 4:
        raise InvalidFieldError("tokens", text, f"a whole number of uint32 token ids (got {len(raw)} bytes)")
    a = array("I")
    a.frombytes(raw)
    if _BIG_ENDIAN:  # pragma: no cover
        a.byteswap()
    return a.tolist()


class _Numbering(dict):
    """A dict that numbers unseen keys 0, 1, 2, ... in order of first appearance."""

    def __missing__(self, key):
        value = self[key] = len(self)
        return value


class TokenAnonymizer:
    """A consistent, injective renaming of token ids, request ids and cache salts.

    Production prompts must not leave the machine, yet the reference must see the same
    equalities vLLM saw: two prompts sharing a prefix must still share it (prefix-cache hits),
    a sampled stop token must still be a stop token. Token ids are therefore renumbered in order
    of first appearance (injective and consistent within one trace; the mapping is never
    written), salts become keyed hashes under a per-run random key, request ids become ``r<n>``.
    What remains visible: lengths, which tokens are equal, timing. Frequency analysis of a long
    trace may still tell common tokens apart; see docs/record.md.
    """

    def __init__(self) -> None:
        self._tokens = _Numbering()
        self._get_token = self._tokens.__getitem__
        self._ids: dict[str, str] = {}
        self._num_ids = 0
        self._key = os.urandom(16)

    def tokens(self, tokens) -> list[int]:
        """The renamed ids. Checked only when the fast path fails (this runs on the recorder's hot
        path): a token that cannot be numbered rolls back the ones this call had numbered."""
        numbering = self._tokens
        before = len(numbering)
        try:
            return list(map(self._get_token, tokens))
        except TypeError as exc:
            while len(numbering) > before:
                numbering.popitem()
            raise InvalidFieldError("tokens", tokens, "a list of token ids (ints)") from exc

    def request_id(self, request_id: str) -> str:
        if type(request_id) is not str:
            raise InvalidFieldError("request_id", request_id, "a request id (str)")
        out = self._ids.get(request_id)
        if out is None:
            out = self._ids[request_id] = f"r{self._num_ids}"
            self._num_ids += 1
        return out

    def forget(self, request_id: str) -> None:
        """A finished request's id is not needed again (keeps memory bounded on long runs)."""
        if type(request_id) is not str:
            raise InvalidFieldError("request_id", request_id, "a request id (str)")
        self._ids.pop(request_id, None)

    def check_invariants(self) -> None:
        assert sorted(self._tokens.values()) == list(range(len(self._tokens))), "token renumbering not injective"
        assert len(set(self._ids.values())) == len(self._ids), "two request ids share an anonymous id"

    def salt(self, salt: str | None) -> str | None:
        if salt is None:
            return None
        if type(salt) is not str:
            raise InvalidFieldError("salt", salt, "a cache salt (str) or None")
        return hashlib.blake2b(salt.encode(), key=self._key, digest_size=8).hexdigest()


    def embeds_digests(self, data, row_bytes: int) -> bytes:
        """:func:`embeds_digests` keyed with this run's key: a reader cannot test a guessed
        embedding (a token's, from the public model) against the trace."""
        return embeds_digests(data, row_bytes, self._key)


#: bytes of one prompt embedding row's digest in an ``add`` record's ``embeds`` (version 6)
EMBED_DIGEST_SIZE = 8


def embeds_digests(data, row_bytes: int, key: bytes = b"") -> bytes:
    """The ``embeds`` digests of raw prompt embeddings ``data`` (rows of ``row_bytes`` bytes, row
    after row): an 8-byte BLAKE2b of each row, concatenated. Equal rows give equal digests, which
    is all the block hashes need of them (vLLM hashes a block's rows' bytes)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidFieldError("data", type(data).__name__, "the embeddings' raw bytes (bytes or a memoryview)")
    if type(key) is not bytes or len(key) > 64:
        raise InvalidFieldError("key", key, "bytes of at most 64 (a BLAKE2b key; b'' for none)")
    view = memoryview(data)
    if not view.c_contiguous:
        raise InvalidFieldError("data", "a non-contiguous view", "contiguous bytes")
    view = view.cast("B")
    check_int("row_bytes", row_bytes, minimum=1)
    if len(view) % row_bytes:
        raise InvalidFieldError("row_bytes", row_bytes, f"a positive divisor of the embeddings' {len(view)} bytes")
    return b"".join(hashlib.blake2b(view[i:i + row_bytes], digest_size=EMBED_DIGEST_SIZE, key=key).digest()
                    for i in range(0, len(view), row_bytes))


def decode_embeds(text: str) -> tuple[bytes, ...]:
    """An ``add`` record's ``embeds`` as one digest row per prompt token (what the reference's
    ``Request.prompt_embeds`` takes)."""
    raw = None
    if type(text) is str:
        try:
            raw = base64.b64decode(text, validate=True)
        except ValueError:
            raw = None
    if raw is None or len(raw) % EMBED_DIGEST_SIZE:
        raise InvalidFieldError("embeds", text, f"base64 of {EMBED_DIGEST_SIZE}-byte digests")
    return tuple(raw[i:i + EMBED_DIGEST_SIZE] for i in range(0, len(raw), EMBED_DIGEST_SIZE))


def _b64_len(text: str) -> int:
    """Decoded length of base64 ``text`` (-1 when it is not base64)."""
    try:
        return len(base64.b64decode(text, validate=True))
    except (ValueError, TypeError):
        return -1


def _num_b64_uint32(text: Any) -> int:
    n = _b64_len(text) if type(text) is str else -1
    return n // 4 if n >= 0 else -1


# ---- validation (reader side) -------------------------------------------------------------------
def _fail(where: str, field: str, value: Any, allowed: str) -> TraceFormatError:
    return TraceFormatError(f"{where}: {field}", value, allowed)


def _is_int(v: Any, minimum: int | None = 0) -> bool:
    return type(v) is int and (minimum is None or v >= minimum)


def _str_list(where: str, rec: dict, key: str) -> list:
    v = rec.get(key)
    if not isinstance(v, list) or not all(type(x) is str for x in v):
        raise _fail(where, key, v, "a list of request ids (str)")
    return v


_SPEC_TYPES = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec",
               "MambaSpec", "CrossAttentionSpec", "EncoderOnlyAttentionSpec", "SinkFullAttentionSpec",
               "UniformTypeKVCacheSpecs")


def validate_header(header: Any, where: str) -> dict:
    """Check a header line; returns it. Unknown extra keys are allowed (minor additions)."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _fail(where, "format", header.get("format") if isinstance(header, dict) else header,
                    f"{FORMAT!r} (is this a kvref run trace?)")
    version = header.get("version")
    if not _is_int(version, 1):
        raise _fail(where, "version", version, f"an int; this kvref reads version {VERSION}")
    if version > VERSION:
        raise _fail(where, "version", version, f"at most {VERSION} (written by a newer kvref; upgrade kvref)")
    pool = header.get("pool")
    if not isinstance(pool, dict):
        raise _fail(where, "pool", pool, "an object with num_blocks, groups, max_model_len, ...")
    for key in ("num_blocks", "max_model_len", "scheduler_block_size", "hash_block_size"):
        if not _is_int(pool.get(key), 1):
            raise _fail(where, f"pool.{key}", pool.get(key), "a positive int")
    groups = pool.get("groups")
    if not isinstance(groups, list) or not groups:
        raise _fail(where, "pool.groups", groups, "a non-empty list of KV cache groups")
    for i, g in enumerate(groups):
        spec = g.get("spec") if isinstance(g, dict) else None
        if not isinstance(spec, dict) or not _is_int(spec.get("block_size"), 1) or not isinstance(spec.get("type"), str):
            raise _fail(where, f"pool.groups[{i}].spec", spec, "an object with a type (str) and block_size (int)")
    sched = header.get("scheduler")
    if not isinstance(sched, dict):
        raise _fail(where, "scheduler", sched, "an object with the scheduler settings")
    for key in ("max_num_batched_tokens", "max_num_seqs"):
        if not _is_int(sched.get(key), 1):
            raise _fail(where, f"scheduler.{key}", sched.get(key), "a positive int")
    unmodelled = header.get("unmodelled", [])
    if not isinstance(unmodelled, list) or not all(isinstance(u, str) for u in unmodelled):
        raise _fail(where, "unmodelled", unmodelled, "a list of feature names (str)")
    conn = header.get("connector")
    if conn is not None:
        if (not isinstance(conn, dict) or conn.get("kv_role") not in CONNECTOR_ROLES
                or conn.get("kv_load_failure_policy") not in ("recompute", "fail")
                or type(conn.get("requires_kv_delivery")) is not bool):
            raise _fail(where, "connector", conn, "an object with kv_role (one of " + ", ".join(CONNECTOR_ROLES)
                        + "), kv_load_failure_policy (recompute or fail) and requires_kv_delivery (bool)")
    return header


def _column(value: Any) -> Any:
    """A base64 int column decoded for validation (anything else returned as is)."""
    if type(value) is str:
        try:
            return decode_tokens(value)
        except ValueError:
            return None
    return value


def _blocks_ok(blocks: Any) -> bool:
    if blocks is None:
        return True
    if not isinstance(blocks, list):
        return False
    for g in blocks:
        if type(g) is str:
            try:
                decode_tokens(g)
            except (ValueError, UnicodeEncodeError):
                return False
            continue
        if not isinstance(g, list):
            return False
        for b in g:
            if type(b) is not int or b < 0:
                return False
    return True


def block_table(blocks):
    """Recorded block ids (per group: an int list or base64 uint32; or None) as int lists per group."""
    if blocks is None:
        return None
    return [decode_tokens(g) if type(g) is str else g for g in blocks]


def cached_block_ids(value, n: int) -> list:
    """A ``sched`` record's cached block ids as one entry per cached id: a dense list as is, the
    sparse form (``{"at": indexes, "blocks": entries}``) expanded with nulls. Raises ``ValueError``
    (``KeyError``/``TypeError`` on a wrong shape) when it does not describe ``n`` entries."""
    if type(value) is not dict:
        return value
    at, blocks = int_column(value["at"]), value["blocks"]
    if not isinstance(at, list) or not isinstance(blocks, list) or len(at) != len(blocks):
        raise ValueError("at and blocks must be lists of the same length")
    out: list = [None] * n
    last = -1
    for i, b in zip(at, blocks):
        if type(i) is not int or not last < i < n:
            raise ValueError(f"index {i!r} out of order or outside 0..{n - 1}")
        out[i] = b
        last = i
    return out


def int_column(value) -> list[int]:
    """An int column of a record: a JSON list, or base64 uint32 (:func:`encode_tokens`)."""
    return decode_tokens(value) if type(value) is str else value


def encode_lengths(lists) -> str:
    """One byte per list: its length (``ValueError`` past 255; writers then fall back to JSON)."""
    return base64.b64encode(bytes(map(len, lists))).decode("ascii")


def update_sampled(rec: dict) -> list[list[int]]:
    """An ``update`` record's sampled token lists, one per id, from either encoding."""
    sampled = rec.get("sampled")
    if sampled is not None:
        return sampled
    toks = decode_tokens(rec["tok"])
    out, i = [], 0
    for n in base64.b64decode(rec["len"].encode("ascii"), validate=True):
        out.append(toks[i:i + n])
        i += n
    if i != len(toks):
        raise ValueError(f"len sums to {i} tokens, tok holds {len(toks)}")
    return out


def sched_rows(rec: dict) -> list[list]:
    """A ``sched`` record as rows ``[id, kind, num_tokens, num_computed, block_ids]`` in batch order
    (kind ``n``/``r``/``c``; ``block_ids`` as recorded: per group, or None)."""
    new = {e[0]: e for e in rec["new"]}
    cids, ccomputed, cblocks = rec["cached"]
    ccomputed = int_column(ccomputed)
    cblocks = cached_block_ids(cblocks, len(cids))
    index = {rid: i for i, rid in enumerate(cids)}
    resumed = rec["resumed"]
    rows = []
    for rid, n in zip(rec["ids"], int_column(rec["n"])):
        e = new.get(rid)
        if e is not None:
            rows.append([rid, "n", n, e[1], block_table(e[2])])
        else:
            i = index[rid]
            b = cblocks[i]
            rows.append([rid, "r" if resumed and rid in resumed else "c", n, ccomputed[i],
                         b if b is None else block_table(b)])
    return rows


def sched_record(step: int, rows, pre=(), fin=()) -> dict:
    """The inverse of :func:`sched_rows`: a ``sched`` record from rows (writers, tests)."""
    new, cids, ccomputed, cblocks, resumed = [], [], [], [], []
    for rid, kind, _n, computed, blocks in rows:
        if kind == "n":
            new.append([rid, computed, blocks])
        else:
            cids.append(rid)
            ccomputed.append(computed)
            cblocks.append(blocks)
            if kind == "r":
                resumed.append(rid)
    return {"t": "sched", "step": step, "ids": [r[0] for r in rows], "n": [r[2] for r in rows], "new": new,
            "cached": [cids, ccomputed, cblocks], "resumed": resumed, "pre": list(pre), "fin": list(fin)}


def _validate_error(rec: dict, where: str) -> None:
    if rec.get("call") not in ERROR_CALLS:
        raise _fail(where, "call", rec.get("call"), "one of " + ", ".join(ERROR_CALLS))
    if not _is_int(rec.get("step"), -1):
        raise _fail(where, "step", rec.get("step"), "an int >= -1")
    for key in ("type", "message"):
        if type(rec.get(key)) is not str:
            raise _fail(where, key, rec.get(key), "the exception's " + ("class name" if key == "type" else "message")
                        + " (str)")
    for key, kind in (("add", "add"), ("update", "update")):
        if rec.get(key) is not None:
            inner = rec[key]
            if not isinstance(inner, dict) or inner.get("t") != kind:
                raise _fail(where, key, inner, f"the call's {kind!r} record")
            validate_record(dict(inner, fin=[]) if kind == "update" else inner, f"{where} ({key})")
    if rec.get("ids") is not None:
        _str_list(where, rec, "ids")


def _groups_ok(blocks: Any) -> bool:
    return isinstance(blocks, list) and all(isinstance(g, list) and all(_is_int(b) for b in g) for g in blocks)


def _kv_entry_ok(e: Any) -> bool:
    if not isinstance(e, list) or not e or e[0] not in KV_CALLS:
        return False
    kind = e[0]
    if kind in ("p", "r"):
        return len(e) == 2 and e[1] in (True, False, None)
    if kind == "w":  # SWA bounded replay beside a connector: the groups the load restores (session 20)
        return len(e) == 3 and type(e[1]) is str and isinstance(e[2], list) and all(_is_int(g) for g in e[2])
    if len(e) < 4 or type(e[1]) is not str:
        return False
    kids = e[5] if kind in ("m", "f") and len(e) > 5 else e[4] if kind == "a" and len(e) > 4 else None
    if kind == "m":
        ok = _is_int(e[2]) and (e[3] is None or _is_int(e[3])) and len(e) >= 5 and type(e[4]) is bool
        return ok and (kids is None or isinstance(kids, list) and all(
            isinstance(k, list) and len(k) == 2 and (k[0] is None or _is_int(k[0])) and type(k[1]) is bool
            for k in kids))
    if kind == "a":
        return _groups_ok(e[2]) and _is_int(e[3]) and (kids is None or isinstance(kids, list) and all(
            _is_int(k) for k in kids))
    return (_groups_ok(e[2]) and type(e[3]) is bool and (len(e) < 5 or e[4] is None or isinstance(e[4], list))
            and (kids is None or isinstance(kids, list) and all(type(k) is bool for k in kids)))


def _validate_kv(kv: Any, where: str) -> None:
    """A record's ``kv`` list: the connector's answers during the call (version 4)."""
    if not isinstance(kv, list):
        raise _fail(where, "kv", kv, "a list of connector calls")
    for i, e in enumerate(kv):
        if not _kv_entry_ok(e):
            raise _fail(where, f"kv[{i}]", e, '["m", id, asked, tokens|null, async, kids?], ["a", id, block ids per '
                        'group, tokens, kids?], ["f", id, block ids per group, delay, params keys?, kids?], ["p", '
                        'bool], ["r", bool|null] or ["w", id, group ids]')


def validate_record(rec: Any, where: str) -> str:
    """Check one record's shape; returns its type. Raises :class:`TraceFormatError`."""
    if not isinstance(rec, dict):
        raise _fail(where, "record", rec, "a JSON object with a type 't'")
    t = rec.get("t")
    if t == "sched":
        if not _is_int(rec.get("step")):
            raise _fail(where, "step", rec.get("step"), "an int >= 0")
        ids, n = rec.get("ids"), _column(rec.get("n"))
        if not isinstance(ids, list) or not all(type(i) is str for i in ids):
            raise _fail(where, "ids", ids, "a list of request ids (str)")
        if not isinstance(n, list) or len(n) != len(ids) or not all(_is_int(v, 1) for v in n):
            raise _fail(where, "n", rec.get("n"), f"{len(ids)} token counts (int >= 1), one per id: a list or "
                        "base64 uint32")
        new = rec.get("new")
        if not isinstance(new, list) or not all(
                isinstance(e, list) and len(e) == 3 and type(e[0]) is str and _is_int(e[1]) and _blocks_ok(e[2])
                for e in new):
            raise _fail(where, "new", new, "a list of [id, num_computed (int >= 0), block ids per group]")
        cached = rec.get("cached")
        if isinstance(cached, list) and len(cached) == 3:
            blocks = cached[2]
            if type(blocks) is dict:
                try:
                    blocks = cached_block_ids(blocks, len(cached[0]) if isinstance(cached[0], list) else 0)
                except (KeyError, TypeError, ValueError) as exc:
                    raise _fail(where, "cached", cached[2], '{"at": indexes (increasing, one per entry), "blocks": '
                                f"entries}} for the non-null block ids ({exc})") from exc
            cached = [cached[0], _column(cached[1]), blocks]
        if (not isinstance(cached, list) or len(cached) != 3 or not all(isinstance(c, list) for c in cached)
                or not len(cached[0]) == len(cached[1]) == len(cached[2])
                or not all(type(i) is str for i in cached[0]) or not all(_is_int(v) for v in cached[1])
                or not all(_blocks_ok(b) for b in cached[2])):
            raise _fail(where, "cached", cached, "[ids, num_computed, block ids per group or null]: three lists "
                        "of equal length (the block ids may be sparse)")
        known = {e[0] for e in new}
        known.update(cached[0])
        for i in ids:
            if i not in known:
                raise _fail(where, "ids", i, "an id listed in new or cached")
        _str_list(where, rec, "resumed")
        _str_list(where, rec, "pre")
        _str_list(where, rec, "fin")
        # the step's encoder inputs, evictions and V2 updates (#28)
        enc, eupd = rec.get("enc"), rec.get("eupd")
        if enc is not None and not (isinstance(enc, dict) and all(
                isinstance(v, list) and all(_is_int(x) for x in v) for v in enc.values())):
            raise _fail(where, "enc", enc, "an object: request id -> input indexes (ints >= 0)")
        if "efree" in rec:
            _str_list(where, rec, "efree")
        if eupd is not None and not (isinstance(eupd, dict) and all(
                isinstance(u, dict) and all(k.isdigit() and v in ("install", "release") for k, v in u.items())
                for u in eupd.values())):
            raise _fail(where, "eupd", eupd, 'an object: request id -> {input index: "install" or "release"}')
    elif t == "update":
        if not _is_int(rec.get("step"), -1):
            raise _fail(where, "step", rec.get("step"), "an int >= 0 (-1: a step the recorder did not see)")
        ids = _str_list(where, rec, "ids")
        if "sampled" not in rec:
            try:
                sampled = update_sampled(rec)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise _fail(where, "tok/len", (rec.get("tok"), rec.get("len")),
                            f"base64 uint32 tokens and base64 per-id lengths that add up ({exc})") from exc
        else:
            sampled = rec.get("sampled")
        if not isinstance(sampled, list) or len(sampled) != len(ids) or not all(
                isinstance(toks, list) and all(_is_int(x) for x in toks) for toks in sampled):
            raise _fail(where, "sampled", sampled, f"a list of {len(ids)} lists of token ids (int >= 0), one per id")
        fin = rec.get("fin")
        if not isinstance(fin, list) or not all(isinstance(f, list) and len(f) == 2 and type(f[0]) is str
                                                and type(f[1]) is str for f in fin):
            raise _fail(where, "fin", fin, "a list of [id, reason]")
    elif t == "add":
        if type(rec.get("id")) is not str or not rec["id"]:
            raise _fail(where, "id", rec.get("id"), "a non-empty request id (str)")
        if type(rec.get("prompt")) is not str:
            raise _fail(where, "prompt", rec.get("prompt"), "base64 of little-endian uint32 token ids")
        if not _is_int(rec.get("max_tokens"), 1):
            raise _fail(where, "max_tokens", rec.get("max_tokens"), "an int >= 1")
        stop = rec.get("stop")
        if not isinstance(stop, list) or not all(_is_int(x) for x in stop):
            raise _fail(where, "stop", stop, "a list of token ids (int >= 0)")
        if rec.get("salt") is not None and type(rec.get("salt")) is not str:
            raise _fail(where, "salt", rec.get("salt"), "null or a str")
        if not _is_int(rec.get("priority"), None):
            raise _fail(where, "priority", rec.get("priority"), "an int")
        if type(rec.get("arrival")) not in (int, float):
            raise _fail(where, "arrival", rec.get("arrival"), "a number (seconds)")
        # multimodal items and the LoRA adapter (#28)
        mm = rec.get("mm")
        if mm is not None and not (isinstance(mm, list) and all(
                isinstance(e, list) and len(e) == 4 and type(e[0]) is str and e[0] and _is_int(e[1])
                and _is_int(e[2], 1) and type(e[3]) is str for e in mm)):
            raise _fail(where, "mm", mm, "a list of [identifier (str), offset (int >= 0), length (int >= 1), "
                        "modality (str)]")
        # check_stop's inputs besides max_tokens and stop (version 5, #28)
        if rec.get("eos") is not None and not _is_int(rec.get("eos")):
            raise _fail(where, "eos", rec.get("eos"), "null or the EOS token id (int >= 0)")
        if "min" in rec and not (_is_int(rec["min"]) and rec["min"] <= rec["max_tokens"]):
            raise _fail(where, "min", rec["min"], f"min_tokens: an int in [0, max_tokens={rec['max_tokens']}]")
        rep = rec.get("rep")
        if rep is not None and not (isinstance(rep, list) and len(rep) == 3 and all(_is_int(x) for x in rep)
                                    and rep[1] <= rep[0] and (rep[0] == 0 or rep[2] >= 2)):
            raise _fail(where, "rep", rep, "[max_pattern_size, min_pattern_size <= max_pattern_size, "
                        "min_count >= 2] (ints >= 0; repetition_detection)")
        emb = rec.get("embeds")
        if emb is not None:
            n = _num_b64_uint32(rec["prompt"])
            if type(emb) is not str or _b64_len(emb) != EMBED_DIGEST_SIZE * n:
                raise _fail(where, "embeds", emb if type(emb) is not str else f"{_b64_len(emb)} bytes",
                            f"base64 of {EMBED_DIGEST_SIZE}-byte digests, one per prompt token ({n})")
        if "resumable" in rec and rec["resumable"] is not True:
            raise _fail(where, "resumable", rec["resumable"], "true (a streaming-input session's turn) or absent")
        lora = rec.get("lora")
        if lora is not None and not (isinstance(lora, list) and len(lora) == 3 and type(lora[0]) is str and lora[0]
                                     and _is_int(lora[1], 1) and type(lora[2]) is str and lora[2]):
            raise _fail(where, "lora", lora, "[name (str), id (int >= 1), path (str)]")
    elif t == "abort":
        _str_list(where, rec, "ids")
    elif t == "end":
        if not _is_int(rec.get("steps")):
            raise _fail(where, "steps", rec.get("steps"), "an int >= 0")
    elif t == "error":
        _validate_error(rec, where)
    elif t == "reset":
        pass
    elif t == "pause":
        if rec.get("state") not in (0, 1, 2) or type(rec.get("state")) is not int:
            raise _fail(where, "state", rec.get("state"), "a pause state: 0 UNPAUSED, 1 PAUSED_NEW, 2 PAUSED_ALL")
    elif t == "drafts":
        ids = _str_list(where, rec, "ids")
        toks = rec.get("tokens")
        # -1 pads a draft slot an n-gram drafter left empty (vLLM's ngram_gpu; the scheduler keeps it)
        if not isinstance(toks, list) or len(toks) != len(ids) or not all(
                isinstance(d, list) and all(_is_int(x, -1) for x in d) for d in toks):
            raise _fail(where, "tokens", toks, f"{len(ids)} lists of draft token ids (int >= 0, or -1 padding), "
                        "one per id")
    elif t in OPTIONAL_RECORD_TYPES:
        pass
    else:
        raise _fail(where, "t", t, "one of " + ", ".join(RECORD_TYPES + OPTIONAL_RECORD_TYPES))
    if t in ("sched", "update", "abort") and "free" in rec and not _is_int(rec["free"]):
        raise _fail(where, "free", rec["free"], "the free-block count after the call (int >= 0)")
    if t == "sched":
        why = rec.get("pre_why")
        if why is not None and (not isinstance(why, dict) or not all(type(v) is str for v in why.values())):
            raise _fail(where, "pre_why", why, "an object {preempted id: reason (str)}")
        spec = rec.get("spec")
        if spec is not None and (not isinstance(spec, dict) or not all(
                isinstance(v, list) and all(_is_int(x, -1) for x in v) for v in spec.values())):
            raise _fail(where, "spec", spec, "an object {id: scheduled draft ids (int >= -1)}")
        refused = rec.get("refused")
        if refused is not None and (not isinstance(refused, list) or not all(type(x) is str for x in refused)):
            raise _fail(where, "refused", refused, "a list of request ids allocate_slots refused this step")
        replay = rec.get("replay")
        if replay is not None and (not isinstance(replay, dict) or not all(_is_int(v) for v in replay.values())):
            raise _fail(where, "replay", replay, "an object {new request id: replay_start (int >= 0)}")
        if "loading" in rec and not _is_int(rec["loading"]):
            raise _fail(where, "loading", rec["loading"], "an int >= 0 (requests waiting for a remote KV load)")
    if t == "update" and rec.get("stats") is not None:
        stats = rec["stats"]
        if not isinstance(stats, dict) or not all(
                k in STATS_KEYS and (type(v) in (int, float) if k == "usage" else _is_int(v)) for k, v in stats.items()):
            raise _fail(where, "stats", stats, "an object with keys among " + ", ".join(STATS_KEYS)
                        + " (usage a number, the others ints >= 0)")
    if "kv" in rec:
        _validate_kv(rec["kv"], where)
    if t == "update" and "kvo" in rec:
        kvo = rec["kvo"]
        if not isinstance(kvo, dict) or not all(
                k in KVO_KEYS and isinstance(v, list) and all((_is_int(x) if k == "i" else type(x) is str) for x in v)
                for k, v in kvo.items()):
            raise _fail(where, "kvo", kvo, "an object with keys among s, r, f (lists of request ids) and i (block ids)")
    x = rec.get("x")
    if x is not None and (not isinstance(x, list) or not all(type(v) is str for v in x)):
        raise _fail(where, "x", x, "a list of feature names (str)")
    return t
