"""The compaction preparer: writes an agent session's compaction summary ahead, while the box is
idle, so that the compaction request is answered without the engine (issue 17, part 3; spec:
"Compaction as a continuation").

When no request has come for ``idle_s``, no hold is on (the box lock is free) and, on CUDA, no
other program is on the GPU, it asks the engine for the conversations in its slots
(`ListConversations`) and takes one of an agent session (``PreparedAnswers.note_session``) of
at least ``min_tokens`` whose summary at its end anchor is not written yet. It builds the
continuation (``continuation(end_ids, system_text, instructions)``: those rows and one user
turn, thinking off; the chat route's builder) with the instructions that client last sent
(else ours), and submits it as idle work: a greedy `Generate` with ``idle`` set, a guest in the
conversation's own slot that goes on from its end anchor and keeps nothing (no anchor, end,
park or store snapshot; the stash puts the rows back). It holds the box lock, taken without
waiting, for as long as it writes.

It yields (the job stops at its next prefill chunk or decode step, and the conversation's rows,
anchors and end anchor are as they were):
- a request arriving: the engine cancels idle work at once when it accepts any other Generate
  (tandem/actors/engine_idle.py);
- a drain: the engine cancels it the same way;
- a process waiting for the box lock in ``flock -w`` (/proc/locks, every ``poll_s``);
- on CUDA, another program on the GPU (nvidia-smi, every ``gpu_poll_s``).

A finished summary goes to ``PreparedAnswers`` under (session, the digest of the rows up to the
end anchor, the system text, the chat template's sha256); it is never written twice for one key.

Invariants (``check_invariants``): at most one preparation at a time; the box lock is held
exactly while one is submitted and not ended.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from tandem.actors.engine_messages import (CancelGeneration, ConversationInPlace,
                                           ConversationsListed, Generate, GenerationAccepted,
                                           GenerationFailed, GenerationFinished,
                                           GenerationParams, GenerationStarted,
                                           ListConversations, PrefillAdmitted, TokenGenerated)
from tandem.actors.messages import Message
from tandem.actors.runtime import Actor, ActorStopped, MailboxFull
from tandem.cache.prepared import PreparedAnswer, PreparedAnswers, PreparedKey, rows_digest

log = structlog.get_logger("tandem.compaction_preparer")

YieldReason = Literal["request", "drain", "lock_waiter", "gpu", "stopped"]
YIELD_REASONS: tuple[YieldReason, ...] = ("request", "drain", "lock_waiter", "gpu", "stopped")
MAX_TOKENS = 2048  # a summary: about 2,000 tokens
ENGINE_ASK_S = 10.0
GPU_CHECK_S = 3.0  # nvidia-smi's answer, past which the GPU counts as busy


class PreparerTick(Message):
    """Sender: the preparer's own poll task, every ``poll_s``. Receiver: the preparer, which
    starts a preparation when everything is idle, or checks the running one's yields."""


class GetPreparerStats(Message):
    """Sender: the server (/v1/cache/stats). Replies `PreparerStats`."""


class PreparerStats(Message):
    stats: dict[str, Any]


@dataclass
class _Preparation:
    request_id: str
    key: PreparedKey
    slot: int
    prompt_len: int
    end_tokens: int
    instructions: str
    tokens: list[int] = field(default_factory=list)
    reason: YieldReason | None = None  # why it was told to stop (None: not told)
    stopped_at: float | None = None  # perf_counter when it was told


async def other_gpu_programs() -> bool:
    """Whether a process other than this one has a compute context on a GPU (nvidia-smi);
    False when nvidia-smi is missing or fails. In a container the tool may list host pids, so
    that this process is not found by its pid: then one entry is taken to be this process
    (which holds a context) and only a second one counts."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    except (FileNotFoundError, PermissionError):
        return False
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), GPU_CHECK_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return True  # a driver that hangs: not a box to write on now
    if proc.returncode != 0:
        return False
    return gpu_others(out.decode(), os.getpid())


def gpu_others(listing: str, pid: int) -> bool:
    """``other_gpu_programs``' verdict on nvidia-smi's pid listing."""
    pids = [line.strip() for line in listing.splitlines() if line.strip()]
    others = [p for p in pids if p != str(pid)]
    return len(others) > (0 if str(pid) in pids else 1)


class CompactionPreparer(Actor):
    def __init__(self, name: str = "compaction_preparer", *, engine: Any,
                 prepared: PreparedAnswers,
                 continuation: Callable[[list[int], str, str], list[int]],
                 template_sha: str, box_lock: Any = None, idle_s: float = 30.0,
                 min_tokens: int = 32768, max_tokens: int = MAX_TOKENS, poll_s: float = 0.5,
                 gpu_poll_s: float = 5.0,
                 gpu_busy: Callable[[], Awaitable[bool]] | None = None,
                 decode: Callable[[list[int]], str] | None = None,
                 mailbox_capacity: int = 4 * MAX_TOKENS, **actor_options: Any) -> None:
        """``engine``: the EngineActor (its ``request_hooks``, ``running``, ``waiting`` and
        ``draining`` are read on the loop); ``box_lock``: tandem.server.boxlock.BoxLock (None:
        no hold is ever on); ``gpu_busy``: whether another program is on the GPU (None: not
        checked, as on a CPU); ``decode``: the tokenizer's, for the summary's text. The
        mailbox holds a whole summary's token events (the engine drops a sink that is full)."""
        super().__init__(name, mailbox_capacity=mailbox_capacity, **actor_options)
        if idle_s < 0 or min_tokens < 0 or max_tokens < 1 or poll_s <= 0 or gpu_poll_s <= 0:
            raise ValueError("the preparer's knobs must be positive")
        self.engine = engine
        self.prepared = prepared
        self.continuation = continuation
        self.template_sha = template_sha
        self.box_lock = box_lock
        self.idle_s = idle_s
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.poll_s = poll_s
        self.gpu_poll_s = gpu_poll_s
        self.gpu_busy = gpu_busy
        self.decode = decode
        self._job: _Preparation | None = None
        self._ids = itertools.count(1)
        self._last_activity_s = 0.0  # set at start: the engine's idle time counts from there
        self._gpu_checked_s: float | None = None
        self._gpu_was_busy = False
        self._tried: set[PreparedKey] = set()  # failed (not yielded) keys: not tried again
        self._ticker: asyncio.Task | None = None
        self.counters: dict[str, Any] = {
            "started": 0, "yielded": 0, "yielded_by": dict.fromkeys(YIELD_REASONS, 0),
            "finished": 0, "failed": 0, "lock_busy": 0, "gpu_busy": 0, "tokens_written": 0}
        self.yield_ms: list[float] = []  # told-to-stop to stopped, the last few
        self.last_finished: dict[str, Any] | None = None  # where the last one ran, and from

    # -- lifecycle -------------------------------------------------------------------------

    async def on_start(self) -> None:
        self._last_activity_s = self.clock.monotonic()
        self.engine.request_hooks.append(self._request_came)
        self._ticker = asyncio.get_running_loop().create_task(self._tick_every())

    async def on_stop(self) -> None:
        if self._request_came in self.engine.request_hooks:
            self.engine.request_hooks.remove(self._request_came)
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        if self._job is not None:
            self._stop_job("stopped")
            self._job = None
        if self.box_lock is not None:
            self.box_lock.release()

    async def _tick_every(self) -> None:
        while True:
            await self.clock.sleep(self.poll_s)
            try:
                self.try_tell(PreparerTick(), sender=self)
            except MailboxFull:
                pass  # ticks are idempotent: the next one will do
            except ActorStopped:
                return

    # -- messages --------------------------------------------------------------------------

    async def handle(self, msg: Message) -> object | None:
        match msg:
            case PreparerTick():
                await self._tick()
            case TokenGenerated(request_id=rid, token_id=token, hidden=hidden):
                if self._job is not None and rid == self._job.request_id and not hidden:
                    self._job.tokens.append(token)
            case GenerationFinished():
                self._ended(msg)
            case GenerationFailed():
                self._ended(msg)
            case GenerationStarted() | PrefillAdmitted():
                pass
            case GetPreparerStats():
                return PreparerStats(self.report())
            case _:
                raise TypeError(f"{self.name} does not handle {type(msg).__name__}")
        return None

    def _request_came(self, msg: Generate) -> None:
        """The engine's hook, on the loop, for each request it accepted (not idle work): it
        has cancelled the preparation already; this notes why and when."""
        self._last_activity_s = self.clock.monotonic()
        job = self._job
        if job is not None and job.reason is None:
            job.reason, job.stopped_at = "request", time.perf_counter()

    # -- the poll --------------------------------------------------------------------------

    async def _tick(self) -> None:
        now = self.clock.monotonic()
        engine = self.engine
        ours = 1 if self._job is not None else 0
        if engine.waiting or engine.running > ours:
            self._last_activity_s = now
        if self._job is not None:
            await self._check_yields(now)
            return
        if engine.draining or engine.waiting or engine.running:
            return
        if now - self._last_activity_s < self.idle_s:
            return
        if await self._gpu_taken(now):
            self.counters["gpu_busy"] += 1
            return
        if self.box_lock is not None and not self.box_lock.try_acquire():
            self.counters["lock_busy"] += 1  # a hold is on: nothing is written
            return
        try:
            started = await self._start()
        except BaseException:
            self._release()
            raise
        if not started:
            self._release()

    async def _gpu_taken(self, now: float) -> bool:
        if self.gpu_busy is None:
            return False
        if self._gpu_checked_s is None or now - self._gpu_checked_s >= self.gpu_poll_s:
            self._gpu_checked_s = now
            self._gpu_was_busy = await self.gpu_busy()
        return self._gpu_was_busy

    async def _check_yields(self, now: float) -> None:
        job = self._job
        if job.reason is not None:
            return
        if self.engine.draining:
            job.reason, job.stopped_at = "drain", time.perf_counter()  # cancelled by it
        elif self.box_lock is not None and self.box_lock.waiters():
            self._stop_job("lock_waiter")
        elif await self._gpu_taken(now):
            self._stop_job("gpu")

    def _stop_job(self, reason: YieldReason) -> None:
        job = self._job
        if job.reason is None:
            job.reason, job.stopped_at = reason, time.perf_counter()
        try:
            self.engine.try_tell(CancelGeneration(job.request_id), sender=self)
        except (MailboxFull, ActorStopped):
            log.warning("preparer_cancel_dropped", request_id=job.request_id)

    async def _start(self) -> bool:
        """Submit the continuation of the best conversation there is; whether one runs."""
        try:
            listed = await self.engine.ask(ListConversations(), ENGINE_ASK_S, sender=self)
        except (ActorStopped, TimeoutError):
            return False
        if not isinstance(listed, ConversationsListed) or listed.busy:
            return False
        pick = self._pick(listed.conversations)
        if pick is None:
            return False
        conversation, key, instructions = pick
        try:
            prompt = list(self.continuation(conversation.end_ids, key.system_text,
                                            instructions))
        except Exception as exc:
            self._tried.add(key)
            self.counters["failed"] += 1
            log.warning("preparer_continuation_failed", error=type(exc).__name__)
            return False
        request_id = f"prepare-{next(self._ids)}"
        job = _Preparation(request_id, key, conversation.slot, len(prompt),
                           len(conversation.end_ids), instructions)
        self._job = job
        try:
            reply = await self.engine.ask(Generate(
                request_id, prompt, GenerationParams(max_tokens=self.max_tokens),
                reply_to=self, session=key.session, namespace=conversation.namespace,
                side=True, idle=True), ENGINE_ASK_S, sender=self)
        except (ActorStopped, TimeoutError):
            self._job = None
            return False
        if not isinstance(reply, GenerationAccepted):
            self._job = None
            return False
        self.counters["started"] += 1
        log.info("preparation_started", request_id=request_id, slot=conversation.slot,
                 end_tokens=job.end_tokens, prompt_tokens=job.prompt_len)
        return True

    def _pick(self, conversations: list[ConversationInPlace]
              ) -> tuple[ConversationInPlace, PreparedKey, str] | None:
        """The longest agent conversation of at least min_tokens with no summary at its end."""
        best = None
        for c in conversations:
            client = self.prepared.agent_client(c.session)
            if client is None or len(c.end_ids) < max(self.min_tokens, 1):
                continue
            system_text, instructions = self.prepared.instructions_for(client)
            key = PreparedKey(c.session, rows_digest(c.end_ids), system_text, self.template_sha)
            if self.prepared.has(key) or key in self._tried:
                continue
            if best is None or len(c.end_ids) > len(best[0].end_ids):
                best = (c, key, instructions)
        return best

    # -- the end of a preparation ------------------------------------------------------------

    def _ended(self, msg: GenerationFinished | GenerationFailed) -> None:
        job = self._job
        if job is None or msg.request_id != job.request_id:
            return
        self._job = None
        self._release()
        cancelled = (isinstance(msg, GenerationFinished) and msg.finish_reason == "cancelled"
                     or isinstance(msg, GenerationFailed) and msg.reason in ("cancelled",
                                                                            "draining"))
        if cancelled:
            reason = job.reason or ("drain" if self.engine.draining else "request")
            self.counters["yielded"] += 1
            self.counters["yielded_by"][reason] += 1
            if job.stopped_at is not None:
                self.yield_ms = (self.yield_ms + [
                    (time.perf_counter() - job.stopped_at) * 1000.0])[-16:]
            log.info("preparation_yielded", request_id=job.request_id, why=reason,
                     tokens=len(job.tokens))
            return
        if isinstance(msg, GenerationFailed):
            self._tried.add(job.key)
            self.counters["failed"] += 1
            log.warning("preparation_failed", request_id=job.request_id, why=msg.reason)
            return
        tokens = list(job.tokens)
        text = self.decode(tokens) if self.decode is not None else ""
        self.prepared.put(PreparedAnswer(job.key, tokens, text, msg.finish_reason,
                                         job.prompt_len, job.end_tokens, len(tokens),
                                         job.instructions))
        self.counters["finished"] += 1
        self.counters["tokens_written"] += len(tokens)
        self.last_finished = {"slot": msg.slot, "source": msg.cache_source, "guest": msg.guest,
                              "reused_tokens": msg.reused_tokens,
                              "reread_tokens": msg.reread_tokens, "tokens": len(tokens)}
        log.info("preparation_finished", request_id=job.request_id, tokens=len(tokens),
                 finish_reason=msg.finish_reason, decode_ms=round(msg.decode_ms, 1),
                 prefill_ms=round(msg.prefill_ms, 1), source=msg.cache_source)

    def _release(self) -> None:
        if self.box_lock is not None:
            self.box_lock.release()

    # -- introspection -----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        job = self._job
        return {
            **{k: (dict(v) if isinstance(v, dict) else v) for k, v in self.counters.items()},
            "served": self.prepared.served,
            "prepared": len(self.prepared),
            "running": None if job is None else {"request_id": job.request_id,
                                                 "slot": job.slot,
                                                 "end_tokens": job.end_tokens,
                                                 "tokens": len(job.tokens)},
            "last_finished": self.last_finished,
            "yield_ms_last": self.yield_ms[-1] if self.yield_ms else None,
            "yield_ms_max": max(self.yield_ms) if self.yield_ms else None,
            "idle_s": self.idle_s, "min_tokens": self.min_tokens,
            "max_tokens": self.max_tokens,
            "box_lock": None if self.box_lock is None else str(self.box_lock.path),
            "gpu_checked": self.gpu_busy is not None,
        }

    def check_invariants(self) -> None:
        self.prepared.check_invariants()
        if self.box_lock is not None:
            assert self.box_lock.held == (self._job is not None), \
                "the box lock is held exactly while a preparation runs"
