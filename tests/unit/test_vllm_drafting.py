"""Where a hit ends under speculative decoding, and what a drafter adds to the model's name
(pure functions of vLLM's numbers)."""

from __future__ import annotations

from kvtier.integrations.vllm.drafting import Drafting, hit_point


def test_without_draft_kv_the_hit_is_whole_units_short_of_the_last_token() -> None:
    assert hit_point(256, 300, 32, 0) == 256
    assert hit_point(256, 256, 32, 0) == 224  # the last token is computed for its logits
    assert hit_point(256, 300, 256, 0) == 256  # whole chunks (sliding window, Mamba)
    assert hit_point(0, 300, 32, 0) == 0


def test_draft_kv_that_read_the_next_token_moves_the_hit_back() -> None:
    # EAGLE: the draft KV at 255 read token 256, which the stored chunks' names do not cover
    assert hit_point(256, 300, 32, 1) == 224
    # a prompt of 256: the hit stops at 224 anyway, and the token at 224 is matched
    assert hit_point(256, 256, 32, 1) == 224
    assert hit_point(256, 257, 32, 1) == 224
    assert hit_point(64, 300, 64, 1) == 0  # whole chunks: a chunk back
    assert hit_point(32, 300, 32, 1) == 0
    # multi-module MTP with 3 modules reads 3 tokens ahead: still one block back at 32
    assert hit_point(256, 300, 32, 3) == 224
    assert hit_point(256, 300, 1, 3) == 253  # at a unit of one token, 3 tokens back


def test_a_drafter_with_kv_names_its_weights() -> None:
    assert Drafting().name_suffix(explicit=False) == ""
    assert Drafting("ngram").name_suffix(explicit=False) == ""  # n-gram keeps no KV
    eagle = Drafting("eagle", "w0123", 1, 0)
    assert eagle.name_suffix(explicit=False) == ":deagle@w0123"
    assert eagle.name_suffix(explicit=True) == ":deagle"
