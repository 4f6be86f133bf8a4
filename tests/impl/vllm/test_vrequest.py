"""The one door from kvref's request data to vLLM's ``Request`` (#26): what each kind of caller
gets, the refusals, and that no other adapter builds a vLLM ``Request`` itself.

The field checks read the vLLM ``Request`` and ``SamplingParams`` the door returns against the
values vLLM 0.33.0's engine would give them (``update_from_generation_config`` puts the EOS in
``all_stop_token_ids``; prompt logprobs make vLLM skip reading the prefix cache). About 1 s at
CI=true once vLLM is imported (the AST scan needs no vLLM).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvref.impl.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, RepetitionDetectionParams, Request
from kvref.impl.vllm import vrequest as door
from kvref.spec.errors import InvalidFieldError
from tests.vllm_env import require_vllm

ROOT = Path(__file__).resolve().parents[3]
#: the door itself: the one module allowed to call vLLM's ``Request`` constructor
DOOR = ROOT / "impl" / "vllm" / "vrequest.py"


@pytest.fixture(scope="module")
def v():
    require_vllm()
    from kvref.impl.vllm.loader import load_vllm

    return load_vllm()


@pytest.fixture(scope="module")
def hasher(v):
    return v["get_request_block_hasher"](4, v["sha256"], 0)


def _rich(**kw) -> Request:
    """A request with every field the door can carry set away from its default."""
    args = dict(max_tokens=8, eos_token_id=3, min_tokens=2, stop_token_ids=(5, 6), cache_salt="salt", priority=-2,
                arrival_time=3.5, mm_features=(MultiModalFeatureSpec("img1", PlaceholderRange(2, 5)),),
                lora_request=LoRARequest("adapter", 7, "/lora"),
                repetition_detection=RepetitionDetectionParams(3, 1, 2), skip_reading_prefix_cache=True,
                do_remote_prefill=True, resumable=True, session_id="sess", kv_cache_report_mode="full",
                prompt_embeds=tuple(bytes([i] * 8) for i in range(12)))
    args.update(kw)
    return Request("r", list(range(1, 13)), **args)


@pytest.mark.vllm
def test_the_scheduler_gets_the_stop_rules_and_every_scheduling_field(v, hasher):
    r = _rich()
    vr = door.vllm_request_from(r, carry=door.SCHEDULER_CARRY, block_hasher=hasher, mm_data={"kvref": True})
    assert isinstance(vr, v["VRequest"])
    assert (vr.request_id, list(vr.prompt_token_ids), vr.arrival_time, vr.priority, vr.cache_salt, vr.resumable) == \
        ("r", list(range(1, 13)), 3.5, -2, "salt", True)
    sp = vr.sampling_params
    assert (sp.max_tokens, sp.stop_token_ids, sp.ignore_eos, sp.min_tokens) == (8, [5, 6], False, 2)
    assert 3 in sp.all_stop_token_ids and sp.eos_token_id == 3  # as the input processor sets a model's EOS
    rd = sp.repetition_detection
    assert (rd.max_pattern_size, rd.min_pattern_size, rd.min_count) == (3, 1, 2)
    assert sp.skip_reading_prefix_cache is True and vr.skip_reading_prefix_cache is True
    assert sp.extra_args == {"kv_transfer_params": {"do_remote_prefill": True}}
    [f] = vr.mm_features
    assert (f.identifier, f.modality, f.mm_position.offset, f.mm_position.length, f.data) == \
        ("img1", "image", 2, 5, {"kvref": True})
    lora = vr.lora_request
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("adapter", 7, "/lora")
    assert bytes(vr.prompt_embeds.contiguous().view(v["torch"].uint8).flatten().tolist()) == b"".join(r.prompt_embeds)
    assert vr.session_id is None  # not carried: the scheduler machines set none
    assert len(vr.block_hashes) == 3  # 12 tokens, hash blocks of 4


@pytest.mark.vllm
def test_without_an_eos_the_scheduler_ignores_eos(v):
    sp = door.vllm_request_from(Request("r", [1, 2], max_tokens=2), carry=door.SCHEDULER_CARRY).sampling_params
    assert (sp.ignore_eos, sp.eos_token_id, sp.extra_args, sp.skip_reading_prefix_cache) == (True, None, None, False)


@pytest.mark.vllm
def test_the_kv_manager_mirror_carries_hash_and_event_fields_but_no_stop_rules(v, hasher):
    vr = door.vllm_request_from(_rich(), carry=door.KV_MANAGER_CARRY, block_hasher=hasher)
    sp = vr.sampling_params
    assert (sp.max_tokens, sp.stop_token_ids, sp.ignore_eos, sp.min_tokens, sp.repetition_detection,
            sp.eos_token_id) == (8, [], False, 0, None, None)
    assert sp.extra_args == {"kv_cache_report_mode": "full"}  # no remote prefill
    assert (vr.session_id, vr.cache_salt, vr.priority, vr.resumable, vr.skip_reading_prefix_cache) == \
        ("sess", "salt", -2, False, True)
    assert vr.mm_features[0].data is None and vr.lora_request.lora_int_id == 7


@pytest.mark.vllm
def test_the_queue_twin_carries_only_what_the_queue_order_reads(v):
    vr = door.vllm_request_from(_rich(), carry=door.QUEUE_CARRY, max_tokens=1)
    assert (vr.arrival_time, vr.priority, vr.sampling_params.max_tokens) == (3.5, -2, 1)
    assert (vr.cache_salt, vr.mm_features, vr.lora_request, vr.prompt_embeds, vr.session_id, vr.resumable) == \
        (None, [], None, None, None, False)
    assert list(vr.block_hashes) == [] and vr.sampling_params.extra_args is None


@pytest.mark.vllm
def test_a_streaming_session_is_resumable_and_ignores_eos(v, hasher):
    vr = door.vllm_request("s", [1, 2, 3, 4, 5], door.vllm_sampling_params(max_tokens=3, ignore_eos=True),
                           arrival_time=2.0, resumable=True, block_hasher=hasher)
    assert (vr.resumable, vr.sampling_params.ignore_eos, vr.sampling_params.max_tokens) == (True, True, 3)
    assert (vr.arrival_time, len(vr.block_hashes)) == (2.0, 1)


@pytest.mark.vllm
def test_prompt_logprobs_and_vllms_own_skip_rule(v):
    asked = door.vllm_request("o", [1, 2], door.vllm_sampling_params(max_tokens=2, prompt_logprobs=True))
    plain = door.vllm_request("o", [1, 2], door.vllm_sampling_params(max_tokens=2))
    assert (asked.sampling_params.prompt_logprobs, asked.skip_reading_prefix_cache) == (0, True)
    assert (plain.sampling_params.prompt_logprobs, plain.skip_reading_prefix_cache) == (None, False)
    assert plain.arrival_time > 0  # None: vLLM's wall clock at construction


@pytest.mark.parametrize("call, field", [
    (lambda: door.vllm_sampling_params(max_tokens=0), "max_tokens"),
    (lambda: door.vllm_sampling_params(max_tokens=2, min_tokens=3), "min_tokens"),
    (lambda: door.vllm_sampling_params(max_tokens=2, stop_token_ids=(1, -1)), "stop_token_ids[i]"),
    (lambda: door.vllm_sampling_params(max_tokens=2, eos_token_id=2, ignore_eos=True), "ignore_eos"),
    (lambda: door.vllm_sampling_params(max_tokens=2, kv_cache_report_mode="all"), "kv_cache_report_mode"),
    (lambda: door.vllm_sampling_params(max_tokens=2, skip_reading_prefix_cache=1), "skip_reading_prefix_cache"),
    (lambda: door.vllm_sampling_params(max_tokens=2, repetition_detection=(3, 1, 2)), "repetition_detection"),
    (lambda: door.vllm_request_from("r", carry=door.QUEUE_CARRY), "request"),
    (lambda: door.vllm_request_from(Request("r", [1]), carry={"priority", "temperature"}), "carry"),
    (lambda: door.vllm_request_from(Request("r", [1]), carry=["priority"]), "carry"),
])
def test_bad_sampling_input_is_refused_naming_the_field(call, field):
    with pytest.raises(InvalidFieldError) as err:
        call()
    assert err.value.field == field


@pytest.mark.vllm
@pytest.mark.parametrize("kw, field", [
    (dict(request_id=""), "request_id"),
    (dict(prompt_token_ids=[]), "prompt_token_ids"),
    (dict(prompt_token_ids=[1, "2"]), "prompt_token_ids[i]"),
    (dict(sampling_params={"max_tokens": 2}), "sampling_params"),
    (dict(arrival_time=float("nan")), "arrival_time"),
    (dict(priority=1.5), "priority"),
    (dict(cache_salt=3), "cache_salt"),
    (dict(block_hasher="sha256"), "block_hasher"),
    (dict(mm_features=("img",)), "mm_features"),
    (dict(lora_request="adapter"), "lora_request"),
    (dict(prompt_embeds=(b"ab",)), "prompt_embeds"),
    (dict(session_id=1), "session_id"),
    (dict(resumable=1), "resumable"),
])
def test_bad_request_input_is_refused_naming_the_field(v, kw, field):
    args = dict(request_id="r", prompt_token_ids=[1, 2], sampling_params=door.vllm_sampling_params(max_tokens=1))
    args.update(kw)
    rid, prompt, sp = args.pop("request_id"), args.pop("prompt_token_ids"), args.pop("sampling_params")
    with pytest.raises(InvalidFieldError) as err:
        door.vllm_request(rid, prompt, sp, **args)
    assert err.value.field == field


def _vllm_request_constructions(path: Path) -> list[str]:
    """``file:line`` of every call of vLLM's ``Request`` in ``path``: a name bound by ``from
    vllm.v1.request import Request [as X]``, ``vllm.v1.request.Request(...)``, or the loader's
    ``v["VRequest"](...)``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    names = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "vllm.v1.request" for a in node.names if a.name == "Request"}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        hit = (isinstance(f, ast.Name) and f.id in names) \
            or (isinstance(f, ast.Attribute) and f.attr == "Request" and ast.unparse(f.value) == "vllm.v1.request") \
            or (isinstance(f, ast.Subscript) and isinstance(f.slice, ast.Constant) and f.slice.value == "VRequest")
        if hit:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_the_scan_finds_a_construction():
    # the door itself builds one: a scan that finds nothing there could not fail below
    assert _vllm_request_constructions(DOOR)


def test_only_the_door_builds_vllm_requests():
    sources = sorted((ROOT / "impl" / "vllm").glob("*.py")) + sorted((ROOT / "models").rglob("*.py"))
    offenders = [hit for path in sources if path != DOOR for hit in _vllm_request_constructions(path)]
    assert not offenders, "build vLLM requests through kvref.impl.vllm.vrequest (#26): " + ", ".join(offenders)
