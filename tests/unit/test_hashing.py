"""Block hashing: the hash functions, the chain, extra keys, and the helpers
that pack hashes for the pool's index and for KV events.

The hex digests below were recorded from vLLM 0.25.1 (``vllm.utils.hashing``
and ``vllm.v1.core.kv_cache_utils`` with vLLM's own ``Request``, run with
``PYTHONHASHSEED=0``). They pin byte-identity: a router that rebuilds vLLM's
hashes must get the same bytes from kvref.
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest

from kvref.core import kv_cache_utils as ku
from kvref.hashing import sha256, sha256_cbor
from kvref.core.kv_cache_utils import (
    BlockHashListWithBlockSize,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
    need_extra_keys,
)
from kvref.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request

HASH_FNS = {"sha256": sha256, "sha256_cbor": sha256_cbor}

# Recorded from vLLM 0.25.1 with PYTHONHASHSEED=0.
VLLM_NONE_HASH_SEED_0 = {
    "sha256": "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
    "sha256_cbor": "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
}
# Recorded from vLLM 0.25.1: hash_block_tokens(fn, None, [1, 2, 3, 4]) and its
# child hash_block_tokens(fn, h0, [5, 6, 7, 8]), PYTHONHASHSEED=0.
VLLM_PLAIN_CHAIN = {
    "sha256": ("762b2e7e1520febd3a0aedb7358e8602facf3924440e18538fce057e23bae91d",
               "9e62b5a7ec298f33cb4c7d9e00b659874bb2432d23ad6879ad1746592a2b036b"),
    "sha256_cbor": ("c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb",
                    "24125b23e68883b5c2141db2959d48433fe6bde2f26bd914efad121d154ab2d6"),
}
# Recorded from vLLM 0.25.1: block_hashes of the request built by
# ``rich_request`` (block size 4, 10 prompt tokens), then after appending [7, 8].
VLLM_RICH_REQUEST = {
    "sha256": ["23930db9e5a8436207b6f43f5f8e74880c8093b5cac0dd7ff7c3cfa3525f9c85",
               "0746b688e3036a4e966238b9d67e929da93d81231fabef85b3872b9d08e6478d",
               "37fafed190040126e3652ebceff6cd00687065db89bc2f358b4baa19b435f7f8"],
    "sha256_cbor": ["58cf5370257e07a3e2307f7e8ca947eee048e09e600faec342cef9d023aa98e5",
                    "6e3eaa70532b911ca414d15ba5adfcc52eea127dfefb3b325d09585a2f8d4a6c",
                    "40b3208dda1be60c6c2dd7634650d8db1613663b5872fc58796e420e97d3f6ae"],
}


@pytest.fixture
def seed0(monkeypatch):
    """PYTHONHASHSEED=0; NONE_HASH is restored after the test."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setattr(ku, "NONE_HASH", ku.NONE_HASH)


@pytest.fixture(params=sorted(HASH_FNS))
def fn_name(request, seed0):
    """Each hash function in turn, with NONE_HASH seeded from PYTHONHASHSEED=0."""
    init_none_hash(HASH_FNS[request.param])
    return request.param


def image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(identifier, PlaceholderRange(offset, length))


def rich_request(hash_fn) -> Request:
    """10 tokens in blocks of 4, LoRA, salt and two images::

        tokens   100 101 102 103 | 104 105 106 107 | 108 109
        img-A            [----------]                        offset 2, length 3
        img-B                        [----------]            offset 5, length 3
    """
    return Request("rich", list(range(100, 110)),
                   block_hasher=get_request_block_hasher(4, hash_fn),
                   lora_request=LoRARequest("adapter-a", 7), cache_salt="salt-1",
                   mm_features=[image("img-A", 2, 3), image("img-B", 5, 3)])


def distinct_equal_strings() -> tuple[str, str]:
    # join builds a fresh object each call, unlike a literal, which is shared.
    a, b = "".join(["ten", "ant"]), "".join(["ten", "ant"])
    assert a == b and a is not b
    return a, b


# -- the two hash functions ----------------------------------------------------


def test_sha256_hashes_the_highest_protocol_pickle():
    value = (b"parent", (1, 2, 3), ("lora",))
    expected = hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert sha256(value) == expected
    assert len(sha256(value)) == 32


def test_sha256_cbor_hashes_the_canonical_cbor_encoding():
    value = (b"parent", (1, 2, 3), ("lora",))
    assert sha256_cbor(value) == hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def test_sha256_tells_the_same_str_twice_from_two_equal_strs():
    # Pickle memoizes objects it has written: the second occurrence of the same
    # object becomes a back-reference, so the bytes (and hash) differ.
    a, b = distinct_equal_strings()
    same, distinct = (b"p", (1, 2), (a, a)), (b"p", (1, 2), (a, b))
    assert same == distinct
    # Recorded from vLLM 0.25.1 (vllm.utils.hashing.sha256).
    assert sha256(same).hex() == \
        "7b9e15cfd24ebfb2bfc143ff1fd1eb99b74ffda15229adcd40b5de1d08aba2de"
    assert sha256(distinct).hex() == \
        "b018c08849177203d3d23252c7cd5a548ffc076ed33acec2fa31d0a9e6b4314f"


def test_sha256_cbor_hashes_equal_values_equally_regardless_of_identity():
    a, b = distinct_equal_strings()
    # Recorded from vLLM 0.25.1 (vllm.utils.hashing.sha256_cbor).
    expected = "027a3246abdfa0cb85cda8e5e2bcbb481ecc0a647f6d1eda5635f5883f9100dc"
    assert sha256_cbor((b"p", (1, 2), (a, a))).hex() == expected
    assert sha256_cbor((b"p", (1, 2), (a, b))).hex() == expected


def test_request_hash_keeps_object_identity_of_lora_name_and_salt(seed0):
    # The hasher must pass the request's own str objects to the hash, not
    # copies: with sha256 "LoRA name IS the salt" and "equals the salt" differ.
    init_none_hash(sha256)
    name, equal_name = distinct_equal_strings()

    def first_hash(salt):
        req = Request("r", [1, 2, 3, 4], block_hasher=get_request_block_hasher(4, sha256),
                      lora_request=LoRARequest(name, 1), cache_salt=salt)
        return req.block_hashes[0].hex()

    # Recorded from vLLM 0.25.1 with vLLM's Request and LoRARequest.
    assert first_hash(name) == \
        "bc330bcc3b3a2c8d553acecfd2e894b71a87bccbaeceb9faf72e0acb461ab178"
    assert first_hash(equal_name) == \
        "d8f303133173c3e76846d5b4987677bf94c50468c09e23c4e4b441ec34fe5aef"


def test_request_hash_under_sha256_cbor_ignores_object_identity(seed0):
    init_none_hash(sha256_cbor)
    name, equal_name = distinct_equal_strings()
    hashes = [Request("r", [1, 2, 3, 4], block_hasher=get_request_block_hasher(4, sha256_cbor),
                      lora_request=LoRARequest(name, 1), cache_salt=salt).block_hashes[0].hex()
              for salt in (name, equal_name)]
    # Recorded from vLLM 0.25.1.
    assert hashes == ["87cf19a3fff9e0886e4d9d0a82cb3cfab838a758f8d9c8914f60ffdcd6bff1dd"] * 2


# -- NONE_HASH --------------------------------------------------------------


def test_none_hash_from_pythonhashseed_0_matches_vllm(fn_name):
    assert ku.NONE_HASH.hex() == VLLM_NONE_HASH_SEED_0[fn_name]


def test_none_hash_is_the_hash_of_the_seed_string(seed0, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    init_none_hash(sha256)
    assert ku.NONE_HASH == sha256("42")
    # Recorded from vLLM 0.25.1.
    assert ku.NONE_HASH.hex() == \
        "c0bc02c9fc92a4944335649961b9e55cc41b194bece4801e8c6ef0f0f3f5884a"


def test_empty_pythonhashseed_still_seeds_deterministically(seed0, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "")
    init_none_hash(sha256)
    # Recorded from vLLM 0.25.1: "" is a seed, not "unset".
    assert ku.NONE_HASH.hex() == \
        "3279c4b947f331d055c47442171c9ea17712596bd7fe094c31d4a5d432b42d68"


def test_unset_pythonhashseed_gives_fresh_random_32_bytes(seed0, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED")
    init_none_hash(sha256)
    first = ku.NONE_HASH
    init_none_hash(sha256)
    assert len(first) == 32 and len(ku.NONE_HASH) == 32
    assert first != ku.NONE_HASH


def test_hashing_before_init_none_hash_raises(monkeypatch):
    monkeypatch.setattr(ku, "NONE_HASH", None)
    with pytest.raises(RuntimeError):
        hash_block_tokens(sha256, None, [1, 2, 3, 4])


# -- hash_block_tokens ------------------------------------------------------


def test_first_block_chains_from_none_hash(fn_name):
    fn = HASH_FNS[fn_name]
    h0 = hash_block_tokens(fn, None, [1, 2, 3, 4])
    assert h0 == fn((ku.NONE_HASH, (1, 2, 3, 4), None))
    assert h0.hex() == VLLM_PLAIN_CHAIN[fn_name][0]


def test_next_block_chains_from_its_parent(fn_name):
    fn = HASH_FNS[fn_name]
    h0 = hash_block_tokens(fn, None, [1, 2, 3, 4])
    h1 = hash_block_tokens(fn, h0, [5, 6, 7, 8])
    assert h1 == fn((h0, (5, 6, 7, 8), None))
    assert h1.hex() == VLLM_PLAIN_CHAIN[fn_name][1]


def test_empty_parent_counts_as_no_parent(seed0):
    init_none_hash(sha256)
    assert hash_block_tokens(sha256, b"", [1, 2]) == hash_block_tokens(sha256, None, [1, 2])


def test_token_container_type_does_not_change_the_hash(seed0):
    init_none_hash(sha256)
    expected = hash_block_tokens(sha256, None, (1, 2, 3, 4))
    assert hash_block_tokens(sha256, None, [1, 2, 3, 4]) == expected
    assert hash_block_tokens(sha256, None, range(1, 5)) == expected


def test_same_tokens_under_another_parent_or_extra_keys_hash_differently(seed0):
    init_none_hash(sha256)
    base = hash_block_tokens(sha256, None, [1, 2, 3, 4])
    assert hash_block_tokens(sha256, base, [1, 2, 3, 4]) != base
    assert hash_block_tokens(sha256, None, [1, 2, 3, 4], ("lora",)) != base
    assert hash_block_tokens(sha256, None, [1, 2, 3, 5]) != base


# -- get_request_block_hasher -------------------------------------------------


def test_request_hasher_hashes_only_full_blocks(seed0):
    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)
    assert len(Request("a", [1, 2, 3], block_hasher=hasher).block_hashes) == 0
    assert len(Request("b", list(range(8)), block_hasher=hasher).block_hashes) == 2
    assert len(Request("c", list(range(11)), block_hasher=hasher).block_hashes) == 2


def test_request_hashes_are_the_plain_chain_without_extra_keys(seed0):
    init_none_hash(sha256)
    req = Request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9],
                  block_hasher=get_request_block_hasher(4, sha256))
    assert [h.hex() for h in req.block_hashes] == list(VLLM_PLAIN_CHAIN["sha256"])


def test_request_hasher_extends_hashes_as_output_tokens_complete_blocks(seed0):
    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)
    req = Request("r", [1, 2, 3, 4, 5], block_hasher=hasher)
    first = req.block_hashes[0]
    counts = []
    for token in [6, 7, 8, 9, 10, 11, 12]:
        req.append_output_token_ids(token)
        counts.append(len(req.block_hashes))
    assert counts == [1, 1, 2, 2, 2, 2, 3]
    assert req.block_hashes[0] is first  # earlier hashes are never recomputed
    whole = Request("w", list(range(1, 13)), block_hasher=hasher)
    assert req.block_hashes == whole.block_hashes


def test_request_hasher_handles_a_list_that_completes_several_blocks(seed0):
    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)
    req = Request("r", [1, 2], block_hasher=hasher)
    req.append_output_token_ids(list(range(3, 12)))
    assert req.block_hashes == Request("w", list(range(1, 12)), block_hasher=hasher).block_hashes
    assert len(req.block_hashes) == 2


def test_request_hasher_rejects_a_non_positive_block_size():
    with pytest.raises(ValueError):
        get_request_block_hasher(0, sha256)


def test_request_with_lora_salt_and_images_hashes_like_vllm(fn_name):
    req = rich_request(HASH_FNS[fn_name])
    assert [h.hex() for h in req.block_hashes] == VLLM_RICH_REQUEST[fn_name][:2]
    req.append_output_token_ids([7, 8])
    assert [h.hex() for h in req.block_hashes] == VLLM_RICH_REQUEST[fn_name]


def test_request_hash_is_the_chain_over_its_extra_keys(seed0):
    init_none_hash(sha256)
    req = rich_request(sha256)
    h0 = hash_block_tokens(sha256, None, [100, 101, 102, 103],
                           ("adapter-a", ("img-A", 2), "salt-1"))
    h1 = hash_block_tokens(sha256, h0, [104, 105, 106, 107],
                           ("adapter-a", ("img-A", -2), ("img-B", 1)))
    assert req.block_hashes == [h0, h1]


def test_block_completed_by_output_tokens_only_sees_the_last_image(seed0):
    # vLLM resumes the multimodal walk at the LAST item for blocks completed
    # after construction, so img-A (also in block 1) is left out of its keys.
    init_none_hash(sha256)
    req = Request("r", [9] * 6, block_hasher=get_request_block_hasher(4, sha256),
                  mm_features=[image("img-A", 4, 1), image("img-B", 5, 1)])
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([1, 2])
    h0, h1 = req.block_hashes
    assert h1 == hash_block_tokens(sha256, h0, [9, 9, 1, 2], (("img-B", 1),))
    # Recorded from vLLM 0.25.1.
    assert [h.hex() for h in req.block_hashes] == [
        "5968974f1627fdcfda1ce34b75d975e5f15f8568f6d6745c72511923c7efc760",
        "f57ced9d34290049a59c6b404f715334c2dfcf496283c56da3ba740a3f5095a4"]
    # The full walk would have seen both images.
    assert generate_block_hash_extra_keys(req, 4, 8, 0) == ((("img-A", 0), ("img-B", 1)), 2)


# -- extra keys ----------------------------------------------------------------


def plain_request(**kwargs) -> Request:
    return Request("r", list(range(16)), **kwargs)


def test_need_extra_keys_only_for_lora_salt_or_images():
    assert not need_extra_keys(plain_request())
    assert need_extra_keys(plain_request(lora_request=LoRARequest("x", 1)))
    assert need_extra_keys(plain_request(cache_salt="s"))
    assert need_extra_keys(plain_request(mm_features=[image("i", 0, 1)]))


def test_no_extra_keys_gives_none_not_an_empty_tuple():
    assert generate_block_hash_extra_keys(plain_request(), 0, 4, 0) == (None, 0)


def test_lora_name_is_an_extra_key_of_every_block():
    req = plain_request(lora_request=LoRARequest("adapter-a", 7))
    for start in (0, 4, 12):
        assert generate_block_hash_extra_keys(req, start, start + 4, 0) == (("adapter-a",), 0)


def test_cache_salt_is_an_extra_key_of_the_first_block_only():
    req = plain_request(cache_salt="salt-1")
    assert generate_block_hash_extra_keys(req, 0, 4, 0) == (("salt-1",), 0)
    assert generate_block_hash_extra_keys(req, 4, 8, 0) == (None, 0)


def test_empty_cache_salt_is_not_a_key():
    assert generate_block_hash_extra_keys(plain_request(cache_salt=""), 0, 4, 0) == (None, 0)


def test_extra_keys_order_is_lora_then_images_then_salt(seed0):
    init_none_hash(sha256)
    req = rich_request(sha256)
    assert generate_block_hash_extra_keys(req, 0, 4, 0) == \
        (("adapter-a", ("img-A", 2), "salt-1"), 0)


def test_image_spanning_two_blocks_is_keyed_in_both_with_relative_offsets():
    req = plain_request(mm_features=[image("img", 2, 5)])          # tokens 2..6
    assert generate_block_hash_extra_keys(req, 0, 4, 0) == ((("img", 2),), 0)
    assert generate_block_hash_extra_keys(req, 4, 8, 0) == ((("img", -2),), 1)
    assert generate_block_hash_extra_keys(req, 8, 12, 1) == (None, 1)


def test_several_images_in_one_block_are_all_keyed_in_order():
    req = plain_request(mm_features=[image("a", 1, 1), image("b", 2, 1), image("c", 6, 2)])
    # a and b end inside block 0; c starts in block 1, so the walk stops at c.
    assert generate_block_hash_extra_keys(req, 0, 4, 0) == ((("a", 1), ("b", 2)), 2)
    assert generate_block_hash_extra_keys(req, 4, 8, 2) == ((("c", 2),), 3)


def test_image_ending_exactly_at_block_end_moves_on_to_the_next_image():
    req = plain_request(mm_features=[image("a", 2, 2), image("b", 4, 4)])
    assert generate_block_hash_extra_keys(req, 0, 4, 0) == ((("a", 2),), 1)
    assert generate_block_hash_extra_keys(req, 4, 8, 1) == ((("b", 0),), 2)


def test_image_starting_after_the_block_is_not_keyed_yet():
    req = plain_request(mm_features=[image("a", 4, 2)])
    assert generate_block_hash_extra_keys(req, 0, 4, 0) == (None, 0)


def test_block_past_every_image_has_no_image_keys():
    req = plain_request(mm_features=[image("a", 0, 2)])
    assert generate_block_hash_extra_keys(req, 8, 12, 0) == (None, 0)


def test_same_image_at_another_offset_in_the_block_hashes_differently(seed0):
    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)
    at_0 = Request("a", [7] * 4, block_hasher=hasher, mm_features=[image("img", 0, 2)])
    at_1 = Request("b", [7] * 4, block_hasher=hasher, mm_features=[image("img", 1, 2)])
    assert at_0.block_hashes != at_1.block_hashes


# -- BlockHashListWithBlockSize -----------------------------------------------

FINE = [b"A", b"B", b"C", b"D", b"E"]


def test_coarse_view_takes_the_fine_hash_at_each_coarse_block_end():
    view = BlockHashListWithBlockSize(FINE[:4], hash_block_size=16, target_block_size=32)
    assert len(view) == 2
    assert (view[0], view[1]) == (b"B", b"D")
    assert list(view) == [b"B", b"D"]


def test_coarse_view_drops_a_trailing_partial_coarse_block():
    view = BlockHashListWithBlockSize(FINE, 16, 32)
    assert len(view) == 2
    assert list(view) == [b"B", b"D"]
    with pytest.raises(IndexError):
        view[2]


def test_coarse_view_supports_negative_indexes():
    view = BlockHashListWithBlockSize(FINE[:4], 16, 32)
    assert (view[-1], view[-2]) == (b"D", b"B")


def test_coarse_view_slices_return_lists():
    view = BlockHashListWithBlockSize(FINE * 2 + [b"F", b"G"], 4, 8)   # 12 fine -> 6 coarse
    assert view[1:3] == [b"D", b"A"]
    assert view[::2] == [b"B", b"A", b"E"]
    assert view[-2:] == [b"E", b"G"]
    assert view[5:100] == [b"G"]


def test_coarse_view_with_scale_one_is_the_list_itself():
    view = BlockHashListWithBlockSize(FINE, 16, 16)
    assert list(view) == FINE and len(view) == 5


def test_coarse_view_follows_the_list_it_wraps():
    hashes = [b"A"]
    view = BlockHashListWithBlockSize(hashes, 16, 32)
    assert len(view) == 0
    hashes.append(b"B")
    assert list(view) == [b"B"]


def test_coarse_view_rejects_a_size_that_is_not_a_multiple():
    with pytest.raises(ValueError):
        BlockHashListWithBlockSize(FINE, 16, 24)


def test_coarse_view_out_of_range_raises_index_error():
    view = BlockHashListWithBlockSize(FINE[:4], 16, 32)
    with pytest.raises(IndexError):
        view[2]
    with pytest.raises(IndexError):
        view[-3]


# -- index keys and event hashes ------------------------------------------------

HASH32 = bytes(range(32))


@pytest.mark.parametrize("group_id", [0, 1, 258, 2**32 - 1])
def test_block_hash_with_group_id_round_trips(group_id):
    key = make_block_hash_with_group_id(HASH32, group_id)
    assert len(key) == 36
    assert key[:32] == HASH32
    assert key[32:] == group_id.to_bytes(4, "big")
    assert get_block_hash(key) == HASH32
    assert get_group_id(key) == group_id


def test_same_hash_in_two_groups_gives_two_keys():
    assert make_block_hash_with_group_id(HASH32, 0) != make_block_hash_with_group_id(HASH32, 1)


def test_group_id_beyond_four_bytes_is_rejected():
    with pytest.raises(OverflowError):
        make_block_hash_with_group_id(HASH32, 2**32)


def test_event_hash_is_the_last_8_bytes_as_an_int_by_default(monkeypatch):
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    converted = maybe_convert_block_hash(HASH32)
    assert converted == int.from_bytes(bytes(range(24, 32)), "big")
    assert converted == 1736447835066146335  # recorded from vLLM 0.25.1


def test_event_hash_of_a_recorded_block_matches_vllm(fn_name):
    h0 = bytes.fromhex(VLLM_PLAIN_CHAIN[fn_name][0])
    # Recorded from vLLM 0.25.1.
    expected = {"sha256": 10362225831949560093, "sha256_cbor": 2164874634404590027}
    assert maybe_convert_block_hash(h0) == expected[fn_name]


def test_event_hash_stays_bytes_when_int_hashes_are_switched_off(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert maybe_convert_block_hash(HASH32) == HASH32
