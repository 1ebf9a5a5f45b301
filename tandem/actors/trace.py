"""A ring buffer of delivered messages, for the console and for debugging a test.

An entry keeps the message's type, sender, receiver, times and a compact summary: tensors become
{shape, dtype, nbytes, digest}, strings longer than `max_str_chars` become their length, so that
user text never reaches the trace (and from there a log or a page). torch is never imported
here at module level; a tensor is recognised by duck typing.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Any

import msgspec

# Hashing a tensor copies it to the host and blocks the event loop; above this size the digest is
# left out (None) rather than stall every actor for one trace line.
DIGEST_MAX_NBYTES = 16 * 1024 * 1024
MAX_STR_CHARS = 64


class TraceEntry(msgspec.Struct, frozen=True):
    type: str
    sender: str | None
    receiver: str
    wall_time_s: float
    handler_ms: float
    correlation_id: int | None
    summary: Any


class Trace:
    def __init__(
        self,
        capacity: int = 1024,
        *,
        summarize: bool = True,
        max_str_chars: int = MAX_STR_CHARS,
        digest_max_nbytes: int = DIGEST_MAX_NBYTES,
    ) -> None:
        self.capacity = capacity
        self.summarize = summarize
        self.max_str_chars = max_str_chars
        self.digest_max_nbytes = digest_max_nbytes
        self._entries: deque[TraceEntry] = deque(maxlen=capacity)
        self.recorded_total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(
        self,
        message: object,
        *,
        sender: str | None,
        receiver: str,
        wall_time_s: float,
        handler_ms: float,
        correlation_id: int | None = None,
    ) -> TraceEntry:
        summary = (
            summarize(message, self.max_str_chars, self.digest_max_nbytes)
            if self.summarize
            else None
        )
        entry = TraceEntry(
            type=type(message).__name__,
            sender=sender,
            receiver=receiver,
            wall_time_s=wall_time_s,
            handler_ms=handler_ms,
            correlation_id=correlation_id,
            summary=summary,
        )
        self._entries.append(entry)
        self.recorded_total += 1
        return entry

    def entries(self, last: int | None = None) -> list[TraceEntry]:
        """Oldest first; `last` keeps only the newest n."""
        if last is None:
            return list(self._entries)
        return list(self._entries)[-last:] if last > 0 else []

    def clear(self) -> None:
        self._entries.clear()


def is_tensor(value: object) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def summarize(
    message: object,
    max_str_chars: int = MAX_STR_CHARS,
    digest_max_nbytes: int = DIGEST_MAX_NBYTES,
) -> Any:
    """A JSON-ready summary of a message with tensors digested and long strings replaced."""

    def enc_hook(value: object) -> object:
        if is_tensor(value):
            return encode_tensor(value, digest_max_nbytes)
        # Anything else msgspec cannot encode is named, not dumped: a trace must never fail.
        return {"unencoded": type(value).__name__}

    if is_tensor(message):
        return encode_tensor(message, digest_max_nbytes)
    return _redact(msgspec.to_builtins(message, enc_hook=enc_hook), max_str_chars)


def encode_tensor(value: Any, digest_max_nbytes: int = DIGEST_MAX_NBYTES) -> dict[str, object]:
    shape = [int(d) for d in value.shape]
    dtype = str(value.dtype).removeprefix("torch.")
    nbytes = int(value.nbytes)
    digest = tensor_digest(value) if nbytes <= digest_max_nbytes else None
    return {"shape": shape, "dtype": dtype, "nbytes": nbytes, "digest": digest}


def tensor_digest(value: Any) -> str:
    """sha256 of the tensor's bytes in row-major order, first 16 hex digits."""
    return hashlib.sha256(_tensor_bytes(value)).hexdigest()[:16]


def _tensor_bytes(value: Any) -> bytes:
    if type(value).__module__.startswith("torch"):
        import torch  # lazy: the runtime must not pull torch in at import

        # A byte view covers dtypes numpy lacks (bfloat16, float8).
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes()
    # numpy and look-alikes: tobytes() is row-major (C order) by default.
    return value.tobytes()


# Element types a summarized list can hold as they are: a prompt's 16k token ids walked one by
# one cost the trace about 4 ms a message, and a request records a dozen.
_PLAIN = {int, float, bool, type(None)}


def _redact(value: Any, max_str_chars: int) -> Any:
    match value:
        case str() if len(value) > max_str_chars:
            return {"str_chars": len(value)}
        case dict():
            return {k: _redact(v, max_str_chars) for k, v in value.items()}
        case list():
            if set(map(type, value)) <= _PLAIN:
                return value  # token ids, counts: nothing in them to redact (one pass in C)
            return [_redact(v, max_str_chars) for v in value]
        case _:
            return value
