import asyncio

import pytest
import structlog

from tandem.actors import Actor, ActorStopped, MailboxFull, Message, Supervisor
from tandem.actors.harness import FakeClock
from tandem.actors.loop import install_uvloop
from tandem.actors.runtime import Deferred

SECRET = "the user's private prompt text"


class Ping(Message):
    """Sender: a test. Receiver: Echo. Ownership: none."""

    n: int


class Pong(Message):
    """Sender: Echo, as the reply to Ping. Receiver: the asker. Ownership: none."""

    n: int


class Hold(Message):
    """Sender: a test. Receiver: Echo, whose handler then waits for `release`. Ownership: none."""


class Crash(Message):
    """Sender: a test. Receiver: Echo, whose handler raises. Ownership: none."""

    text: str


class Relay(Message):
    """Sender: a test. Receiver: Echo, which asks its `peer` a Ping. Ownership: none."""

    n: int


class Echo(Actor):
    def __init__(self, name: str, peer: Actor | None = None, **options) -> None:
        super().__init__(name, **options)
        self.peer = peer
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, msg: Message) -> object | None:
        match msg:
            case Ping(n=n):
                return Pong(n)
            case Hold():
                self.holding.set()
                await self.release.wait()
                return None
            case Crash():
                raise ValueError("handler broke")
            case Relay(n=n):
                assert self.peer is not None
                return await self.peer.ask(Ping(n), 1.0, sender=self)
        raise TypeError(type(msg).__name__)


class Recorder(Actor):
    """Writes its lifecycle into a shared log; its on_start may wait on the fake clock."""

    def __init__(self, name: str, log: list[str], start_delay_s: float = 0.0, **options) -> None:
        super().__init__(name, **options)
        self.log = log
        self.start_delay_s = start_delay_s

    async def on_start(self) -> None:
        self.log.append(f"{self.name}:start")
        await self.clock.sleep(self.start_delay_s)
        self.log.append(f"{self.name}:ready")

    async def on_stop(self) -> None:
        self.log.append(f"{self.name}:stop")

    async def handle(self, msg: Message) -> object | None:
        return None


async def test_actors_start_in_order_and_each_waits_for_the_previous_to_be_ready():
    clock, log = FakeClock(), []
    supervisor = Supervisor(ready_timeout_s=1.0)
    first = supervisor.add(Recorder("first", log, start_delay_s=5.0, clock=clock))
    second = supervisor.add(Recorder("second", log, clock=clock))

    starting = asyncio.create_task(supervisor.start())
    await clock.until_sleeping(1)
    assert log == ["first:start"]
    assert not first.ready.is_set() and not second.ready.is_set()

    clock.advance(5.0)
    await asyncio.wait_for(starting, 1.0)
    assert log == ["first:start", "first:ready", "second:start", "second:ready"]
    assert first.ready.is_set() and second.ready.is_set()
    assert list(supervisor.actors) == ["first", "second"]
    await supervisor.stop()


async def test_actors_stop_in_reverse_order_after_owned_tasks_are_cancelled():
    log: list[str] = []
    supervisor = Supervisor(ready_timeout_s=1.0)
    supervisor.add(Recorder("first", log))
    supervisor.add(Recorder("second", log))
    await supervisor.start()
    forever = asyncio.Event()

    async def background() -> None:
        try:
            await forever.wait()
        finally:
            log.append("task:cancelled")

    task = supervisor.spawn(background(), "background")
    await supervisor.stop()
    assert task.cancelled()
    assert log[-3:] == ["task:cancelled", "second:stop", "first:stop"]
    assert not supervisor.failed and supervisor.exception is None
    assert not supervisor.running


async def test_an_actor_not_ready_in_time_fails_start_and_stops_the_actors_already_started():
    clock, log = FakeClock(), []
    supervisor = Supervisor(ready_timeout_s=0.05)
    supervisor.add(Recorder("first", log, clock=clock))
    late = supervisor.add(Recorder("late", log, start_delay_s=60.0, clock=clock))
    never = supervisor.add(Recorder("never", log, clock=clock))
    pending = asyncio.create_task(never.ask(Ping(1), 1.0))

    with pytest.raises(TimeoutError, match="actor late not ready"):
        await supervisor.start()
    assert log == ["first:start", "first:ready", "late:start", "first:stop"]
    assert late.stopped and never.stopped
    with pytest.raises(ActorStopped, match="actor never stopped"):
        await asyncio.wait_for(pending, 0.5)


async def test_a_failing_on_start_fails_start_with_its_cause():
    class Broken(Actor):
        async def on_start(self) -> None:
            raise RuntimeError("no weights")

    supervisor = Supervisor(ready_timeout_s=1.0)
    supervisor.add(Broken("broken"))
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(RuntimeError, match="no weights"):
            await supervisor.start()
    failed = [e for e in logs if e["event"] == "actor_failed"]
    assert failed[0]["actor"] == "broken" and failed[0]["message_type"] is None


async def test_ask_returns_what_the_handler_returns():
    supervisor = Supervisor()
    echo = supervisor.add(Echo("echo"))
    async with supervisor:
        assert await echo.ask(Ping(7), 1.0) == Pong(7)


class Later(Actor):
    """Answers a Hold later (when the test resolves ``job``), a Ping at once meanwhile."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.job: asyncio.Future | None = None

    async def handle(self, msg: Message) -> object | None:
        match msg:
            case Hold():
                self.job = asyncio.get_running_loop().create_future()
                return Deferred(self.job)
            case Ping(n=n):
                return Pong(n)
        raise TypeError(type(msg).__name__)


async def test_a_deferred_reply_answers_the_ask_later_and_the_mailbox_moves_on_meanwhile():
    supervisor = Supervisor()
    later = supervisor.add(Later("later"))
    async with supervisor:
        held = asyncio.ensure_future(later.ask(Hold(), 5.0))
        assert await later.ask(Ping(3), 5.0) == Pong(3)  # answered while the Hold is not
        assert not held.done() and later.statistics().pending_asks == 1
        later.job.set_result(Pong(9))
        assert await asyncio.wait_for(held, 5.0) == Pong(9)
        stuck = asyncio.ensure_future(later.ask(Hold(), 5.0))
        await later.ask(Ping(4), 5.0)
    with pytest.raises(ActorStopped):  # a stop fails a deferred reply like any pending ask
        await asyncio.wait_for(stuck, 5.0)


async def test_a_failing_handler_stops_the_system_and_a_pending_ask_to_another_actor_fails_at_once():
    supervisor = Supervisor(ready_timeout_s=1.0)
    first = supervisor.add(Echo("first"))
    second = supervisor.add(Echo("second"))
    await supervisor.start()

    held = asyncio.create_task(second.ask(Hold(), 5.0))
    await asyncio.wait_for(second.holding.wait(), 1.0)
    with structlog.testing.capture_logs() as logs:
        crashed = asyncio.create_task(first.ask(Crash(SECRET), 5.0))
        with pytest.raises(ActorStopped, match="actor second stopped"):
            await asyncio.wait_for(held, 0.5)
        with pytest.raises(ActorStopped, match="actor first stopped") as stopped:
            await asyncio.wait_for(crashed, 0.5)
        await asyncio.wait_for(supervisor.wait(), 0.5)

    assert isinstance(stopped.value.__cause__, ValueError)
    assert supervisor.failed and isinstance(supervisor.exception, ValueError)
    assert first.stopped and second.stopped
    failed = [e for e in logs if e["event"] == "actor_failed"]
    assert len(failed) == 1
    assert failed[0]["actor"] == "first"
    assert failed[0]["error"] == "ValueError"
    assert failed[0]["message_type"] == "Crash"
    assert SECRET not in repr(logs)


async def test_asks_and_tells_to_a_stopped_actor_fail_at_once():
    supervisor = Supervisor()
    echo = supervisor.add(Echo("echo"))
    await supervisor.start()
    await supervisor.stop()
    with pytest.raises(ActorStopped, match="actor echo stopped"):
        await asyncio.wait_for(echo.ask(Ping(1), 5.0), 0.5)
    with pytest.raises(ActorStopped):
        await asyncio.wait_for(echo.tell(Ping(1)), 0.5)
    with pytest.raises(ActorStopped):
        echo.try_tell(Ping(1))


async def test_an_ask_with_no_reply_in_time_raises_timeout_error_and_the_actor_goes_on():
    supervisor = Supervisor()
    echo = supervisor.add(Echo("echo"))
    async with supervisor:
        await echo.tell(Hold())
        with pytest.raises(TimeoutError):
            await echo.ask(Ping(1), 0.05)
        assert echo.statistics().pending_asks == 0
        echo.release.set()
        assert await echo.ask(Ping(2), 1.0) == Pong(2)
    assert not supervisor.failed


async def test_try_tell_raises_mailbox_full_at_capacity_and_tell_waits_for_room():
    supervisor = Supervisor()
    echo = supervisor.add(Echo("echo", mailbox_capacity=2))
    async with supervisor:
        await echo.tell(Hold())
        await asyncio.wait_for(echo.holding.wait(), 1.0)
        echo.try_tell(Ping(1))
        echo.try_tell(Ping(2))
        with pytest.raises(MailboxFull):
            echo.try_tell(Ping(3))
        assert echo.statistics().mailbox_depth == 2

        waiting = asyncio.create_task(echo.tell(Ping(3)))
        done, _ = await asyncio.wait([waiting], timeout=0.02)
        assert not done
        echo.release.set()
        await asyncio.wait_for(waiting, 1.0)
        assert await echo.ask(Ping(4), 1.0) == Pong(4)
        assert echo.statistics().handled_by_type == {"Hold": 1, "Ping": 4}


async def test_a_tell_waiting_for_room_fails_when_the_actor_stops():
    supervisor = Supervisor()
    echo = supervisor.add(Echo("echo", mailbox_capacity=1))
    await supervisor.start()
    await echo.tell(Hold())
    await asyncio.wait_for(echo.holding.wait(), 1.0)
    await echo.tell(Ping(1))
    waiting = [asyncio.create_task(echo.tell(Ping(n))) for n in range(3)]
    await supervisor.stop()
    for tell in waiting:
        with pytest.raises(ActorStopped):
            await asyncio.wait_for(tell, 0.5)


async def test_statistics_count_messages_by_type_and_time_handlers_on_the_actor_clock():
    clock = FakeClock()

    class Slow(Message):
        """Sender: a test. Receiver: Timed, whose handler takes 5 ms of fake time."""

    class Timed(Echo):
        async def handle(self, msg: Message) -> object | None:
            if isinstance(msg, Slow):
                clock.advance(0.005)
                return None
            return await super().handle(msg)

    supervisor = Supervisor()
    timed = supervisor.add(Timed("timed", clock=clock, mailbox_capacity=8, recent_capacity=2))
    async with supervisor:
        await timed.ask(Ping(1), 1.0, sender="test")
        await timed.ask(Slow(), 1.0, sender="test")
        await timed.ask(Ping(2), 1.0)
        stats = timed.statistics()
    assert stats.name == "timed"
    assert stats.mailbox_capacity == 8 and stats.mailbox_depth == 0
    assert stats.handled_total == 3
    assert stats.handled_by_type == {"Ping": 2, "Slow": 1}
    assert stats.handler_ms_max == pytest.approx(5.0)
    assert stats.handler_ms_total == pytest.approx(5.0)
    assert [(m.type, m.sender) for m in stats.last_messages] == [("Slow", "test"), ("Ping", None)]
    assert stats.last_messages[0].at_s == pytest.approx(0.005)


async def test_an_owned_task_that_raises_stops_the_system():
    supervisor = Supervisor()
    echo = supervisor.add(Echo("echo"))
    await supervisor.start()
    held = asyncio.create_task(echo.ask(Hold(), 5.0))
    await asyncio.wait_for(echo.holding.wait(), 1.0)

    async def broken() -> None:
        raise KeyError("lost")

    with structlog.testing.capture_logs() as logs:
        supervisor.spawn(broken(), "broken")
        await asyncio.wait_for(supervisor.wait(), 0.5)
    with pytest.raises(ActorStopped):
        await asyncio.wait_for(held, 0.5)
    assert isinstance(supervisor.exception, KeyError)
    failed = [e for e in logs if e["event"] == "task_failed"]
    assert failed[0]["task"] == "broken" and failed[0]["error"] == "KeyError"
    with pytest.raises(RuntimeError, match="not running"):
        supervisor.spawn(broken(), "late")


async def test_the_graph_has_an_edge_for_each_sender_and_receiver_seen():
    supervisor = Supervisor()
    low = supervisor.add(Echo("low"))
    high = supervisor.add(Echo("high", peer=low))
    async with supervisor:
        assert await high.ask(Relay(3), 1.0, sender="server") == Pong(3)
        graph = supervisor.graph()
    assert [(n.name, n.kind) for n in graph.nodes] == [
        ("low", "actor"),
        ("high", "actor"),
        ("server", "external"),
    ]
    assert [(e.sender, e.receiver, e.messages) for e in graph.edges] == [
        ("high", "low", 1),
        ("server", "high", 1),
    ]


async def test_actors_take_only_message_structs():
    supervisor = Supervisor()
    echo = supervisor.add(Echo("echo"))
    async with supervisor:
        with pytest.raises(TypeError, match="Message structs"):
            await echo.tell({"type": "Ping", "n": 1})  # type: ignore[arg-type]


def test_install_uvloop_makes_uvloop_the_event_loop_policy():
    uvloop = pytest.importorskip("uvloop")
    before = asyncio.get_event_loop_policy()
    try:
        assert install_uvloop() is True
        assert isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)
    finally:
        asyncio.set_event_loop_policy(before)
