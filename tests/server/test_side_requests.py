"""Open WebUI's side requests (tandem/server/side.py) through the HTTP server, on the small real
model: after a chat's first answer, its title, tags and follow-up requests and, before the next
turn, a search-query request, each one user message opening with ``### Task:`` that holds the
chat as text and is longer than the chat. Marked, they keep nothing, so the chat's second turn,
its copy without the first answer's reasoning, resumes at the end anchor of its first turn and
forwards only the new message: the same cache figures as the same chat on a server that saw no
side request. With one slot they run as guests over the stash; with four, in an empty slot (the
fourth, unmarked, would have displaced the chat: three slots hold the first three).

Greedy gate: the side requests' greedy answers are the same with the rule on and off (they run
cold either way, on the same grid), and so is the second turn's against the undisturbed chat.
"""

import json

import msgspec
import pytest
from multidict import CIMultiDict

from tandem.server.app import build_app
from tandem.server.keys import CACHE_STATS
from tandem.server.sessions import hash_session, load_secret, session_key
from tandem.server.side import is_side_request

QUESTION = ("I am planning a small vegetable garden on a balcony that gets morning sun. What "
            "should I grow first, and how deep do the pots need to be? ") * 6
REASONING = "The user asks about a balcony garden; morning sun suits leafy greens."
ANSWER = "Start with lettuce and herbs in pots 20 cm deep."
FOLLOW = "And what about tomatoes?"
CHAT_ID = "3f2a9c1e-chat-of-someone"
# The openings of Open WebUI's task templates (its DEFAULT_*_PROMPT_TEMPLATE), then the chat.
AFTER_ANSWER = [
    "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.",
    "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history, "
    "along with 1-3 more specific subtopic tags.",
    "### Task:\nSuggest 3-5 relevant follow-up questions or prompts that the user might "
    "naturally ask next in this conversation as a **user**, based on the chat history.",
]
BEFORE_TURN = ("### Task:\nAnalyze the chat history to determine the necessity of generating "
               "search queries, in the given language.")


def _cache(resp) -> dict:
    return resp.usage.model_extra["tandem"]["cache"]


def _task(opening: str, follow: str | None = None) -> list[dict]:
    history = f"USER: {QUESTION}\nASSISTANT: {ANSWER}"
    if follow is not None:
        history += f"\nUSER: {follow}"
    return [{"role": "user", "content": f"{opening}\n### Guidelines:\n- Be brief.\n"
             f"### Chat History:\n<chat_history>\n{history}\n</chat_history>"}]


async def _chat(client, messages, chat_id, forced=None, max_tokens=8):
    extra = {} if forced is None else {"tandem_forced_output": forced}
    headers = {} if chat_id is None else {"X-OpenWebUI-Chat-Id": chat_id}
    return await client.chat.completions.create(model="small", messages=messages,
                                                max_tokens=max_tokens, temperature=0,
                                                extra_body=extra, extra_headers=headers)


async def _open_webui(client, *, tasks: bool, chat_id: str | None = None):
    """The chat's two turns (the first forced: reasoning, then the answer; the second greedy,
    its copy without the reasoning) and, with ``tasks``, the side requests between them
    (greedy). Returns (first, side responses, second)."""
    messages = [{"role": "user", "content": QUESTION}]
    first = await _chat(client, messages, chat_id, f"{REASONING}\n</think>\n\n{ANSWER}",
                        max_tokens=120)
    assert first.choices[0].message.content == ANSWER
    side = []
    if tasks:
        for opening in AFTER_ANSWER:
            side.append(await _chat(client, _task(opening), chat_id))
        side.append(await _chat(client, _task(BEFORE_TURN, FOLLOW), chat_id))
    # Open WebUI sends the answer back without its reasoning.
    messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FOLLOW}]
    return first, side, await _chat(client, messages, chat_id)


def _said(resp) -> tuple:
    message = resp.choices[0].message
    return (message.model_extra.get("reasoning_content"), message.content,
            resp.usage.completion_tokens)


@pytest.mark.parametrize("parallel,chat_id", [(1, None), (4, None), (4, CHAT_ID)],
                         ids=["one_slot", "four_slots", "four_slots_chat_id"])
async def test_side_requests_longer_than_the_chat_leave_its_next_turn_at_its_end(
        small_loaded, make_config, serve, sdk, parallel, chat_id):
    config = make_config(allow_forced_output=True, window=2048, parallel=parallel)
    async with serve(build_app(config, small_loaded)) as server:
        first, side, second = await _open_webui(sdk(server), tasks=True, chat_id=chat_id)
        stats = await server.app[CACHE_STATS]()
    journal = [json.loads(line) for line in config.journal_path().read_text().splitlines()]
    # Each reference in a home of its own: the spill would bring this one's chat back.
    alone_config = msgspec.structs.replace(config, home=config.home + "-alone")
    async with serve(build_app(alone_config, small_loaded)) as server:
        _, _, alone = await _open_webui(sdk(server), tasks=False, chat_id=chat_id)
        stats_alone = await server.app[CACHE_STATS]()
    unmarked = make_config(allow_forced_output=True, window=2048, parallel=parallel,
                           side_requests=False)
    unmarked = msgspec.structs.replace(unmarked, home=config.home + "-unmarked")
    async with serve(build_app(unmarked, small_loaded)) as server:
        _, side_unmarked, _ = await _open_webui(sdk(server), tasks=True, chat_id=chat_id)

    for resp in side:  # each longer than the chat, as Open WebUI's are
        assert resp.usage.prompt_tokens > first.usage.prompt_tokens
        assert resp.usage.model_extra["tandem"]["side"] is True
        assert _cache(resp)["slot"] != _cache(first)["slot"] or parallel == 1
    cache = _cache(second)
    assert (cache["source"], cache["aligned"]) == ("end", "reasoning"), cache
    # Nothing re-read beyond the new message: the figures of the chat that was never left.
    assert cache == _cache(alone), (cache, _cache(alone))
    assert second.usage.prompt_tokens_details.cached_tokens \
        == alone.usage.prompt_tokens_details.cached_tokens
    assert cache["reread"] < 24  # the new user message and the turn markers
    assert "side" not in second.usage.model_extra["tandem"]
    assert _said(second) == _said(alone)
    # The greedy gate for the side requests: the same answers without the rule.
    assert [_said(r) for r in side] == [_said(r) for r in side_unmarked]
    # Kept nothing: no park, no store snapshot of theirs (the prefix snapshots are the lone
    # chat's; one session put decided a chat turn, none a side request), each a guest.
    assert stats["owners"]["park"]["parks"] == 0
    store, store_alone = stats["tiers"]["store"], stats_alone["tiers"]["store"]
    assert store["prefix_puts"] == store_alone["prefix_puts"]
    assert store["session_puts"] + store["declined_short"] + store["declined_big"] == 2
    assert stats["tiers"]["resident"]["guests"] == len(side)
    rows = [row for row in journal if row.get("route") == "chat"]
    assert [bool((row.get("extra") or {}).get("side")) for row in rows] \
        == [False, True, True, True, True, False]
    assert all((row.get("extra") or {}).get("guest") for row in rows[1:5])
    if chat_id is not None:
        # The chat id is the session of the chat's turns and of its side requests, hashed.
        assert len({row["session"] for row in rows}) == 1
        assert rows[0]["session"] is not None and CHAT_ID not in json.dumps(journal)


async def test_a_task_text_in_an_earlier_message_does_not_mark_the_request(
        small_loaded, make_config, serve, sdk):
    config = make_config(window=2048)
    messages = [{"role": "user", "content": "### Task:\nSummarise what follows."},
                {"role": "assistant", "content": "Send it."},
                {"role": "user", "content": QUESTION}]
    async with serve(build_app(config, small_loaded)) as server:
        resp = await _chat(sdk(server), messages, None)
    assert "side" not in resp.usage.model_extra["tandem"]
    assert not is_side_request(messages)


def test_only_the_last_user_message_s_opening_marks_a_side_request():
    task = "### Task:\nGenerate a concise title."
    assert is_side_request([{"role": "user", "content": task}])
    assert is_side_request([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "\n  " + task}])
    assert is_side_request([{"role": "user", "content": [{"type": "text", "text": task}]}])
    # A task after the user's message, an assistant's prefill after the task.
    assert is_side_request([{"role": "user", "content": task},
                            {"role": "assistant", "content": "{"}])
    assert not is_side_request([{"role": "user", "content": "Quote: " + task}])
    assert not is_side_request([{"role": "user", "content": task},
                                {"role": "assistant", "content": "Ok."},
                                {"role": "user", "content": "Thanks."}])
    assert not is_side_request([{"role": "assistant", "content": task}])
    assert not is_side_request([])


def test_open_webui_s_chat_id_is_the_session_unless_another_key_is_given(tmp_path):
    secret = load_secret(tmp_path)
    chat = CIMultiDict({"X-OpenWebUI-Chat-Id": CHAT_ID})
    assert session_key({}, chat, secret) == hash_session(CHAT_ID, secret)
    assert session_key({}, CIMultiDict(chat, **{"X-Session-Id": "other"}), secret) \
        == hash_session("other", secret)
    assert session_key({"conversation_id": "c1"}, chat, secret) == hash_session("c1", secret)
