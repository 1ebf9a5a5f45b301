import asyncio
import importlib
import pkgutil
from typing import Any, Literal, Union

import msgspec
import pytest

import tandem.actors
from tandem.actors import Actor, Message
from tandem.actors.harness import FakeClock, Harness, example


class Tick(Message):
    """Sender: a test. Receiver: Timer, which waits `delay_s` on its clock. Ownership: none."""

    delay_s: float


class Rang(Message):
    """Sender: Timer, once its delay has passed. Receiver: its listener. Ownership: none."""

    at_s: float


class Lookup(Message):
    """Sender: a test. Receiver: a Probe that answers from its reply table. Ownership: none."""

    key: str


class Boom(Message):
    """Sender: a test. Receiver: Timer, whose handler raises. Ownership: none."""


class Shapes(Message):
    """Sender: nobody; exercises `example` over many field types. Ownership: none."""

    num_tokens: int
    ratio: float
    tags: list[str]
    spans: dict[str, tuple[int, int]]
    source: Literal["resident", "disk"]
    nested: Rang | None
    raw: bytes
    anything: Any = None


class Timer(Actor):
    def __init__(self, name: str, listener: Actor, **options: Any) -> None:
        super().__init__(name, **options)
        self.listener = listener

    async def handle(self, msg: Message) -> object | None:
        match msg:
            case Tick(delay_s=delay_s):
                await self.clock.sleep(delay_s)
                await self.listener.tell(Rang(self.clock.monotonic()), sender=self)
            case Boom():
                raise RuntimeError("boom")
        return None


async def test_a_probe_receives_what_a_real_actor_sends_after_the_fake_clock_advances():
    harness = Harness()
    listener = harness.probe("listener")
    harness.add(Timer("timer", listener, clock=harness.clock))
    async with harness:
        await harness.inject("timer", Tick(2.0))
        await harness.clock.until_sleeping(1)
        assert listener.received == []
        harness.clock.advance(2.0)
        rang = await listener.expect(Rang, timeout_s=1.0, sender="timer")
    assert rang == Rang(2.0)


async def test_expect_takes_messages_in_order_and_times_out_naming_what_came_instead():
    harness = Harness()
    probe = harness.probe("probe")
    async with harness:
        await harness.inject("probe", Rang(1.0))
        await harness.inject("probe", Lookup("k"))
        await harness.inject("probe", Rang(2.0))
        assert await probe.expect(Rang) == Rang(1.0)
        assert await probe.expect(Rang) == Rang(2.0)
        expected = r"probe got no Rang in 0.05 s; unread: \['Lookup'\]"
        with pytest.raises(TimeoutError, match=expected):
            await probe.expect(Rang, timeout_s=0.05)
    assert [r.sender for r in probe.received] == ["harness"] * 3


async def test_a_probe_answers_asks_from_its_reply_table():
    harness = Harness()
    harness.probe("tier", replies={Lookup: lambda msg: Rang(float(len(msg.key)))})
    async with harness:
        assert await harness.ask("tier", Lookup("abc")) == Rang(3.0)
        assert await harness.ask("tier", Rang(0.0)) is None


async def test_fake_clock_sleep_ends_only_when_the_clock_is_advanced_past_it():
    clock = FakeClock()
    short = asyncio.create_task(clock.sleep(1.0))
    long = asyncio.create_task(clock.sleep(3.0))
    await clock.until_sleeping(2)
    assert clock.advance(0.5) == 0
    assert clock.advance(0.5) == 1
    await asyncio.wait_for(short, 1.0)
    assert not long.done()
    long.cancel()
    assert clock.advance(10.0) == 0
    assert clock.monotonic() == 11.0 and clock.sleepers == 0


async def test_leaving_the_harness_raises_when_an_actor_failed_unexpectedly():
    harness = Harness()
    listener = harness.probe("listener")
    harness.add(Timer("timer", listener, clock=harness.clock))
    with pytest.raises(AssertionError, match="an actor failed during the test"):
        async with harness:
            await harness.inject("timer", Boom())
            await harness.until_stopped()
    assert isinstance(harness.supervisor.exception, RuntimeError)


def _message_types() -> list[type[Message]]:
    # Every module of the actors package, so that a message type added there is covered here.
    for module in pkgutil.walk_packages(tandem.actors.__path__, "tandem.actors."):
        importlib.import_module(module.name)
    found, todo = [], [Message]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return sorted(found, key=lambda cls: (cls.__module__, cls.__qualname__))


@pytest.mark.parametrize("cls", _message_types(), ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_message_type_round_trips_through_msgspec_json(cls):
    msg = example(cls)
    data = msgspec.json.encode(msg)
    assert msgspec.json.decode(data)["type"] == cls.__name__
    assert msgspec.json.decode(data, type=cls) == msg


def test_every_message_type_is_frozen_and_tagged_with_a_unique_name():
    types = _message_types()
    for cls in types:
        config = cls.__struct_config__
        assert config.frozen and config.tag == cls.__name__, cls
    # The tag is the class name; two package messages of one name could not share a union.
    package_tags = [cls.__name__ for cls in types if cls.__module__.startswith("tandem.")]
    assert len(package_tags) == len(set(package_tags))
    local = tuple(cls for cls in types if cls.__module__ == __name__)
    assert msgspec.json.decode(msgspec.json.encode(Rang(1.0)), type=Union[local]) == Rang(1.0)
