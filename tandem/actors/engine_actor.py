"""The engine actor: the only owner of the Engine, running all its torch work on one thread.

The event loop never runs torch: the engines (one a slot) are built and every generation runs on
a single-worker ThreadPoolExecutor, where a scheduler runs while there is work (``_schedule``):
each round, one grid chunk of the one prefill in flight, then every waiting decode step as one
batched forward, then the ends the cache gate lets through. Each generation is a generator of
the engine's steps (tandem.engine.Engine.generate_steps). The thread hands each token to the
loop with ``loop.call_soon_threadsafe``; the loop delivers it to the request's sink. The actor's
handler only queues, cancels and grants, so a `CancelGeneration` or a lock request is handled
while generations run. A request's plan is made on the loop (``_prepare``), one at a time, while
the other slots decode.

The capture lock: one FIFO of holders (tandem.actors.capture_lock, a pure class), the
engine's generations and outside holders (`RequestCaptureLock`) in arrival order. The running
generations hold it as one group, which a request behind them joins while a slot is idle and no
outside holder waits ahead of it; an outside holder gets it between two of the scheduler's
rounds (the generations pause) and holds it from `CaptureLockGranted` to its
`ReleaseCaptureLock`.

Invariants (`check_invariants`): at most one holder; generations run only while their group
holds the lock or is paused for an outside holder; no more of them than slots, none two in one
slot; the FIFO holds no request twice; `waiting` counts the generations in the FIFO.

What the loop shows of the engine (``view``, ``cache_stats``) the loop alone writes: the engine
thread hands each value over with ``call_soon_threadsafe`` (the tokens it posts, the rows and
taint a generation left, the caches' counters) and never touches an attribute the loop reads.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import structlog
import torch

from tandem.actors.engine_messages import (
    CachesCleared,
    CancelGeneration,
    ChoiceEnded,
    ClearCaches,
    CaptureLockGranted,
    Drain,
    DrainStarted,
    EngineDrained,
    EngineFaulted,
    Generate,
    GenerationAccepted,
    GenerationFailed,
    GenerationFinished,
    GenerationParams,
    GenerationRejected,
    GenerationStarted,
    ListConversations,
    Peek,
    PrefillAdmitted,
    PromptLogprobs,
    ReleaseCaptureLock,
    ReadSpill,
    RequestCaptureLock,
    SpillSlots,
    TokenGenerated,
)
from tandem.actors.capture_lock import CaptureLockFifo, CaptureLockMisuse
from tandem.actors.compaction_messages import FindSessionRecord
from tandem.actors.disk_messages import DiskJob, Fence
from tandem.actors.engine_compaction import EngineCompaction
from tandem.actors.engine_idle import EngineIdle
from tandem.actors.engine_peek import EnginePeek
from tandem.actors.engine_spill import EngineSpill
from tandem.actors.governor import TierHeld
from tandem.actors.mailbox import MailboxFull
from tandem.actors.messages import Message
from tandem.actors.runtime import Actor, ActorStopped
from tandem.actors.store import StoreAdmit, StoreHolds, StoreOffer, StoreShed
from tandem.actors.suffix import SuffixActor, SuffixAppend
from tandem.actors.tier_messages import (AnchorWritten, ClearHoldings, GenerationEnded,
                                         OfferTiers, ParkOffered, PrefillPlan, ResidentOffered)
from tandem.actors.tiers import ParkActor, ResidentActor
from tandem.cache.copies import SectionsCopy
from tandem.cache.drafter import LookupDrafter
from tandem.cache.governor import MemoryGovernor, MemoryRefused
from tandem.cache.endalign import Alignment
from tandem.cache.endrecords import EndRecords
from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import SHARED, Namespace
from tandem.cache.vocabulary import Source
from tandem.cache.planner import Planner
from tandem.cache.resident import (PARK_STATS, Decided, ParkOffer, ResidentOffer,
                                   ResidentPrefix, Resume, choose, park_offer, resident_offer)
from tandem.cache.tower import ImagePlacer, TowerCache  # noqa: I001 (beside the caches)
from tandem.cache.store import StateStore
from tandem.choices import Choices, DecodeBatch, choice_params, decode_steps, sent
from tandem.io.spill_slots import weigh
from tandem.engine import CHUNK, ContextOverflow, DecodeStep, Engine, SamplingParams, decode_batch
from tandem.engine import TailStep, VerifyStep
import tandem.engine as engine_mod
from tandem.grammar import TokenGrammar
from tandem.models.base import ModelError
from tandem.models.image_keys import has_keys, is_key, text_runs
from tandem.models.rows import release_rows
from tandem.models.reasoning_budget import ReasoningBudget

log = structlog.get_logger("tandem.engine")

# Retry-After: the estimate is clamped to [1, 60] s (a client told 0 retries at once; past a
# minute it is a guess), from the median of this many recent generations' durations.
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1.0, 60.0
RECENT_DURATIONS = 32
# The memory levels the resident and the park hold (tandem/cache/memory.py LEVELS less the store).
TIER_LEVELS = ("prompt_end", "anchors", "end", "stash", "park", "pin")
TIER_ASK_S = 30.0  # a tier's offer is a few microseconds of its handler; past this it is stuck
# Tokens a second the disk offer's cost is weighed against before any prefill was measured,
# and the shortest prefill whose rate is counted (shorter ones are mostly overhead).
PREFILL_RATE_PRIOR, PREFILL_RATE_MIN_TOKENS = 2000.0, 512
# How long a decode batch holding a prefill's tail waits, while the loop makes the next
# request's plan, for that request's tail to join it (a plan takes 2 to 4 ms here): turns
# sent together then take their first rows in one batch rather than one a round.
TAIL_WAIT_S = 0.006


# The resident's counters and bytes each slot keeps of its own, summed over the slots in
# /v1/cache/stats (the park's and the pin's are one tier's, shared, and counted once).
SLOT_COUNTERS = ("anchor_bytes", "anchors_taken", "evictions", "hits", "cold", "ends",
                 "end_hits", "end_absorbed", "prompt_ends", "prompt_end_hits",
                 "prompt_end_bytes", "guests", "guest_refused", "stash_bytes", "replays",
                 "aligned_to_store")


class EngineBroken(RuntimeError):
    """After a failed request the engine's buffers could not be put back to a sound row: no
    later request can trust them, so the system stops."""


def estimate_retry_after(waiting: int, recent_s: Sequence[float],
                         running_elapsed_s: float | None, default_s: float = 1.0) -> float:
    """When a request refused now would find the engine free: the generations waiting, each
    a typical one (the median of recent durations, which one long outlier does not move; none
    yet: ``default_s``), plus what remains of the running one, clamped to
    [RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S]."""
    typical = statistics.median(recent_s) if recent_s else default_s
    remaining = 0.0 if running_elapsed_s is None else max(typical - running_elapsed_s, 0.0)
    return min(max(waiting * typical + remaining, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)


def _fatal(exc: BaseException) -> bool:
    """Whether an exception from one request's work stops the system. Only these do:
    - not an Exception (KeyboardInterrupt, SystemExit): the process is being stopped;
    - MemoryError: the host ran out of memory, and a half-built object anywhere in the process
      (not only this request's) may be left behind; a supervisor restart is the safe answer;
    - EngineBroken: the recovery itself failed, the buffers are not known to be sound;
    - a CUDA error (torch.AcceleratorError, or a RuntimeError naming one): the device context
      is poisoned and every later kernel fails; a device out of memory is not one of them
      (the allocator recovers, and the request is refused as no_memory).
    Anything else is one request's Python exception: that request fails, the engine goes on."""
    if not isinstance(exc, Exception) or isinstance(exc, (MemoryError, EngineBroken)):
        return True
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(exc, accelerator):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


class RequestView(msgspec.Struct, frozen=True):
    """The running request as the console sees it (its tokens counted on the loop)."""

    id: str
    phase: Literal["prefill", "decode"]
    prompt_tokens: int
    generated: int = 0


class EngineView(msgspec.Struct, frozen=True):
    """The engine as the loop publishes it, replaced whole, so a reader never sees the rows of
    one moment with the taint of another: the rows in place and their taint as the last
    generation left them, the engine's fixed shape, and the running request."""

    rows_in_place: int = 0
    taint: int | None = None
    window: int | None = None
    prefix_chunk: int | None = None
    num_threads: int | None = None
    request: RequestView | None = None


class _Job:
    """One accepted generation (of ``n`` choices: tandem/choices.py)."""

    def __init__(self, msg: Generate, accepted_s: float) -> None:
        self.request_id = msg.request_id
        self.prompt_ids = msg.prompt_ids
        p = self.generation_params = msg.params
        self.reply_to = msg.reply_to
        self.session = msg.session
        self.marks = msg.marks
        self.side = msg.side or msg.idle
        self.idle = msg.idle  # idle work: any request cancels it (tandem/actors/engine_idle.py)
        self.namespace = Namespace(msg.namespace)
        self.max_reasoning_tokens = p.max_reasoning_tokens
        self.forced_ids = p.forced_ids
        self.accepted_s = accepted_s
        self.started_s: float | None = None
        self.slot = 0  # the slot the resident placed it in (tandem/cache/slots.py)
        self.placed = "only"
        self.parked_before: object = None  # the park's conversation before it ran
        self.park: Any = None  # the park's holdings while this job has them (ParkHoldings)
        self.plan: PrefillPlan | None = None
        self.plan_taken = False  # engine thread only: the plan reached the planner
        self.cancel = threading.Event()
        self.n = max(1, msg.n)
        self.choice_cancels = [threading.Event() for _ in range(self.n)]  # a stop string's
        self.view = RequestView(self.request_id, "prefill", len(self.prompt_ids))
        self.staged: dict[int, Any] = {}  # engine thread: disk anchors' sections by line
        self.disk_told = False  # the writer was told its job (or its plan was given back)
        self.images = msg.images  # the prompt's images (prompt_ids are then its key ids)
        self.placer: ImagePlacer | None = None  # engine thread: their tower runs and hits


@dataclass
class _Outcome:
    """What a finished job hands back from the engine thread."""

    result: Any  # tandem.engine.GenerationResult
    source: Source
    guest: bool
    reread: int
    alignment: Alignment | None
    budget: ReasoningBudget | None
    # n > 1: choices 1..n-1, each's result and budget (choice 0's are the fields above).
    choices: list[tuple[Any, ReasoningBudget | None]] = field(default_factory=list)


@dataclass(frozen=True)
class _AskStore:
    """A planned generation whose tokens are all out asks the loop for the store's verdict on
    its session put, and is sent it before the rest runs on the engine thread."""

    put: Any  # tandem.cache.store.SessionPut, or None: nothing to admit


class _Ending:
    """A generation between its last token and its end (the end anchor, the session put):
    the scheduler runs what follows only while the loop is not making a plan (the cache
    gate), since both reserve and shed the caches' memory."""

    __slots__ = ()


END = _Ending()
_NEW = object()  # a run not advanced yet: its first advance restores and runs a first chunk


class _Run:
    """One job's generation on the engine thread (the scheduler's): the generator and what it
    waits for (a Step, END, an _AskStore answered from the loop, or _NEW)."""

    __slots__ = ("job", "steps", "need", "sent", "tail")

    def __init__(self, job: "_Job", steps: Any) -> None:
        self.job = job
        self.steps = steps
        self.need: Any = _NEW
        self.sent: Any = None  # the loop's answer to an _AskStore, once it came
        self.tail = 0.0  # when its prefill's tail began to wait for a decode batch


class _Outside:
    """An outside holder of the capture lock, waiting or holding."""

    def __init__(self, holder: str, reply_to: Any, grant_id: int) -> None:
        self.holder = holder
        self.reply_to = reply_to
        self.grant_id = grant_id


class EngineActor(EnginePeek, EngineSpill, EngineIdle, EngineCompaction, Actor):
    def __init__(self, name: str = "engine", *, make_engine: Callable[[], Engine],
                 make_resident: Callable[[Engine], ResidentPrefix] | None = None,
                 make_store: Callable[[Engine], StateStore] | None = None,
                 governor: MemoryGovernor | None = None,
                 tokenizer: Any = None, end_align: bool = True,
                 end_align_reasoning: bool = True, queue_limit: int = 16, retry_after_s: float = 1.0,
                 speculation: str = "off", draft_max: int = 8, suffix: SuffixActor | None = None,
                 tiers: tuple[ResidentActor, ParkActor] | None = None, parallel: int = 1,
                 governor_actor: Actor | None = None,
                 executor: ThreadPoolExecutor | None = None,
                 make_disk_tier: Callable[[Engine], Any] | None = None,
                 disk_writer: Actor | None = None,
                 make_spill: Callable[[Engine, Any], Any] | None = None,
                 spill_writer: Actor | None = None, spill_min_tokens: int = 16384,
                 spill_park_min_tokens: int = 4096, tower_cache: TowerCache | None = None,
                 mailbox_capacity: int = 256, **actor_options: Any) -> None:
        """``make_engine`` runs on the engine thread in on_start (it allocates the buffers);
        ``make_resident`` builds the resident prefix over it there (None: no caches);
        ``make_store`` the engine's side of the state store beside it (its core lives in the
        store actor; None: no store); ``governor`` holds those caches to the machine's memory
        limits (its core: the engine thread calls it before each prefill and at every reserve,
        so what it sheds is shed on the engine thread, where the tiers live);
        ``tokenizer`` gives the token bytes the end alignment compares and the reasoning
        budget's phrase (None: neither);
        ``queue_limit``: generations that may wait beyond the running one;
        ``retry_after_s``: the Retry-After estimate's guess at one generation's duration until
        some have finished (estimate_retry_after);
        ``speculation`` ("off" or "lookup") and ``draft_max``: the lookup drafter's verify
        blocks; ``suffix``: the suffix store actor the drafter reads and every finished
        generation is reported to (None: drafts come from the request's own tokens);
        ``tiers``: the resident and park actors that own the tiers (tandem/actors/tiers.py):
        when a job gets the engine they are asked for their offers and lend their holdings
        to the composer ``make_resident`` built (``ResidentPrefix.lent_to``) for that
        generation, after the `PrefillPlan` was built on the loop (None: the composer holds
        its own tiers on the engine thread);
        ``parallel``: slots, the sequences held in place at once (tandem/cache/slots.py: the
        resident actor places each request in one and lends that slot's holdings; with
        ``tiers`` only). A slot's engine shares the model and is built when first placed;
        ``governor_actor`` is told the bytes of the rows every slot holds (`TierHeld`);
        ``executor``: the single-worker executor the engine's work runs on, the caller's to
        keep (tandem.torch_thread: the thread the model was loaded on); None makes one;
        ``make_disk_tier`` (run on the engine thread over the first engine: its manifest and
        grid name the files; tandem.io.tier.make_disk_tier) and ``disk_writer`` (the tier's
        writer actor, which may be set after construction): the plan asks
        the tier for its offer and what the prefill writes, the engine thread reads its files
        and stages the anchors' sections, and the writer is told the job after the prefill and
        fences it before the slot's rows are written again (None: no disk tier);
        ``make_spill`` (run on the engine thread after the disk tier, over the engine and the
        tier: tandem.io.spill.make_session_spill's identity and grid), ``spill_writer`` (its
        writer actor, may be set later) and the two thresholds of what leaves a slot for it
        (tandem/actors/engine_spill.py; None: no session spill)."""
        super().__init__(name, mailbox_capacity=mailbox_capacity, **actor_options)
        self._tiers = tiers
        if parallel < 1 or (parallel > 1 and tiers is None):
            raise ValueError("parallel slots need at least one slot and the tier actors")
        self.parallel = parallel
        # Every slot's rows in place, their taint and namespace as the last generation on it
        # left them: what the tiers' offers and the placement are made over (written by the
        # loop, from the engine thread's hand-off).
        self._slot_rows: list[list[int]] = [[] for _ in range(parallel)]
        self._slot_taint: list[int | None] = [None] * parallel
        self._slot_namespace: list[Namespace] = [SHARED] * parallel
        # Each slot's sequence and the caches' parts over it: its engine, its composer (lent
        # that slot's holdings), its planner and its side of the store, built on the engine
        # thread when the slot is first placed in.
        self.engines: list[Engine | None] = [None] * parallel
        self.composers: list[ResidentPrefix | None] = [None] * parallel
        self.planners: list[Planner | None] = [None] * parallel
        self.stores: list[StateStore | None] = [None] * parallel
        # The engine thread's own: the slot whose run it advances now, and that slot's parts
        # (``engine``, ``resident``, ``planner``, ``store``), which only the thread reads.
        self._slot = 0
        self._slot_stats: list[dict | None] = [None] * parallel  # each slot's last counters
        # The pin's and the park's counters as the last composer holding them saw them.
        self._park_stats: dict = {"pinned": None, "pinned_anchors": [], "pins": 0,
                                  "pin_hits": 0, "pin_bytes": 0, "parked": None, "parks": 0,
                                  "park_hits": 0, "park_bytes": 0}
        # The rows each slot has backed, in whole blocks of grid rows (its high water since
        # it was last released), and one row's bytes over every view.
        self._slot_backed: list[int] = [0] * parallel
        self._thread_backed: list[int] = [0] * parallel  # the same, the engine thread's
        self._row_nbytes = 0
        self._state_nbytes = 0  # one sequence's sections (a choice's fork holds a copy)
        self.governor_actor = governor_actor
        # The slot the parked conversation was parked from (its head is in that slot's rows).
        self._park_slot: int | None = None
        self._plans: dict[str, PrefillPlan] = {}  # the running jobs', until GenerationEnded
        # Tokens a second of recent cold prefills (the disk offer's cost is weighed by them).
        self._prefill_rates: deque[float] = deque(maxlen=RECENT_DURATIONS)
        self._make_disk_tier = make_disk_tier
        self.disk_tier: Any = None  # tandem.io.tier.DiskTier, built on the engine thread
        self.disk_writer = disk_writer
        self._init_spill(make_spill, spill_writer, spill_min_tokens, spill_park_min_tokens)
        self._init_idle()
        self._init_peek()
        self._last_slot = 0  # the slot the last plan placed in
        # The jobs running (admitted, in a slot), and the one whose plan is made or whose
        # prefill runs: prefills run one at a time, each's plan made when the one before it
        # has forwarded its prompt (while the others decode).
        self._active: dict[str, _Job] = {}
        self._prefilling: _Job | None = None
        self._group = object()  # the running generations, as one holder of the capture lock
        # The loop's tasks (a plan being made, a session put being admitted).
        self._tasks: set[asyncio.Task[None]] = set()
        # The cache gate: the loop holds it while it makes a plan, the engine thread while a
        # generation ends; both reserve and shed the caches' memory.
        self._cache_gate = threading.Lock()
        # The scheduler's inbox (the loop's side): jobs to start, answers, calls to run.
        self._inbox: deque[tuple[str, Any, Any]] = deque()
        self._inbox_lock = threading.Lock()
        self._inbox_event = threading.Event()  # set by each submit: a waiting round wakes
        self._scheduling = False  # a scheduler runs on the engine thread (under the lock)
        # The loop's: the request whose plan is being made (read by the engine thread, whose
        # batch with a tail in it may wait for that plan's tail: TAIL_WAIT_S).
        self._planning: str | None = None
        self._queued = 0  # and the requests waiting to be planned (_pump)
        self._tail_wait: float | None = None  # engine thread only: this round's batch waits
        self._scheduler: asyncio.Future[Any] | None = None
        # An outside holder takes the lock between two of the scheduler's rounds: the thread
        # parks (``_unpause`` wakes it) while ``_paused``; ``_pausing`` while it is asked to.
        self._pausing = False
        self._paused = False
        self._unpause = threading.Event()
        self._runs: dict[str, _Run] = {}  # engine thread only
        # Engine thread only: a scheduler round runs (a graph may be captured in it), and one
        # was captured in it (_capture_gate).
        self._in_round = False
        self._round_captured = False
        self._thread_prefilling: str | None = None  # engine thread only: the prefilling run
        # The decode steps run, by how many sequences each forwarded at once (the thread's
        # count; the loop's copy, ``decode_batches``, as handed over after each generation).
        self._thread_batches: dict[int, int] = {}
        self.decode_batches: dict[int, int] = {}
        self._make_engine = make_engine
        self._make_resident = make_resident
        self.resident: ResidentPrefix | None = None
        self._make_store = make_store
        self.store: StateStore | None = None
        self.governor = governor
        self.planner: Planner | None = None  # engine thread only
        self.tokenizer = tokenizer
        self.end_align = end_align and tokenizer is not None
        self.end_align_reasoning = end_align_reasoning
        # The records beside the resident prefix's ends, which a client's copy is aligned
        # with (engine thread only; built with the resident prefix).
        self.ends: EndRecords | None = None
        # The caches' counters as the engine thread last handed them over (after each
        # generation), stored by the loop: the loop reads this dict, never the tiers' live state.
        self.cache_stats: dict = {"tiers": {}}
        self.view = EngineView()  # written on the loop alone (snapshot reads it)
        self.queue_limit = queue_limit
        self.retry_after_s = retry_after_s
        if speculation not in ("off", "lookup"):
            raise ValueError(f"speculation must be off or lookup, not {speculation!r}")
        self.speculation = speculation
        self.draft_max = draft_max
        self.suffix = suffix
        # The vision tower's output by image digest (image_cache_mb): the engine thread's.
        self.tower_cache = tower_cache
        self.image_stats = tower_cache.statistics() if tower_cache is not None else None
        self.drafted_total = 0
        self.accepted_total = 0
        self.engine: Engine | None = None
        # The namespace of the rows in place when no resident prefix keeps it (caches off).
        self._rows_namespace: Namespace = SHARED
        self._executor: ThreadPoolExecutor | None = executor
        self._own_executor = executor is None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: CaptureLockFifo[_Job | _Outside | object] = CaptureLockFifo()
        self._jobs: dict[str, _Job] = {}  # every accepted job not yet finished, by request id
        self._grant_ids = itertools.count(1)
        self._draining = False
        self._drain_sinks: list[Any] = []
        self._fault: BaseException | None = None
        self._durations: deque[float] = deque(maxlen=RECENT_DURATIONS)  # finished, seconds
        self.finished_total = 0
        self.failed_total = 0

    # -- lifecycle -------------------------------------------------------------------------

    def slot_rows_nbytes(self) -> int:
        """The bytes of the rows every slot has backed (what the governor is told)."""
        return sum(self._slot_backed) * self._row_nbytes

    def _blocks(self, rows: int) -> int:
        """``rows`` rounded up to whole blocks of grid rows."""
        chunk = self.view.prefix_chunk or 1
        return -(-rows // chunk) * chunk

    def _report_slots(self) -> None:
        if self.governor_actor is None:
            return
        try:
            self.governor_actor.try_tell(TierHeld("slots", {"slots": self.slot_rows_nbytes()}),
                                         sender=self)
        except (MailboxFull, ActorStopped):
            log.warning("tier_held_dropped", tier="slots")

    async def on_start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._own_executor:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"tandem-{self.name}")
        try:
            self.engine = await self._loop.run_in_executor(self._executor, self._build)
            self.view = await self._loop.run_in_executor(self._executor, self._engine_view)
            if self._tiers is not None:  # the slots' rows are counted with the tiers only
                self._row_nbytes = self.engine.cost().row_nbytes
                self._state_nbytes = self.engine.cost().state_nbytes
        except BaseException:
            if self._own_executor:
                self._executor.shutdown(wait=False, cancel_futures=True)
            raise

    def _build(self) -> Engine:
        """On the engine thread: the engine and the caches that own copies of its state."""
        engine = self._make_engine()
        graphs = getattr(getattr(engine, "model", None), "graphs", None)
        if graphs is not None:
            graphs.gate = self._capture_gate
        self._build_parts(0, engine)
        if self._make_disk_tier is not None and self._make_resident is not None:
            self.disk_tier = self._make_disk_tier(engine)
            self._build_spill(engine)
        if self._make_resident is not None:
            if self.end_align and self._tiers is None:
                self.ends = EndRecords(
                    self.resident, self.tokenizer.token_bytes,
                    allow_reasoning=self.end_align_reasoning,
                    holds=self.store.holds if self.store is not None else None)
            if self._tiers is None:
                self._publish_cache_stats()
        elif self.governor is not None:
            self.governor.attach(MemoryAccountant({}), {}, engine.cost())  # workspace only
        return engine

    def _build_parts(self, index: int, engine: Engine) -> None:
        """On the engine thread: slot ``index``'s composer, planner and store side over
        ``engine``, and the thread's pointers at them."""
        self.engines[index] = engine
        if self._make_resident is not None:
            composer = self.composers[index] = self._make_resident(engine)
            if self._make_store is not None:
                self.stores[index] = self._make_store(engine)
            # With the tiers as actors, the governor's gate on this thread never sheds the
            # store (an ask): a planned prefill's room was made on the loop.
            self.planners[index] = Planner(composer, self.stores[index], self.governor,
                                           shed_store=self._tiers is None)
            if self.governor is not None and self._tiers is not None:
                # Whatever the governor sheds on this thread comes from the slot whose run
                # it serves (the slot the thread advances).
                self.governor.attach(composer.memory, {
                    level: (lambda need, level=level: self.resident.shed(level, need))
                    for level in TIER_LEVELS}, engine.cost())
        self._activate(index)

    def _activate(self, index: int) -> None:
        """On the engine thread: its pointers at slot ``index``'s parts."""
        self._slot = index
        self.engine = self.engines[index]
        self.resident = self.composers[index]
        self.planner = self.planners[index]
        self.store = self.stores[index]

    def _build_slot(self, index: int) -> Engine:
        """On the engine thread: a slot's sequence over the same model (its own buffers)."""
        first = self.engines[0]
        engine = Engine(first.model, window=first.window, prefix_chunk=first.prefix_chunk)
        self._build_parts(index, engine)
        return engine

    async def _use_slot(self, index: int) -> None:
        """On the loop: slot ``index``'s parts exist (built on the engine thread)."""
        if self.engines[index] is None:
            await self._on_thread(self._build_slot, index)

    def _engine_view(self) -> EngineView:
        """On the engine thread: the engine as it stands, for the loop to publish."""
        engine = self.engine
        return EngineView(rows_in_place=engine.length, taint=engine.taint, window=engine.window,
                          prefix_chunk=engine.prefix_chunk, num_threads=engine.num_threads)

    def _publish_cache_stats(self) -> None:
        """On the engine thread: the caches' counters, made here and stored by the loop."""
        if self.resident is not None:
            self._to_loop(self._set_cache_stats, self._statistics(self.resident), self._slot)
        if self.tower_cache is not None:
            self._to_loop(setattr, self, "image_stats", self.tower_cache.statistics())

    def _statistics(self, composer: ResidentPrefix) -> dict:
        """A slot's counters (on the thread that holds its composer)."""
        resident = composer.statistics()
        ends = composer.holdings.records if self._tiers is not None else self.ends
        resident["alignments"] = dict(ends.alignments) if ends is not None else {}
        resident["replays"] = ends.replays if ends is not None else 0
        resident["aligned_to_store"] = ends.stored if ends is not None else 0
        # The store's counters are asked of its actor (/v1/cache/stats), not asked for from
        # here after every request.
        return {"tiers": {"resident": resident}}

    def _end_records(self) -> EndRecords | None:
        """The end records: the resident's (in its holdings, while they are lent), or the
        engine's own when the composer keeps its tiers."""
        if self._tiers is not None:
            return self.resident.holdings.records
        return self.ends

    def _set_cache_stats(self, stats: dict, slot: int = 0) -> None:
        """On the loop: the slot's counters as its last generation left them; the resident's
        are summed over the slots (the shared park's and pin's are counted once: the last
        that a composer holding them saw), the rest are the last slot's, and ``slots`` lists
        each one's."""
        resident = stats["tiers"]["resident"]
        if PARK_STATS[0] in resident:
            self._park_stats = {key: resident[key] for key in PARK_STATS}
        else:
            resident = stats["tiers"]["resident"] = dict(resident, **self._park_stats)
        self._slot_stats[slot] = resident
        if self.parallel == 1:
            self.cache_stats = stats
            return
        merged = dict(resident)
        seen = [s for s in self._slot_stats if s is not None]
        for key in SLOT_COUNTERS:
            merged[key] = sum(s.get(key, 0) for s in seen)
        alignments: dict[str, int] = {}
        for s in seen:
            for mode, n in s.get("alignments", {}).items():
                alignments[mode] = alignments.get(mode, 0) + n
        merged["alignments"] = alignments
        merged["slot"] = slot
        merged["slots"] = [None if s is None else {
            "slot": i, "rows_in_place": s["rows_in_place"], "anchors": s["anchors"],
            "end": s["end"], "prompt_end": s["prompt_end"], "taint": s["taint"],
            "anchor_bytes": s["anchor_bytes"]}
            for i, s in enumerate(self._slot_stats)]
        self.cache_stats = {"tiers": {"resident": merged}}

    def _to_loop(self, callback: Callable[..., None], *args: Any) -> None:
        """From the engine thread: ``callback(*args)`` on the loop, ahead of the job's end (which
        is posted the same way, after it)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the loop has closed: nobody is left to read it

    async def on_stop(self) -> None:
        for job in list(self._jobs.values()):
            job.cancel.set()
        for item in self._lock.waiting():
            if isinstance(item, _Job):
                self._fail(item, "stopped", "the engine stopped before the request ran")
        self._lock.clear()
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()  # its asks fail as the tiers stop; no task of this actor outlives it
        if tasks:
            await asyncio.wait(tasks)
        self._unpause.set()  # a parked scheduler goes on, to see its runs cancelled
        if self._scheduler is not None and not self._scheduler.done():
            # The runs stop at their next token; wait so that no torch work outlives the actor.
            await asyncio.wait([self._scheduler])
        if self.spill is not None and self.spill_writer is None:
            self.spill.close()  # no writer owns it: its I/O thread ends with the engine
        if self._executor is not None and self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- introspection ---------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return sum(1 for item in self._lock.waiting() if isinstance(item, _Job))

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def busy(self) -> bool:
        """Whether any generation runs (holds the capture lock)."""
        return self._lock.holder is self._group

    @property
    def running(self) -> int:
        """The generations running now, each in its slot."""
        return len(self._active)

    def retry_after_estimate(self) -> float:
        """Seconds a client refused now should wait (queue_full, draining, a slow ask): the
        jobs waiting share the slots, and the oldest running one frees one first."""
        started = [job.started_s for job in self._active.values() if job.started_s is not None]
        elapsed = self.clock.monotonic() - min(started) if started else None
        slots = max(self.parallel, 1)
        return estimate_retry_after(-(-self.waiting // slots), self._durations, elapsed,
                                    self.retry_after_s)

    def snapshot(self) -> dict:
        """The engine for the console (tandem.server.keys.ENGINE's contract): the published
        view and the loop's own counts, never the engine's live fields."""
        view = self.view
        holder = self._lock.holder
        request = view.request
        return {
            "rows_in_place": view.rows_in_place,
            "window": view.window,
            "prefix_chunk": view.prefix_chunk,
            "num_threads": view.num_threads,
            "taint": view.taint,
            "request": None if request is None else _request_json(request),
            "requests": [_request_json(job.view) for job in self._active.values()],
            "waiting": self.waiting,
            "draining": self._draining,
            "capture_lock": (None if holder is None else
                             self.name if holder is self._group else holder.holder),
            "finished_total": self.finished_total,
            "failed_total": self.failed_total,
            "speculation": self.speculation, "draft_max": self.draft_max,
            "drafted_total": self.drafted_total, "accepted_total": self.accepted_total,
            "decode_batches": dict(sorted(self.decode_batches.items())),
            "slots": self.slot_views(),
        }

    def slot_views(self) -> list[dict]:
        """Each slot as the loop last saw it: its rows, taint, anchors and end (its last
        generation's counters), and whether a request holds it now."""
        held = {job.slot: job.request_id for job in self._active.values()
                if job.plan is not None}
        out = []
        for i in range(self.parallel):
            stats = self._slot_stats[i] or {}
            out.append({"slot": i, "rows_in_place": len(self._slot_rows[i]),
                        "taint": self._slot_taint[i], "anchors": len(stats.get("anchors", [])),
                        "end": stats.get("end"), "busy": i in held, "request": held.get(i)})
        return out

    def check_invariants(self) -> None:
        self._lock.check_invariants()
        ids = [item.request_id for item in self._lock.waiting() if isinstance(item, _Job)]
        assert len(ids) == len(set(ids)), "a request waits twice"
        assert self.busy <= bool(self._active), "the generations hold the lock with none running"
        assert bool(self._active) <= (self.busy or self._paused), \
            "generations run without the capture lock"
        assert len(self._active) <= self.parallel, "more generations than slots"
        assert self._prefilling is None or self._prefilling.request_id in self._active, \
            "a prefill runs for a job that is not running"
        slots = [job.slot for job in self._active.values() if job.plan is not None]
        assert len(slots) == len(set(slots)), "two generations in one slot"
        assert set(self._jobs) == set(ids) | set(self._active), \
            "job table out of step with the FIFO"

    # -- messages --------------------------------------------------------------------------

    async def handle(self, msg: Message) -> object | None:
        if self._fault is not None:
            raise self._fault
        match msg:
            case Generate():
                return self._accept(msg)
            case CancelGeneration(request_id=request_id, choice=choice):
                self._cancel(request_id, choice)
            case Drain(reply_to=reply_to):
                return self._drain(reply_to)
            case ClearCaches():
                return await self._clear_caches()
            case SpillSlots():
                return await self._spill_slots()
            case ReadSpill():
                return await self._read_spill()
            case ListConversations():
                return await self._list_conversations()
            case Peek():
                return await self._peek(msg)
            case FindSessionRecord():
                return await self._session_record(msg)
            case RequestCaptureLock(holder=holder, reply_to=reply_to):
                self._lock.enqueue(_Outside(holder, reply_to, next(self._grant_ids)))
                self._pump()
            case ReleaseCaptureLock(holder=holder, grant_id=grant_id):
                held = self._lock.holder
                if not (isinstance(held, _Outside) and held.grant_id == grant_id
                        and held.holder == holder):
                    raise CaptureLockMisuse(
                        f"{holder} released capture lock grant {grant_id} it does not hold")
                self._lock.release(held)
                self._pump()
            case EngineFaulted():
                pass  # the fault was raised above
            case _:
                raise TypeError(f"{self.name} does not handle {type(msg).__name__}")
        return None

    async def _clear_caches(self) -> CachesCleared:
        """The resident's and the park's copies dropped and every slot's rows emptied, while
        nothing runs or waits (the handler holds the mailbox meanwhile: no request starts)."""
        if self._tiers is None or self._jobs or self._lock.holder is not None:
            return CachesCleared(busy=self._tiers is not None,
                                 retry_after_s=self.retry_after_estimate())
        dropped: dict[str, int] = {}
        for tier in self._tiers:
            reply = await tier.ask(ClearHoldings(), TIER_ASK_S, sender=self)
            if reply.busy:
                return CachesCleared(busy=True, retry_after_s=self.retry_after_estimate())
            dropped[f"{tier.name}_nbytes"] = reply.nbytes
        dropped["rows"] = sum(len(rows) for rows in self._slot_rows)
        await self._on_thread(self._empty_slots)
        for i in range(self.parallel):
            self._slot_rows[i], self._slot_taint[i] = [], None
            self._slot_namespace[i] = SHARED
            self._slot_backed[i] = 0
        self._park_slot = None
        self.view = msgspec.structs.replace(self.view, rows_in_place=0, taint=None)
        # What each slot holds now (its counters stay: they count what happened).
        empty = {"rows_in_place": 0, "anchors": [], "anchor_bytes": 0, "end": None,
                 "prompt_end": None, "prompt_end_bytes": 0, "taint": None, "stash_bytes": 0,
                 "pinned": None, "pinned_anchors": [], "pin_bytes": 0, "parked": None,
                 "park_bytes": 0}
        self._park_stats.update({k: v for k, v in empty.items() if k in self._park_stats})
        for i, stats in enumerate(self._slot_stats):
            if stats is not None:
                self._set_cache_stats({"tiers": {"resident": dict(stats, **empty)}}, i)
        self._report_slots()
        log.info("engine_caches_cleared", **dropped)
        return CachesCleared(dropped=dropped)

    def _empty_slots(self) -> None:
        """On the engine thread: every built slot at length 0, its rows' pages given back."""
        for i, engine in enumerate(self.engines):
            if engine is None:
                continue
            engine.reset()
            release_rows(engine.state, 0)
            self._thread_backed[i] = 0
        if self.tower_cache is not None:
            self.tower_cache.clear()
            self._to_loop(setattr, self, "image_stats", self.tower_cache.statistics())

    def _accept(self, msg: Generate) -> GenerationAccepted | GenerationRejected:
        if self._draining:
            return GenerationRejected(msg.request_id, "draining", self.retry_after_estimate())
        if msg.request_id in self._jobs:
            return GenerationRejected(msg.request_id, "duplicate", 0.0)
        if (refused := self._refuse_idle(msg)) is not None:
            return refused
        ahead = self.waiting
        if ahead >= self.queue_limit:
            return GenerationRejected(msg.request_id, "queue_full", self.retry_after_estimate())
        job = _Job(msg, self.clock.monotonic())
        self._request_came(msg)
        self._jobs[job.request_id] = job
        self._lock.enqueue(job)
        self._pump()
        return GenerationAccepted(msg.request_id, 0 if job.request_id in self._active else ahead)

    def _cancel(self, request_id: str, choice: int | None = None) -> None:
        job = self._jobs.get(request_id)
        if job is None:
            return  # finished already, or never known
        if choice is not None and job.n > 1:
            if 0 <= choice < job.n:
                job.choice_cancels[choice].set()  # that choice alone ends at its next token
            return
        job.cancel.set()
        if request_id not in self._active:
            self._lock.withdraw(job)
            self._fail(job, "cancelled", "cancelled while waiting")
            self._pump()  # an outside holder behind it may take the lock now

    def _drain(self, reply_to: Any) -> DrainStarted:
        first = not self._draining
        self._draining = True
        self._yield_idle()
        dropped = 0
        for item in self._lock.waiting():
            if isinstance(item, _Job):
                self._lock.withdraw(item)
                self._fail(item, "draining", "the server is shutting down",
                           retry_after_s=self.retry_after_estimate())
                dropped += 1
        running = len(self._active)
        if first:
            log.info("engine_draining", running=running, dropped=dropped)
        if reply_to is not None:
            if running:
                self._drain_sinks.append(reply_to)
            else:
                self._emit(reply_to, EngineDrained())
        self._pump()
        return DrainStarted(running, dropped)

    # -- the capture lock's FIFO -----------------------------------------------------------

    def _pump(self) -> None:
        """Hand the lock to the next in line while it is free; a job behind the running
        generations joins them while a slot is idle and no other prefill is being planned
        or run (prefills run one at a time; a slot's decode never waits for a plan). An
        outside holder gets it between two of the scheduler's rounds (the running
        generations pause until it releases: a copy waits at most one step), and those
        behind it wait for it (the FIFO's order)."""
        self._hand_over()
        # For the engine thread (_batch_waits): requests a plan will be made for once the
        # prefill running lets it, a slot being idle for them.
        self._queued = self.waiting if len(self._active) < self.parallel else 0

    def _hand_over(self) -> None:
        if self._fault is not None or self.state == "stopped":
            return
        while True:
            item = self._lock.peek()
            holder = self._lock.holder
            if isinstance(item, _Outside):
                if holder is self._group:
                    self._pause_steps()
                    return
                if self._lock.grant_next() is None:
                    return
                self._emit(item.reply_to, CaptureLockGranted(item.holder, item.grant_id))
                continue
            if self._paused and holder is None:
                self._resume_steps()
                holder = self._lock.holder
            if item is None:
                return
            if holder is not None and (holder is not self._group or self._prefilling is not None
                                       or len(self._active) >= self.parallel):
                return
            job = self._lock.join_holder(self._group)
            self._active[job.request_id] = job
            self._prefilling = job
            self._start(job)

    # -- running a generation --------------------------------------------------------------

    def _start(self, job: _Job) -> None:
        assert self._loop is not None and self._executor is not None
        job.started_s = self.clock.monotonic()
        self.view = msgspec.structs.replace(self.view, request=job.view)
        queued_ms = (self.clock.monotonic() - job.accepted_s) * 1000.0
        self._emit(job.reply_to, GenerationStarted(job.request_id, len(job.prompt_ids), queued_ms),
                   job)
        if self._tiers is None:
            self._submit("start", job, None)
        else:
            self._planning = job.request_id  # from now: the task runs at the loop's next turn
            self._task(self._planned(job))

    async def _planned(self, job: _Job) -> None:
        """``_prepare``, with the engine thread told that a plan is being made."""
        try:
            await self._prepare(job)
        finally:
            if self._planning == job.request_id:  # no plan came of it: a waiting batch goes on
                self._planning = None
                self._inbox_event.set()

    def _pause_steps(self) -> None:
        """On the loop: ask the scheduler to park between two rounds; once it has, the
        running generations give the lock up to the outside holder waiting."""
        if self._pausing or self._paused:
            return
        self._pausing = True
        parked = self._on_thread(_park_marker)

        def done(fut: asyncio.Future[Any]) -> None:
            self._pausing = False
            self._paused = True
            if self._lock.holder is self._group:
                self._lock.release(self._group)
            self._pump()

        parked.add_done_callback(done)

    def _resume_steps(self) -> None:
        """On the loop: the outside holders are done; the running generations take the lock
        back and the scheduler goes on."""
        self._paused = False
        if self._active:
            self._lock.take(self._group)
        self._unpause.set()

    def _task(self, work: Any) -> None:
        task = self._loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the scheduler's inbox, on the loop --------------------------------------------------

    def _submit(self, kind: str, job: Any, value: Any) -> None:
        """Hand the engine thread a job to start, an answer, or a call; the scheduler runs
        there while it has work, and is started when it does not run."""
        with self._inbox_lock:
            self._inbox.append((kind, job, value))
            self._inbox_event.set()
            if self._scheduling:
                return
            self._scheduling = True
        self._scheduler = self._loop.run_in_executor(self._executor, self._schedule)
        self._scheduler.add_done_callback(self._scheduler_ended)

    def _scheduler_ended(self, fut: asyncio.Future[Any]) -> None:
        """On the loop: the scheduler returns only with no work; one that raised is a bug of
        its own (each run's failure is that run's), which stops the system."""
        if fut.cancelled():
            with self._inbox_lock:
                self._scheduling = False
            return
        exc = fut.exception()
        if exc is not None and self._fault is None:
            log.error("engine_fault", error=type(exc).__name__,
                      traceback="".join(traceback.format_tb(exc.__traceback__)))
            self._fault = exc
            for job in list(self._active.values()):
                self._finish(job, exc)
            try:
                self.try_tell(EngineFaulted(), sender=self)
            except (MailboxFull, ActorStopped):
                pass

    def _on_thread(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """``fn(*args)`` on the engine thread, between the scheduler's rounds."""
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._submit("call", None, (fn, args, fut))
        return fut

    def _halfway(self, job: _Job, put: Any) -> None:
        """On the loop: a planned generation's session put, admitted by the store (an ask),
        then the verdict back to the thread. Whatever fails here fails the job there."""
        async def admit() -> None:
            verdict: Any = None
            try:
                if put is not None:
                    reply = await self._ask_store(StoreAdmit(put.key_ids, "session", put.nbytes,
                                                             put.namespace))
                    verdict = reply.verdict if reply is not None else "refused"
            except Exception as exc:
                verdict = exc
            self._submit("answer", job, _NO_PUT if verdict is None else verdict)

        self._task(admit())

    # -- the scheduler, on the engine thread ---------------------------------------------------

    def _schedule(self) -> None:
        """On the engine thread, while there is work: each round runs one chunk of the prefill
        (the one job in its prefill: a new one begins there), then every decode step waiting
        as one batched forward (the weights read once a step; a resumed turn's short tail
        among them, which may first wait a few ms for the next request's plan:
        _batch_waits), then the ends the cache gate lets through. A decoding slot waits at
        most one chunk, or that wait; a slot's tokens and logits are those it gets alone
        (decode_batch)."""
        runs = self._runs
        idle = 0
        while True:
            with self._inbox_lock:
                items = list(self._inbox)
                self._inbox.clear()
                self._inbox_event.clear()
                if not items and not any(self._ready(run) for run in runs.values()):
                    self._scheduling = False
                    return
            for kind, job, value in items:
                if kind == "call" and value[0] is _park_marker:
                    # An outside holder takes the capture lock: the thread parks here,
                    # between two rounds, until the loop gives the generations it back.
                    self._to_loop(_settle, value[2], None, None)
                    self._unpause.wait()
                    self._unpause.clear()
                elif kind == "call":
                    fn, args, fut = value
                    try:
                        self._to_loop(_settle, fut, fn(*args), None)
                    except Exception as exc:
                        self._to_loop(_settle, fut, None, exc)
                elif kind == "start":
                    runs[job.request_id] = _Run(job, self._steps(job, value))
                    self._thread_prefilling = job.request_id
                else:  # "answer": the store's verdict on a session put
                    runs[job.request_id].sent = value
            self._in_round, self._round_captured = True, False
            try:
                ran = self._round(runs)
            finally:
                self._in_round = False
            if ran:
                idle = 0
                if self._tail_wait is not None:
                    # The batch waits for the plan the loop is making (a submit wakes it).
                    self._inbox_event.wait(self._tail_wait)
                    self._tail_wait = None
            else:
                # Only ends wait, for the gate the loop holds while it makes a plan
                # (milliseconds): the thread waits a little, not spinning the CPU.
                idle += 1
                time.sleep(min(0.0002 * idle, 0.005))

    def _capture_gate(self, capture: Callable[[], Any]) -> Any:
        """The model's graphs' gate (tandem.models.graphs), on the engine thread: a graph is
        captured only in a scheduler round, while the running generations hold the capture
        lock, and at most one a round. An outside holder (a writer's device copies) gets the
        lock only once the thread is parked between two rounds and the thread goes on only
        after it released it, so no copy runs during a capture (the spec's capture race: a
        CUDA call of another thread fails a global-mode capture), and a copy that waits waits
        at most for the one capture of the round running. Declined (None), the step runs
        eagerly, the same bits."""
        if not self._in_round or self._round_captured:
            return None
        holder = self._lock.holder
        if holder is not self._group:
            log.error("graph_capture_outside_lock",
                      holder=None if holder is None else getattr(holder, "holder", "request"))
            return None
        self._round_captured = True
        return capture()

    def _ready(self, run: _Run) -> bool:
        """Whether a run can be advanced (an _AskStore waits for the loop's answer)."""
        return not isinstance(run.need, _AskStore) or run.sent is not None

    def _round(self, runs: dict[str, _Run]) -> bool:
        """One round; whether anything ran."""
        ran = batched = False
        for run in list(runs.values()):
            if run.need is _NEW or run.need is CHUNK:
                if run.need is _NEW and self._long_prefill(run.job):
                    # A prefill's first chunk would hold the tails waiting in the batch (for
                    # this very plan, perhaps) by a chunk: the batch goes first this round.
                    waiting = [r for r in runs.values() if isinstance(r.need, TailStep)]
                    if waiting:
                        self._decode([r for r in runs.values() if isinstance(
                            r.need, (DecodeStep, VerifyStep, TailStep, DecodeBatch))])
                        batched = True
                self._advance(run, None)
                ran = True
                break
        decoding = [] if batched else [
            run for run in runs.values()
            if isinstance(run.need, (DecodeStep, VerifyStep, TailStep, DecodeBatch))]
        if decoding:
            ran = True
            wait = self._batch_waits(decoding)
            if wait is not None:
                self._tail_wait = wait
            else:
                self._decode(decoding)
        for run in [r for r in runs.values() if r.need is END
                    or (isinstance(r.need, _AskStore) and r.sent is not None)]:
            if not self._cache_gate.acquire(blocking=False):
                break
            try:
                sent, run.sent = run.sent, None
                if isinstance(sent, BaseException):
                    self._advance(run, None, throw=sent)
                else:
                    self._advance(run, sent if sent is not _NO_PUT else None)
            finally:
                self._cache_gate.release()
            ran = True
        return ran

    def _long_prefill(self, job: _Job) -> bool:
        """Whether a planned job forwards more than a tail (TAIL_ROWS tokens past its start):
        its prefill runs in chunks, not in the batch."""
        plan = job.plan
        if plan is None:
            return True
        served = plan.served if plan.served is not None else job.prompt_ids
        return len(served) - plan.start > engine_mod.TAIL_ROWS

    def _batch_waits(self, decoding: list[_Run]) -> float | None:
        """Seconds this round's batch waits, or None to run it now. A batch that holds a
        prefill's tail waits while the loop makes the next request's plan (or has one queued
        to make), up to TAIL_WAIT_S after its newest tail joined: four turns sent together
        then take their first rows in one or two batches, where one a round (a plan apart)
        left the last one's first token 70 ms after the first's. A decoding slot waits at most
        that, once for each request."""
        if self._planning is None and not self._queued:
            return None
        newest = max((run.tail for run in decoding if isinstance(run.need, TailStep)),
                     default=0.0)
        left = newest + TAIL_WAIT_S - time.monotonic() if newest else 0.0
        return left if left > 0 else None

    def _decode(self, decoding: list[_Run]) -> None:
        """Every waiting decode step (a request's choices' steps among them) as one batched
        forward, each run sent its logits. A batch that fails runs each run's steps alone, so
        that only the run at fault fails."""
        steps = [step for run in decoding for step in decode_steps(run.need)]
        size = len(steps)
        self._thread_batches[size] = self._thread_batches.get(size, 0) + 1
        try:
            logits = decode_batch(steps)
        except Exception as exc:
            if len(decoding) == 1:
                self._advance(decoding[0], None, throw=exc)
                return
            log.warning("decode_batch_failed", batch=size, error=type(exc).__name__)
            for run in decoding:
                try:
                    rows = [decode_batch([step])[0] for step in decode_steps(run.need)]
                except Exception as alone:
                    self._advance(run, None, throw=alone)
                else:
                    self._advance(run, sent(run.need, rows))
            return
        at = 0
        for run in decoding:
            k = len(decode_steps(run.need))
            self._advance(run, sent(run.need, logits[at:at + k]))
            at += k

    def _advance(self, run: _Run, value: Any, throw: BaseException | None = None) -> None:
        """Run one job's generation to its next step, with the thread's pointers at its slot;
        what it ends with (a result or an exception) goes to the loop."""
        job = run.job
        self._activate(job.slot)
        if self.planner is not None:
            self.planner.governed = self._thread_prefilling in (None, job.request_id)
        try:
            need = run.steps.throw(throw) if throw is not None else run.steps.send(value)
        except StopIteration as done:
            self._ended_run(run, done.value, None)
            return
        except BaseException as exc:
            self._ended_run(run, None, exc)
            if not isinstance(exc, Exception):
                raise
            return
        run.need = need
        if isinstance(need, _AskStore):
            self._to_loop(self._halfway, job, need.put)
        if run.tail and not isinstance(need, TailStep):
            run.tail = 0.0
            self._to_loop(self._prefill_over, job)  # the disk hears of it now
        if self._thread_prefilling == job.request_id and need is not CHUNK:
            self._thread_prefilling = None
            if isinstance(need, TailStep):
                # What is left of this prefill is a tail in the next decode batch, a few rows
                # as decode runs them: the next request is planned while it waits (its own
                # prefill starts a round later at the earliest, one at a time still), so that
                # turns sent together join the batch a round apart rather than a plan apart.
                run.tail = time.monotonic()
                if self.planner is not None:
                    self.planner.settle_early()
                self._to_loop(self._plan_next, job)
            else:
                self._to_loop(self._prefill_over, job)

    def _ended_run(self, run: _Run, outcome: Any, exc: BaseException | None) -> None:
        job = run.job
        del self._runs[job.request_id]
        if self._thread_prefilling == job.request_id:
            self._thread_prefilling = None
        self._to_loop(self._set_batches, dict(self._thread_batches))
        self._to_loop(self._finish, job, exc, outcome)

    def _set_batches(self, batches: dict[int, int]) -> None:
        self.decode_batches = batches

    def _steps(self, job: _Job, plan: PrefillPlan | None) -> Any:
        """On the engine thread: the generation, then the rows it left in place and their
        taint handed to the loop, whether it finished or failed."""
        job.plan_taken = False
        try:
            # With a plan, the composer holds the lent tiers (the loop lent them in _prepare
            # and gives them back in _done).
            return (yield from self._generate(job, plan))
        except BaseException:
            if plan is not None and not job.plan_taken:
                self._unplan({"entry": plan.store_entry, "lines": plan.store_lines})
            raise
        finally:
            self._hand_over_rows()

    # -- the loop's side of a run ------------------------------------------------------------

    def _prefill_over(self, job: _Job) -> None:
        """On the loop: the job's prompt is forwarded; the next prefill may be planned, and the
        disk writer is told what to write of it (it copies the rows out while this decodes)."""
        self._tell_disk(job)
        self._plan_next(job)

    def _plan_next(self, job: _Job) -> None:
        """On the loop: the job's prefill no longer holds the planning back (it is over, or
        all that is left of it is a tail waiting for a decode batch)."""
        if self._prefilling is job:
            self._prefilling = None
            self._pump()

    def _tell_disk(self, job: _Job) -> None:
        plan = job.plan
        if plan is None or plan.disk_plan is None or job.disk_told:
            return
        job.disk_told = True
        engine = self.engines[job.slot]
        msg = DiskJob(job.request_id, job.slot, plan.disk_plan, dict(job.staged),
                      engine.state.views, list((plan.served or job.prompt_ids)))
        try:
            self.disk_writer.try_tell(msg, sender=self)
        except (MailboxFull, ActorStopped):
            log.warning("disk_job_dropped", request_id=job.request_id)
            self._drop_disk_plan(plan.disk_plan)

    def _drop_disk_plan(self, plan: Any) -> None:
        """A disk plan nothing will write: its entries go back to the admission."""
        self.disk_tier.drop_entries(plan.entries(), list(plan.chunk_lines)
                                    + list(plan.anchor_lines), "drop")

    async def _fence(self, job: _Job, plan: PrefillPlan) -> None:
        """On the loop, before the thread runs ``plan``: the disk writer copies no more rows
        of the slot that the request writes over (those it had not copied are dropped)."""
        if self.disk_writer is None:
            return
        base = plan.resident_offer if plan.source == "disk" else plan.start
        from_row = base if plan.source in ("cold", "resident", "end", "prompt_end", "disk") \
            else 0
        try:
            await self.disk_writer.ask(Fence(job.slot, from_row), TIER_ASK_S, sender=self)
        except Exception as exc:
            # A writer that cannot answer (stopping, stuck, failed) copies nothing more that
            # this request could be cost: its jobs' unwritten entries are what is lost.
            log.warning("disk_fence_unanswered", slot=job.slot, error=type(exc).__name__)

    def _finish(self, job: _Job, exc: BaseException | None, outcome: Any = None) -> None:
        """On the loop, after every token of the job was delivered (they were posted before)."""
        if job.request_id not in self._active:
            return  # failed already (a fault of the scheduler)
        fut: asyncio.Future[Any] = self._loop.create_future()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(outcome)
        self._done(job, fut)

    # -- the plan, on the loop -------------------------------------------------------------

    async def _prepare(self, job: _Job) -> None:
        """On the loop: ask each tier for its offer (each lends its holdings with it), align
        the client's copy with the ends, have the governor admit the workspace, ask the store
        for a longer entry (lent) and admit the prefix lines the prefill will snapshot, decide
        the resident's moves, then build the job's PrefillPlan and hand it to the engine
        thread, which asks nobody. A refusal (no room: a 503) or a tier that cannot answer
        fails the job; whatever was lent or reserved goes back."""
        resident, park = self._tiers
        lent: dict[str, Any] = {}
        planned: dict[str, Any] = {"entry": None, "lines": {}}
        try:
            _sampling(job.generation_params)  # a bad value fails this request before any ask
        except ValueError as exc:
            fut: asyncio.Future[Any] = self._loop.create_future()
            fut.set_exception(exc)
            self._done(job, fut)
            return
        # The cache gate, while the plan is made: an end on the engine thread waits for it.
        gated = False
        try:
            gated = await self._enter_gate()
            # The park first, over the rows of the slot it was parked from (its head is
            # there): whether its conversation comes back is part of the placement.
            idle = [i for i in range(self.parallel) if i not in self._busy_slots()]
            from_slot = (self._park_slot if self._park_slot in idle else
                         self._last_slot if self._last_slot in idle else idle[0])
            p = await park.ask(OfferTiers(job.request_id, list(job.prompt_ids),
                                          self._slot_rows[from_slot], job.namespace,
                                          rows_namespace=self._slot_namespace[from_slot]),
                               TIER_ASK_S, sender=self)
            lent["park"] = job.park = p.holdings
            job.parked_before = p.holdings.park.parked
            r = await resident.ask(OfferTiers(
                job.request_id, list(job.prompt_ids), self._slot_rows[from_slot],
                job.namespace, slot_rows=self._slot_rows if self.parallel > 1 else [],
                session=job.session, park_slot=self._park_slot, park_point=p.park_point,
                park_session=p.park_session, side=job.side, own_slot=job.idle),
                TIER_ASK_S, sender=self)
            lent["resident"] = r.holdings
            job.slot, job.placed = r.slot, r.placed
            self._last_slot = r.slot
            if self.parallel > 1:
                log.info("slot_placed", request_id=job.request_id, slot=r.slot, why=r.placed,
                         start=r.start, source=r.source, shared=r.shared,
                         running=len(self._active))
            await self._use_slot(r.slot)
            if r.slot != from_slot:
                # The park's offer over the rows of the slot the request was placed in.
                again = park_offer(p.holdings, job.prompt_ids, job.namespace,
                                   self._slot_rows[r.slot], r.rows_namespace)
                p = msgspec.structs.replace(p, pin_point=again.pin_point,
                                            park_point=again.park_point)
            # The slot's composer holds the lent tiers from here (the loop's, then the
            # thread's) until _done gives them back (the park's once its restore is done).
            self.composers[r.slot].lend(r.holdings, p.holdings)
            plan = await self._plan(job, r, p, planned)
        except Exception as exc:
            if not isinstance(exc, MemoryRefused):
                log.error("plan_failed", request_id=job.request_id, error=type(exc).__name__)
            self._unplan(planned)
            if "resident" in lent:
                composer = self.composers[job.slot]
                if composer is not None and composer.holds_park:
                    if isinstance(exc, MemoryRefused):
                        # What the governor shed on the way.
                        self._set_cache_stats(self._statistics(composer), job.slot)
                    composer.give_back()
            job.park = None
            self._give_back(job, lent, "not_run")
            if gated:
                self._cache_gate.release()
            fut: asyncio.Future[Any] = self._loop.create_future()
            fut.set_exception(exc if isinstance(exc, (ActorStopped, MemoryRefused)) else
                              EngineBroken(f"the plan could not be made ({type(exc).__name__})"))
            self._done(job, fut)
            return
        except BaseException:
            if gated:
                self._cache_gate.release()
            raise
        self._cache_gate.release()
        job.plan = self._plans[job.request_id] = plan
        await self._fence(job, plan)
        try:
            await self._spill_leaving(job, plan)
        except Exception as exc:  # the conversation is lost to the NVMe, not the request
            log.error("spill_leaving_failed", request_id=job.request_id,
                      error=type(exc).__name__)
        if self._trace is not None:
            self._trace.record(plan, sender=self.name, receiver=f"{self.name}.thread",
                               wall_time_s=self.clock.wall_time(), handler_ms=0.0,
                               correlation_id=None)
        self._planning = None  # before the submit wakes a batch that waits for it
        self._submit("start", job, plan)

    def _busy_slots(self) -> set[int]:
        return {job.slot for job in self._active.values() if job.plan is not None}

    async def _enter_gate(self) -> bool:
        """On the loop: take the cache gate, which the engine thread holds only while one
        generation ends (milliseconds); the loop is never blocked waiting for it."""
        wait = 0.0002
        while not self._cache_gate.acquire(blocking=False):
            await asyncio.sleep(wait)
            wait = min(wait * 2, 0.005)
        return True

    async def _plan(self, job: _Job, r: ResidentOffered, p: ParkOffered,
                    planned: dict[str, Any]) -> PrefillPlan:
        prompt = job.prompt_ids
        namespace = job.namespace
        rows = self._slot_rows[job.slot]
        composer = self.composers[job.slot]
        scored = job.generation_params.prompt_logprobs is not None
        mine = ResidentOffer(Resume(r.start, r.source, guest=r.guest), r.shared, r.continuing,
                             r.decisive)
        theirs = ParkOffer(p.pin_point, p.park_point)
        # A prompt scored for logprobs is the client's, forwarded cold: no rows are put back.
        # A prompt with images replays no hidden span (spec): its copy resumes as it came.
        alignment = (await self._align(job) if r.holdings.records is not None and not scored
                     and not job.side and not job.images else None)
        served = alignment.served if alignment is not None else prompt
        spill_offer = None
        if alignment is None and not scored and self.spill is not None:
            # The spill's entry for the copy: as it came, or aligned on the entry's own end
            # (a copy without its reasoning resumes there, as in RAM). The alignment is taken
            # only when the entry would serve over the resident's offer of the copy.
            spill_offer, spill_alignment = self._spill_candidate(
                job, prompt, r.holdings.records if not job.images else None)
            if spill_alignment is not None and weigh(
                    spill_offer, mine.resume.start, len(spill_alignment.served),
                    self.view.prefix_chunk or 1, self._prefill_rate(),
                    self._restore_rate())[0]:
                alignment = r.holdings.records.count(spill_alignment)
                served = alignment.served
        if served is not prompt:
            # The copy is served as other rows: the same offers, over the same lent holdings,
            # for the rows served.
            mine = resident_offer(r.holdings, served, namespace, rows, side=job.side,
                                      guest_ok=r.guest_ok)
            if not mine.decisive:
                theirs = park_offer(p.holdings, served, namespace, rows, r.holdings.namespace)
        workspace = 0
        if self.governor is not None:
            # Room for the prefill's workspace before anything moves: cheaper caches are shed
            # (the tiers' on the lent holdings, the store's by asking it), or the request is
            # refused (MemoryRefused: a 503). The offers are made again over what is left.
            workspace, changed = await self._admit(job, len(served))
            if changed:
                mine = resident_offer(r.holdings, served, namespace, rows, side=job.side,
                                      guest_ok=r.guest_ok)
                theirs = (ParkOffer(0, 0) if mine.decisive else
                          park_offer(p.holdings, served, namespace, rows, r.holdings.namespace))
        resume = choose(mine, theirs)
        store_start = 0
        store = self.stores[job.slot]
        if store is not None:
            if not resume.guest:
                # A guest never takes the store: its restore would write over resident rows
                # no stash protects.
                reply = await self._ask_store(StoreOffer(list(served), namespace))
                if reply is not None and reply.entry is not None:
                    store_start = reply.start
                    if reply.start > resume.start:
                        planned["entry"] = reply.entry
                        resume = Resume(reply.start, "store")
                    else:
                        store.release(reply.entry)  # the resident serves it as well or better
            # A side request keeps nothing, in the store neither.
            for line in () if job.side else store.plan_prefix(served, resume.start, namespace):
                reply = await self._ask_store(StoreAdmit(
                    list(served[:line]), "prefix", store.snapshot_nbytes(line), namespace))
                planned["lines"][line] = reply.verdict if reply is not None else "refused"
        moves = None
        if resume.source != "store":
            moves = composer.moves(list(served), job.generation_params.max_tokens,
                                   job.session, namespace, resume, mine.shared,
                                   mine.continuing, rows, self._slot_taint[job.slot])
        disk_offer, disk_plan = self._plan_disk(job, served, resume, scored)
        ram = resume
        if disk_offer is not None:
            # The resident's moves put the engine at its start; the disk's files go on from
            # there (tandem.io.tier.DiskTier.restore), on the engine thread.
            resume = Resume(disk_offer.line, "disk")
        if spill_offer is not None:
            # More than a chunk past every tier in RAM, and past the disk's files.
            if self._weigh_spill(job, spill_offer, ram, len(served),
                                 disk_offer.line if disk_offer is not None else 0):
                # The resident's moves put the engine at its own start; the entry's blocks go
                # on over the rows in place (tandem.io.spill.SessionSpill.restore), on the
                # engine thread. Its rows are another copy's: the disk writes nothing of them.
                if disk_plan is not None:
                    self._drop_disk_plan(disk_plan)
                disk_offer = disk_plan = None
                resume = Resume(spill_offer.line, "spill")
            else:
                spill_offer = None
        return build_plan(job.request_id, served, self.view.prefix_chunk, mine, theirs,
                          resume, r.holdings, p.holdings, scored=scored, moves=moves,
                          session_put=store is not None,
                          keep_end=r.holdings.ends.end_anchor and not resume.guest,
                          served_ids=None if served is prompt else list(served),
                          alignment=alignment, store_offer=store_start,
                          store_entry=planned["entry"], store_lines=dict(planned["lines"]),
                          workspace_nbytes=workspace, disk_offer=disk_offer,
                          disk_plan=disk_plan, spill_offer=spill_offer, spill_base=ram)

    def _plan_disk(self, job: _Job, served: Sequence[int], resume: Resume,
                   scored: bool) -> tuple[Any, Any]:
        """On the loop: the disk tier's offer, taken when it starts later than every tier in
        RAM and its read costs less than the prefill it saves, and what this prefill writes
        to it (tandem.io.admission). The offer reads above a resident grid anchor or a cold
        start only (the rows below are the slot's own, in place); a guest, a scored prompt and
        a prompt the store or a resident end serves write and read nothing."""
        tier = self.disk_tier
        if tier is None or resume.guest or scored:
            return None, None
        offer = None
        if resume.source in ("cold", "resident"):
            got = tier.offer(list(served), job.namespace, start=resume.start)
            if got is not None and resume.start < got.line < len(served) \
                    and got.worth(self._prefill_rate()):
                offer = got
            elif got is not None:
                log.info("disk_offer_declined", request_id=job.request_id, line=got.line,
                         start=resume.start, est_ms=round(got.est_ms, 1))
        if resume.source in ("park", "pin", "store") or self.disk_writer is None:
            # Rows restored from another copy: their taint is that copy's, and a snapshot's
            # rows are never written (admission's rule); without a writer nothing is.
            return offer, None
        start = offer.line if offer is not None else resume.start
        marks = job.marks
        # A chat prompt says where its parts start (the route's PromptMarks); rows the end
        # alignment put back shift nothing below the end anchor, where the head lies.
        plan = tier.plan(list(served), job.namespace, start=start,
                         taint=self._slot_taint[job.slot],
                         first_of_session=marks is not None and marks.first_of_session,
                         last_user_start=marks.last_user_start if marks is not None else None,
                         head_stop=marks.head_stop if marks is not None else None,
                         from_snapshot=False)
        return offer, (plan if plan is not None and not plan.empty else None)

    def _prefill_rate(self) -> float:
        """Tokens a second of this process's recent cold prefills (a prior before any)."""
        return statistics.median(self._prefill_rates) if self._prefill_rates else \
            PREFILL_RATE_PRIOR

    async def _admit(self, job: _Job, num_tokens: int) -> tuple[int, bool]:
        """The governor's admission of this prefill, on the loop; the workspace admitted and
        whether any tier's copies were shed for it."""
        shed_tiers = False

        async def shed(level: str, need: int) -> int:
            nonlocal shed_tiers
            if level == "store":
                reply = await self._ask_store(StoreShed(need))
                return reply.freed if reply is not None else 0
            shed_tiers = True
            return self.composers[job.slot].shed(level, need)

        levels = set(TIER_LEVELS) | ({"store"} if self.stores[job.slot] is not None else set())
        # The rows this request may back beyond its slot's: its prompt and answer.
        wanted = min(self.view.window, num_tokens + job.generation_params.max_tokens)
        grow = max(0, self._blocks(wanted) - self._slot_backed[job.slot]) * self._row_nbytes
        # Choices past the first decode in side rows of their own, as long as the slot's may
        # grow (tandem/choices.py): admitted here with the request, never taken from a slot.
        grow += (job.n - 1) * (wanted * self._row_nbytes + self._state_nbytes)
        workspace = await self.governor.admit_prefill(num_tokens, shed, levels,
                                                      grow_nbytes=grow)
        return workspace, shed_tiers

    async def _align(self, job: _Job) -> Alignment | None:
        """The end alignment, on the loop over the lent holdings: an end in place or parked,
        else a recent turn's whose session snapshot the store says it holds."""
        ends = self.composers[job.slot].holdings.records
        alignment, recent = ends.align_in_place(job.prompt_ids, job.namespace)
        for candidate, rows in recent:
            reply = await self._ask_store(StoreHolds(list(rows), job.namespace))
            if reply is not None and reply.held:
                return ends.aligned_to_store(candidate)
        return alignment

    async def _ask_store(self, msg: Message) -> Any:
        """An ask of the store actor from the loop; None when it cannot answer (a shutdown),
        which the plan takes as an empty store, as the engine thread's port does."""
        try:
            return await self.stores[0].port.actor.ask(msg, TIER_ASK_S, sender=self)
        except (ActorStopped, TimeoutError) as e:
            log.warning("store_unreachable", message_type=type(msg).__name__,
                        error=type(e).__name__)
            return None

    def _unplan(self, planned: dict[str, Any]) -> None:
        """A plan that never ran: its store lease and admitted rooms go back (told; any slot's
        side of the store tells the one store)."""
        store = self.stores[0]
        if store is None:
            return
        if planned["entry"] is not None:
            store.release(planned["entry"])
        for line, verdict in planned["lines"].items():
            if verdict == "reserved":
                store.port.cancel(store.snapshot_nbytes(line))

    def _give_back(self, job: _Job, lent: dict[str, Any], outcome: str) -> None:
        """What the tiers lent goes back to them (`GenerationEnded`, one to each)."""
        for name, actor in zip(("resident", "park"), self._tiers or ()):
            if name not in lent or lent[name] is None:
                continue
            msg = GenerationEnded(job.request_id, outcome, self._slot_rows[job.slot], lent[name])
            try:
                actor.try_tell(msg, sender=self)
            except MailboxFull:
                self._loop.create_task(actor.tell(msg, sender=self))
            except ActorStopped:
                pass  # a stopped tier takes nothing back; the system is stopping

    def _anchor_written(self, job: _Job, line: int) -> None:
        """On the engine thread, after its prefill anchored ``line`` in the lent holdings."""
        resident = self._tiers[0]

        def tell() -> None:
            try:
                resident.try_tell(AnchorWritten(job.request_id, line), sender=self)
            except (MailboxFull, ActorStopped):
                log.warning("anchor_written_dropped", request_id=job.request_id)

        self._to_loop(tell)

    def _hand_over_rows(self) -> None:
        """On the engine thread: the rows it left in place and their taint, to the loop; the
        pages of the rows above the block holding the last one go back to the OS first (a
        conversation that left the slot, or was cut back, holds its memory no longer)."""
        engine = self.engine
        rows = list(engine.token_ids) if self._tiers is not None else None
        backed = self._release_unused(engine) if self._tiers is not None else None
        self._to_loop(self._ended, self._slot, engine.length, engine.taint, rows, backed)

    def _release_unused(self, engine: Engine) -> int:
        """On the engine thread: the slot's rows backed after releasing those above the
        block of its length (tandem.models.rows.release_rows)."""
        slot = self._slot
        keep = self._blocks(engine.length)
        if keep < engine.window:
            # Every time: rows above the length may have been written during the job (a
            # guest's, a verify block's) though the length was never above ``keep`` after it.
            released = release_rows(engine.state, keep)
            if self._thread_backed[slot] > keep:
                log.info("slot_rows_released", slot=slot,
                         rows=self._thread_backed[slot] - keep, skipped=len(released.skipped))
        self._thread_backed[slot] = keep
        return keep

    def _ended(self, slot: int, rows_in_place: int, taint: int | None, rows: list[int] | None,
               backed: int | None = None) -> None:
        self.view = msgspec.structs.replace(self.view, rows_in_place=rows_in_place, taint=taint)
        self._slot_taint[slot] = taint
        if backed is not None and backed != self._slot_backed[slot]:
            self._slot_backed[slot] = backed
            self._report_slots()
        if rows is not None:
            self._slot_rows[slot] = rows

    def _generate(self, job: _Job, plan: PrefillPlan | None = None) -> Any:
        """On the engine thread: the whole generation, tokens posted to the loop as they come.
        A generator of the engine's steps (the scheduler's), then END and an _AskStore for a
        planned one; it returns the _Outcome."""
        assert self.engine is not None
        engine, resident = self.engine, self.resident
        params = _sampling(job.generation_params)  # a bad value fails this request only
        scoring = {}
        if params.prompt_logprobs is not None:
            scoring["on_prompt_logprobs"] = lambda entries: self._post(
                job, PromptLogprobs(job.request_id, entries))
        if job.images:
            # The prefill's: the tower runs here, on the engine thread, through its cache, for
            # the images whose rows the prefill forwards (tandem.cache.tower.ImagePlacer).
            job.placer = ImagePlacer(job.images, getattr(engine.model, "images", None),
                                     self.tower_cache)
            scoring["images"] = job.placer

        if resident is None:
            if self.governor is not None:
                self.governor.before_prefill(len(job.prompt_ids))
            self._post(job, PrefillAdmitted(job.request_id))
            if job.namespace != self._rows_namespace:
                engine.reset()  # another namespace's rows: the engine must not extend them
            self._rows_namespace = job.namespace
            try:
                result, budget, others = yield from self._choices_steps(
                    job, engine, job.prompt_ids, params, scoring)
            except BaseException:
                # No copy exists to cut back to: the rows the request wrote (a forward may have
                # stopped half way) must not be resumed over by the next prompt sharing them.
                _recover(engine.reset)
                raise
            finally:
                if self.governor is not None:
                    self.governor.after_request()
            return _Outcome(result, "engine" if result.reused_tokens else "cold", False,
                            len(job.prompt_ids) - result.reused_tokens, None, budget, others)
        ends = self._end_records()
        if plan is not None:
            # Aligned on the loop, over the same lent holdings.
            alignment = plan.alignment
            served = plan.served if plan.served is not None else job.prompt_ids
        else:
            # A prompt scored for logprobs is the client's, forwarded cold: no rows are put back.
            alignment = (ends.align(job.prompt_ids, job.namespace)
                         if ends is not None and params.prompt_logprobs is None
                         and not job.images else None)
            served = alignment.served if alignment is not None else job.prompt_ids
        planner = self.planner
        parked_before = resident.parked
        on_chunk = planner.on_chunk
        if plan is not None:
            # The loop's decision, over these very holdings, for the rows served (with a disk
            # offer, the resident's own resume: the files go on from its start).
            base = (Resume(plan.start, plan.source, guest=plan.guest)
                    if plan.disk_offer is None else
                    Resume(plan.resident_offer, "resident" if plan.resident_offer else "cold"))
            if plan.spill_offer is not None:
                base = Resume(plan.spill_base, plan.spill_base_source)
            resident.decided(served, Decided(base, plan.shared, plan.continuing, plan.moves))
            lines = set(plan.anchor_lines)
            staging = set(plan.disk_lines)

            def on_chunk(end: int) -> None:
                planner.on_chunk(end)
                if end in lines and end in resident.anchors:
                    self._anchor_written(job, end)
                if end in staging:
                    # The disk anchor's sections as the prefill passes its line (the rows stay
                    # where the prefill wrote them until the writer copies them out).
                    job.staged[end] = SectionsCopy.take(engine.cache_state())
        # From here the planner answers for the plan's store lease and rooms (it gives them
        # back, on a failure too); a failure before leaves them to _steps.
        job.plan_taken = True
        try:
            resume = planner.begin(served, params.max_tokens, job.session, job.namespace,
                                   plan=plan)
        except MemoryRefused:
            # Refused before anything moved in the engine (the request gets a 503); the
            # governor may have shed caches on the way, which the stats show.
            self._publish_cache_stats()
            raise
        except BaseException:
            self._abort(planner, ends)  # a restore may have stopped half way
            raise
        try:
            if ends is not None:
                # The park moves only in the restore: its record follows it now, before the
                # park goes back.
                ends.follow_park(parked_before, resume.source == "park")
            if plan is not None:
                self._return_park(job)
                if plan.disk_offer is not None:
                    resume = self._restore_disk(job, plan, served, resume)
                if plan.spill_offer is not None:
                    resume = self._restore_spill(job, plan, served)
        except BaseException:
            self._abort(planner, ends)
            raise
        self._post(job, PrefillAdmitted(job.request_id))
        # Idle work yields between two prefill chunks too.
        stopping = {"stop_prefill": job.cancel.is_set} if job.idle else {}
        try:
            result, budget, others = yield from self._choices_steps(
                job, engine, served, params,
                dict(on_chunk=on_chunk, on_prefill=planner.on_prefill, logits=resume.logits,
                     **scoring, **stopping))
            committed = served + result.token_ids
            if plan is not None:
                yield END  # the end reserves and sheds: it waits while the loop makes a plan
                put = planner.ended(committed, job.session, job.namespace,
                                    session_put=not job.side)
            else:
                planner.finish(committed, job.session, job.namespace)
        except BaseException:
            self._abort(planner, ends)
            raise
        if alignment is not None and alignment.served is job.prompt_ids:
            alignment = None
        if params.prompt_logprobs is not None:
            # The engine ran the prompt cold whatever the tiers restored (tandem.engine:
            # prompt logprobs need every position forwarded): usage says so.
            outcome = _Outcome(result, "cold", resume.guest, len(served), alignment, budget,
                               others)
        else:
            outcome = _Outcome(result, resume.source, resume.guest,
                               len(served) - resume.start, alignment, budget, others)

        def complete(verdict: str | None) -> _Outcome:
            """The rest, on the engine thread: with a plan, after the loop asked the store
            to admit the session put (``verdict``)."""
            try:
                if plan is not None:
                    planner.settle(put, verdict or "refused", committed)
                planner.check_invariants(alone=self._alone(job))
                if ends is not None and not resume.guest:
                    ends.remember(served, result.token_ids, _hidden(budget, result.token_ids))
            except BaseException:
                self._abort(planner, ends)
                raise
            self._publish_cache_stats()
            return outcome

        if plan is None:
            return complete(None)
        verdict = yield _AskStore(put)
        return complete(verdict)

    def _choice_options(self, job: _Job, choice: int) -> tuple[dict, ReasoningBudget | None]:
        """On the engine thread: what one choice's generation has of its own: its reasoning
        budget (or the forced answer), its drafter, its cancel, and the callbacks that post its
        tokens (counted in that choice); the budget too, for its hidden tokens."""
        budget = None
        if job.max_reasoning_tokens > 0 and self.tokenizer is not None:
            budget = ReasoningBudget.for_tokenizer(self.tokenizer, job.max_reasoning_tokens)
        force = budget
        if job.forced_ids:
            forced = job.forced_ids

            def force(out: list[int]) -> int | None:
                return forced[len(out)] if len(out) < len(forced) else None

        speculate = {}
        if self.speculation == "lookup":
            # The drafter indexes the prompt at its first proposal, after the first token: a
            # 32k prompt's index (tens of ms) never delays the time to first token. A salted
            # request drafts from its own tokens only: the store holds every tenant's text.
            store = (self.suffix.store if self.suffix is not None and job.namespace == SHARED
                     else None)
            speculate = {"draft": LookupDrafter(store).propose, "draft_max": self.draft_max}

        if job.generation_params.grammar is not None:
            # Compiled here, on the engine thread (milliseconds for a schema), as every mask
            # after it: the loop never waits on a grammar. One matcher a choice: it keeps the
            # state of the tokens its choice wrote.
            if self.tokenizer is None:
                raise ModelError("structured outputs need the model's tokenizer")
            speculate["grammar"] = TokenGrammar(self.tokenizer, job.generation_params.grammar)

        entry = None  # the logprobs of the token on_token sees next (the engine's order)
        generated = 0

        def on_logprobs(logprobs) -> None:
            nonlocal entry
            entry = logprobs

        def on_token(token_id: int) -> bool:
            nonlocal entry, generated
            index, generated = generated, generated + 1
            hidden = budget is not None and index in budget.hidden_positions
            self._post(job, TokenGenerated(job.request_id, token_id, index, hidden, entry,
                                           choice))
            entry = None
            return False

        stopped = job.choice_cancels[choice]
        options = {"on_token": on_token, "force": force, **speculate,
                   "should_cancel": (job.cancel.is_set if job.n == 1 else
                                     lambda: job.cancel.is_set() or stopped.is_set())}
        if job.generation_params.logprobs is not None:
            options["on_logprobs"] = on_logprobs
        return options, budget

    def _choices_steps(self, job: _Job, engine: Engine, prompt: Sequence[int],
                       params: SamplingParams, shared: dict) -> Any:
        """On the engine thread: choice 0's generation on the slot's engine (``shared``: its
        prefill's options), and with n > 1 the others forked from its state at the prompt's
        end and decoded beside it (tandem/choices.py), their rows released at the end,
        whatever the end. Returns choice 0's result and budget, and the others'."""
        options, budget = self._choice_options(job, 0)
        if job.n == 1:
            result = yield from _engine_steps(engine, prompt, params, **options, **shared)
            return result, budget, []
        budgets: list[ReasoningBudget | None] = []

        def make(i: int, twin: Engine, logits: torch.Tensor) -> Any:
            own, choice_budget = self._choice_options(job, i)
            budgets.append(choice_budget)
            return twin.generate_steps(prompt, choice_params(params, i), logits=logits, **own)

        choices = Choices(job.n, make)
        on_prefill = shared.get("on_prefill")

        def forked(logits: torch.Tensor) -> None:
            if on_prefill is not None:
                on_prefill(logits)  # the caches keep the prompt's end first, as for one choice
            choices.fork(engine, logits, params.max_tokens)

        shared = dict(shared, on_prefill=forked)
        try:
            if shared.get("logits") is not None:
                # The whole prompt restored with its logits: nothing is forwarded, the choices
                # fork from the rows as they are.
                choices.fork(engine, shared["logits"], params.max_tokens)
            results = yield from choices.run(engine.generate_steps(prompt, params, **options,
                                                                   **shared, batch_tail=True))
        finally:
            choices.release()
        budgets += [None] * (job.n - 1 - len(budgets))
        return results[0], budget, list(zip(results[1:], budgets))

    def _alone(self, job: _Job) -> bool:
        """On the engine thread: no other generation runs here, and none is being planned on
        the loop (its plan reserves the store's rooms before its run reaches this thread; the
        loop sets ``_prefilling`` before it starts a plan)."""
        planning = self._prefilling
        return len(self._runs) == 1 and (planning is None or planning is job)

    def _restore_disk(self, job: _Job, plan: PrefillPlan, served: Sequence[int],
                      resume: Resume) -> Resume:
        """On the engine thread, after the resident put the engine at its start: the disk
        tier's chunk files above it and its anchor's sections (every chunk's token ids and
        every section's crc32 checked before a byte reaches the engine). A file that fails
        is deleted with the longer chunks of its chain (the tier's) and the prefill goes on
        from the resident's start, whose state is put back (its anchor, or zeros)."""
        engine, offer = self.engine, plan.disk_offer
        start = engine.length
        try:
            self.disk_tier.restore(offer, list(served), engine.cache_state())
        except Exception as exc:
            log.warning("disk_restore_failed", request_id=job.request_id, line=offer.line,
                        start=start, error=type(exc).__name__)
            state = engine.cache_state()
            if start and start in self.resident.anchors:
                self.resident.anchors[start].restore(state)
                engine.resume_at(start)
            else:
                engine.resume_at(0)  # zeros: the cold start
                start = 0
            return Resume(start, "resident" if start else "cold")
        # The rows below the resident's start keep their taint; the files' rows and the
        # anchor's state above are a cold grid prefill's.
        engine.resume_at(offer.line, list(served[:offer.line]))
        self.resident.anchor_tier.take(offer.line, engine.cache_state())
        return Resume(offer.line, "disk")

    def _return_park(self, job: _Job) -> None:
        """On the engine thread, once the restore is done: the pin and the park go back to
        their actor (through the loop), so that the next request's plan may borrow them while
        this one runs; their counters as they are now go with them."""
        self._publish_cache_stats()
        park = self.resident.give_back_park()
        self._to_loop(self._park_returned, job, park)

    def _park_returned(self, job: _Job, park: Any) -> None:
        """On the loop: the park back from a job's restore (before its first token)."""
        if job.park is not park:
            return
        job.park = None
        parked = park.park.parked
        if parked is not None and parked is not job.parked_before:
            self._park_slot = job.slot  # the conversation that left this slot
        elif parked is None:
            self._park_slot = None
        self._give_back(job, {"park": park}, "restored")

    def _abort(self, planner: Planner, ends: EndRecords | None) -> None:
        """On the engine thread, after a failure: the rows in place are not trusted past the
        last sound one; a guest's stash goes back, anything else is cut back to its highest
        anchor (planner.abort), and no end record describes rows that are gone."""
        _recover(planner.abort)
        if ends is not None:
            ends.forget()
        self._publish_cache_stats()

    def _post(self, job: _Job, msg: Message) -> None:
        """From the engine thread to the loop."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._arrived, job, msg)
        except RuntimeError:
            job.cancel.set()  # the loop has closed: nobody is left to read the tokens

    def _arrived(self, job: _Job, msg: Message) -> None:
        """On the loop: an event of the running job, counted in the view, then delivered."""
        if isinstance(msg, TokenGenerated) and msg.choice == 0:  # the console counts choice 0
            job.view = msgspec.structs.replace(job.view, phase="decode",
                                               generated=msg.index + 1)
            request = self.view.request
            if request is not None and request.id == job.request_id:
                self.view = msgspec.structs.replace(self.view, request=job.view)
        self._emit(job.reply_to, msg, job)

    def _done(self, job: _Job, fut: asyncio.Future[Any]) -> None:
        """On the loop, after every token of the job was delivered (the engine thread posts
        its end through call_soon_threadsafe too, so it comes after them)."""
        plan = self._plans.pop(job.request_id, None)
        if plan is not None:
            self._slot_used_s[job.slot] = self.clock.monotonic()  # the prewarm's in-use rule
            self._slot_namespace[job.slot] = plan.resident.namespace
            if plan.disk_plan is not None and not job.disk_told:
                job.disk_told = True
                self._drop_disk_plan(plan.disk_plan)  # its prefill never ended
            outcome = ("finished" if not fut.cancelled() and fut.exception() is None
                       else "failed")
            if job.park is not None:
                # It never got as far as giving the park back (a failure in the restore).
                self.composers[job.slot].give_back_park()
                self._park_returned(job, job.park)
            self.composers[job.slot].give_back()
            self._give_back(job, {"resident": plan.resident}, outcome)
        self._active.pop(job.request_id, None)
        if self._prefilling is job:
            self._prefilling = None
        if not self._active and self._lock.holder is self._group:
            self._lock.release(self._group)
        self._jobs.pop(job.request_id, None)
        request = self.view.request
        if request is not None and request.id == job.request_id:
            later = [j for j in self._active.values()]
            self.view = msgspec.structs.replace(
                self.view, request=later[-1].view if later else None)
        if job.started_s is not None and not fut.cancelled() and fut.exception() is None:
            self._durations.append(self.clock.monotonic() - job.started_s)
        if fut.cancelled():
            self._fail(job, "stopped", "the engine stopped", forget=False)
        elif (exc := fut.exception()) is not None:
            if isinstance(exc, MemoryRefused):
                self._fail(job, "no_memory", str(exc), forget=False,
                           retry_after_s=exc.retry_after_s)
            elif isinstance(exc, ContextOverflow):
                self._fail(job, "context_overflow", str(exc), forget=False,
                           num_tokens=exc.num_tokens, window=exc.window)
            elif isinstance(exc, (ModelError, ValueError)):
                self._fail(job, "model_error", str(exc), forget=False)
            elif _fatal(exc):
                log.error("engine_fault", request_id=job.request_id, error=type(exc).__name__,
                          traceback="".join(traceback.format_tb(exc.__traceback__)))
                self._fail(job, "engine_error", f"internal engine error ({type(exc).__name__})",
                           forget=False)
                self._fault = exc
                try:
                    self.try_tell(EngineFaulted(), sender=self)
                except (MailboxFull, ActorStopped):
                    pass  # the next message raises the fault; a stopped actor needs no nudge
            elif _device_oom(exc):
                log.warning("engine_device_oom", request_id=job.request_id)
                self._fail(job, "no_memory", "the device ran out of memory", forget=False,
                           retry_after_s=self.retry_after_estimate())
            else:
                # One request's failure, the engine's buffers cut back to a sound row on its
                # thread: that request fails, the next one runs. The frames name code only;
                # an exception's message may quote the request, so it is never logged.
                log.error("engine_request_failed", request_id=job.request_id,
                          error=type(exc).__name__,
                          traceback="".join(traceback.format_tb(exc.__traceback__)))
                self._fail(job, "engine_error", f"internal engine error ({type(exc).__name__})",
                           forget=False)
        else:
            outcome = fut.result()
            result = outcome.result
            choices = [(result, outcome.budget), *outcome.choices] if outcome.choices else []
            drafted = result.drafted + sum(r.drafted for r, _ in outcome.choices)
            accepted = result.accepted + sum(r.accepted for r, _ in outcome.choices)
            self.finished_total += 1
            if outcome.reread >= PREFILL_RATE_MIN_TOKENS and result.prefill_ms > 0:
                self._prefill_rates.append(outcome.reread / (result.prefill_ms / 1000.0))
            self._emit(job.reply_to, GenerationFinished(
                request_id=job.request_id, finish_reason=result.finish_reason,
                prompt_tokens=result.prompt_tokens, completion_tokens=len(result.token_ids),
                reused_tokens=result.reused_tokens, prefill_ms=result.prefill_ms,
                decode_ms=result.decode_ms, decode_tok_s=result.decode_tok_s,
                stop_token=result.stop_token, cache_source=outcome.source, guest=outcome.guest,
                reread_tokens=outcome.reread,
                aligned=outcome.alignment.mode if outcome.alignment else None,
                end_replayed=(outcome.alignment.replayed_hidden
                              + outcome.alignment.replayed_reasoning
                              if outcome.alignment else 0),
                hidden_tokens=len(_hidden(outcome.budget, result.token_ids)),
                drafted=drafted, accepted=accepted, slot=job.slot, choices=[
                    ChoiceEnded(r.finish_reason, len(r.token_ids), r.stop_token,
                                len(_hidden(b, r.token_ids))) for r, b in choices]),
                job)
            self.drafted_total += drafted
            self.accepted_total += accepted
            self._report_to_suffix(job, outcome)
        self._pump()
        if self._draining and not self._active:
            sinks, self._drain_sinks = self._drain_sinks, []
            for sink in sinks:
                self._emit(sink, EngineDrained())

    def _report_to_suffix(self, job: _Job, outcome: "_Outcome") -> None:
        """The client's prompt and the visible output go to the suffix store; hidden tokens
        (the budget's phrase) and rows the alignment put back never do (spec)."""
        suffix = self.suffix
        if suffix is None or suffix.store is None or job.namespace != SHARED or job.idle:
            # A salted request's text is never drafted for anyone else; idle work's prompt
            # is a conversation the store has already, and it may run many times.
            return
        out = outcome.result.token_ids
        if outcome.budget is not None:
            out = outcome.budget.visible(out)
        prompt = list(job.prompt_ids)
        if job.images or has_keys(prompt):
            # The store never receives placeholder rows: the text after the last image only.
            # (A compaction's continuation carries an image conversation's rows without its
            # images: it is known by its keys.)
            runs = text_runs(prompt)
            prompt = runs[-1] if runs and not is_key(prompt[-1]) else []
        try:
            suffix.try_tell(SuffixAppend(prompt, list(out)), sender=self)
        except (MailboxFull, ActorStopped):
            log.warning("suffix_append_dropped", request_id=job.request_id)

    def _fail(self, job: _Job, reason: str, detail: str, *, forget: bool = True,
              **counts: int | float) -> None:
        if forget:
            self._jobs.pop(job.request_id, None)
        self.failed_total += 1
        self._emit(job.reply_to, GenerationFailed(job.request_id, reason, detail, **counts), job)

    def _emit(self, sink: Any, msg: Message, job: _Job | None = None) -> None:
        """Deliver an event to a sink, on the loop. A sink that cannot take it (an actor that
        stopped or is full) has lost the request: the job is cancelled."""
        if sink is None:
            return
        if job is not None and job.placer is not None and isinstance(msg, GenerationFinished):
            msg = msgspec.structs.replace(msg, tower_runs=job.placer.runs,
                                          tower_hits=job.placer.hits)
        try:
            if isinstance(sink, Actor):
                sink.try_tell(msg, sender=self)
            else:
                sink.put_nowait(msg)
        except (MailboxFull, ActorStopped, asyncio.QueueFull):
            log.warning("engine_sink_lost", message_type=type(msg).__name__,
                        request_id=None if job is None else job.request_id)
            if job is not None:
                job.cancel.set()


_NO_PUT = object()  # the loop's answer to an _AskStore with nothing to admit


def _park_marker() -> None:
    """The scheduler's "call" that parks it for an outside holder (never called)."""


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _request_json(view: RequestView) -> dict:
    return {"id": view.id, "phase": view.phase, "prompt_tokens": view.prompt_tokens,
            "generated": view.generated}


def build_plan(request_id: str, served: Sequence[int], chunk: int, mine: ResidentOffer,
               theirs: ParkOffer, resume: Resume, resident: Any, park: Any, *,
               scored: bool = False, served_ids: list[int] | None = None,
               alignment: Any = None, store_offer: int = 0, store_entry: Any = None,
               store_lines: dict[int, str] | None = None,
               workspace_nbytes: int = 0, moves: Any = None, session_put: bool = False,
               keep_end: bool = False, disk_offer: Any = None,
               disk_plan: Any = None, spill_offer: Any = None,
               spill_base: Resume | None = None) -> PrefillPlan:
    """The plan for the rows ``served`` (the loop's part of a request's way; pure): ``resume``
    chosen over the resident's and the park's offers (and the store's, ``store_offer``), the
    grid lines the resident anchors as the prefill passes them (``scored``: the prompt's
    logprobs are wanted, so the prefill runs from token 0 and passes every line; a guest keeps
    none), the store's lent entry and admitted prefix lines."""
    first = 0 if scored else resume.start
    lines = [] if resume.guest else list(range((first // chunk + 1) * chunk, len(served) + 1,
                                               chunk))
    return PrefillPlan(request_id, len(served), resume.start, resume.source, resume.guest,
                       mine.shared, mine.continuing, mine.resume.start, theirs.pin_point,
                       theirs.park_point, lines, moves=moves, session_put=session_put,
                       keep_end=keep_end,
                       aligned=alignment.mode if alignment is not None else None,
                       served=served_ids, alignment=alignment, store_offer=store_offer,
                       store_entry=store_entry, store_lines=store_lines or {},
                       workspace_nbytes=workspace_nbytes, resident=resident, park=park,
                       disk_offer=disk_offer, disk_plan=disk_plan,
                       disk_lines=list(disk_plan.anchor_lines) if disk_plan is not None else [],
                       spill_offer=spill_offer,
                       spill_base=spill_base.start if spill_base is not None else 0,
                       spill_base_source=spill_base.source if spill_base is not None else "cold")


def _engine_steps(engine: Any, prompt: Sequence[int], params: SamplingParams, **options: Any
                  ) -> Any:
    """The engine's generation as steps (tandem.engine.Engine.generate_steps); an engine that
    only generates whole (a test's scripted one) runs in one step."""
    steps = getattr(engine, "generate_steps", None)
    if steps is None:
        return engine.generate(prompt, params, **options)
    # a short tail rides in the scheduler's decode batch (tandem.engine.TailStep)
    return (yield from steps(prompt, params, batch_tail=True, **options))


def _sampling(p: GenerationParams) -> SamplingParams:
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                          top_k=p.top_k, seed=p.seed, stop_token_ids=tuple(p.stop_token_ids),
                          presence_penalty=p.presence_penalty,
                          frequency_penalty=p.frequency_penalty,
                          logit_bias=tuple(tuple(pair) for pair in p.logit_bias),
                          logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs)


def _recover(cut_back: Callable[[], None]) -> None:
    """Run a recovery after a failure; a recovery that fails leaves buffers nobody can trust."""
    try:
        cut_back()
    except BaseException as exc:
        raise EngineBroken(f"the recovery after a failed request failed "
                           f"({type(exc).__name__})") from exc


def _device_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError)


def _hidden(budget: ReasoningBudget | None, out: list[int]) -> list[int]:
    """The budget's hidden positions inside the output: a verify block asks the budget about
    positions a stop then left unwritten."""
    if budget is None:
        return []
    return [p for p in budget.hidden_positions if p < len(out)]
