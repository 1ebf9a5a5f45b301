"""The memory governor's core: every cache held to three machine limits (spec: "Memory").

- ``ceiling``: the engine between requests (allocated plus the allocator's reserve). A cache
  grows only while the total stays under the ceiling less the slack; a more valuable cache may
  take the room of cheaper ones (``admit``, the memory accountant's gate).
- ``peak``: the engine during a prefill. Before a prefill the allocator's reserve goes back, then
  the caches are shed cheapest first until the prefill's estimated workspace fits under the peak
  (``before_prefill``); one that still does not fit is refused (`MemoryRefused`: a 503 with
  Retry-After), never run.
- ``slack``: the free blocks the allocator may keep between requests; over it they go back after
  the request (``after_request``), never inside one.

What is held is measured, not counted: on a CPU the process's anonymous resident memory (file
pages, such as mmapped weights or page cache the server keeps on purpose, are the kernel's to
drop and count as free); on CUDA the allocator's reserved bytes. The workspace estimate is the
adapter's ``cost()`` (floor, per token, cap), raised by what a prefill was seen to take beyond it.

Pure logic: no asyncio and no clock. The caches live on the engine thread, so the engine thread
calls every method but ``set_limits`` / ``statistics`` (the governor actor's, on the loop): the
governor decides what to shed and calls the tiers' shedders, which therefore run on the engine
thread too. Limits are one immutable object replaced whole, so a reader never sees half an edit.

The counters have one owner. What a call counts (a shed, a refusal, a prefill) leaves it as one
frozen `GovernorDelta` handed to ``observed``: by default the core's own `GovernorStats` (a core
used alone, as in the cache tests), and, once the governor actor runs, a tell to that actor,
whose handler alone writes the stats its report shows. What the core decides with (the workspace
raise, the running prefill) stays the core's, on the thread that calls it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Collection, Generator, Protocol

import msgspec
import structlog

from tandem.cache.memory import LEVELS, MemoryAccountant
from tandem.models.base import Cost
from tandem.models.rows import lent_nbytes

log = structlog.get_logger()

GiB = 1 << 30


class MemoryRefused(Exception):
    """A prefill whose workspace does not fit under the peak even with every cache shed."""

    def __init__(self, needed_nbytes: int, peak_nbytes: int, retry_after_s: float):
        super().__init__(f"the prefill needs {needed_nbytes / GiB:.2f} GiB with every cache "
                         f"given back; the peak is {peak_nbytes / GiB:.2f} GiB")
        self.needed_nbytes = needed_nbytes
        self.peak_nbytes = peak_nbytes
        self.retry_after_s = retry_after_s


MAX_NBYTES = 1 << 60  # no machine holds an exbibyte; under it every limit is exact as a float


def gib_nbytes(name: str, value: object) -> int:
    """``value`` GiB as bytes; a ValueError naming ``name`` unless it is a finite number >= 0
    under MAX_NBYTES (a bool, a string, NaN, inf, 1e308 or a 401-digit integer is refused
    here, before any arithmetic can overflow)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of GiB")
    try:
        gib = float(value)
    except OverflowError:
        raise ValueError(f"{name} is larger than any machine") from None
    if not math.isfinite(gib) or gib < 0:
        raise ValueError(f"{name} must be a finite number of GiB >= 0")
    if gib * GiB > MAX_NBYTES:
        raise ValueError(f"{name} is larger than any machine")
    return int(gib * GiB)


@dataclass(frozen=True)
class MemoryLimits:
    ceiling_nbytes: int
    peak_nbytes: int
    slack_nbytes: int

    def __post_init__(self):
        for name in ("ceiling_nbytes", "peak_nbytes", "slack_nbytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"memory limit {name} must be an int, not {value!r}")
        if not 0 <= self.slack_nbytes < self.ceiling_nbytes <= self.peak_nbytes <= MAX_NBYTES:
            raise ValueError("memory limits need 0 <= slack < ceiling <= peak "
                             f"(slack {self.slack_nbytes}, ceiling {self.ceiling_nbytes}, "
                             f"peak {self.peak_nbytes})")

    @classmethod
    def gib(cls, ceiling: float, peak: float, slack: float, *,
            total_nbytes: int | None = None) -> "MemoryLimits":
        """The limits in GiB, each checked (``gib_nbytes``); with ``total_nbytes`` (the
        machine's memory as its allocator reports it) the peak must fit in the machine."""
        limits = cls(gib_nbytes("mem_ceiling_gib", ceiling), gib_nbytes("mem_peak_gib", peak),
                     gib_nbytes("reserve_slack_gib", slack))
        if total_nbytes is not None and limits.peak_nbytes > total_nbytes:
            raise ValueError(f"mem_peak_gib {limits.peak_nbytes / GiB:.2f} is over the "
                             f"machine's {total_nbytes / GiB:.2f} GiB")
        return limits

    @classmethod
    def resolve(cls, ceiling_gib: float, peak_gib: float, slack_gib: float,
                total_nbytes: int) -> "MemoryLimits":
        """The configured limits; a 0 takes the spec's share of the machine's memory (70, 77
        and 2 of 128 GB). A configured limit over the machine is held to the machine (logged):
        what no machine can hold never binds anyway."""
        def configured(name: str, value: float) -> int:
            nbytes = gib_nbytes(name, value)
            if nbytes > total_nbytes:
                log.warning("memory_limit_over_machine", limit=name, gib=value,
                            machine_gib=round(total_nbytes / GiB, 2))
                return total_nbytes
            return nbytes

        ceiling = (configured("mem_ceiling_gib", ceiling_gib) if ceiling_gib
                   else int(total_nbytes * 70 / 128))
        peak = (configured("mem_peak_gib", peak_gib) if peak_gib
                else max(ceiling, int(total_nbytes * 77 / 128)))
        slack = (configured("reserve_slack_gib", slack_gib) if slack_gib
                 else min(2 * GiB, ceiling // 16))
        return cls(ceiling, peak, slack)

    def to_gib(self) -> dict:
        return {"mem_ceiling_gib": self.ceiling_nbytes / GiB,
                "mem_peak_gib": self.peak_nbytes / GiB,
                "reserve_slack_gib": self.slack_nbytes / GiB}


@dataclass(frozen=True)
class Reading:
    held_nbytes: int  # what the engine holds: allocated plus the allocator's reserve
    reserve_nbytes: int  # free blocks the allocator keeps, within held


class Allocator(Protocol):
    device: str

    def measure(self) -> Reading: ...

    def release_reserve(self) -> None: ...

    def total_nbytes(self) -> int: ...


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


class CpuAllocator:
    """The process on a CPU: anonymous resident pages from /proc/self/statm (resident less
    shared, i.e. less file pages), glibc's free blocks (mallinfo2) as the reserve, and
    malloc_trim to give them back. Held counts the rows lent to the caches too
    (tandem.models.rows.lent_nbytes): a write over a slot's rows copies them at any time, so
    the limits are kept as if they were copied already."""

    device = "cpu"

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._libc = None
        name = ctypes.util.find_library("c")
        if name:
            try:
                libc = ctypes.CDLL(name)
                libc.malloc_trim.argtypes = [ctypes.c_size_t]
                self._libc = libc
                self._mallinfo2 = getattr(libc, "mallinfo2", None)
                if self._mallinfo2 is not None:
                    self._mallinfo2.restype = _Mallinfo2
            except (OSError, AttributeError):  # no libc, or one without malloc_trim (musl)
                self._libc = None

    def measure(self) -> Reading:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        held = (int(fields[1]) - int(fields[2])) * self._page + lent_nbytes()
        reserve = 0
        if self._libc is not None and self._mallinfo2 is not None:
            reserve = min(int(self._mallinfo2().fordblks), held)
        return Reading(held, reserve)

    def release_reserve(self) -> None:
        if self._libc is not None:
            self._libc.malloc_trim(0)

    def total_nbytes(self) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class CudaAllocator:
    """One CUDA device: torch's reserved bytes (allocated plus its cache of free blocks)."""

    device = "cuda"

    def __init__(self, index: int = 0) -> None:
        import torch

        self._cuda = torch.cuda
        self.index = index

    def measure(self) -> Reading:
        reserved = self._cuda.memory_reserved(self.index)
        return Reading(reserved, reserved - self._cuda.memory_allocated(self.index))

    def release_reserve(self) -> None:
        self._cuda.empty_cache()

    def total_nbytes(self) -> int:
        return self._cuda.get_device_properties(self.index).total_memory


class GovernorDelta(msgspec.Struct, frozen=True):
    """What one call of the core counted; built by that call alone and never changed after."""

    shed_total: dict[str, int] = {}  # level -> sheds
    shed_nbytes: dict[str, int] = {}  # level -> bytes freed
    refused_growth: dict[str, int] = {}  # level -> reserves refused
    refusals: int = 0
    prefills: int = 0
    reserve_releases: int = 0
    workspace_raised_nbytes: int = 0
    max_prefill_nbytes: int = 0  # merged by max
    last_prefill: dict[str, int] | None = None  # replaces the last one


class _Tally:
    """The counts of one call in progress, on the thread making it."""

    def __init__(self) -> None:
        self.shed_total: dict[str, int] = {}
        self.shed_nbytes: dict[str, int] = {}
        self.refused_growth: dict[str, int] = {}
        self.counts: dict[str, Any] = {}

    def shed(self, level: str, nbytes: int) -> None:
        self.shed_total[level] = self.shed_total.get(level, 0) + 1
        self.shed_nbytes[level] = self.shed_nbytes.get(level, 0) + nbytes

    def delta(self) -> GovernorDelta | None:
        if not (self.shed_total or self.refused_growth or self.counts):
            return None
        return GovernorDelta(shed_total=self.shed_total, shed_nbytes=self.shed_nbytes,
                             refused_growth=self.refused_growth, **self.counts)


@dataclass
class GovernorStats:
    shed_total: dict = field(default_factory=lambda: {level: 0 for level in LEVELS})
    shed_nbytes: dict = field(default_factory=lambda: {level: 0 for level in LEVELS})
    refused_growth: dict = field(default_factory=lambda: {level: 0 for level in LEVELS})
    refusals: int = 0  # prefills refused (503)
    prefills: int = 0
    reserve_releases: int = 0
    workspace_raised_nbytes: int = 0
    max_prefill_nbytes: int = 0  # the most held seen during any prefill
    last_prefill: dict = field(default_factory=dict)

    def apply(self, delta: GovernorDelta) -> None:
        """By the stats' owner only (the governor actor's handler, or a core used alone)."""
        for mine, theirs in ((self.shed_total, delta.shed_total),
                             (self.shed_nbytes, delta.shed_nbytes),
                             (self.refused_growth, delta.refused_growth)):
            for level, n in theirs.items():
                mine[level] += n
        self.refusals += delta.refusals
        self.prefills += delta.prefills
        self.reserve_releases += delta.reserve_releases
        self.workspace_raised_nbytes += delta.workspace_raised_nbytes
        self.max_prefill_nbytes = max(self.max_prefill_nbytes, delta.max_prefill_nbytes)
        if delta.last_prefill is not None:
            self.last_prefill = dict(delta.last_prefill)

    def copy(self) -> "GovernorStats":
        return GovernorStats(dict(self.shed_total), dict(self.shed_nbytes),
                             dict(self.refused_growth), self.refusals, self.prefills,
                             self.reserve_releases, self.workspace_raised_nbytes,
                             self.max_prefill_nbytes, dict(self.last_prefill))


class MemoryGovernor:
    def __init__(self, limits: MemoryLimits, allocator: Allocator, *,
                 retry_after_s: float = 2.0) -> None:
        self._limits = limits
        self.allocator = allocator
        self.retry_after_s = retry_after_s
        self.memory: MemoryAccountant | None = None
        self.shedders: dict[str, Callable[[int], int]] = {}
        self.cost: Cost | None = None
        # The core's own count, the owner of the counters while no actor took them (report_to).
        self.stats = GovernorStats()
        self.observed: Callable[[GovernorDelta], None] = self.stats.apply
        # What the core decides with, on the thread that calls it (the engine's): what prefills
        # were seen to take beyond the estimate, and the running prefill.
        self._workspace_raised_nbytes = 0
        self._prefill: dict | None = None  # the running prefill: workspace, held before, max

    # -- wiring and limits -----------------------------------------------------------------

    def attach(self, memory: MemoryAccountant, shedders: dict[str, Callable[[int], int]],
               cost: Cost) -> None:
        """On the engine thread, once its caches exist: every reserve asks ``admit``;
        ``shedders[level](need_nbytes) -> freed`` gives back copies at that level."""
        unknown = set(shedders) - set(LEVELS)
        if unknown:
            raise ValueError(f"unknown memory levels {sorted(unknown)}")
        self.memory = memory
        self.shedders = dict(shedders)
        self.cost = cost
        memory.gate = self.admit

    def report_to(self, observed: Callable[[GovernorDelta], None]) -> GovernorStats:
        """From now on every count goes to ``observed`` (any thread may call it: the actor's
        posts it to the loop); returns a copy of what was counted so far, which the new owner
        starts from. Called before any request runs (the governor actor's on_start)."""
        counted = self.stats.copy()
        self.observed = observed
        return counted

    def _emit(self, tally: _Tally) -> None:
        delta = tally.delta()
        if delta is not None:
            self.observed(delta)

    @property
    def limits(self) -> MemoryLimits:
        return self._limits

    def set_limits(self, limits: MemoryLimits) -> None:
        """Replace the limits whole (validated by MemoryLimits); the next reserve or prefill
        holds to them. Caches over a lowered ceiling are shed at the next prefill."""
        self._limits = limits
        log.info("memory_limits_set", **limits.to_gib())

    def measure(self) -> Reading:
        return self.allocator.measure()

    # -- growth ----------------------------------------------------------------------------

    def _growth_limit(self) -> int:
        lim = self._limits
        limit = lim.ceiling_nbytes - lim.slack_nbytes
        if self._prefill is not None:
            # During a prefill a copy also has to leave the workspace its room under the peak.
            limit = min(limit, lim.peak_nbytes - self._prefill["workspace"])
        return limit

    def admit(self, level: str, nbytes: int) -> bool:
        """May ``level`` grow by ``nbytes``? Only while the total stays under the ceiling less
        the slack (and, inside a prefill, under the peak less its workspace); cheaper levels are
        shed first to make room."""
        limit = self._growth_limit()
        held = self.measure().held_nbytes
        if held + nbytes <= limit:
            return True
        tally = _Tally()
        try:
            cheaper = LEVELS[:LEVELS.index(level)]
            held = self._drive(self._shed(cheaper, lambda h: h + nbytes <= limit,
                                          held + nbytes - limit, tally))
            if held + nbytes <= limit:
                return True
            tally.refused_growth[level] = 1
            return False
        finally:
            self._emit(tally)  # also what was shed before a shedder raised

    def _shed(self, levels: tuple[str, ...], fits: Callable[[int], bool], need: int,
              tally: _Tally, sheddable: Collection[str] | None = None
              ) -> Generator[tuple[str, int], int, int]:
        """Shed ``levels`` cheapest first until ``fits(held)``; the held bytes measured last.
        A generator: it yields each shed it decides, ``(level, need_nbytes)``, and is sent the
        bytes freed, so that one decision serves a caller that sheds by calling the tiers
        (``_drive``, the engine thread) and one that sheds by asking actors (the loop)."""
        held = self.measure().held_nbytes
        for level in levels:
            if fits(held):
                break
            # A level holding nothing frees nothing: its shedder answers 0 (asking it costs
            # no more than reading a count another owner writes).
            if level not in (self.shedders if sheddable is None else sheddable):
                continue
            freed = yield level, max(need, 1)
            if freed:
                tally.shed(level, freed)
                log.info("memory_shed", level=level, nbytes=freed)
                self.allocator.release_reserve()
                new_held = self.measure().held_nbytes
                need -= max(held - new_held, 0) or freed
                held = new_held
        return held

    # -- prefills --------------------------------------------------------------------------

    def workspace_nbytes(self, num_tokens: int) -> int:
        base = self.cost.workspace_nbytes(num_tokens) if self.cost is not None else 0
        return base + self._workspace_raised_nbytes

    def _drive(self, steps: Generator[tuple[str, int], int, int]) -> int:
        """Run a shed decision, each shed by the level's shedder."""
        try:
            level, need = next(steps)
            while True:
                try:
                    freed = self.shedders[level](need)
                except BaseException:
                    steps.close()  # its count of what was shed so far still goes out
                    raise
                level, need = steps.send(freed)
        except StopIteration as done:
            return done.value

    def before_prefill(self, num_tokens: int) -> int:
        """Make room for a prefill over ``num_tokens`` context tokens: when it does not fit, the
        allocator's reserve goes back, then caches cheapest first until the workspace fits under
        the peak. Raises
        `MemoryRefused` when it still does not; the workspace estimate otherwise."""
        return self._drive(self._before_prefill(num_tokens))

    async def admit_prefill(self, num_tokens: int,
                            shed: Callable[[str, int], Awaitable[int]],
                            sheddable: Collection[str], grow_nbytes: int = 0) -> int:
        """``before_prefill`` on the event loop, before the plan is handed to the engine
        thread: each shed is ``await shed(level, need_nbytes) -> freed`` (an ask of the actor
        holding that level, or a call on tiers lent to the loop), for the ``sheddable``
        levels. ``grow_nbytes``: the rows the request backs beyond what its slot holds (the
        slots' rows are backed as they grow), admitted with the workspace."""
        steps = self._before_prefill(num_tokens, sheddable, grow_nbytes)
        try:
            level, need = next(steps)
            while True:
                try:
                    freed = await shed(level, need)
                except BaseException:
                    steps.close()
                    raise
                level, need = steps.send(freed)
        except StopIteration as done:
            return done.value

    def _before_prefill(self, num_tokens: int, sheddable: Collection[str] | None = None,
                        grow_nbytes: int = 0) -> Generator[tuple[str, int], int, int]:
        peak = self._limits.peak_nbytes
        workspace = self.workspace_nbytes(num_tokens) + grow_nbytes
        held = self.measure().held_nbytes
        tally = _Tally()
        try:
            if held + workspace > peak:
                # The allocator's free blocks go back only when the prefill needs their room
                # (the spec's order: the reserve first, then caches): memory handed back costs
                # page faults when it is touched again.
                self.allocator.release_reserve()
                held = self.measure().held_nbytes
            if held + workspace > peak:
                held = yield from self._shed(LEVELS, lambda h: h + workspace <= peak,
                                             held + workspace - peak, tally, sheddable)
            if held + workspace > peak:
                tally.counts["refusals"] = 1
                log.warning("prefill_refused", num_tokens=num_tokens, held=held,
                            workspace=workspace, peak=peak)
                raise MemoryRefused(held + workspace, peak, self.retry_after_s)
            self._prefill = {"workspace": workspace, "before": held, "max": held,
                             "num_tokens": num_tokens}
            tally.counts["prefills"] = 1
            return workspace
        finally:
            # Before the refusal reaches anyone: the 503 is never answered ahead of its count.
            self._emit(tally)

    def observe(self) -> None:
        """Between prefill chunks: what is held now, for the peak seen."""
        if self._prefill is None:
            return
        held = self.measure().held_nbytes
        if held > self._prefill["max"]:
            self._prefill["max"] = held

    def after_prefill(self) -> None:
        """The prefill is over: a workspace larger than estimated raises the estimate."""
        p = self._prefill
        if p is None:
            return
        self.observe()
        self._prefill = None
        taken = p["max"] - p["before"]
        tally = _Tally()
        if taken > p["workspace"]:
            self._workspace_raised_nbytes += taken - p["workspace"]
            tally.counts["workspace_raised_nbytes"] = taken - p["workspace"]
            log.info("workspace_raised", taken=taken, estimate=p["workspace"])
        tally.counts["max_prefill_nbytes"] = p["max"]
        tally.counts["last_prefill"] = {"num_tokens": p["num_tokens"],
                                        "workspace": p["workspace"], "taken": taken,
                                        "max_held": p["max"]}
        self._emit(tally)

    def after_request(self) -> None:
        """Between requests: free blocks over the slack go back to the system."""
        self._prefill = None
        if self.measure().reserve_nbytes > self._limits.slack_nbytes:
            self.allocator.release_reserve()
            tally = _Tally()
            tally.counts["reserve_releases"] = 1
            self._emit(tally)

    # -- reporting -------------------------------------------------------------------------

    def level_nbytes(self) -> dict[str, int]:
        held = self.memory.held if self.memory is not None else {}
        return {level: held.get(level, 0) for level in LEVELS}

    def statistics(self, stats: GovernorStats | None = None) -> dict:
        """The report: the limits and what is held, measured now, and the counters of
        ``stats`` (the owner's; None: the core's own, for a core used alone)."""
        s = self.stats if stats is None else stats
        reading = self.measure()
        return {
            "device": self.allocator.device,
            "limits": self._limits.to_gib(),
            "limits_bytes": {"ceiling": self._limits.ceiling_nbytes,
                             "peak": self._limits.peak_nbytes,
                             "slack": self._limits.slack_nbytes},
            "held_bytes": reading.held_nbytes, "reserve_bytes": reading.reserve_nbytes,
            # the caches' rows still read in their slots (in held on a CPU, not yet copied)
            "lent_bytes": lent_nbytes(),
            "machine_bytes": self.allocator.total_nbytes(),
            "levels": self.level_nbytes(), "levels_order": list(LEVELS),
            "shed_total": dict(s.shed_total), "shed_bytes": dict(s.shed_nbytes),
            "refused_growth": dict(s.refused_growth), "refusals": s.refusals,
            "prefills": s.prefills, "reserve_releases": s.reserve_releases,
            "workspace_raised_bytes": s.workspace_raised_nbytes,
            "max_prefill_bytes": s.max_prefill_nbytes, "last_prefill": dict(s.last_prefill),
        }
