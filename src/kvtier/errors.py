"""kvtier's exception tree; each class carries the wire error code that stands for it.

A server handler raises one of these; the transport turns it into an error reply with the same
code, and the client raises the same class again, so a caller catches identical types whether
the failure happened locally or in the server.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Error codes on the wire. Values are stable: never renumber, only append."""

    MALFORMED_FRAME = 1
    UNKNOWN_REQUEST = 2
    PROTOCOL_VERSION = 3
    HASH_CONTRACT = 4
    MISALIGNED_RANGE = 5
    UNKNOWN_SESSION = 6
    BAD_ARRAY = 7
    NOT_REGISTERED = 8
    LAYOUT_MISMATCH = 9
    NO_SPACE = 10
    UNKNOWN_RESERVATION = 11
    INVALID_ARGUMENT = 12
    NOT_CONNECTED = 13
    LEASE_EXPIRED = 14
    INTERNAL = 99


class KVTierError(Exception):
    """Base of every kvtier error; `code` is what travels on the wire."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MalformedFrameError(KVTierError):
    """A frame that does not decode as a kvtier message."""

    code = ErrorCode.MALFORMED_FRAME


class UnknownRequestError(KVTierError):
    """A well-formed frame whose request type this server does not know."""

    code = ErrorCode.UNKNOWN_REQUEST


class ProtocolVersionError(KVTierError):
    """Client and server speak different protocol versions."""

    code = ErrorCode.PROTOCOL_VERSION


class HashContractError(KVTierError):
    """Client and server would name chunks differently (algorithm, chunk size, seed...)."""

    code = ErrorCode.HASH_CONTRACT


class MisalignedRangeError(KVTierError, ValueError):
    """A token range whose ends are not on chunk boundaries, or that is out of bounds."""

    code = ErrorCode.MISALIGNED_RANGE


class UnknownSessionError(KVTierError, KeyError):
    """An operation that needs an existing session named one the server does not hold."""

    code = ErrorCode.UNKNOWN_SESSION

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class BadArrayError(KVTierError, ValueError):
    """A KV array whose shape, size or dtype does not match the registered layout."""

    code = ErrorCode.BAD_ARRAY


class NotRegisteredError(KVTierError):
    """A store or retrieve from a worker that did not register its layout."""

    code = ErrorCode.NOT_REGISTERED


class LayoutMismatchError(KVTierError):
    """A registration that contradicts the layout other ranks registered for the model."""

    code = ErrorCode.LAYOUT_MISMATCH


class NoSpaceError(KVTierError):
    """The L1 cannot make room for a store even after evicting everything evictable."""

    code = ErrorCode.NO_SPACE


class UnknownReservationError(KVTierError):
    """A commit or release of a reservation the server does not hold (expired or never made)."""

    code = ErrorCode.UNKNOWN_RESERVATION


class InvalidArgumentError(KVTierError, ValueError):
    """Any other argument the server refuses; the message names it."""

    code = ErrorCode.INVALID_ARGUMENT


class NotConnectedError(KVTierError):
    """The client could not reach the server in time."""

    code = ErrorCode.NOT_CONNECTED


class LeaseExpiredError(KVTierError):
    """A staging or retrieve lease lapsed before the client finished with its slots: a store's
    chunks were not stored, a retrieve's copied bytes cannot be vouched for (discard them)."""

    code = ErrorCode.LEASE_EXPIRED


class InternalError(KVTierError):
    """A bug in kvtier: the handler failed in a way it did not anticipate."""

    code = ErrorCode.INTERNAL


_BY_CODE: dict[int, type[KVTierError]] = {
    cls.code: cls
    for cls in (
        MalformedFrameError,
        UnknownRequestError,
        ProtocolVersionError,
        HashContractError,
        MisalignedRangeError,
        UnknownSessionError,
        BadArrayError,
        NotRegisteredError,
        LayoutMismatchError,
        NoSpaceError,
        UnknownReservationError,
        InvalidArgumentError,
        NotConnectedError,
        LeaseExpiredError,
        InternalError,
    )
}


def error_from_code(code: int, message: str) -> KVTierError:
    """The exception that stands for a wire error code (InternalError for unknown codes)."""
    return _BY_CODE.get(code, InternalError)(message)
