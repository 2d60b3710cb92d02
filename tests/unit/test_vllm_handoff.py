"""The hand-off's objects and the consumer's refusals (pure functions of the params)."""

from __future__ import annotations

from kvtier.integrations.vllm import handoff


def test_objects_cover_the_prompt_with_a_tail_ending_at_its_last_block() -> None:
    objs = handoff.objects(600, 256, 32)
    assert [(o.chunk_start, o.chunk_end, o.first) for o in objs] == [
        (0, 256, 0),
        (256, 512, 256),
        (352, 608, 512),  # the tail: 256 tokens of blocks ending at 608 = 19 blocks of 32
    ]
    assert [o.chunk_end for o in handoff.objects(512, 256, 32)] == [256, 512]  # no tail
    assert [(o.chunk_start, o.first) for o in handoff.objects(40, 256, 32)] == [(-192, 0)]
    assert handoff.window_blocks([5, 6, 7], -2, 4) == (0, 0, 5, 6)


def test_a_consumer_refuses_another_layout_naming_both_values() -> None:
    params = handoff.produced("h", 600, "m", 1, 256)
    assert handoff.refusal(params, 600, "m", 1, 256) is None
    why = handoff.refusal(params, 600, "m", 2, 256)
    assert why is not None and "over 1 ranks and this decode instance reads 2" in why
    assert "model" in (handoff.refusal(params, 600, "other", 1, 256) or "")
    assert "--chunk-size" in (handoff.refusal(params, 600, "m", 1, 128) or "")
    assert "same prompt" in (handoff.refusal(params, 599, "m", 1, 256) or "")
    assert handoff.wanted({"do_remote_decode": True}) == ""
    assert handoff.wanted({"kvtier_handoff": "x"}) == "x"
    assert handoff.wanted(None) is None and handoff.given({"other": 1}) is None
