"""The aiohttp application: routes, the actor system it runs, and their lifecycle.

`build_app` wires everything and returns the application; the supervisor starts with the app
(aiohttp's cleanup context) and, when the app shuts down, the engine drains (the running
generation finishes, nothing new starts) before every actor stops. Tests serve it with aiohttp's
TestServer; `tandem serve` (tandem/serve.py) with a TCPSite.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import structlog
from aiohttp import web

from tandem.actors import Actor, ActorStopped, Supervisor, Trace
from tandem.actors.compaction_preparer import (CompactionPreparer, GetPreparerStats,
                                               other_gpu_programs)
from tandem.actors.disk_messages import ClearDisk, DrainDisk, GetDiskStats
from tandem.actors.disk_writer import DiskWriterActor
from tandem.actors.engine_actor import EngineActor
from tandem.actors.engine_messages import (ClearCaches, Drain, EngineDrained, ReadSpill,
                                           SpillSlots)
from tandem.actors.governor import GetMemoryReport, GovernorActor
from tandem.actors.spill_messages import ClearSpill, DrainSpill, GetSpillStats
from tandem.actors.spill_writer import SpillWriterActor
from tandem.actors.store import ClearStore, GetStoreStats, StoreActor
from tandem.actors.suffix import SuffixActor
from tandem.actors.tier_messages import GetTierStats
from tandem.actors.tiers import ParkActor, ResidentActor
from tandem.cache.prepared import PreparedAnswers
from tandem.cache.governor import CpuAllocator, CudaAllocator, MemoryGovernor, MemoryLimits
from tandem.cache.memory import (PARK_LEVELS, RESIDENT_LEVELS, Accounts, MemoryAccountant,
                                 Share)
from tandem.cache.endalign import token_splitter
from tandem.cache.endrecords import EndRecords
from tandem.cache.resident import ResidentPrefix, make_holdings
from tandem.cache.response import ResponseCache
from tandem.cache.store import StateStore, StoreCore
from tandem.cache.tower import TowerCache
from tandem.cache.suffix import PersistentSuffixStore
from tandem.config import Config
from tandem.engine import Engine
from tandem.io.spill import make_session_spill
from tandem.server.compaction import continuation_ids
from tandem.server.tokenize_routes import add_tokenize_routes
from tandem.io.tier import make_disk_tier
from tandem.server.disk_routes import (add_disk_routes, journal_disk_events,
                                       journal_disk_events_every)
from tandem.server.boxlock import BoxLock
from tandem.server.errors import ApiError, error_middleware
from tandem.server.guard import admin_route, guard_middleware
from tandem.server.journal import EventRow, Journal
from tandem.server.keys import (
    CACHE_STATS,
    CONFIG,
    DISK_WRITER,
    ENGINE,
    JOURNAL,
    MEMORY,
    MODEL_NAME,
    PREPARED,
    SPILL_WRITER,
    SUFFIX,
    SUPERVISOR,
)
from tandem.server.memory_routes import add_memory, add_memory_routes
from tandem.server.metrics import CONTENT_TYPE, Metrics
from tandem.server.openai_routes import add_openai_routes, template_report, warm_chat_prompt
from tandem.server.peek_routes import add_peek_routes
from tandem.server.sessions import load_secret
from tandem.server.state import STATE, SamplingDefaults, ServerState

log = structlog.get_logger("tandem.server")

GiB = 1 << 30
MiB = 1 << 20
DRAIN_TIMEOUT_S = 600.0  # the longest a shutdown waits for the running generation
STATS_ASK_TIMEOUT_S = 5.0  # the longest a stats route waits for an actor's answer


def build_app(config: Config, loaded, *, engine: Actor | None = None,
              engine_executor: ThreadPoolExecutor | None = None) -> web.Application:
    """The server for ``loaded`` (a tandem.models.LoadedModel: its tokenizer is required).

    ``engine``: an actor speaking the engine's messages (tests pass one around a scripted
    engine); None builds the EngineActor over ``loaded.model`` with the config's engine knobs,
    running on ``engine_executor`` when given (tandem.torch_thread: the thread the model was
    loaded on), else on a thread of its own.
    """
    if loaded.tokenizer is None:
        raise ValueError(f"model {loaded.name!r} has no tokenizer; the server needs one")
    governor = governor_actor = None
    suffix = store = tiers = disk_writer = spill_writer = None
    spec = config.speculation
    if engine is None:
        e = config.engine
        if spec.speculation != "off" and spec.suffix_store:
            suffix = SuffixActor("suffix", open_store=partial(
                PersistentSuffixStore, config.suffix_store_path(),
                tokenizer_sha256=loaded.tokenizer.sha256, cap_mb=spec.suffix_store_mb,
                scope=spec.suffix_store_scope, readonly=spec.suffix_store_readonly))
        governor = make_governor(config, loaded.model)
        governor_actor = GovernorActor("governor", core=governor)
        caches = config.cache.caches
        memory = make_memory(config, loaded.model) if caches else None
        # One accountant an owner: the resident's levels, the park's, the store's; each tells
        # the governor what it holds.
        if caches and config.cache.store:
            store_memory = memory.part(("store",))
            store_memory.gate = governor.admit
            store = StoreActor("store", core=StoreCore(
                store_memory, entry_nbytes=int(config.cache.store_entry_gb * GiB)),
                governor=governor_actor)
        if caches:
            c = config.cache
            resident_memory, park_memory = memory.part(RESIDENT_LEVELS), memory.part(PARK_LEVELS)
            memory = Accounts(resident_memory, park_memory)  # the composer's view of both
            # Several slots share the resident budget; each counts its own part of it.
            shares = ([Share(resident_memory) for _ in range(e.parallel)] if e.parallel > 1
                      else [resident_memory])
            slots, parked = [], None
            for share in shares:
                held, park = make_holdings(share, e.prefix_chunk,
                                           guest_max=c.resident_guest_max,
                                           end_anchor=c.end_anchor,
                                           prompt_end_anchor=c.prompt_end_anchor,
                                           park_memory=park_memory)
                parked = parked or park  # one park for every slot
                if c.end_align:
                    # The end records are the resident's, beside the ends they describe.
                    held.records = EndRecords(None, loaded.tokenizer.token_bytes,
                                              split=token_splitter(
                                                  loaded.tokenizer.encode_text,
                                                  loaded.tokenizer.special_ids.values()),
                                              allow_reasoning=c.end_align_reasoning,
                                              store_backed=store is not None)
                slots.append(held)
            tiers = (ResidentActor("resident", slots=slots, governor=governor_actor),
                     ParkActor("park", holdings=parked, governor=governor_actor))
        engine = EngineActor("engine", make_engine=partial(
            Engine, loaded.model, window=e.window, prefix_chunk=e.prefix_chunk,
            num_threads=e.num_threads),
            make_resident=partial(ResidentPrefix.lent_to, memory=memory) if caches else None,
            tiers=tiers, parallel=e.parallel if caches else 1, governor_actor=governor_actor,
            make_store=partial(make_store, config, store) if store is not None else None,
            governor=governor,
            tokenizer=loaded.tokenizer, end_align=config.cache.end_align,
            end_align_reasoning=config.cache.end_align_reasoning,
            queue_limit=config.server.queue_limit, speculation=spec.speculation,
            draft_max=spec.draft_max, suffix=suffix, executor=engine_executor,
            make_disk_tier=(partial(make_disk_tier, config,
                                    model_dir=getattr(loaded, "path", None))
                            if caches and config.disk.disk_cache != "off" else None),
            make_spill=(partial(_make_spill, config) if caches and spill_enabled(config) else None),
            spill_min_tokens=config.spill.session_spill_min_tokens,
            spill_park_min_tokens=config.spill.session_spill_park_min_tokens,
            tower_cache=(TowerCache(int(config.images.image_cache_mb * (1 << 20)))
                         if getattr(loaded.model, "images", None) is not None else None))
        if caches and config.disk.disk_cache != "off":
            spill_on = spill_enabled(config)
            # The tier is built on the engine thread from the engine's manifest; the writer
            # takes it once the engine has started (it is added after it).
            disk_writer = DiskWriterActor(
                "disk_writer", tier=lambda: engine.disk_tier, engine=engine,
                # the spill's turns on the drive: the writer gives way to a save
                spill_turns=(lambda: getattr(getattr(engine, "spill", None), "turns", None))
                if spill_on else None)
            engine.disk_writer = disk_writer
            if spill_on:
                # The spill too is the engine thread's to build (beside the tier, with its
                # identity); the tier's write guard counts its bytes.
                spill_writer = SpillWriterActor(
                    "spill_writer", spill=lambda: getattr(engine, "spill", None),
                    guard=lambda: getattr(engine.disk_tier, "guard", None),
                    engine=engine)  # its saves of device rows hold the capture lock
                engine.spill_writer = spill_writer
    supervisor = Supervisor(trace=Trace(summarize=False))
    if suffix is not None:
        supervisor.add(suffix)  # before the engine: its drafter reads the suffix store
    if store is not None:
        supervisor.add(store)  # before the engine, which asks it from its first request
    for tier in tiers or ():
        supervisor.add(tier)  # before the engine, which asks them from its first request
    supervisor.add(engine)
    if disk_writer is not None:
        supervisor.add(disk_writer)  # after the engine, which builds its tier
    if spill_writer is not None:
        supervisor.add(spill_writer)  # after the engine, which builds the spill
    if governor is not None:
        supervisor.add(governor_actor)
    preparer = _make_preparer(config, loaded, engine)
    if preparer is not None:
        supervisor.add(preparer)  # after the engine, whose requests it yields to
    journal = Journal(config.journal_path())
    metrics = Metrics()
    path = getattr(loaded, "path", None)
    state = ServerState(
        config=config, tokenizer=loaded.tokenizer, model_name=loaded.name, engine=engine,
        journal=journal, metrics=metrics, supervisor=supervisor,
        defaults=SamplingDefaults.from_model_dir(path),
        chat_template=getattr(loaded.tokenizer, "chat_template", None),
        session_secret=load_secret(config.home_path()),
        images=getattr(loaded.model, "images", None),
        device=str(getattr(loaded.model, "device", "cpu")),
        dtype=str(getattr(loaded.model, "dtype", "")).removeprefix("torch."))
    metrics.gauge("tandem_engine_rows_in_place", "Rows (tokens) in the engine's buffers.",
                  lambda: engine.snapshot().get("rows_in_place") or 0)
    metrics.gauge("tandem_requests_waiting", "Requests waiting for the engine.",
                  lambda: engine.snapshot().get("waiting") or 0)
    metrics.gauge("tandem_requests_running", "Requests the engine is running (one a slot).",
                  lambda: len(engine.snapshot().get("requests") or ()))
    metrics.gauge("tandem_decode_steps", "Batched decode forwards run since the start.",
                  lambda: sum((engine.snapshot().get("decode_batches") or {}).values()))
    metrics.gauge("tandem_decode_step_rows",
                  "Sequences those forwards decoded (over tandem_decode_steps: the mean batch).",
                  lambda: sum(size * n for size, n in
                              (engine.snapshot().get("decode_batches") or {}).items()))
    counts = getattr(loaded.model, "screen_counts", None)
    if counts is not None:  # greedy decode through the head's screen (tandem/kernels/screen.py)
        metrics.gauge("tandem_head_screen_tokens",
                      "Greedy tokens (decode steps' and prompts' first) found through the "
                      "head's int8 screen since the start.",
                      lambda: counts["screened"])
        metrics.gauge("tandem_head_screen_full_rows",
                      "Greedy-only rows (decode steps, prompts' last positions) that read the "
                      "full head instead (more than 32 in a step, no screen, or an input the "
                      "screen does not take).",
                      lambda: counts["full"])
    metrics.gauge("tandem_slots_busy", "Engine slots a request is running in.",
                  lambda: sum(1 for s in engine.snapshot().get("slots") or () if s["busy"]))
    metrics.gauge("tandem_slots_idle", "Engine slots no request is running in.",
                  lambda: sum(1 for s in engine.snapshot().get("slots") or () if not s["busy"]))
    metrics.gauge("tandem_slots_holding", "Engine slots holding a conversation's rows.",
                  lambda: sum(1 for s in engine.snapshot().get("slots") or ()
                              if s["rows_in_place"]))
    if config.cache.response_cache:
        state.response_cache = ResponseCache(int(config.cache.response_cache_mb * MiB))
    if governor_actor is not None:
        add_memory(app_metrics=metrics, governor=governor_actor)

    # error_middleware outermost: a guard's refusal is answered in the OpenAI format too.
    app = web.Application(client_max_size=config.server.max_body_bytes,
                          middlewares=[error_middleware, guard_middleware(config.server)])
    app[STATE] = state
    app[SUPERVISOR] = supervisor
    app[ENGINE] = engine
    app[JOURNAL] = journal
    app[CONFIG] = config
    app[MODEL_NAME] = loaded.name
    app[SUFFIX] = suffix
    app[CACHE_STATS] = partial(_cache_stats, engine, state, store, suffix, tuple(tiers or ()),
                               disk_writer, spill_writer, preparer)
    app[PREPARED] = preparer.prepared if preparer is not None else None
    app[DISK_WRITER] = disk_writer
    app[SPILL_WRITER] = spill_writer
    if disk_writer is not None:
        _disk_metrics(metrics, engine)
    if spill_writer is not None:
        _spill_metrics(metrics, spill_writer)
    if governor_actor is not None:
        app[MEMORY] = partial(_memory_report, governor_actor)
    app.cleanup_ctx.append(_system)

    add_openai_routes(app)
    add_memory_routes(app)
    add_disk_routes(app)
    add_tokenize_routes(app)
    add_peek_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/v1/cache/stats", cache_stats)
    app.router.add_post("/v1/cache/clear", cache_clear)
    from tandem.server.console import add_console_routes

    add_console_routes(app)
    return app


def make_memory(config: Config, model) -> MemoryAccountant:
    """The accountant every cache reserves its copies with, one budget a level."""
    c, e = config.cache, config.engine
    state_nbytes = model.cost(e.window, e.prefix_chunk).state_nbytes
    slots = e.parallel if c.caches else 1
    return MemoryAccountant({
        "anchors": int(c.resident_gb * GiB),
        # Each slot's end anchor buffers, and a parked end on its way back in.
        "end": (slots + 1) * state_nbytes if c.end_anchor else 0,
        # Each slot's prompt-end anchor: one state and the last position's logits (fp32).
        "prompt_end": slots * (state_nbytes + 4 * model.vocab_size) if c.prompt_end_anchor
        else 0,
        "stash": int(c.resident_stash_gb * GiB),
        "pin": int(c.resident_pin_gb * GiB),
        "park": int(c.resident_park_gb * GiB),
        "store": int(c.cache_gb * GiB) if c.store else 0,
    })


def make_store(config: Config, store: StoreActor, engine: Engine) -> StateStore:
    """The engine thread's side of the state store, asking the store actor (on the engine
    thread, once the actor has started)."""
    c = config.cache
    return StateStore(engine, store.port(), entry_nbytes=int(c.store_entry_gb * GiB),
                      boundaries=c.store_boundaries, session_trim=c.session_trim)


def make_governor(config: Config, model) -> MemoryGovernor:
    """The memory governor over the device the model runs on (its core; the engine actor
    calls it on the engine thread, the governor actor edits its limits)."""
    import torch

    device = torch.device(getattr(model, "device", "cpu"))  # cuda:N: that device's memory
    allocator = CudaAllocator(device.index or 0) if device.type == "cuda" else CpuAllocator()
    m = config.memory
    limits = MemoryLimits.resolve(m.mem_ceiling_gib, m.mem_peak_gib, m.reserve_slack_gib,
                                  allocator.total_nbytes())
    return MemoryGovernor(limits, allocator)


async def _ask(actor: Actor, msg, what: str):
    """An actor's reply for a stats route; one that stopped or does not answer is a 503."""
    try:
        return await actor.ask(msg, STATS_ASK_TIMEOUT_S, sender="server")
    except ActorStopped:
        raise ApiError(503, f"the {what} has stopped", code=f"{actor.name}_stopped") from None
    except TimeoutError:
        raise ApiError(503, f"the {what} did not answer in time", code=f"{actor.name}_busy",
                       retry_after_s=STATS_ASK_TIMEOUT_S) from None


async def _cache_stats(engine: Actor, state: ServerState, store: StoreActor | None,
                       suffix: SuffixActor | None, tiers: tuple[Actor, ...] = (),
                       disk_writer: Actor | None = None,
                       spill_writer: Actor | None = None,
                       preparer: Actor | None = None) -> dict:
    # The resident's counters as the engine actor published them on the loop after the last
    # generation (never a tier's live state, which is the engine thread's).
    doc = getattr(engine, "cache_stats", {"tiers": {}})
    extra = {}
    if store is not None:
        # Asked of the store actor, in its mailbox's order: current, not as of the last request.
        extra["store"] = (await _ask(store, GetStoreStats(), "state store")).stats
    if state.response_cache is not None:
        extra["response"] = state.response_cache.statistics()
    if getattr(engine, "image_stats", None) is not None:
        # The tower's cache, as the engine thread last published it.
        extra["images"] = engine.image_stats
    if suffix is not None:
        extra["suffix"] = suffix.report()
    if disk_writer is not None:
        extra["disk"] = (await _ask(disk_writer, GetDiskStats(), "disk tier")).stats
    if spill_writer is not None and spill_writer.on:
        extra["spill"] = (await _ask(spill_writer, GetSpillStats(), "session spill")).stats
    if extra:
        doc = {**doc, "tiers": {**doc.get("tiers", {}), **extra}}
    doc = {**doc, "compaction": state.compaction.statistics()}
    if preparer is not None:
        doc = {**doc, "compaction_preparer": (await _ask(preparer, GetPreparerStats(),
                                                         "compaction preparer")).stats}
    if tiers:
        # Each tier actor's own account of what it holds, asked of it (as of the last
        # generation while its holdings are lent: ``lent_to`` names the request).
        owners = {}
        for tier in tiers:
            report = await _ask(tier, GetTierStats(), tier.name)
            owners[tier.name] = {**report.stats, "lent_to": report.lent_to}
        doc = {**doc, "owners": owners}
    return doc


async def _memory_report(governor: GovernorActor) -> dict:
    return (await _ask(governor, GetMemoryReport(), "memory governor")).report


async def _system(app: web.Application) -> AsyncIterator[None]:
    """Start the actors with the app; on shutdown drain the engine, then stop them."""
    state = app[STATE]
    await state.supervisor.start()
    if getattr(state.engine, "spill", None) is not None:
        # The conversations the last process wrote at its stop are back in their slots
        # before the first request (the engine's mailbox holds every request behind it).
        try:
            await state.engine.ask(ReadSpill(), DRAIN_TIMEOUT_S, sender="server")
        except (ActorStopped, TimeoutError) as exc:
            log.warning("spill_read_unfinished", error=type(exc).__name__)
    try:
        await asyncio.to_thread(warm_chat_prompt, state)
    except Exception as exc:  # a template that cannot render: the requests will say why
        log.warning("chat_warm_up_failed", error=type(exc).__name__)
    writer = app[DISK_WRITER]
    if writer is not None:
        # The tier's events reach the journal from the loop (they happen on other threads).
        state.supervisor.spawn(journal_disk_events_every(writer.tier, state.journal),
                               name="disk_journal")
    try:
        yield
    finally:
        drained = await drain(state.engine, DRAIN_TIMEOUT_S)
        spill_writer = app[SPILL_WRITER]
        if spill_writer is not None:
            if drained:
                # A planned stop: every slot's conversation to the NVMe, for the next start.
                try:
                    await state.engine.ask(SpillSlots(), DRAIN_TIMEOUT_S, sender="server")
                except (ActorStopped, TimeoutError) as exc:
                    log.warning("spill_slots_unsaved", error=type(exc).__name__)
            # The drain's saves (the live conversations) are on the disk before the actors
            # stop; the disk tier's last files wait for them anyway.
            try:
                await spill_writer.ask(DrainSpill(), DRAIN_TIMEOUT_S, sender="server")
            except (ActorStopped, TimeoutError) as exc:
                log.warning("spill_drain_unfinished", error=type(exc).__name__)
        if writer is not None:
            # What the last prefills admitted is written (and the counts saved) before the
            # actors stop; a writer that cannot finish in time loses those entries only.
            try:
                await writer.ask(DrainDisk(), DRAIN_TIMEOUT_S, sender="server")
            except (ActorStopped, TimeoutError) as exc:
                log.warning("disk_drain_unfinished", error=type(exc).__name__)
            journal_disk_events(writer.tier, state.journal)
        await state.supervisor.stop()
        state.journal.close()


def _make_preparer(config: Config, loaded: Any, engine: Actor) -> CompactionPreparer | None:
    """The compaction preparer, with the caches and compaction_prepare on (over the real
    engine actor only: it runs idle work as guests in the engine's slots)."""
    p = config.compaction
    if not (config.cache.caches and p.compaction_prepare == "on"
            and isinstance(engine, EngineActor)):
        return None
    import torch

    from tandem.models.chat import template_info

    tokenizer = loaded.tokenizer
    lock_path = config.box_lock_path()
    return CompactionPreparer(
        engine=engine, prepared=PreparedAnswers(),
        continuation=partial(continuation_ids, tokenizer,
                             getattr(tokenizer, "chat_template", None)),
        template_sha=template_info(getattr(tokenizer, "chat_template", None)).sha256,
        box_lock=BoxLock(lock_path) if lock_path is not None else None,
        idle_s=p.compaction_idle_s, min_tokens=p.compaction_min_tokens,
        gpu_busy=other_gpu_programs if torch.cuda.is_available() else None,
        decode=tokenizer.decode)


def spill_enabled(config: Any) -> bool:
    """The session spill runs beside the disk tier (its folder, identity and write guard)."""
    return config.disk.disk_cache != "off" and config.spill.session_spill != "off"


def _make_spill(config: Any, engine: Any, tier: Any) -> Any:
    """On the engine thread, after the disk tier: the spill with the tier's identity."""
    return make_session_spill(config, tier.identity, engine.prefix_chunk, guard=tier.guard)


async def drain(engine: Actor, timeout_s: float) -> bool:
    """Drain the engine: the running generation finishes, the waiting ones and every later one
    are refused. True once nothing runs; False after ``timeout_s`` or if the engine stopped."""
    drained: asyncio.Queue = asyncio.Queue()
    try:
        await engine.ask(Drain(reply_to=drained), timeout_s, sender="server")
        async with asyncio.timeout(timeout_s):
            while not isinstance(await drained.get(), EngineDrained):
                pass
    except (ActorStopped, TimeoutError):
        return False
    return True


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.supervisor.running:
        return web.json_response({"status": "stopped"}, status=503)
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    body = {"status": "ok", "model": state.model_name, "device": state.device,
            "dtype": state.dtype, **template_report(state)}
    suffix = request.app[SUFFIX]
    if suffix is not None:
        body["suffix_store"] = suffix.report()  # rebuild_ms_total and rebuild_ms_last with it
    tier = getattr(request.app[ENGINE], "disk_tier", None)
    guard = getattr(tier, "guard", None)
    if guard is not None:  # the day's write budget (its own lock; nothing asked of an actor)
        body.setdefault("cache", {})["disk_writes"] = guard.report()
    return web.json_response(body)


async def metrics_route(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def cache_stats(request: web.Request) -> web.Response:
    return web.json_response(await request.app[CACHE_STATS]())

CLEARABLE = ("ram", "disk", "spill", "all")  # POST /v1/cache/clear?tier=... (none: ram)
RAM = ("ram", "all")  # the clears that empty the caches in RAM
# What ``all`` leaves: the suffix store is the drafter's token history, no prompt cache.
KEPT_BY_ALL = ("suffix",)


@admin_route
async def cache_clear(request: web.Request) -> web.Response:
    """Empty cache tiers (admin). No ``tier`` (or ``?tier=ram``): the caches in RAM (every
    slot's resident tiers and rows, the park, the state store, the response cache and the
    summaries written ahead), while no request runs or waits; the NVMe keeps its files.
    ``?tier=disk``: the disk tier's files and its admission
    counts, after the writes queued before it (409 when the tier is off). ``?tier=spill``: the
    session spill's entries, after the save or restore under way (409 when the spill is off).
    ``?tier=all``: the disk tier and the spill (when on), the state store (every entry not lent to a restore under way) and the
    response cache; the answer names the tiers ``cleared``, those ``kept`` (KEPT_BY_ALL, where
    they run) and the counts ``dropped`` of each, and each clear is journaled."""
    tier = request.query.get("tier", "") or "ram"
    if tier not in CLEARABLE:
        raise ApiError(400, f"tier must be one of {', '.join(CLEARABLE)}; got {tier[:32]!r}",
                       param="tier", code="invalid_tier")
    app = request.app
    state = app[STATE]
    writer = app[DISK_WRITER]
    spill_writer = app[SPILL_WRITER]
    if spill_writer is not None and not spill_writer.on:
        spill_writer = None  # the engine built no spill: off, as when not configured
    if tier == "disk" and writer is None:
        raise ApiError(409, "the disk tier is off on this server", code="tier_off")
    if tier == "spill" and spill_writer is None:
        raise ApiError(409, "the session spill is off on this server", code="tier_off")
    dropped: dict[str, dict[str, int]] = {}
    if tier in RAM:
        engine = state.engine
        reply = await _ask(engine, ClearCaches(), "engine")
        if reply.busy:
            raise ApiError(409, "requests are running; the caches in RAM are cleared only "
                           "while none runs", code="engine_busy",
                           retry_after_s=reply.retry_after_s)
        if reply.dropped:
            dropped["resident"] = dict(reply.dropped)
    if writer is not None and tier in ("disk", "all"):
        reply = await _ask(writer, ClearDisk(), "disk tier")
        journal_disk_events(writer.tier, state.journal)  # the events before the clear first
        dropped["disk"] = {k: int(v) for k, v in reply.dropped.items()}
    if spill_writer is not None and tier in ("spill", "all"):
        reply = await _ask(spill_writer, ClearSpill(), "session spill")
        dropped["spill"] = {k: int(v) for k, v in reply.dropped.items()}
    if tier in RAM:
        store = app[SUPERVISOR].actors.get("store")
        if store is not None:
            dropped["store"] = dict((await _ask(store, ClearStore(), "state store")).dropped)
        cache = state.response_cache
        if cache is not None:
            entries, nbytes = cache.statistics()["entries"], cache.nbytes
            cache.clear()
            dropped["response"] = {"entries": entries, "nbytes": nbytes}
        prepared = app.get(PREPARED)
        if prepared is not None:
            # The summaries written ahead: each is an answer kept in memory.
            dropped["prepared"] = {"entries": len(prepared)}
            prepared.clear()
    tasks = {"disk": "disk_cache", "spill": "session_spill", "store": "store",
             "response": "response_cache", "resident": "resident",
             "prepared": "compaction_prepared"}
    for name, counts in dropped.items():
        state.journal.append(EventRow(kind="memory", task=tasks[name], event="clear",
                                      t=time.time(), detail=counts))
        log.info("cache_cleared", tier=name, **counts)
    if tier in ("disk", "spill"):
        return web.json_response({"tier": tier, "cleared": [tier], "dropped": dropped[tier]})
    running = app[SUPERVISOR].actors  # the resident, park and suffix actors where they run
    kept = [name for name in KEPT_BY_ALL if name in running]
    if tier == "ram":  # the NVMe's tiers keep their files
        kept += [name for name, on in (("disk", writer), ("spill", spill_writer)) if on]
    return web.json_response({"tier": tier, "cleared": list(dropped), "kept": kept,
                              "dropped": dropped})


def _spill_metrics(metrics: Metrics, writer: SpillWriterActor) -> None:
    """The session spill's gauges, read from its writer's report when scraped (the writer's
    counters and the spill's index under its own lock; nothing asked of the actor)."""
    def read(key: str):
        def value() -> float:
            return float(writer.report().get(key, 0) or 0)
        return value

    for key, name, doc in (
            ("entries", "entries", "Conversations the session spill holds."),
            ("nbytes", "nbytes", "Bytes the session spill's files hold."),
            ("saves", "saves_total", "Conversations the spill writer saved."),
            ("restores", "restores_total", "Conversations read back from the session spill."),
            ("skips_total", "skips_total",
             "Saves the spill writer did not write (the write guard, the budget, a failure)."),
            ("failures", "failures_total", "Spill saves that failed (nothing partial kept).")):
        metrics.gauge(f"tandem_session_spill_{name}", doc, read(key))


def _disk_metrics(metrics: Metrics, engine: EngineActor) -> None:
    """The disk tier's gauges, read from its statistics when scraped (its own lock)."""
    def read(key: str):
        def value() -> float:
            tier = engine.disk_tier
            return float((tier.statistics() if tier is not None else {}).get(key, 0) or 0)
        return value

    for key, doc in (("nbytes", "Bytes the disk tier's files hold."),
                     ("chunks", "Chunk files in the disk tier."),
                     ("anchors", "Anchor files in the disk tier."),
                     ("hits", "Prompts the disk tier served."),
                     ("misses", "Prompts the disk tier was asked for and had nothing."),
                     ("writes", "Files the disk tier wrote."),
                     ("write_failures", "Disk tier writes that failed (nothing partial kept)."),
                     ("failed_restores", "Disk tier reads that failed (the file deleted)."),
                     ("evictions", "Files the disk tier evicted for its budget."),
                     ("free_nbytes", "Free bytes on the disk tier's file system.")):
        metrics.gauge(f"tandem_disk_cache_{key}", doc, read(key))
