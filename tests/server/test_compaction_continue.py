"""A compaction request served as the continuation of its conversation (tandem/server/compaction.py)
through the HTTP server, on the small real model with the real Qwen tokenizer.

An opencode-shaped session (system text, tools, ``x-session-id``, a tool call and its result, a
title request, a second task), then its compaction request: the agent's summarisation system
text and ONE user message holding the history as role-marked lines. Served as a continuation it
resumes at the end anchor of the session's last answer and forwards only the new turn; then the
turn after it (the same system text and tools, the history restarted from the summary) resumes
at least as far as the pinned head of the same flow with ``compaction = client``.

Greedy gate: the continuation resumes at an end anchor (state decoding wrote), so its answer is
held to the same greedy tokens as a caches-off server's run of the same ids.
"""

import json

import msgspec
import pytest
from opencode_copy import opencode_copy

from tandem.actors.compaction_messages import FindSessionRecord
from tandem.config import (CacheConfig, CompactionConfig, DiskConfig, SpeculationConfig,
                           SpillConfig)
from tandem.models.chat import encode_chat
from tandem.server.app import build_app
from tandem.server.compaction import build_continuation, compaction_request, turn_after_answer
from tandem.server.keys import CACHE_STATS, ENGINE
from tandem.server.sessions import hash_session, load_secret

SESSION = "ses_compaction_0001"
SYSTEM = ("You are opencode, an interactive CLI agent for software engineering tasks. "
          "Working directory: /home/user/ledger. Today's date: 2026-11-29. " * 8)
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"The {name} tool. " * 6,
    "parameters": {"type": "object", "properties": {
        "filePath": {"type": "string", "description": "Absolute path of the file"}},
        "required": ["filePath"]}}} for name in ("read", "bash", "edit")]
TASKS = ["The ledger export drops the last row when the batch size divides the row count.",
         "Now add a test for the empty batch."]
COMPACT_SYSTEM = ("You are a helpful AI assistant tasked with summarizing conversations. "
                  "When asked to summarize, write what was done, which files changed, what is "
                  "left and what the next step is.")
INSTRUCTIONS = "Provide a detailed summary for continuing the conversation above."
CALL = ("I should read the exporter first.\n</think>\n\n<tool_call>\n{\"name\": \"read\", "
        "\"arguments\": {\"filePath\": \"/home/user/ledger/src/export.py\"}}\n</tool_call>")
RESULT = "def export(rows, batch):\n    for i in range(0, len(rows) - 1, batch): ...\n"


def _cache(resp) -> dict:
    return resp.usage.model_extra["tandem"]["cache"]


async def _chat(client, messages, forced=None, *, tools=TOOLS, session=SESSION, **kw):
    extra = {} if forced is None else {"tandem_forced_output": forced}
    return await client.chat.completions.create(
        model="small", messages=messages, max_tokens=kw.pop("max_tokens", 120), temperature=0,
        extra_body=extra, extra_headers={"x-session-id": session},
        **({"tools": tools} if tools else {}), **kw)


def _history(messages: list[dict]) -> str:
    """The history as opencode writes it into its compaction request: role-marked lines."""
    lines = []
    for m in messages[1:]:
        text = m.get("content") or ""
        if m.get("tool_calls"):
            text += " " + json.dumps(m["tool_calls"][0]["function"])
        lines.append(f"[{'Tool result' if m['role'] == 'tool' else m['role'].title()}]: {text}")
    return "\n\n".join(lines)


def compaction_messages(messages: list[dict], *, first_user: str | None = None) -> list[dict]:
    history = _history(messages)
    if first_user is not None:
        history = history.replace(TASKS[0], first_user)
    return [{"role": "system", "content": COMPACT_SYSTEM},
            {"role": "user", "content": "Here is the conversation so far:\n<conversation>\n"
             + history + f"\n</conversation>\n\n{INSTRUCTIONS}"}]


async def _session(client) -> list[dict]:
    """Two tasks of an opencode session: a tool call, its result and an answer, a title
    request, then a second task; every later turn resumes at the end anchor."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASKS[0]}]
    first = await _chat(client, messages, CALL)
    assert first.choices[0].finish_reason == "tool_calls"
    title = await _chat(client, [{"role": "system", "content": "You are a title generator. "
                                  "Output only a thread title."},
                                 {"role": "user", "content": TASKS[0]}],
                        "A title.\n</think>\n\nLedger export drops a row", tools=None)
    assert "compaction" not in title.usage.model_extra["tandem"]
    messages += opencode_copy(first.choices[0].message, RESULT)
    answer = await _chat(client, messages, "The range stops one short.\n</think>\n\n"
                         "The loop's range stops one row short; it now runs to len(rows).")
    assert _cache(answer)["source"] == "end", _cache(answer)
    messages += [{"role": "assistant", "content": answer.choices[0].message.content,
                  "reasoning_content": answer.choices[0].message.model_extra[
                      "reasoning_content"]},
                 {"role": "user", "content": TASKS[1]}]
    second = await _chat(client, messages, "A test with batch 0.\n</think>\n\n"
                         "Added test_empty_batch to tests/test_export.py.")
    assert _cache(second)["source"] == "end", _cache(second)
    messages.append({"role": "assistant", "content": second.choices[0].message.content,
                     "reasoning_content": second.choices[0].message.model_extra[
                         "reasoning_content"]})
    return messages


async def _after(client, summary: str):
    """The turn after the compaction: the same system text and tools, the history restarted
    from the summary."""
    return await _chat(client, [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": "What did we do so far?"},
                                {"role": "assistant", "content": summary},
                                {"role": "user", "content": "Run the tests."}],
                       "Run them.\n</think>\n\nRunning the tests.")


def _tokens(logprobs) -> list[str]:
    return [entry.token for entry in logprobs.content]


async def test_a_compaction_resumes_at_the_end_of_the_session_and_forwards_only_its_turn(
        small_loaded, make_config, serve, sdk):
    config = make_config(allow_forced_output=True, window=4096)
    tok = small_loaded.tokenizer
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        messages = await _session(client)
        compact = compaction_messages(messages)
        # The record the engine holds: what the continuation is built over.
        key = hash_session(SESSION, load_secret(config.home_path()))
        record = await server.app[ENGINE].ask(FindSessionRecord(key), 10)
        assert record.where == "slot" and record.token_ids
        expected = build_continuation(compaction_request(compact, None), record.token_ids,
                                      "slot", tok, None)
        resp = await _chat(client, compact, tools=None, max_tokens=12, logprobs=True)
        stats = await server.app[CACHE_STATS]()
        after = await _after(client, resp.choices[0].message.content or "A summary.")
    journal = [json.loads(line) for line in config.journal_path().read_text().splitlines()]

    cache = _cache(resp)
    assert cache["source"] == "continuation" and cache["resumed_from"] == "end", cache
    turn, _ = turn_after_answer(f"{COMPACT_SYSTEM}\n\n{INSTRUCTIONS}", tok, None)
    # The rows end before the answer's close (its stop token is never forwarded): the whole
    # turn is forwarded, nothing else.
    assert cache["reread"] == len(turn) == expected.turn_tokens
    assert cache["cached"] == len(record.token_ids) == expected.record_tokens
    # usage: the client's prompt, and what of it was not forwarded.
    client_prompt = len(encode_chat(tok, compact, None))
    assert resp.usage.prompt_tokens == client_prompt
    assert resp.usage.prompt_tokens_details.cached_tokens == client_prompt - len(turn)
    tandem = resp.usage.model_extra["tandem"]
    assert tandem["compaction"] == {"served": "continuation", "where": "slot",
                                    "record_tokens": len(record.token_ids),
                                    "turn_tokens": len(turn)}
    assert stats["compaction"]["continuations"] == stats["compaction"]["resumed"] == 1
    assert stats["compaction"]["guard_missed"] == 0
    row = [r for r in journal if r.get("route") == "chat"][-2]
    assert row["cache_source"] == "continuation" and row["cache_tier"] == "resident" and row["prompt_tokens"] == client_prompt
    assert row["extra"]["compaction"]["served"] == "continuation"
    assert row["extra"]["resumed_from"] == "end"
    assert SESSION not in json.dumps(journal)

    # The greedy gate: the same ids on a server with no caches give the same tokens.
    cold_config = msgspec.structs.replace(
        config, home=config.home + "-cold",
        cache=msgspec.structs.replace(config.cache, caches=False))
    async with serve(build_app(cold_config, small_loaded)) as server:
        cold = await sdk(server).completions.create(
            model="small", prompt=expected.prompt_ids, max_tokens=12, temperature=0,
            logprobs=1)
    assert cold.usage.prompt_tokens == len(expected.prompt_ids)
    assert _tokens(resp.choices[0].logprobs) == cold.choices[0].logprobs.tokens
    assert resp.usage.completion_tokens == cold.usage.completion_tokens

    # The turn after it resumes at the pinned head of the same flow served as sent, or later.
    client_config = msgspec.structs.replace(
        config, home=config.home + "-client", compaction=CompactionConfig(compaction="client"))
    async with serve(build_app(client_config, small_loaded)) as server:
        client = sdk(server)
        messages = await _session(client)
        sent = await _chat(client, compaction_messages(messages), tools=None, max_tokens=12)
        pinned = await _after(client, sent.choices[0].message.content or "A summary.")
        client_stats = await server.app[CACHE_STATS]()
    assert sent.usage.model_extra["tandem"]["compaction"] == {"served": "as_sent",
                                                              "why": "client"}
    assert _cache(sent)["source"] == "cold"
    assert sent.usage.prompt_tokens == client_prompt
    assert client_stats["compaction"]["client"] == 1
    assert client_stats["compaction"]["continuations"] == 0
    # Served as sent, a compaction this short runs as a guest and the head's anchors stay in
    # place (a longer one pins the head): the turn after resumes in the head either way.
    assert _cache(pinned)["source"] in ("pin", "resident"), _cache(pinned)
    head = len(encode_chat(tok, [{"role": "system", "content": SYSTEM}], TOOLS,
                           add_generation_prompt=False))
    chunk = config.engine.prefix_chunk
    assert _cache(pinned)["cached"] > 0
    assert _cache(after)["source"] not in ("cold", "continuation"), _cache(after)
    assert _cache(after)["cached"] >= _cache(pinned)["cached"]
    assert after.usage.prompt_tokens_details.cached_tokens >= head - head % (4 * chunk)


@pytest.mark.parametrize("first_user", ["A task this session never had."])
async def test_a_history_whose_first_user_line_is_not_in_the_record_is_served_as_sent(
        small_loaded, make_config, serve, sdk, first_user):
    config = make_config(allow_forced_output=True, window=4096)
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        messages = await _session(client)
        resp = await _chat(client, compaction_messages(messages, first_user=first_user),
                           tools=None, max_tokens=4)
        other = await _chat(client, compaction_messages(messages), tools=None, max_tokens=4,
                            session="ses_another_one")
        stats = await server.app[CACHE_STATS]()
        # opencode's own request names a limit; one that names none is continued too, its
        # answer given the room the continuation leaves (not the client's prompt's).
        unlimited = await client.chat.completions.create(
            model="small", messages=compaction_messages(messages), temperature=0,
            extra_body={"tandem_forced_output": "A summary."},
            extra_headers={"x-session-id": SESSION})
    assert resp.usage.model_extra["tandem"]["compaction"] == {"served": "as_sent",
                                                              "why": "guard"}
    assert _cache(resp)["source"] != "continuation"
    # Another session holds no record here: served as sent too.
    assert other.usage.model_extra["tandem"]["compaction"] == {"served": "as_sent",
                                                               "why": "no_record"}
    assert stats["compaction"]["guard_misses"] == {"guard": 1, "no_record": 1}
    assert stats["compaction"]["continuations"] == 0
    assert _cache(unlimited)["source"] == "continuation", unlimited.usage
    assert unlimited.choices[0].message.content == "A summary."


@pytest.mark.parametrize("others,where", [(1, "park"), (2, "spill")])
async def test_a_compaction_continues_its_session_from_the_park_or_the_spill(
        small_loaded, make_config, serve, sdk, others, where):
    # One slot and no state store: another session parks this one, a third gives its park up
    # (written to the spill as it was parked).
    config = make_config(allow_forced_output=True, window=4096, parallel=1)
    config = msgspec.structs.replace(
        config, speculation=SpeculationConfig(speculation="off"), cache=CacheConfig(store=False),
        disk=DiskConfig(disk_cache_min_free_gb=0, disk_cache_min_tokens=1 << 20),
        spill=SpillConfig(session_spill_min_tokens=64, session_spill_park_min_tokens=64))
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        messages = await _session(client)
        for k in range(others):
            await _chat(client, [{"role": "system", "content": f"Agent {k} of another folder. "
                                  * 40}, {"role": "user", "content": "List the files."}],
                        "Listing.\n</think>\n\nsrc/ tests/", session=f"ses_other_{k}")
        resp = await _chat(client, compaction_messages(messages), tools=None, max_tokens=4)
    compaction = resp.usage.model_extra["tandem"]["compaction"]
    assert compaction["served"] == "continuation" and compaction["where"] == where, compaction
    cache = _cache(resp)
    assert cache["source"] == "continuation" and cache["resumed_from"] == where, cache
    assert cache["reread"] == compaction["turn_tokens"]


async def test_a_summary_written_ahead_while_idle_answers_the_compaction_without_the_engine(
        small_loaded, make_config, serve, sdk):
    """The preparer (tandem/actors/compaction_preparer.py) writes the continuation of the
    session's conversation ahead, with the system text and instructions this client last sent;
    the next compaction request at that end anchor is answered from it (source ``prepared``)
    with the tokens a continuation would have decoded (the greedy gate, against a server that
    prepares nothing)."""
    import asyncio

    from tandem.server.keys import SUPERVISOR

    base = make_config(allow_forced_output=True, window=4096)
    config = msgspec.structs.replace(base, compaction=CompactionConfig(
        compaction_idle_s=0.2, compaction_min_tokens=64))

    async def flow(config, prepare: bool):
        async with serve(build_app(config, small_loaded)) as server:
            if prepare:
                server.app[SUPERVISOR].actors["compaction_preparer"].max_tokens = 12
            client = sdk(server)
            compact = compaction_messages(await _session(client))
            first = await _chat(client, compact, tools=None, max_tokens=12)
            if prepare:
                async with asyncio.timeout(60):
                    while (await server.app[CACHE_STATS]())["compaction_preparer"][
                            "finished"] < 1:
                        await asyncio.sleep(0.05)
            again = await _chat(client, compact, tools=None, max_tokens=12)
            return first, again, await server.app[CACHE_STATS]()

    first, again, stats = await flow(config, True)
    assert _cache(first)["source"] == "continuation"
    assert _cache(again)["source"] == "prepared", _cache(again)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert again.usage.model_extra["tandem"]["compaction"]["served"] == "prepared"
    assert stats["compaction_preparer"]["served"] == 1
    off = msgspec.structs.replace(config, home=config.home + "-off", compaction=CompactionConfig(
        compaction_prepare="off"))
    _, want, _ = await flow(off, False)
    assert _cache(want)["source"] == "continuation"
    assert again.choices[0].message.content == want.choices[0].message.content
    assert again.usage.completion_tokens == want.usage.completion_tokens
