"""Request: the tokens, status and hashes the KV layer reads from a sequence."""

from __future__ import annotations

import dataclasses

import pytest

from kvref.request import (
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
)

# vLLM 0.25.1's RequestStatus members, in declaration order.
VLLM_STATUS_ORDER = [
    "WAITING", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_REMOTE_KVS",
    "WAITING_FOR_STREAMING_REQ", "RUNNING", "PREEMPTED", "FINISHED_STOPPED",
    "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR",
    "FINISHED_REPETITION",
]


def image(offset: int, length: int = 1, identifier: str = "img") -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(identifier, PlaceholderRange(offset, length))


# -- tokens --------------------------------------------------------------------


def test_new_request_counts_its_prompt_tokens():
    req = Request("r0", [5, 6, 7])
    assert req.request_id == "r0"
    assert req.num_tokens == 3 and req.num_prompt_tokens == 3
    assert req.prompt_token_ids == [5, 6, 7]
    assert list(req.all_token_ids) == [5, 6, 7]


def test_new_request_starts_waiting_with_nothing_computed():
    req = Request("r0", [1])
    assert req.status is RequestStatus.WAITING
    assert req.num_computed_tokens == 0 and req.num_preemptions == 0
    assert not req.is_finished()


def test_request_without_a_hasher_has_no_block_hashes():
    req = Request("r0", list(range(64)))
    req.append_output_token_ids(list(range(64)))
    assert req.block_hashes == []


def test_optional_fields_default_to_off():
    req = Request("r0", [1])
    assert req.lora_request is None and req.cache_salt is None
    assert req.mm_features == [] and req.skip_reading_prefix_cache is False
    assert req.max_tokens is None


def test_optional_fields_are_kept_as_given():
    lora = LoRARequest("adapter", 3)
    req = Request("r0", [1], lora_request=lora, cache_salt="salt",
                  skip_reading_prefix_cache=True, max_tokens=9)
    assert req.lora_request is lora and req.cache_salt == "salt"
    assert req.skip_reading_prefix_cache is True and req.max_tokens == 9


def test_append_output_token_ids_accepts_one_int():
    req = Request("r0", [1, 2])
    req.append_output_token_ids(3)
    assert list(req.all_token_ids) == [1, 2, 3]
    assert req.num_tokens == 3 and req.num_prompt_tokens == 2


def test_append_output_token_ids_accepts_a_list_in_order():
    req = Request("r0", [1, 2])
    req.append_output_token_ids([9, 8, 7])
    req.append_output_token_ids([])
    assert list(req.all_token_ids) == [1, 2, 9, 8, 7]
    assert req.num_tokens == 5
    assert req.prompt_token_ids == [1, 2]


def test_all_token_ids_is_a_live_view():
    req = Request("r0", [1, 2])
    view = req.all_token_ids
    req.append_output_token_ids(3)
    assert len(view) == 3 and view[-1] == 3
    assert view[1:] == [2, 3]


def test_all_token_ids_cannot_be_modified():
    req = Request("r0", [1, 2])
    with pytest.raises(TypeError):
        req.all_token_ids[0] = 7
    with pytest.raises((TypeError, AttributeError)):
        req.all_token_ids.append(7)
    assert list(req.all_token_ids) == [1, 2]


def test_changing_the_callers_list_does_not_change_the_request():
    prompt = [1, 2, 3]
    req = Request("r0", prompt)
    prompt.append(4)
    prompt[0] = 0
    assert list(req.all_token_ids) == [1, 2, 3] and req.num_tokens == 3


def test_empty_prompt_raises_value_error():
    with pytest.raises(ValueError):
        Request("r0", [])


# -- multimodal features -----------------------------------------------------------


def test_mm_features_sorted_by_offset_are_accepted():
    features = [image(0, identifier="a"), image(0, identifier="b"), image(4, identifier="c")]
    req = Request("r0", list(range(8)), mm_features=features)
    assert [f.identifier for f in req.mm_features] == ["a", "b", "c"]


def test_unsorted_mm_features_raise_value_error():
    with pytest.raises(ValueError):
        Request("r0", list(range(8)), mm_features=[image(4), image(1)])


def test_mm_feature_defaults_to_an_image():
    feature = image(2, 3, "h")
    assert feature.modality == "image"
    assert (feature.identifier, feature.mm_position.offset, feature.mm_position.length) \
        == ("h", 2, 3)


# -- RequestStatus -------------------------------------------------------------------


def test_request_status_has_vllms_members_in_vllms_order():
    assert [s.name for s in RequestStatus] == VLLM_STATUS_ORDER
    assert [s.value for s in RequestStatus] == list(range(1, len(VLLM_STATUS_ORDER) + 1))


@pytest.mark.parametrize("name", VLLM_STATUS_ORDER)
def test_request_status_is_finished_only_after_preempted(name):
    status = RequestStatus[name]
    assert RequestStatus.is_finished(status) == name.startswith("FINISHED_")


def test_request_is_finished_follows_its_status():
    req = Request("r0", [1])
    req.status = RequestStatus.RUNNING
    assert not req.is_finished()
    req.status = RequestStatus.PREEMPTED
    assert not req.is_finished()
    req.status = RequestStatus.FINISHED_ABORTED
    assert req.is_finished()


# -- LoRARequest ------------------------------------------------------------------


def test_lora_request_exposes_vllms_adapter_id_and_name():
    lora = LoRARequest("adapter-a", 7)
    assert lora.adapter_id == 7 and lora.name == "adapter-a"
    assert (lora.lora_name, lora.lora_int_id) == ("adapter-a", 7)


def test_lora_request_compares_by_value_and_is_frozen():
    assert LoRARequest("a", 1) == LoRARequest("a", 1)
    assert LoRARequest("a", 1) != LoRARequest("a", 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        LoRARequest("a", 1).lora_name = "b"
