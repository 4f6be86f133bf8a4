"""The run-trace format: round trips, streaming, truncation, and every kind of bad input named."""

from __future__ import annotations

import gzip
import json

import pytest
from kvref.impl.run_trace import (
    OPTIONAL_RECORD_TYPES,
    TokenAnonymizer,
    TraceFormatError,
    TraceReader,
    TraceWriter,
    decode_tokens,
    encode_tokens,
)
from kvref.spec.errors import InvalidFieldError

from tests.record.traces import add, full_setup, header_for, sched, update, write_trace


def _header():
    return header_for(*full_setup())


@pytest.mark.parametrize("name", ["t.kvtrace.gz", "t.jsonl"])
@pytest.mark.parametrize("background", [True, False])
def test_round_trip_gzip_and_plain(tmp_path, name, background):
    path = tmp_path / name
    w = TraceWriter(str(path), _header(), background=background, chunk_records=4)
    recs = [add(f"r{i}", list(range(1, 10 + i))) for i in range(50)]
    for r in recs:
        w.write(r)
    w.write({"t": "kv_events", "anything": [1, 2]})  # optional record: kept, skippable
    w.check_invariants()
    w.close({"t": "end", "steps": 0, "records": 52})
    with TraceReader(path) as reader:
        got = [rec for _, rec in reader.records()]
        assert not reader.truncated
        reader.check_invariants()
    assert got[:50] == recs and got[50]["t"] in OPTIONAL_RECORD_TYPES and got[-1]["t"] == "end"
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")


def test_sched_records_round_trip_through_rows():
    from kvref.impl.run_trace.format import sched_record, sched_rows

    rows = [["a", "c", 1, 9, None], ["b", "r", 4, 0, [[3, 4], [5]]], ["c", "n", 8, 4, [[1, 6], [0, 7]]]]
    assert sched_rows(sched_record(3, rows, ["x"], ["y"])) == rows


def test_tokens_round_trip_and_reject_garbage():
    ids = [0, 1, 2**32 - 1, 151_643, 7]
    assert decode_tokens(encode_tokens(ids)) == ids
    with pytest.raises(ValueError):
        decode_tokens("not base64!")


def test_a_cut_trace_is_read_up_to_its_last_complete_record(tmp_path):
    path = tmp_path / "t.kvtrace.gz"
    w = TraceWriter(str(path), _header(), background=False, chunk_records=1)  # one sync-flushed chunk per record
    for i in range(20):
        w.write(add(f"r{i}", [1, 2, 3]))
    w.flush()
    data = path.read_bytes()  # the writer is "killed": no end record, no gzip trailer
    (tmp_path / "cut.gz").write_bytes(data)
    with TraceReader(tmp_path / "cut.gz") as reader:
        n = sum(1 for _ in reader.records())
        assert reader.truncated and reader.truncation
        reader.check_invariants()
    assert n == 20
    (tmp_path / "cut2.gz").write_bytes(data[: len(data) - 7])  # mid-chunk
    with TraceReader(tmp_path / "cut2.gz") as reader:
        assert sum(1 for _ in reader.records()) < 20 and reader.truncated
    w.close()


@pytest.mark.parametrize("mutate, field", [
    (lambda h: h.update(format="something-else"), "format"),
    (lambda h: h.update(version=99), "version"),
    (lambda h: h["pool"].update(num_blocks=0), "pool.num_blocks"),
    (lambda h: h["pool"]["groups"][0]["spec"].pop("block_size"), "pool.groups[0].spec"),
    (lambda h: h["scheduler"].update(max_num_seqs="4"), "scheduler.max_num_seqs"),
])
def test_bad_headers_are_named(tmp_path, mutate, field):
    h = _header()
    mutate(h)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(h) + "\n")
    with pytest.raises(TraceFormatError) as e:
        TraceReader(path)
    assert isinstance(e.value, ValueError) and field in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("record, field", [
    ({**sched(0, [["r0", "n", 1, 0, None]]), "n": [0]}, "n="),
    ({**sched(0, [["r0", "n", 1, 0, None]]), "ids": ["r9"]}, "ids="),
    ({**sched(0, [["r0", "c", 1, 0, None]]), "cached": [["r0"], [], [None]]}, "cached="),
    ({**sched(0, [["r0", "n", 1, 0, [[-3]]]])}, "new="),
    (sched(-1, []), "step"),
    (update(0, {"r0": [-1]}), "sampled="),
    ({**update(0, {"r0": [1]}), "sampled": []}, "sampled="),
    (update(0, {}, fin=[["r0"]]), "fin="),
    ({"t": "add", "id": "r0", "prompt": [1, 2], "max_tokens": 1, "stop": [], "salt": None, "priority": 0,
      "arrival": 0}, "prompt"),
    ({"t": "abort", "ids": [1]}, "ids"),
    ({"t": "nope"}, ": t="),
])
def test_bad_records_name_the_line_and_field(tmp_path, record, field):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_header()) + "\n" + json.dumps(add("a", [1])) + "\n" + json.dumps(record) + "\n")
    with TraceReader(path) as reader, pytest.raises(TraceFormatError) as e:
        list(reader.records())
    assert "line 3" in str(e.value) and field in str(e.value)


def test_not_a_trace_at_all(tmp_path):
    for content in (b"", b"\x00\x01garbage", b"{not json\n"):
        path = tmp_path / "bad.bin"
        path.write_bytes(content)
        with pytest.raises(TraceFormatError):
            TraceReader(path)
    path = tmp_path / "bad.gz"
    path.write_bytes(gzip.compress(b"[1, 2]\n"))
    with pytest.raises(TraceFormatError, match="format"):
        TraceReader(path)


def test_writer_rejects_zstd_and_bad_levels(tmp_path):
    with pytest.raises(InvalidFieldError, match="zstd"):
        TraceWriter(str(tmp_path / "t.zst"), _header())
    with pytest.raises(InvalidFieldError, match="compresslevel"):
        TraceWriter(str(tmp_path / "t.gz"), _header(), compresslevel=12)


def test_records_after_end_are_an_error(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", _header(), [add("a", [1])])
    with open(path, "a") as f:
        f.write(json.dumps(add("b", [1])) + "\n")
    with TraceReader(path) as reader, pytest.raises(TraceFormatError, match="after the end"):
        list(reader.records())


def test_a_line_longer_than_any_record_is_refused_not_read_whole(tmp_path, monkeypatch):
    """A corrupt or hostile trace with one endless line: refused naming the line and the limit
    (readline without a bound read it all into memory first)."""
    from kvref.impl.run_trace import reader as reader_module

    monkeypatch.setattr(reader_module, "MAX_LINE_CHARS", 4096)
    head = tmp_path / "head.jsonl"
    head.write_text(json.dumps({**_header(), "pad": "x" * 5000}) + "\n")
    with pytest.raises(TraceFormatError, match="line 1.*at most 4096"):
        TraceReader(head)
    body = tmp_path / "body.jsonl"
    body.write_text(json.dumps(_header()) + "\n" + json.dumps(add("a", list(range(2000)))) + "\n")
    with TraceReader(body) as reader, pytest.raises(TraceFormatError, match="line 2.*at most 4096"):
        list(reader.records())


def test_anonymizer_is_consistent_and_injective():
    a = TokenAnonymizer()
    p1, p2 = a.tokens([500, 600, 700, 500]), a.tokens([500, 600, 9])
    assert p1[:2] == p2[:2] and p1[0] == p1[3] and len({*p1, *p2}) == 4
    assert p1 == [0, 1, 2, 0] and p2 == [0, 1, 3]  # renumbered in order of first appearance
    a.check_invariants()
    assert a.request_id("cmpl-secret") == a.request_id("cmpl-secret") == "r0" and a.request_id("x") == "r1"
    assert a.salt("s") == a.salt("s") != "s" and a.salt(None) is None
    assert TokenAnonymizer().salt("s") != a.salt("s")  # keyed per run


def _compact(rec: dict) -> dict:
    """A dense ``sched`` record in the version-2 form the recorder writes: new requests' block
    tables as base64 per group, the cached block ids sparse."""
    if rec.get("t") != "sched":
        return rec
    cids, computed, blocks = rec["cached"]
    at = [i for i, b in enumerate(blocks) if b is not None]
    return {**rec, "n": encode_tokens(rec["n"]),
            "new": [[rid, c, [encode_tokens(g) for g in b]] for rid, c, b in rec["new"]],
            "cached": [cids, encode_tokens(computed), {"at": encode_tokens(at), "blocks": [blocks[i] for i in at]}]}


def test_version_1_and_version_2_traces_read_back_to_the_same_steps(tmp_path):
    """The recorder writes version 2 (sparse cached block ids, base64 block tables); a version-1
    trace (dense lists) of the same run reads back to the same rows and checks the same."""
    from kvref.impl.run_trace.format import VERSION, sched_rows
    from kvref.models.run_check import check_trace
    from kvref.models.run_check.generate import generate_trace

    from tests.record.traces import hybrid_setup, read_lines, rewrite

    pool, cfg = hybrid_setup(num_blocks=None)  # preemptions: resumed requests' whole tables too
    src = str(tmp_path / "src.kvtrace.gz")
    generate_trace(src, pool, cfg, steps=300, seed=3)
    lines = read_lines(src)
    assert VERSION == 7 and lines[0]["version"] == 7
    v1 = tmp_path / "v1.kvtrace.gz"
    w = TraceWriter(str(v1), {**lines[0], "version": 1}, background=False)
    for rec in lines[1:-1]:
        w.write(rec)
    w.close(lines[-1])
    v2 = rewrite(src, tmp_path / "v2.kvtrace.gz", _compact, version=2)
    got = {}
    for name, path in (("v1", v1), ("v2", v2)):
        with TraceReader(path) as reader:
            assert reader.header["version"] == (1 if name == "v1" else 2)
            got[name] = [sched_rows(rec) if rec["t"] == "sched" else rec for _, rec in reader.records()]
    compacted = [rec for rec in read_lines(v2)[1:] if rec["t"] == "sched"]
    assert any(isinstance(rec["cached"][2], dict) and rec["cached"][2]["at"] for rec in compacted)
    assert any(rec["new"] and type(rec["new"][0][2][0]) is str for rec in compacted)
    assert got["v1"] == got["v2"]
    r1, r2 = check_trace(v1, check_invariants_every=1), check_trace(v2, check_invariants_every=1)
    assert r1.ok and r1.followed and r1.steps_compared == 300, r1.divergence and r1.divergence.table()
    assert (r2.ok, r2.followed, r2.steps_compared, r2.summary) == (r1.ok, r1.followed, r1.steps_compared, r1.summary)
    assert r1.summary["preemptions"] > 0


@pytest.mark.parametrize("blocks, field", [
    ({"at": encode_tokens([0, 1]), "blocks": [[[1]]]}, "cached="),  # one index too many
    ({"at": encode_tokens([1]), "blocks": [[[1]]]}, "cached="),  # past the one cached id
    ({"at": "not base64!", "blocks": [[[1]]]}, "cached="),
    ({"blocks": []}, "cached="),
    ({"at": encode_tokens([0]), "blocks": [[[-1]]]}, "cached="),
])
def test_bad_sparse_cached_block_ids_are_named(tmp_path, blocks, field):
    rec = sched(0, [["r0", "c", 1, 0, None]])
    rec["cached"][2] = blocks
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_header()) + "\n" + json.dumps(add("r0", [1])) + "\n" + json.dumps(rec) + "\n")
    with TraceReader(path) as reader, pytest.raises(TraceFormatError) as e:
        list(reader.records())
    assert "line 3" in str(e.value) and field in str(e.value)


def test_a_bad_base64_block_table_is_named(tmp_path):
    rec = sched(0, [["r0", "n", 1, 0, [[1, 2]]]])
    rec["new"][0][2] = ["%%%"]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_header()) + "\n" + json.dumps(add("r0", [1])) + "\n" + json.dumps(rec) + "\n")
    with TraceReader(path) as reader, pytest.raises(TraceFormatError, match="new="):
        list(reader.records())
