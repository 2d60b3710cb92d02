"""The integration seam shared by the transformers adapter, the vLLM connector and the SGLang
backend."""

from __future__ import annotations

import logging
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import InvalidArgumentError, NotConnectedError
from kvtier.integrations.seam import (
    LazyClient,
    Recompute,
    agree_min,
    check_chunk_blocks,
    common_resume_points,
    head_range,
    prefill_speed,
    resume_points,
)


def test_head_range_splits_evenly_and_refuses_otherwise() -> None:
    assert head_range(8, 4, 3) == slice(6, 8)
    assert head_range(2, 1, 0) == slice(0, 2)
    with pytest.raises(ValueError, match="does not divide"):
        head_range(4, 3, 0)
    with pytest.raises(ValueError, match="worker_id=2"):
        head_range(4, 2, 2)


def test_ranks_agree_on_the_smallest_span() -> None:
    assert agree_min([512, 256, 768]) == 256
    assert agree_min([0]) == 0


def test_chunk_must_be_whole_blocks() -> None:
    assert check_chunk_blocks(256, 32, "--block-size") == 8
    with pytest.raises(InvalidArgumentError, match=r"chunk size \(48 tokens.*--block-size"):
        check_chunk_blocks(48, 32, "--block-size")


def test_full_attention_resumes_only_inside_its_leading_pages() -> None:
    assert resume_points([True, True, False, True]) == [1, 2]
    assert resume_points([False, True]) == []
    assert resume_points([]) == []


def test_a_trailing_part_resumes_where_its_last_pages_are_held() -> None:
    state = [False, True, False, False, True, True]  # a recurrent state after pages 2, 5, 6
    assert resume_points(state, trailing=1) == [2, 5, 6]
    window = [True, False, True, True, False, True, True, True]
    assert resume_points(window, trailing=2) == [1, 4, 7, 8]  # 1: the window is the prefix
    assert resume_points(window, trailing=5) == [1]


def test_every_part_must_resume_at_a_common_point() -> None:
    kv = resume_points([True] * 6)
    state = resume_points([False, True, False, True, False, False], trailing=1)
    window = resume_points([True, True, True, False, True, True], trailing=2)
    assert common_resume_points(6, [kv, state, window]) == [2]
    assert common_resume_points(6, [kv]) == kv
    assert common_resume_points(4, [kv]) == [1, 2, 3, 4]  # only points inside num_pages
    assert common_resume_points(6, [kv, []]) == []


@given(
    present=st.lists(st.booleans(), max_size=40),
    trailing=st.one_of(st.none(), st.integers(1, 6)),
)
def test_resume_points_match_the_window_rule(present: list[bool], trailing: int | None) -> None:
    n = len(present) if trailing is None else trailing
    want = [p for p in range(1, len(present) + 1) if all(present[max(0, p - n) : p])]
    assert resume_points(present, trailing) == want


def test_a_kvtier_failure_reads_as_the_fallback_until_reset() -> None:
    r = Recompute("test")
    calls = []

    def failing() -> int:
        calls.append(1)
        raise NotConnectedError("down")

    assert r.call("lookup", 0, failing) == 0
    assert isinstance(r.last_error, NotConnectedError)
    assert r.call("retrieve", 0, lambda: 5) == 0  # not attempted: the unit already failed
    assert calls == [1]
    r.reset()
    assert r.call("lookup", 0, lambda: 7) == 7


def test_calls_that_stand_alone_are_each_attempted_and_an_outage_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = Recompute("test", per_unit=False)

    def failing() -> int:
        raise NotConnectedError("down")

    caplog.set_level(logging.DEBUG, logger="kvtier.integrations.seam")
    assert r.call("lookup", 0, failing) == 0
    assert r.call("lookup", 0, failing) == 0
    assert r.call("lookup", 0, lambda: 7) == 7  # attempted: no unit holds the failure
    assert isinstance(r.last_error, NotConnectedError)  # kept: what the last miss came from
    levels = [rec.levelno for rec in caplog.records]
    assert levels == [logging.WARNING, logging.DEBUG, logging.INFO]
    assert "answers again" in caplog.records[-1].getMessage()


def test_lazy_client_fails_fast_then_retries(tmp_path: object) -> None:
    lazy = LazyClient(f"ipc://{tmp_path}/nobody.sock", timeout=0.3, retry_s=60)
    t0 = time.monotonic()
    assert lazy.try_connect("test") is None  # the connect attempt times out
    t1 = time.monotonic()
    assert lazy.try_connect("test") is None  # within retry_s: no second attempt
    assert time.monotonic() - t1 < 0.1 < t1 - t0 + 0.1
    lazy.close()


def test_a_stated_prefill_speed_is_a_finite_number_of_tokens_per_second() -> None:
    assert prefill_speed({}, "cfg") == 0.0
    assert prefill_speed({"prefill_tokens_per_s": "25000"}, "cfg") == 25000.0
    for bad in (-1, "fast", float("inf"), float("nan"), None):
        with pytest.raises(
            InvalidArgumentError, match=r"cfg: prefill_tokens_per_s=.* must be >= 0"
        ):
            prefill_speed({"prefill_tokens_per_s": bad}, "cfg")


def test_lazy_client_hands_a_failed_connect_to_recompute_and_refuses_misfits(
    tmp_path: object,
) -> None:
    r = Recompute("test", per_unit=False)
    lazy = LazyClient(f"ipc://{tmp_path}/nobody.sock", timeout=0.3, connect_timeout=0.3)
    assert lazy.try_connect("test", r) is None
    assert isinstance(r.last_error, NotConnectedError)
    assert lazy.connected is None
    lazy.close()

    misfit = LazyClient("nowhere", timeout=0.3, refused=(ValueError,))
    with pytest.raises(InvalidArgumentError, match="needs a scheme"):
        misfit.try_connect("test")  # an address to fix, never waited out
