"""Scripted replay: send a recording's requests in order and say where every prompt token came
from.

    rows = read_rows("sessions/opencode_short.jsonl")
    async with InProcessServer(config, loaded) as server:          # or UrlTarget(url)
        turns = await Replayer(rows, mode="forced", tokenizer=tok).run(server)
    print(format_table(turns, totals(turns)))

``verbatim`` sends each body as recorded (the model named is replaced by the one served, and a
stream asks for its usage, which changes nothing the engine does). ``forced`` also sends the
recorded answer as ``tandem_forced_output``, so that the engine writes it token for token and
the next recorded request continues what the engine really holds, as in the recorded session.
A request's answer is its row's ``response``; a row captured without one gets the assistant
message a later request of its conversation carries.

A turn's counts are the server's (``usage``: prompt tokens, cached, re-read, source, TTFT);
``new`` is computed here: the prompt's tokens past its longest common prefix with any earlier
prompt of the replay, so that their sum is the number of distinct tokens the session holds, and
``forwarded / distinct`` is 1.0 for a server that forwards every token exactly once.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import msgspec
import numpy as np
import structlog
from aiohttp import web

from tandem.models.chat import ChatError, encode_chat
from tandem.replay.forced import answer_message, forced_text, next_answer

log = structlog.get_logger("tandem.replay")

MODES = ("verbatim", "forced")
REQUEST_TIMEOUT_S = 3600.0  # one request of a long session on a CPU


@dataclass
class Turn:
    """One replayed request, as the table and ``--json`` show it."""

    turn: int
    session: str
    route: str
    status: int
    prompt_tokens: int | None = None
    cached: int | None = None
    reread: int | None = None
    new: int | None = None
    source: str | None = None
    ttft_ms: float | None = None
    request_id: str | None = None
    error: str | None = None


# -- targets ---------------------------------------------------------------------------------


class UrlTarget:
    """A server that runs elsewhere; it cannot be restarted."""

    def __init__(self, url: str) -> None:
        self.base_url = url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]

    async def restart(self) -> bool:
        return False

    async def __aenter__(self) -> UrlTarget:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


class InProcessServer:
    """`build_app` on 127.0.0.1 at a free port, in this process; ``restart`` stops it and
    builds a new one over the same loaded model and config (the same home)."""

    def __init__(self, config: Any, loaded: Any) -> None:
        self.config = config
        self.loaded = loaded
        self.runner: web.AppRunner | None = None
        self.app: web.Application | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        from tandem.server.app import build_app

        self.app = build_app(self.config, self.loaded)
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # aiohttp exposes it only here

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def restart(self) -> bool:
        await self.stop()
        await self.start()
        return True

    async def __aenter__(self) -> InProcessServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


# -- the replay ------------------------------------------------------------------------------


class Replayer:
    """Sends ``rows`` in order. ``tokenizer`` and ``template`` render the prompts for the
    ``new`` column (None: the column stays empty); ``max_tokens`` caps what a request may
    generate where no recorded answer is forced (a recording's 32,000 on a random model)."""

    def __init__(self, rows: list[dict[str, Any]], *, mode: str = "verbatim",
                 tokenizer: Any = None, template: str | None = None,
                 max_tokens: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.rows = rows
        self.mode = mode
        self.tokenizer = tokenizer
        self.template = template
        self.max_tokens = max_tokens
        self._seen: list[np.ndarray] = []

    async def run(self, target: Any) -> list[Turn]:
        turns: list[Turn] = []
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            model = await _served_model(http, target.base_url)
            for i, row in enumerate(self.rows):
                if row.get("restart"):
                    if not await target.restart():
                        log.warning("replay_restart_skipped", row=i,
                                    reason="the server runs elsewhere")
                    await _served_model(http, target.base_url)
                    continue
                turn = await self._send(http, target.base_url, model, i, len(turns) + 1)
                turns.append(turn)
        return turns

    def body_for(self, index: int, model: str) -> dict[str, Any]:
        """What is sent for ``rows[index]``: its body, the served model, usage asked for, and in
        forced mode the recorded answer."""
        row = self.rows[index]
        body = copy.deepcopy(row["body"])
        body["model"] = model
        # A recording of a forced replay holds the admin field: it is the replay's, not the
        # client's, so only forced mode sends one (its own).
        body.pop("tandem_forced_output", None)
        if body.get("stream"):
            options = dict(body.get("stream_options") or {})
            options["include_usage"] = True
            body["stream_options"] = options
        forced = self._forced(index, body) if self.mode == "forced" else None
        if forced is not None:
            body["tandem_forced_output"] = forced
            # The forced answer is as long as it is: a recorded client's cap (opencode's
            # 32,000) may exceed a smaller replay window's room, which is a 400.
            body.pop("max_tokens", None)
            body.pop("max_completion_tokens", None)
        elif self.max_tokens is not None:
            # A recorded 0 stays 0: an echo scoring a prompt (lm-eval-harness) generates nothing.
            recorded = body.get("max_tokens")
            body["max_tokens"] = min(int(recorded if recorded is not None else self.max_tokens),
                                     self.max_tokens)
            if body.get("max_completion_tokens"):
                body["max_completion_tokens"] = min(int(body["max_completion_tokens"]),
                                                    self.max_tokens)
        return body

    def _forced(self, index: int, body: dict[str, Any]) -> str | None:
        row = self.rows[index]
        if not _route(row).endswith("/chat/completions"):
            text = (row.get("response") or {}).get("text")
            return text if isinstance(text, str) else None
        message = answer_message(row.get("response") or {}) or next_answer(self.rows, index)
        if message is None:
            return None
        return forced_text(message, enable_thinking=_thinking(body), template=self.template)

    async def _send(self, http: aiohttp.ClientSession, base_url: str, model: str, index: int,
                    number: int) -> Turn:
        row = self.rows[index]
        route = _route(row)
        headers = dict(row.get("headers") or {})
        session = headers.get("x-session-id") or "-"
        body = self.body_for(index, model)
        new = self._new_tokens(route, row["body"])
        turn = Turn(turn=number, session=session, route=route, status=0, new=new)
        t0 = time.perf_counter()
        first_s: float | None = None
        usage: dict | None = None
        try:
            async with http.post(base_url + route, json=body, headers=headers) as resp:
                turn.status = resp.status
                if resp.status != 200:
                    doc = await resp.json(content_type=None)
                    turn.error = ((doc or {}).get("error") or {}).get("code") or str(resp.status)
                    return turn
                if body.get("stream"):
                    async for doc in _sse(resp):
                        if first_s is None and _has_output(doc):
                            first_s = time.perf_counter()
                        if "error" in doc:
                            turn.error = doc["error"].get("code") or "stream_error"
                        if doc.get("usage"):
                            usage = doc["usage"]
                        turn.request_id = turn.request_id or doc.get("id")
                else:
                    doc = await resp.json()
                    first_s = time.perf_counter()
                    usage = doc.get("usage")
                    turn.request_id = doc.get("id")
        except (aiohttp.ClientError, TimeoutError) as e:
            turn.error = type(e).__name__
            return turn
        if usage:
            tandem = usage.get("tandem") or {}
            cache = tandem.get("cache") or {}
            turn.prompt_tokens = usage.get("prompt_tokens")
            turn.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            turn.reread = cache.get("reread", None if turn.cached is None
                                    else (turn.prompt_tokens or 0) - turn.cached)
            turn.source = cache.get("source")
            turn.ttft_ms = tandem.get("ttft_ms")
        if turn.ttft_ms is None and first_s is not None:
            turn.ttft_ms = round((first_s - t0) * 1000.0, 3)  # measured here: a foreign server
        return turn

    def _new_tokens(self, route: str, body: dict[str, Any]) -> int | None:
        ids = self._prompt_ids(route, body)
        if ids is None:
            return None
        arr = np.asarray(ids, dtype=np.int64)
        best = 0
        for seen in self._seen:
            m = min(len(seen), len(arr))
            diff = np.flatnonzero(seen[:m] != arr[:m])
            best = max(best, int(diff[0]) if diff.size else m)
            if best == len(arr):
                break
        self._seen.append(arr)
        return len(arr) - best

    def _prompt_ids(self, route: str, body: dict[str, Any]) -> list[int] | None:
        tok = self.tokenizer
        if tok is None:
            return None
        try:
            if route.endswith("/chat/completions"):
                tools = body.get("tools") if body.get("tool_choice") != "none" else None
                return encode_chat(tok, body.get("messages") or [], tools,
                                   add_generation_prompt=True, enable_thinking=_thinking(body),
                                   template=self.template)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return prompt
            return tok.encode(prompt) if isinstance(prompt, str) else None
        except (ChatError, TypeError, ValueError):
            return None


def _route(row: dict[str, Any]) -> str:
    return row.get("route") or "/v1/chat/completions"


def _thinking(body: dict[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs") or {}
    return kwargs.get("enable_thinking", True) is not False


def _has_output(doc: dict[str, Any]) -> bool:
    for choice in doc.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") \
                or choice.get("text"):
            return True
    return False


async def _sse(resp: aiohttp.ClientResponse):
    """The JSON documents of an event stream, until ``[DONE]``."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield msgspec.json.decode(data)


async def _served_model(http: aiohttp.ClientSession, base_url: str) -> str:
    async with http.get(base_url + "/v1/models") as resp:
        resp.raise_for_status()
        doc = await resp.json()
    return doc["data"][0]["id"]


# -- reports ---------------------------------------------------------------------------------


def totals(turns: list[Turn]) -> dict[str, Any]:
    """forwarded (tokens the prefills ran), distinct (tokens of the session), TTFT median and
    p90 in ms, and the number of requests served from each source."""
    ok = [t for t in turns if t.error is None and t.prompt_tokens is not None]
    ttfts = sorted(t.ttft_ms for t in ok if t.ttft_ms is not None)
    news = [t.new for t in turns if t.new is not None]
    return {
        "forwarded": sum(t.reread or 0 for t in ok),
        "distinct": sum(news) if news else None,
        "ttft_ms_median": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_ms_p90": round(_quantile(ttfts, 0.9), 3) if ttfts else None,
        "sources": dict(Counter(t.source for t in ok if t.source is not None)),
        "errors": sum(1 for t in turns if t.error is not None),
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank quantile (p90 of 10 values is the 9th)."""
    rank = max(1, int(np.ceil(q * len(sorted_values))))
    return sorted_values[rank - 1]


def report(turns: list[Turn]) -> dict[str, Any]:
    """The ``--json`` object: ``{"turns": [...], "totals": {...}}``."""
    return {"turns": [asdict(t) for t in turns], "totals": totals(turns)}


def ratio(forwarded: int, distinct: int | None) -> str:
    return f"{forwarded / distinct:.2f}" if distinct else "-"


def format_table(turns: list[Turn], tot: dict[str, Any] | None = None) -> str:
    tot = tot if tot is not None else totals(turns)
    head = ("turn", "session", "prompt", "cached", "re-read", "new", "source", "TTFT ms")
    lines = [head]
    for t in turns:
        lines.append((str(t.turn), t.session[:18], _n(t.prompt_tokens), _n(t.cached),
                      _n(t.reread), _n(t.new), t.error and f"ERR {t.error}" or t.source or "-",
                      "-" if t.ttft_ms is None else f"{t.ttft_ms:.0f}"))
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i in (1, 6) else c.rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths))) for r in lines]
    sources = ", ".join(f"{k} {v}" for k, v in sorted(tot["sources"].items())) or "-"
    out.append("")
    out.append(f"forwarded / distinct: {tot['forwarded']} / {_n(tot['distinct'])} = "
               f"{ratio(tot['forwarded'], tot['distinct'])}")
    out.append(f"TTFT ms: median {_ms(tot['ttft_ms_median'])}, p90 {_ms(tot['ttft_ms_p90'])}")
    out.append(f"hits by source: {sources}")
    if tot["errors"]:
        out.append(f"errors: {tot['errors']}")
    return "\n".join(out)


def format_compare(on: dict[str, Any], off: dict[str, Any]) -> str:
    a, b = on["totals"], off["totals"]
    lines = ["", "caches on against off:",
             f"  forwarded / distinct: {ratio(a['forwarded'], a['distinct'])} on, "
             f"{ratio(b['forwarded'], b['distinct'])} off "
             f"({a['forwarded']} against {b['forwarded']} tokens forwarded)"]
    if a["ttft_ms_median"] and b["ttft_ms_median"]:
        lines.append(f"  TTFT median: {a['ttft_ms_median']:.0f} ms on, "
                     f"{b['ttft_ms_median']:.0f} ms off "
                     f"(on/off {a['ttft_ms_median'] / b['ttft_ms_median']:.2f})")
    return "\n".join(lines)


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
