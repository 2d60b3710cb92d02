"""LayoutRegistry: one layout per (model, world_size), checked on every data request."""

from __future__ import annotations

import pytest

from kvtier.errors import (
    BadArrayError,
    InvalidArgumentError,
    LayoutMismatchError,
    NoSpaceError,
    NotRegisteredError,
)
from kvtier.layouts import Layout, LayoutRegistry


def test_layout_size_and_text() -> None:
    layout = Layout.of([32, 2, 256, 4, 128], "bfloat16")
    assert layout.nbytes == 32 * 2 * 256 * 4 * 128 * 2
    assert layout.text == "bfloat16[32,2,256,4,128]"


@pytest.mark.parametrize(
    ("shape", "dtype"), [([], "float16"), ([4, 0], "float16"), ([4], "complex64")]
)
def test_bad_layouts_are_refused(shape: list[int], dtype: str) -> None:
    with pytest.raises(BadArrayError):
        Layout.of(shape, dtype)


def test_every_rank_must_register_the_same_layout() -> None:
    reg = LayoutRegistry()
    reg.register("m", 2, 0, [4, 8], "float16")
    reg.register("m", 2, 1, [4, 8], "float16")
    reg.register("m", 1, 0, [4, 16], "float16")  # another world size is another name space
    with pytest.raises(LayoutMismatchError, match=r"float16\[4,8\].*float32\[4,8\]"):
        reg.register("m", 2, 1, [4, 8], "float32")
    with pytest.raises(InvalidArgumentError, match="worker_id 2"):
        reg.register("m", 2, 2, [4, 8], "float16")


def test_check_names_what_is_wrong() -> None:
    reg = LayoutRegistry()
    with pytest.raises(NotRegisteredError, match="register"):
        reg.check("m", 1, 0, [4, 8], "float16")
    reg.register("m", 1, 0, [4, 8], "float16")
    assert reg.check("m", 1, 0, [4, 8], "float16").nbytes == 64
    with pytest.raises(BadArrayError, match=r"float16\[4, 9\].*float16\[4,8\]"):
        reg.check("m", 1, 0, [4, 9], "float16")
    with pytest.raises(InvalidArgumentError):
        reg.check("m", 1, 3, [4, 8], "float16")


def test_a_refused_registration_records_nothing() -> None:
    """Every check comes before the record: after a refusal, the first valid registration of
    the name sets its layout."""
    reg = LayoutRegistry()
    with pytest.raises(InvalidArgumentError):
        reg.register("m", 2, 2, [4, 8], "float16")
    with pytest.raises(BadArrayError):
        reg.register("m", 2, 0, [4, 0], "float16")
    with pytest.raises(NoSpaceError, match=r"needs 256 bytes .* L1 of 255 bytes"):
        reg.register("m", 2, 0, [4, 8], "float32", max_group_bytes=255)
    assert reg.get("m", 2) is None
    assert reg.register("m", 2, 0, [4, 8], "float32") == Layout.of([4, 8], "float32")
