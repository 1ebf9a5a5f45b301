"""CUDA graphs of the batched decode step and of verify blocks, captured per shape (issue 20,
part 3).

On a CUDA device with ``cuda_graphs`` on, HybridModel.forward_batch and forward_ragged hand
their step to ``StepGraphs``, which runs it as a *static step*: the same layers
(``HybridModel._step_layers``) with every value that changes from one step to the next read
from one device buffer (the token ids, each row's position and rotary offset, copied in with
one host-to-device copy a step), so that a graph captured once replays every later step of
that shape. What a step writes it writes in place, where the sequences' own memory lies: each
sequence's recurrent state and conv tails (its sections, advanced in place) and its K/V row
(``index_copy_`` at the position read from the buffer). A row's attention reads a fixed span
of its keys, ``span(position)`` (a power of two from SPAN_MIN, at most the window), with the
keys past its position masked, instead of exactly the keys below it; so a graph serves every
position up to its span, and a row reads at most twice the keys it needs.

A graph is keyed by its shape (``GraphKey``): the kind, each sequence's rows, each row's span,
and every sequence's memory (the address, shape, strides and dtype of each section and view):
a graph writes the memory it was captured on, so a replay is taken only by the sequences that
lie there. A slot's engine keeps its buffers for its life, so its graphs replay turn after
turn; a choice's fork lies elsewhere each request, and its shapes are captured again (or run
eagerly, ``capture_after``). A verify block's per-position states (the pending commit's steps)
lie in a work arena of that sequence's (``_Arena``), which its next forward reads back before
it is written again (``Engine._verify_position`` settles the commit first).

Exactness: a shape's first ``capture_after - 1`` steps run the static step eagerly, the next is
captured (and run), every later one replays the graph. The eager static step and its replay
run the same kernels on the same shapes and addresses, so they give the same bits (the GPU
test: tests/models/test_graphs.py); the static step is not bit for bit the dynamic one
(forward_batch without graphs: masked attention over a span against attention over exactly
the keys below), and the greedy tokens are the same. A CPU never runs this path: the knob is
off there whatever it says, and the CPU's bits are what they were.

The capture lock: a capture runs only through ``gate`` (the engine actor's: the running
generations hold the capture lock, no writer copies meanwhile, and a round captures at most
one graph, so a copy waits at most one capture). Outside the actor (``tandem generate``, a
benchmark) nothing else issues CUDA calls and the gate runs the capture at once.

Not captured: a model with a mixture of experts (its router picks the experts on the host,
models/moe.py): its steps stay eager, and ``takes`` says so.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import structlog
import torch
import torch.nn.functional as F

from tandem.kernels import decode as decode_ops
from tandem.models.base import ModelError, ModelState

log = structlog.get_logger("tandem.graphs")

GraphsMode = Literal["auto", "on", "off"]
StepKind = Literal["decode", "verify"]

SPAN_MIN = 256  # the shortest span a row's attention reads
CAPTURE_AFTER = 2  # a shape's first step runs eagerly (Triton's compiles, cuBLAS's set-up)
MAX_GRAPHS = 64  # shapes kept, the least recently used let go first
MAX_ARENAS = 8  # sequences whose verify arenas are kept
# The rows a lone sequence's static step carries (itself and a pad row): torch's decode matmuls
# take two rows a call, the only ones a device's step runs.
PAD_ROWS = getattr(decode_ops, "TORCH_BLOCK", None) or decode_ops.BLOCK

T = TypeVar("T")
Gate = Callable[[Callable[[], T]], "T | None"]


def run_now(capture: Callable[[], T]) -> T:
    """The gate outside the engine actor: nothing else in the process issues CUDA calls."""
    return capture()


def span(position: int, window: int) -> int:
    """The keys a row at ``position`` attends over in a static step: the smallest power of
    two from SPAN_MIN that holds it, at most the window."""
    width = SPAN_MIN
    while width < position + 1:
        width *= 2
    return min(width, window)


def _memory(state: ModelState) -> tuple:
    """Where a sequence's sections and views lie: what a graph captured on them writes."""
    parts = [(name, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
             for name, t in sorted(state.sections.items())]
    parts += [(name, v.tensor.data_ptr(), tuple(v.tensor.shape), v.tensor.stride(),
               v.tensor.dtype) for name, v in sorted(state.views.items())]
    return tuple(parts)


@dataclass(frozen=True)
class GraphKey:
    kind: StepKind
    blocks: tuple[int, ...]  # each sequence's rows (1 for a decode)
    verify: tuple[bool, ...]
    spans: tuple[int, ...]  # each row's attention span
    memory: tuple  # every sequence's sections and views (_memory)


class Graph(Protocol):
    def replay(self) -> None: ...


class Backend(Protocol):
    """Captures a step: runs it once (its outputs now) and records it; returns the graph,
    the outputs now and the static outputs a replay rewrites."""

    device_type: str

    def capture(self, step: Callable[[], Any]) -> tuple[Graph, Any, Any]: ...


class CudaGraphs:
    """torch.cuda.CUDAGraph, the graphs of one model sharing one memory pool (their outputs
    are copied out after each replay, so no graph reads what another left there)."""

    device_type = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None

    def capture(self, step: Callable[[], Any]) -> tuple[Graph, Any, Any]:
        now = step()  # the step itself, eagerly: a capture runs nothing
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # global capture mode (torch's default): a CUDA call of another thread meanwhile
        # would fail the capture, which the capture lock rules out (the gate)
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool):
            static = step()
        return graph, now, static


class _Entry:
    """One shape's static inputs, its graph once captured and what that graph reads."""

    __slots__ = ("inputs", "seen", "graph", "outputs", "keep", "arenas")

    def __init__(self, inputs: torch.Tensor) -> None:
        self.inputs = inputs  # [ids | positions | rotary offsets], long, on the device
        self.seen = 0
        self.graph: Graph | None = None
        self.outputs: Any = None
        self.keep: list[Any] = []  # tensors made outside the capture that the graph reads
        self.arenas: tuple = ()  # the sequences (their _memory) whose arenas it writes


class _Arena:
    """One sequence's verify work: every section's value after each position of a block. An
    entry whose graph writes it keeps it alive (``keep``), and its address is in that entry's
    key, so no graph ever writes an arena let go."""

    def __init__(self, state: ModelState, rows: int) -> None:
        self.rows = rows
        self.work = {name: state.sections[name].new_empty((rows,) + tuple(
            state.sections[name].shape)) for name in ("gdn.conv", "gdn.S")}


class StepGraphs:
    """The captured steps of one model (``HybridModel.graphs``), keyed per shape."""

    def __init__(self, backend: Backend, *, capture_after: int = CAPTURE_AFTER,
                 max_graphs: int = MAX_GRAPHS, max_arenas: int = MAX_ARENAS) -> None:
        if capture_after < 1 or max_graphs < 1 or max_arenas < 1:
            raise ValueError("capture_after, max_graphs and max_arenas must be positive")
        self.backend = backend
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        self.max_arenas = max_arenas
        self.gate: Gate = run_now  # the engine actor puts its own in while it runs
        self.entries: OrderedDict[GraphKey, _Entry] = OrderedDict()
        self._arenas: OrderedDict[tuple, _Arena] = OrderedDict()
        self._aranges: dict[torch.device, torch.Tensor] = {}
        self._takes: dict[int, bool] = {}
        self.counts = {"captures": 0, "replays": 0, "eager": 0, "declined": 0, "evicted": 0}

    def statistics(self) -> dict:
        return dict(self.counts, graphs=sum(e.graph is not None for e in self.entries.values()),
                    shapes=len(self.entries), arenas=len(self._arenas))

    def check_invariants(self) -> None:
        """At most max_graphs shapes and max_arenas arenas; a verify graph keeps alive every
        arena it writes, and those are the arenas its key names (so it replays on them only)."""
        assert len(self.entries) <= self.max_graphs and len(self._arenas) <= self.max_arenas
        for key, entry in self.entries.items():
            if key.kind == "verify" and entry.graph is not None:
                kept = tuple(work["gdn.S"].data_ptr() for work in entry.keep[-1])
                assert kept == key.memory[-1], "a verify graph writes an arena it does not keep"

    def takes(self, model) -> bool:
        """Whether ``model``'s steps run here: on the backend's device, no layer a mixture of
        experts (its router picks experts on the host)."""
        got = self._takes.get(id(model))
        if got is None:
            c = model.config
            got = self._takes[id(model)] = (
                model.device.type == self.backend.device_type
                and not any(c.is_moe_layer(i) for i in range(len(c.layer_types))))
        return got

    # -- the two steps ---------------------------------------------------------------------

    def decode(self, model, states: list[ModelState], token_ids: list[int],
               positions: list[int], rope_offsets: list[int] | None = None) -> torch.Tensor:
        """forward_batch as a static step: fp32 logits ``[B, vocab]``."""
        n = len(states)
        _check_ids(model, token_ids)
        spans = tuple(span(p, _window(s)) for p, s in zip(positions, states))
        key = GraphKey("decode", (1,) * n, (False,) * n, spans,
                       tuple(_memory(s) for s in states))
        ids = list(token_ids) if n >= PAD_ROWS else list(token_ids) * PAD_ROWS
        values = ids + list(positions) + list(rope_offsets or [0] * n)
        out = self._run(model, key, values, lambda entry: _decode_step(
            model, states, entry, len(ids), spans))
        return out

    def verify(self, model, states: list[ModelState], blocks: list[list[int]],
               positions: list[int], rope_offsets: list[int] | None,
               verify: list[bool]) -> tuple[list[torch.Tensor], list]:
        """forward_ragged (a verify block among its sequences) as a static step."""
        ids = [t for b in blocks for t in b]
        _check_ids(model, ids)
        offsets = rope_offsets or [0] * len(blocks)
        at = [p + j for p, b in zip(positions, blocks) for j in range(len(b))]
        spans = tuple(span(a, _window(s)) for s, b, p in zip(states, blocks, positions)
                      for a in range(p, p + len(b)))
        memory = tuple(_memory(s) for s in states)
        arenas = [self._arena(m, s, len(b)) if v else None
                  for m, s, b, v in zip(memory, states, blocks, verify)]
        # the arenas' addresses too: a graph writes the arena it was captured on, and one
        # grown or let go and made again lies elsewhere
        where = tuple(a.work["gdn.S"].data_ptr() for a in arenas if a is not None)
        key = GraphKey("verify", tuple(len(b) for b in blocks), tuple(verify), spans,
                       memory + (where,))
        values = ids + at + [o for o, b in zip(offsets, blocks) for _ in b]
        return self._run(model, key, values, lambda entry: _verify_step(
            model, states, blocks, verify, arenas, entry, spans),
            arenas=tuple(m for m, v in zip(memory, verify) if v))

    # -- the cache of shapes -------------------------------------------------------------------

    def _run(self, model, key: GraphKey, values: list[int],
             make: Callable[[_Entry], Callable[[], Any]], arenas: tuple = ()) -> Any:
        with torch.inference_mode():  # the static buffers are inference tensors
            return self._run_entry(model, key, values, make, arenas)

    def _run_entry(self, model, key: GraphKey, values: list[int],
                   make: Callable[[_Entry], Callable[[], Any]], arenas: tuple) -> Any:
        entry = self.entries.get(key)
        if entry is None:
            entry = self._add(key, len(values), model.device)
            entry.arenas = arenas
        else:
            self.entries.move_to_end(key)
        entry.inputs.copy_(torch.tensor(values, dtype=torch.long))
        if entry.graph is not None:
            entry.graph.replay()
            self.counts["replays"] += 1
            return _copied(entry.outputs)
        entry.seen += 1
        step = make(entry)
        if entry.seen >= self.capture_after:
            t0 = time.perf_counter()
            got = self.gate(lambda: self.backend.capture(step))
            if got is not None:
                entry.graph, now, entry.outputs = got
                self.counts["captures"] += 1
                log.info("graph_captured", kind=key.kind, rows=len(key.spans),
                         sequences=len(key.blocks), spans=max(key.spans),
                         ms=round((time.perf_counter() - t0) * 1000, 2),
                         graphs=self.statistics()["graphs"])
                return now
            self.counts["declined"] += 1
        self.counts["eager"] += 1
        return step()

    def _add(self, key: GraphKey, size: int, device: torch.device) -> _Entry:
        with torch.inference_mode():
            entry = _Entry(torch.zeros(size, dtype=torch.long, device=device))
        self.entries[key] = entry
        while len(self.entries) > self.max_graphs:
            self.entries.popitem(last=False)
            self.counts["evicted"] += 1
        return entry

    def _arena(self, memory: tuple, state: ModelState, rows: int) -> _Arena:
        """The sequence's verify arena, at least ``rows`` positions: a larger block grows it,
        and the shapes that wrote the old one go (their graphs hold its addresses)."""
        arena = self._arenas.get(memory)
        if arena is not None and arena.rows >= rows:
            self._arenas.move_to_end(memory)
            return arena
        if arena is not None:
            self._drop_arena(memory)
        with torch.inference_mode():
            arena = self._arenas[memory] = _Arena(state, rows)
        while len(self._arenas) > self.max_arenas:
            self._drop_arena(next(iter(self._arenas)))
        return arena

    def _drop_arena(self, memory: tuple) -> None:
        del self._arenas[memory]
        for key in [k for k, e in self.entries.items() if memory in e.arenas]:
            del self.entries[key]
            self.counts["evicted"] += 1

    def arange(self, device: torch.device, size: int) -> torch.Tensor:
        """0, 1, ... on ``device``, at least ``size`` long (the masks' key indices); an entry
        keeps the one its graph reads."""
        got = self._aranges.get(device)
        if got is None or got.shape[0] < size:
            with torch.inference_mode():
                got = self._aranges[device] = torch.arange(max(size, SPAN_MIN),
                                                           device=device)
        return got


# -- the static steps: everything that changes a step read from entry.inputs ---------------------

def _window(state: ModelState) -> int:
    view = state.views["K"]
    return view.tensor.shape[view.token_axis]


def _check_ids(model, ids: list[int]) -> None:
    # the eager step's F.embedding refuses an id out of range; on a device the static step's
    # would be a device-side assert, which ends the process's CUDA context
    vocab = model.w["embed_tokens.weight"].shape[0]
    for t in ids:
        if not 0 <= t < vocab:
            raise ModelError(f"token id {t} is outside the model's {vocab} embeddings")


def _copied(outputs: Any) -> Any:
    """A replay's outputs copied out of the graph's memory (the next replay rewrites it); a
    verify block's steps stay in the sequence's arena, read back before it is written again."""
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    logits, steps = outputs
    return [t.clone() for t in logits], steps


def _masks(arange: torch.Tensor, spans: tuple[int, ...], at: torch.Tensor,
           dtype: torch.dtype) -> list[torch.Tensor]:
    """Each row's additive mask over its span: 0 up to its position, -inf past it."""
    return [torch.zeros(width, dtype=dtype, device=at.device)
            .masked_fill_(arange[:width] > at[r:r + 1], float("-inf")).view(1, 1, 1, width)
            for r, width in enumerate(spans)]


def _attend(spans: tuple[int, ...], at: torch.Tensor, masks: list[torch.Tensor]):
    """HybridModel._attention_rows' loop with the positions on the device: row r writes its
    K/V row at ``at[r]`` and attends over its span's keys, those past it masked."""
    def attend(slot, q5, k, v, keys, values, scale):
        out = []
        for r in range(len(spans)):
            kbuf, vbuf = keys[r][slot], values[r][slot]
            where = at[r:r + 1]
            kbuf.index_copy_(1, where, k[r].unsqueeze(1).to(kbuf.dtype))
            vbuf.index_copy_(1, where, v[r].unsqueeze(1).to(vbuf.dtype))
            out.append(F.scaled_dot_product_attention(
                q5[r], kbuf[None, :, :spans[r]], vbuf[None, :, :spans[r]],
                attn_mask=masks[r], scale=scale, enable_gqa=True))
        return out

    return attend


def _decode_step(model, states: list[ModelState], entry: _Entry, num_ids: int,
                 spans: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    from tandem.models.hybrid import _rms_rows

    n = len(states)
    buf = entry.inputs
    ids, at, offsets = buf[:num_ids], buf[num_ids:num_ids + n], buf[num_ids + n:]
    arange = model.graphs.arange(model.device, max(spans))
    entry.keep = [arange]
    tails = [s.sections["gdn.conv"].unbind(0) for s in states]
    recur = [s.sections["gdn.S"].unbind(0) for s in states]
    keys = [s.views["K"].tensor for s in states]
    values = [s.views["V"].tensor for s in states]
    embed = model.w["embed_tokens.weight"]

    def step() -> torch.Tensor:
        turns = (at + offsets).to(torch.float32)
        masks = _masks(arange, spans, at, model.dtype)
        x = F.embedding(ids, embed)
        x = model._step_layers(x, n, turns, at, keys, values, tails, recur, None,
                               attend=_attend(spans, at, masks))
        x = _rms_rows(x, model._gain["norm.weight"], model._eps)
        logits = model._linear(x, "lm_head.weight")
        logits = logits if x.shape[0] == n else logits[:n]
        return logits if logits.dtype == torch.float32 else logits.float()

    return step


def _verify_step(model, states: list[ModelState], blocks: list[list[int]], verify: list[bool],
                 arenas: list[_Arena | None], entry: _Entry, spans: tuple[int, ...]
                 ) -> Callable[[], tuple[list[torch.Tensor], list]]:
    """HybridModel.forward_ragged's verify path, static: its work in the arenas, its index
    tensors made here (outside a capture) and kept by the entry."""
    from tandem.models.hybrid import _Ragged, _rms_rows, verify_head_groups

    rows = sum(len(b) for b in blocks)
    buf = entry.inputs
    ids, at, offsets = buf[:rows], buf[rows:2 * rows], buf[2 * rows:]
    work = [{name: a.work[name][:len(b)] for name in a.work} if a is not None else None
            for a, b in zip(arenas, blocks)]
    ragged = _Ragged(states, blocks, verify, model.device, work=work)
    arange = model.graphs.arange(model.device, max(spans))
    keys = [s.views["K"].tensor for s, b in zip(states, blocks) for _ in b]
    values = [s.views["V"].tensor for s, b in zip(states, blocks) for _ in b]
    # the verify rows' head in groups of whole blocks, as forward_ragged groups them
    groups = verify_head_groups(blocks, verify, model.device)
    decoded = [ragged.rows[r][0] for r in ragged.decode_rows]
    entry.keep = [arange, ragged.decode_index, [i for _, i in ragged.waves],
                  [i for _, i in groups], [a.work for a in arenas if a is not None]]
    embed = model.w["embed_tokens.weight"]

    def step() -> tuple[list[torch.Tensor], list]:
        turns = (at + offsets).to(torch.float32)
        masks = _masks(arange, spans, at, model.dtype)
        x = F.embedding(ids, embed)
        x = model._step_layers(x, rows, turns, at, keys, values, None, None, ragged,
                               attend=_attend(spans, at, masks))
        x = _rms_rows(x, model._gain["norm.weight"], model._eps)
        logits: list[torch.Tensor | None] = [None] * len(blocks)
        if decoded:
            heads = model._linear(x[ragged.decode_index], "lm_head.weight").float()
            for row, b in zip(heads, decoded):
                logits[b] = row[None]
        for members, idx in groups:
            res = model._verify_head(x[idx])
            at_row = 0
            for g in members:
                logits[g] = res[at_row:at_row + len(blocks[g])]
                at_row += len(blocks[g])
        return logits, ragged.steps()

    return step


# -- the knob -------------------------------------------------------------------------------------

def graphs_wanted(mode: str, device: torch.device) -> bool:
    """The ``cuda_graphs`` knob on ``device``: auto is on with CUDA; on without CUDA is a
    ValueError (the caller names the knob); a CPU never captures."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"cuda_graphs {mode!r} is none of auto, on, off")
    if mode == "on" and device.type != "cuda":
        raise ValueError(f"cuda_graphs on needs a CUDA device; the engine runs on {device}")
    return mode != "off" and device.type == "cuda"


def engine_graphs(config, device: torch.device) -> bool:
    """The config's ``cuda_graphs`` on the resolved device; ``on`` without CUDA is a
    ConfigError naming the knob (the CLI prints it and exits 2, before any model is read)."""
    from tandem.config import KNOBS, ConfigError

    try:
        return graphs_wanted(config.engine.cuda_graphs, device)
    except ValueError as exc:
        raise ConfigError(f"{exc} (knob {KNOBS['cuda_graphs'].spellings()})") from None


def attach(model, mode: str) -> StepGraphs | None:
    """Give ``model`` its graphs where the knob wants them (None elsewhere: eager steps)."""
    if not graphs_wanted(mode, model.device):
        model.graphs = None
        return None
    model.graphs = StepGraphs(CudaGraphs(model.device))
    if not model.graphs.takes(model):
        log.info("graphs_unused", reason="mixture_of_experts")
    return model.graphs
