"""The caller's data as the wire carries it: token ids packed as uint32 bytes, and a numpy
array or CPU torch tensor of chunks viewed as rows of bytes (no copy)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import BadArrayError, InvalidArgumentError, KVTierError
from kvtier.hashing import TokenIds, token_bytes

__all__ = ["chunk_rows", "packed_tokens"]


def packed_tokens(tokens: TokenIds) -> bytes:
    """`tokens` as packed uint32 bytes; InvalidArgumentError names what is wrong with them."""
    try:
        raw = token_bytes(tokens)
    except KVTierError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(
            f"tokens must be ints in [0, 2**32), a numpy integer array or packed uint32 "
            f"bytes: {exc}"
        ) from None
    return raw if isinstance(raw, bytes) else bytes(raw)


def chunk_rows(
    array: Any, what: str, *, writable: bool
) -> tuple[npt.NDArray[np.uint8], list[int], str]:
    """A (num_chunks, chunk_bytes) uint8 view of a numpy array or CPU torch tensor, no copy.

    Returns the view, the chunk shape (array shape without its first axis) and the dtype name.
    """
    if isinstance(array, np.ndarray):
        if array.ndim < 2:
            raise BadArrayError(
                f"{what} must be (num_chunks, *chunk_shape), got shape {array.shape}"
            )
        if not array.flags.c_contiguous:
            raise BadArrayError(f"{what} must be C-contiguous (use np.ascontiguousarray)")
        if not array.dtype.isnative:
            raise BadArrayError(
                f"{what} has byte order {array.dtype.str!r}, not this machine's: convert it "
                "(array.astype(array.dtype.newbyteorder('=')))"
            )
        if writable and not array.flags.writeable:
            raise BadArrayError(f"{what} is read-only; retrieve writes into it")
        rows = array.reshape(array.shape[0], math.prod(array.shape[1:])).view(np.uint8)
        return rows, list(array.shape[1:]), array.dtype.name
    if type(array).__module__.startswith("torch"):
        if array.device.type != "cpu":
            raise BadArrayError(f"{what} is on {array.device}; kvtier moves CPU tensors")
        if array.dim() < 2:
            raise BadArrayError(
                f"{what} must be (num_chunks, *chunk_shape), got {tuple(array.shape)}"
            )
        if not array.is_contiguous():
            raise BadArrayError(f"{what} must be contiguous (call .contiguous())")
        import torch  # only reached when the caller already uses torch

        flat = array.detach().reshape(array.shape[0], math.prod(array.shape[1:]))
        rows_t = flat.view(torch.uint8)
        return rows_t.numpy(), list(array.shape[1:]), str(array.dtype).removeprefix("torch.")
    raise BadArrayError(f"{what} must be a numpy array or a CPU torch tensor, got {type(array)}")
