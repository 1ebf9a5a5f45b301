import hashlib
from typing import Any

import numpy as np
import pytest

from tandem.actors import Actor, Message, Trace
from tandem.actors.harness import FakeClock, Harness
from tandem.actors.trace import summarize


class Rows(Message):
    """Sender: a test. Receiver: Sink. Ownership: the rows move to the receiver."""

    rows: Any  # a tensor, passed by reference
    label: str


class Note(Message):
    """Sender: a test. Receiver: Sink. Ownership: none."""

    text: str
    num_tokens: int


class Sink(Actor):
    async def handle(self, msg: Message) -> object | None:
        match msg:
            case Note():
                self.clock.advance(0.002)  # type: ignore[attr-defined]  # a FakeClock here
        return None


class StandIn:
    """Not numpy, not torch: only the duck-typed surface the trace reads."""

    shape = (2, 3)
    dtype = "int8"
    nbytes = 6

    def tobytes(self) -> bytes:
        return bytes(range(6))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


async def test_the_trace_records_type_sender_receiver_and_times_of_each_delivered_message():
    clock = FakeClock(start_s=10.0, epoch_s=1000.0)
    harness = Harness(Sink("sink", clock=clock), clock=clock)
    async with harness:
        await harness.ask("sink", Note("hi", 2), sender="server")
    [entry] = harness.trace.entries()
    assert (entry.type, entry.sender, entry.receiver) == ("Note", "server", "sink")
    assert entry.handler_ms == pytest.approx(2.0)
    assert entry.wall_time_s == pytest.approx(1010.002)
    assert entry.correlation_id == 1
    assert entry.summary == {"type": "Note", "text": "hi", "num_tokens": 2}


def test_the_trace_keeps_only_the_newest_entries():
    trace = Trace(capacity=3)
    for n in range(5):
        trace.record(Note("x", n), sender=None, receiver="r", wall_time_s=0.0, handler_ms=0.0)
    assert [e.summary["num_tokens"] for e in trace.entries()] == [2, 3, 4]
    assert [e.summary["num_tokens"] for e in trace.entries(last=2)] == [3, 4]
    assert len(trace) == 3 and trace.recorded_total == 5


def test_tensors_are_recorded_as_shape_dtype_and_digest():
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    summary = summarize(Rows(rows, "a"))
    assert summary["rows"] == {
        "shape": [3, 4],
        "dtype": "float32",
        "nbytes": 48,
        "digest": _digest(rows.tobytes()),
    }
    stand_in = summarize(Rows(StandIn(), "b"))["rows"]
    digest = _digest(bytes(range(6)))
    assert stand_in == {"shape": [2, 3], "dtype": "int8", "nbytes": 6, "digest": digest}


def test_torch_tensors_are_recorded_as_shape_dtype_and_digest():
    torch = pytest.importorskip("torch")
    rows = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    encoded = summarize(Rows(rows, "a"))["rows"]
    raw = rows.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert encoded == {"shape": [2, 3], "dtype": "bfloat16", "nbytes": 12, "digest": _digest(raw)}
    assert summarize(Rows(rows.clone(), "a"))["rows"]["digest"] == encoded["digest"]
    assert summarize(Rows(rows + 1, "a"))["rows"]["digest"] != encoded["digest"]
    # A transposed view digests its row-major values, not its storage.
    assert summarize(Rows(rows.t(), "a"))["rows"]["digest"] == _digest(
        rows.t().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    )


def test_a_tensor_over_the_digest_limit_keeps_its_shape_without_a_digest():
    rows = np.zeros((4, 4), dtype=np.float64)
    assert summarize(Rows(rows, "a"), digest_max_nbytes=64)["rows"]["digest"] is None


def test_strings_longer_than_64_chars_are_recorded_as_their_length_only():
    user_text = "please summarise my medical history " * 4
    summary = summarize(Note(user_text, 3))
    assert summary["text"] == {"str_chars": len(user_text)}
    assert user_text not in repr(summary)
    assert summarize(Note("short", 3))["text"] == "short"


def test_a_field_the_trace_cannot_encode_is_named_not_dumped():
    assert summarize(Rows(object(), "a"))["rows"] == {"unencoded": "object"}
