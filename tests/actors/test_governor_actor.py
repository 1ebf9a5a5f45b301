"""The governor actor keeps its limits whole and keeps running whatever an edit holds: a value
that is not a finite number of GiB, one past the machine, a 401-digit integer."""

import pytest

from tandem.actors.governor import GetMemoryReport, GovernorActor, SetMemoryLimits
from tandem.actors.harness import Harness
from tandem.cache.governor import MAX_NBYTES, MemoryGovernor, MemoryLimits, Reading

GiB = 1 << 30


class Machine:
    """16 GiB, of which the process holds 1."""

    device = "fake"

    def measure(self) -> Reading:
        return Reading(GiB, 0)

    def release_reserve(self) -> None:
        pass

    def total_nbytes(self) -> int:
        return 16 * GiB


BAD = [1e308, 10 ** 400, float("inf"), float("nan"), -1, True, "8", 17, 16.5]


@pytest.mark.parametrize("value", BAD, ids=repr)
async def test_a_bad_limit_is_refused_and_the_actor_lives_on(value):
    harness = Harness()
    core = MemoryGovernor(MemoryLimits.gib(4, 8, 1), Machine())
    actor = harness.add(GovernorActor("governor", core=core, clock=harness.clock))
    async with harness:
        for field in ("mem_ceiling_gib", "mem_peak_gib", "reserve_slack_gib"):
            reply = await actor.ask(SetMemoryLimits(**{field: value}), 5.0, sender="test")
            assert reply.error is not None, field
            assert reply.report["limits"] == {"mem_ceiling_gib": 4, "mem_peak_gib": 8,
                                              "reserve_slack_gib": 1}
        reply = await actor.ask(SetMemoryLimits(mem_peak_gib=16), 5.0, sender="test")
        assert reply.error is None and reply.report["limits"]["mem_peak_gib"] == 16
        assert (await actor.ask(GetMemoryReport(), 5.0, sender="test")).report[
            "machine_bytes"] == 16 * GiB


def test_the_core_checks_every_limit_before_any_arithmetic():
    for value in (1e308, 10 ** 400, float("inf"), float("nan"), "1", None, False):
        with pytest.raises(ValueError):
            MemoryLimits.gib(value, 8, 1)
    with pytest.raises(ValueError):
        MemoryLimits(1, MAX_NBYTES + 1, 0)
    with pytest.raises(ValueError):
        MemoryLimits(1.5, 2, 0)
    with pytest.raises(ValueError, match="machine"):
        MemoryLimits.gib(4, 17, 1, total_nbytes=16 * GiB)
    # A configured limit over the machine is held to it; the same for a 0 (the spec's share).
    held = MemoryLimits.resolve(500, 600, 1, 16 * GiB)
    assert (held.ceiling_nbytes, held.peak_nbytes) == (16 * GiB, 16 * GiB)
