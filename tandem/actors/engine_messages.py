"""Messages the engine actor receives, and the events it sends back.

A requester (the server, or a tier) asks the engine with `Generate` and names a *sink* in
`reply_to`: an `asyncio.Queue` (anything with a non-blocking ``put_nowait``) or an actor (told with
``try_tell``). The engine's events for that request go there, in order: `GenerationStarted`, one
`TokenGenerated` a token, then exactly one of `GenerationFinished` / `GenerationFailed`.

Sinks are annotated `Any`: they are live objects that never leave the process, so an encoded
message (trace, round-trip test) carries them as null.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tandem.actors.messages import Message
from tandem.cache.vocabulary import FinishReason, Source
from tandem.logprobs import TokenLogprob


class GenerationParams(msgspec.Struct, frozen=True):
    """Sampling of one generation; the engine's SamplingParams as a plain encodable struct."""

    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Past this many reasoning tokens the engine closes the reasoning with a hidden phrase
    # and </think>, and the answer goes on (0: no budget).
    max_reasoning_tokens: int = 0
    # An admin's forced continuation (replay's forced mode): the engine writes these ids
    # first, then samples on.
    forced_ids: tuple[int, ...] = ()
    # OpenAI's logits processors, before sampling (greedy too); zero and empty: off. The
    # penalties count generated tokens only; logit_bias holds (token id, bias) pairs sorted by
    # id with no zero bias, so equal requests carry equal params (the response cache's key).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Logprobs of the raw model (tandem.logprobs): None off, else the top count of each
    # generated token's entry; prompt_logprobs the same for the prompt (echo), which runs the
    # prefill cold. Part of the response cache's key, as every field here.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured outputs and forced tool calls: a grammar (llguidance's serialised form,
    # tandem.grammar) the output is held to, checked when the request was read; None: free.
    grammar: str | None = None


# -- generation ------------------------------------------------------------------------------


class PromptMarks(msgspec.Struct, frozen=True):
    """Where a chat prompt's parts start, for what the disk tier writes of its head
    (tandem.io.admission): ``first_of_session``: its conversation holds no answer yet;
    ``last_user_start``: the token its last user message starts at; ``head_stop``: the token
    the conversation's first answer starts at (None: it holds none)."""

    first_of_session: bool = False
    last_user_start: int | None = None
    head_stop: int | None = None


class Generate(Message):
    """Sender: the server (asks). Receiver: the engine, which queues the request behind the
    capture lock's FIFO and answers `GenerationAccepted` or `GenerationRejected` at once.
    Ownership: `prompt_ids` are the engine's from now on; the events go to `reply_to`."""

    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    reply_to: Any = None  # the sink of this request's events
    session: str | None = None  # the hashed session key, for the console
    # The cache namespace (tandem.cache.namespace: the digest of the request's cache_salt, ""
    # for none): only copies of the same namespace serve it, and it never writes the suffix
    # store unless it is the shared one.
    namespace: str = ""
    marks: PromptMarks | None = None  # a chat prompt's parts (None: a text prompt)
    # The prompt's images in order (tandem.models.image_keys.ImageInput: key, digest, grid,
    # patches); ``prompt_ids`` are then its key ids, each image's rows its key.
    images: list[Any] = []
    # A chat client's side request (tandem/server/side.py: a title, tags, follow-ups): it
    # runs keeping nothing, never in the place of a conversation (tandem/cache/slots.py).
    side: bool = False
    # Idle work (tandem/actors/compaction_preparer.py): a side request placed in its
    # session's slot, over a stash; any other Generate or a drain cancels it at once, and its
    # cancel stops its prefill at the next chunk (tandem/actors/engine_idle.py).
    idle: bool = False
    # Choices (OpenAI's n): the prompt is prefilled once in the slot, and choices 1..n-1 are
    # forked from its state at the prompt's end and decoded beside choice 0 (tandem/choices.py),
    # choice i with seed + i; choice 0's rows stay in the slot as the conversation's end.
    n: int = 1


class ClearCaches(Message):
    """Sender: the server (POST /v1/cache/clear?tier=all). Receiver: the engine, which, when
    no generation runs or waits, has the resident and the park drop every copy and puts every
    slot's rows back to empty; answers `CachesCleared` (``busy`` otherwise: nothing dropped)."""


class CachesCleared(Message):
    busy: bool = False
    retry_after_s: float = 0.0
    dropped: dict[str, int] = {}  # resident_nbytes, park_nbytes, rows (the slots' rows in place)


class SpillSlots(Message):
    """Sender: the server at a planned stop, once the engine drained. Receiver: the engine,
    which writes every slot's conversation to the session spill (its spill writer) while
    nothing runs, and answers `SlotsSpilled` (``busy`` when something still runs)."""

    reason: Literal["drain"] = "drain"


class SlotsSpilled(Message):
    busy: bool = False
    saved: int = 0  # entries written
    skipped: dict[str, int] = {}  # by why (guard, budget, failed, off)


class ReadSpill(Message):
    """Sender: the server at start, before it takes a request. Receiver: the engine, which
    reads the most recent entries of the session spill back into its empty slots (the newest
    into slot 0), so that their next turns resume where the last process stopped; answers
    `SpillRead`."""


class SpillRead(Message):
    read: int = 0  # entries read back into slots
    failed: int = 0  # entries that failed their checks (deleted)


class ListConversations(Message):
    """Sender: the compaction preparer, while the engine is idle. Receiver: the engine, which,
    when no generation runs or waits, answers `ConversationsListed`: each slot's conversation
    that has an end anchor (``busy`` otherwise: none listed)."""


class ConversationInPlace(msgspec.Struct, frozen=True):
    """One slot's conversation: its session key (hashed) and namespace, and the tokens of its
    rows up to the end anchor of its last generation."""

    slot: int
    session: str | None
    namespace: str
    end_ids: list[int]


class ConversationsListed(Message):
    busy: bool = False
    conversations: list[ConversationInPlace] = []


class GenerationAccepted(Message):
    """Reply to `Generate`: queued (0 ahead: it runs now, or once an outside holder of the
    capture lock lets go); `waiting_ahead`: generations that wait before it."""

    request_id: str
    waiting_ahead: int


class GenerationRejected(Message):
    """Reply to `Generate`: not queued. ``draining``: the engine is stopping; ``queue_full``:
    more than the queue limit already wait; ``duplicate``: the request id is already known."""

    request_id: str
    reason: Literal["draining", "queue_full", "duplicate"]
    retry_after_s: float


class CancelGeneration(Message):
    """Sender: the server (a client went away, a stop string matched). Receiver: the engine,
    which drops the request if it waits, or stops it at its next token if it runs. A request
    that has already finished is ignored. ``choice``: only that choice of an n > 1 request
    stops (a stop string matched in it); the others go on."""

    request_id: str
    choice: int | None = None


class GenerationStarted(Message):
    """Sender: the engine, to the request's sink, when its prefill begins."""

    request_id: str
    prompt_tokens: int
    queued_ms: float


class PrefillAdmitted(Message):
    """Sender: the engine thread, to the request's sink, once the memory governor found room for
    the prefill's workspace and the caches restored its rows: nothing can refuse it any more, so
    a streaming server may send its headers (a refusal before it is a 503 with Retry-After)."""

    request_id: str


class TokenGenerated(Message):
    """Sender: the engine, to the request's sink, once per sampled token, in order."""

    request_id: str
    token_id: int
    index: int  # 0 for the first generated token
    hidden: bool = False  # in the rows, never shown to the client nor counted in usage
    logprobs: TokenLogprob | None = None  # when the params ask for them
    choice: int = 0  # which of the request's n choices it belongs to (``index`` counts in it)


class PromptLogprobs(Message):
    """Sender: the engine thread, to the request's sink, after the prefill of a request whose
    params ask for prompt logprobs, before its first `TokenGenerated`. ``entries[i]`` scores
    prompt token i + 1 (the first token has none)."""

    request_id: str
    entries: list[TokenLogprob]


class ChoiceEnded(msgspec.Struct, frozen=True):
    """How one choice of an n > 1 request ended (GenerationFinished.choices)."""

    finish_reason: FinishReason
    completion_tokens: int
    stop_token: int | None = None
    hidden_tokens: int = 0


class GenerationFinished(Message):
    """Sender: the engine, to the request's sink: the last event of a generation that ran.
    ``finish_reason``: "stop" (a stop token), "length" (max_tokens or the window) or
    "cancelled"; ``reused_tokens``: the line the prefill resumed at (cached), in the served
    prompt's positions; ``cache_source``: what served the rows below it (cold, resident, end,
    prompt_end, pin, park, store); ``guest``: the request ran as a guest (its rows were
    stashed and put back)."""

    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    prefill_ms: float
    decode_ms: float
    decode_tok_s: float
    stop_token: int | None = None
    cache_source: Source = "cold"
    guest: bool = False
    reread_tokens: int = 0  # tokens the prefill forwarded
    aligned: str | None = None  # how the client's copy met the end anchor (exact, glue, reasoning)
    end_replayed: int = 0  # hidden and reasoning rows served that the client's copy lacks
    hidden_tokens: int = 0  # generated tokens the client never sees
    tower_runs: int = 0  # images the vision tower encoded for this prompt
    tower_hits: int = 0  # images the tower's cache answered
    drafted: int = 0  # tokens the lookup drafter proposed
    accepted: int = 0  # of them, those the verify blocks accepted
    slot: int = 0  # the slot it ran in (tandem/cache/slots.py)
    # n > 1: every choice's end, choice 0's first (the fields above are choice 0's, but for
    # drafted and accepted, summed over the choices); empty for one choice.
    choices: list[ChoiceEnded] = []


class GenerationFailed(Message):
    """Sender: the engine, to the request's sink: the last event of a generation that did not
    run to its end. ``context_overflow`` carries both counts; ``draining`` / ``stopped``: the
    engine dropped it before it started; ``cancelled``: cancelled while waiting;
    ``model_error``: the model refused the input; ``no_memory``: the memory governor could
    not fit the prefill's workspace under the peak (retry after ``retry_after_s``);
    ``engine_error``: a bug met by this request's work (the engine cut its rows back to a
    sound one and serves the next request; only a fault that leaves the process or the device
    untrusted stops the system)."""

    request_id: str
    reason: Literal["context_overflow", "model_error", "draining", "stopped", "cancelled",
                    "no_memory", "engine_error"]
    detail: str
    num_tokens: int | None = None
    window: int | None = None
    retry_after_s: float | None = None


# -- drain -----------------------------------------------------------------------------------


class Drain(Message):
    """Sender: the entry point on SIGTERM. Receiver: the engine: the running generation
    finishes, the waiting ones fail with ``draining``, every later `Generate` is rejected.
    `EngineDrained` goes to `reply_to` once nothing runs. Replies `DrainStarted`."""

    reply_to: Any = None


class DrainStarted(Message):
    """Reply to `Drain`: what was running and what was dropped from the queue."""

    running: int
    dropped: int


class EngineDrained(Message):
    """Sender: the engine, to a `Drain`'s sink, once no generation runs."""


# -- the capture lock ------------------------------------------------------------------------


class RequestCaptureLock(Message):
    """Sender: anything that issues device work outside the engine (a tier's copy thread).
    Receiver: the engine, which owns the lock's FIFO: its own generations and outside holders
    take it in arrival order. `CaptureLockGranted` goes to `reply_to` when it is the holder's
    turn. On a CPU the lock only serialises; the protocol is the same."""

    holder: str
    reply_to: Any = None


class CaptureLockGranted(Message):
    """Sender: the engine, to the holder's sink. Ownership: the lock is the holder's until it
    sends `ReleaseCaptureLock` with this `grant_id`; the engine starts no work meanwhile."""

    holder: str
    grant_id: int


class ReleaseCaptureLock(Message):
    """Sender: the holder. Receiver: the engine, which grants the lock to the next in line.
    Releasing a lock one does not hold is a bug: the engine actor fails."""

    holder: str
    grant_id: int


class EngineFaulted(Message):
    """Sender: the engine actor to itself, when its thread raised a fatal error (see
    engine_actor._fatal); handling it re-raises that exception, so the supervisor stops the
    system."""


# -- peek and prewarm (spec: "Peek and prewarm") ----------------------------------------------


class Peek(Message):
    """Sender: the server (POST /v1/cache/peek, /v1/cache/prewarm). Receiver: the engine, which,
    while no generation runs or waits, makes the plan a `Generate` of ``prompt_ids`` would get
    (the tiers' offers, the alignment, the store's, the disk tier's and the spill's) without
    running, lending for long, counting or moving anything, and answers `Peeked`; ``busy``
    otherwise. ``prewarm``: when the plan resumes from the spill, its entry is read into the
    slot as that request would read it (tandem/actors/engine_peek.py)."""

    prompt_ids: list[int]
    session: str | None = None  # the hashed session key
    namespace: str = ""
    side: bool = False
    prewarm: bool = False
    # The prompt has images (prompt_ids are then its key ids): as a Generate with images, its
    # plan replays no hidden span.
    images: bool = False


class Peeked(Message):
    """Reply to `Peek`. ``busy``: a generation runs or waits (``waiting``: generations waiting
    for the engine, when the route answers 409 at once) or a prewarm runs; nothing was asked.
    Otherwise where the plan resumes: ``source`` (tandem.cache.vocabulary) and its ``tier``,
    ``cached_tokens`` (the line, in the served prompt's positions), ``reread_tokens``,
    ``tokens`` (the served prompt's), ``restore_ms`` (the NVMe's or the disk's read),
    ``reread_eta_ms`` (the re-read at the median rate of the last long prefills, plus the
    read) and the ``slot``. ``prewarm``: the prewarm's answer (``prewarmed``, ``why``,
    ``restore``), for a `Peek` with ``prewarm`` set."""

    busy: bool = False
    waiting: int = 0
    retry_after_s: float = 0.0
    source: Source = "cold"
    tier: str = "none"
    cached_tokens: int = 0
    reread_tokens: int = 0
    tokens: int = 0
    restore_ms: float = 0.0
    reread_eta_ms: float = 0.0
    slot: int | None = None
    prewarm: dict[str, Any] | None = None
