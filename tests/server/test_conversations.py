"""Real clients' conversations through the HTTP server with the OpenAI SDK, on the small real
model. The engine is made to write realistic answers (reasoning, tool calls) through the admin
field tandem_forced_output; every later turn must resume at the end anchor (greedy gate: these
states were written by decoding), through the end alignment where the client's copy differs
from the rows (re-tokenised text, compacted tool-call JSON, stripped reasoning)."""

import msgspec
import pytest
from opencode_copy import opencode_copy

from tandem.server.app import build_app
from tandem.server.keys import CACHE_STATS

SYSTEM = ("You are opencode, an interactive CLI agent for software engineering tasks. "
          "Working directory: /home/user/project. Today's date: 2026-11-29. " * 12)
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"The {name} tool. " * 6,
    "parameters": {"type": "object", "properties": {
        "filePath": {"type": "string", "description": "Absolute path of the file"},
        "limit": {"type": "integer", "description": "Lines to read"}},
        "required": ["filePath"]}}}
    for name in ("read", "write", "edit", "bash", "glob", "grep", "list", "patch", "todo", "web")]


@pytest.fixture
async def server(small_loaded, make_config, serve):
    app = build_app(make_config(allow_forced_output=True, window=8192, parallel=1), small_loaded)
    async with serve(app) as server:
        yield server


def _cache(resp) -> dict:
    return resp.usage.model_extra["tandem"]["cache"]


async def _chat(client, messages, forced, **kw):
    extra = {"tandem_forced_output": forced, **kw.pop("extra_body", {})}
    return await client.chat.completions.create(model="small", messages=messages,
                                                max_tokens=200, temperature=0,
                                                extra_body=extra, **kw)


async def test_an_opencode_conversation_resumes_every_turn_at_the_end_anchor(server, sdk):
    client = sdk(server)
    headers = {"x-session-id": "ses_opencode_1"}
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Fix the failing test in src/app.py"}]
    first = await _chat(client, messages, "The test is in src/app.py; I should read it.\n"
                        "</think>\n\n<tool_call>\n{\"name\": \"read\", \"arguments\": "
                        "{\"filePath\": \"/home/user/project/src/app.py\"}}\n</tool_call>",
                        tools=TOOLS, extra_headers=headers)
    assert _cache(first)["source"] == "cold"
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].function.name == "read"
    # The title request of the first turn: its own system text, no tools: a guest.
    title = await _chat(client, [{"role": "system", "content": "Generate a short title."},
                                 {"role": "user", "content": "Fix the failing test"}],
                        "Title.\n</think>\n\nFixing a failing test", extra_headers=headers)
    assert title.choices[0].message.content == "Fixing a failing test"
    results = ["def add(a, b):\n    return a - b\n", "1 failed: test_add expected 3 got -1"]
    prompt_before = first.usage.prompt_tokens
    for turn, result in enumerate(results):
        # opencode sends the reasoning back as reasoning_content and the arguments compacted.
        messages += opencode_copy(msg, result)
        resp = await _chat(client, messages, f"Step {turn + 2}: run the tests.\n</think>\n\n"
                           "<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"filePath\": "
                           "\"pytest -q\"}}\n</tool_call>", tools=TOOLS, extra_headers=headers)
        cache = _cache(resp)
        assert cache["source"] == "end", cache
        # Only the tool result and the template's glue are forwarded, not the history.
        assert cache["reread"] < 60, cache
        assert resp.usage.prompt_tokens > prompt_before
        assert resp.usage.prompt_tokens_details.cached_tokens == resp.usage.prompt_tokens \
            - cache["reread"]
        prompt_before = resp.usage.prompt_tokens
        msg = resp.choices[0].message


async def test_an_open_webui_chat_without_its_reasoning_resumes_at_the_end_through_alignment(
        server, sdk):
    client = sdk(server)
    question = ("Here is my essay draft; tell me what to improve. " + "The essay text. " * 300)
    messages = [{"role": "user", "content": question}]
    first = await _chat(client, messages, "The user wants feedback on the essay.\n</think>\n\n"
                        "Your essay repeats one sentence; vary it.")
    answer = first.choices[0].message
    assert answer.content == "Your essay repeats one sentence; vary it."
    assert answer.model_extra["reasoning_content"]
    for turn in range(2):
        # The follow-up suggestions request: one user message holding the chat as text.
        follow = await _chat(client, [{"role": "user", "content": "Suggest 3 follow-up "
                                       "questions for this chat: ### Task ..."}],
                             "Ok.\n</think>\n\n[\"Why?\", \"How?\", \"What next?\"]")
        assert _cache(follow)["source"] == "cold"
        # Open WebUI sends the answer back with its reasoning stripped.
        messages += [{"role": "assistant", "content": answer.content},
                     {"role": "user", "content": f"Thanks. Question {turn}: and the ending?"}]
        resp = await _chat(client, messages, f"Answer {turn}.\n</think>\n\nEnd it with a "
                           "question.")
        cache = _cache(resp)
        assert cache["source"] == "end", cache
        assert cache["aligned"] == "reasoning"
        assert cache["end_replayed"] > 0 and cache["reread"] < 40
        answer = resp.choices[0].message
    stats = (await server.app[CACHE_STATS]())["tiers"]["resident"]
    assert stats["alignments"] == {"reasoning": 2} and stats["guests"] == 2


async def test_forced_output_is_refused_unless_the_server_allows_it(small_loaded, make_config,
                                                                    serve, sdk):
    app = build_app(make_config(), small_loaded)
    async with serve(app) as server:
        with pytest.raises(Exception) as info:
            await _chat(sdk(server), [{"role": "user", "content": "Hi"}], "forced")
        assert info.value.status_code == 403


async def test_a_short_open_webui_chat_comes_back_from_the_park_at_its_end(server, sdk):
    """A chat too short for its follow-up requests to be guests: each follow-up (no session
    key, parts from the rows) parks the chat with its end; the next turn's copy, its reasoning
    stripped, aligns to the parked end and the park swaps it back (greedy gate)."""
    client = sdk(server)
    messages = [{"role": "user", "content": "Name a colour."}]
    first = await _chat(client, messages, "A short answer will do.\n</think>\n\nBlue.")
    answer = first.choices[0].message
    for turn in range(2):
        follow = await _chat(client, [{"role": "user", "content": "Suggest 3 follow-up "
                                       "questions for this chat: ### Task ... " * 3}],
                             "Ok.\n</think>\n\n[\"Why?\", \"How?\"]")
        assert not follow.usage.model_extra["tandem"]["cache"]["source"] == "park"
        messages += [{"role": "assistant", "content": answer.content},
                     {"role": "user", "content": f"Another one, please ({turn})."}]
        resp = await _chat(client, messages, f"Again {turn}.\n</think>\n\nGreen.")
        cache = _cache(resp)
        assert (cache["source"], cache["aligned"]) == ("park", "reasoning"), cache
        assert cache["reread"] < 30
        answer = resp.choices[0].message
    stats = (await server.app[CACHE_STATS]())["tiers"]["resident"]
    assert stats["park_hits"] == 2 and stats["guests"] == 0


async def test_an_open_webui_chat_whose_park_was_taken_comes_back_from_the_store(server, sdk):
    """After the first answer Open WebUI sends a title, a tags and a follow-up request, each
    the chat as text and too long to be a guest: the second one's park takes the slot from the
    chat. The chat's next copy, its reasoning stripped, aligns with the rows of the turn's
    session snapshot, and the state store resumes it there (greedy gate)."""
    client = sdk(server)
    messages = [{"role": "user", "content": "Name a colour."}]
    first = await _chat(client, messages, "A short answer will do.\n</think>\n\nBlue.")
    answer = first.choices[0].message
    for task in ("a title", "tags", "3 follow-up questions"):
        await _chat(client, [{"role": "user", "content": f"Generate {task} for this chat: "
                              "### Task ... " * 3}], "Ok.\n</think>\n\n[\"x\"]")
    messages += [{"role": "assistant", "content": answer.content},
                 {"role": "user", "content": "Another one, please."}]
    resp = await _chat(client, messages, "Again.\n</think>\n\nGreen.")
    cache = _cache(resp)
    assert (cache["source"], cache["aligned"]) == ("store", "reasoning"), cache
    assert cache["reread"] < 30
    stats = (await server.app[CACHE_STATS]())["tiers"]
    assert stats["resident"]["aligned_to_store"] == 1 and stats["store"]["session_hits"] == 1


async def test_an_answer_cut_inside_its_reasoning_resumes_at_the_end_when_sent_back_empty(
        small_loaded, make_config, serve, sdk, tmp_path):
    """max_tokens came inside the reasoning: the answer is empty and Open WebUI sends it back
    so, <think>\\n\\n</think>\\n\\n. The copy aligns with the rows (their reasoning left out,
    the copy's </think> after it), the turn resumes at the end anchor, and its greedy tokens
    are those of a cold prefill of the conversation sent with the reasoning the rows hold
    (greedy gate: the rows were written by decoding)."""
    tok = small_loaded.tokenizer
    forced = "Some thought about the essay and how it ends, then more of it."
    kept = tok.decode(tok.encode(forced)[:5])  # a cut answer's last token is not in the rows
    assert kept == "Some thought about the essay"
    question = "Here is my essay draft; tell me what to improve. " + "The essay text. " * 100
    messages = [{"role": "user", "content": question}]
    follow = {"role": "user", "content": "And the ending?"}
    app = build_app(make_config(allow_forced_output=True, window=8192, parallel=1),
                    small_loaded)
    async with serve(app) as server:
        client = sdk(server)
        first = await client.chat.completions.create(
            model="small", messages=messages, max_tokens=6, temperature=0,
            extra_body={"tandem_forced_output": forced})
        assert first.choices[0].finish_reason == "length"
        assert not first.choices[0].message.content
        assert first.choices[0].message.model_extra["reasoning_content"]
        resumed = await client.chat.completions.create(
            model="small", messages=messages + [{"role": "assistant", "content": ""}, follow],
            max_tokens=8, temperature=0)
    cache = _cache(resumed)
    assert (cache["source"], cache["aligned"]) == ("end", "reasoning"), cache
    assert cache["end_replayed"] == 5 and cache["reread"] < 20, cache
    # a server of its own home: nothing the first wrote (its spill) is read
    fresh = msgspec.structs.replace(make_config(window=8192, parallel=1),
                                    home=str(tmp_path / "cold"))
    async with serve(build_app(fresh, small_loaded)) as server:
        cold = await sdk(server).chat.completions.create(
            model="small", messages=messages + [
                {"role": "assistant", "content": "", "reasoning_content": kept}, follow],
            max_tokens=8, temperature=0)
    assert _cache(cold)["source"] == "cold"
    # the prompt the engine read (the rows' reasoning injected) is the cold one's, token for
    # token in length; the client's copy is shorter by that reasoning
    assert cache["cached"] + cache["reread"] == cold.usage.prompt_tokens
    assert resumed.usage.model_extra["tandem"]["parts"]["injected"] == 6  # five rows and a \n
    got, want = resumed.choices[0].message, cold.choices[0].message
    assert (got.model_extra.get("reasoning_content"), got.content) == (
        want.model_extra.get("reasoning_content"), want.content)
