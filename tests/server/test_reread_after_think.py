"""After a long generation (spec: "After a long generation"): the turn after one that thought
resumes at the end anchor and forwards only what is new, not the previous output; when the
reasoning budget closed the thinking with a hidden phrase, the client's copy lacks it and the
server puts it back (replay). The end anchor holds state decoding wrote: greedy gate."""

import aiohttp
import pytest

from tandem.server.app import build_app
from tandem.server.keys import JOURNAL


@pytest.fixture
async def server(small_loaded, make_config, serve):
    app = build_app(make_config(window=4096, max_reasoning_tokens=10), small_loaded)
    async with serve(app) as server:
        yield server


async def test_the_turn_after_a_budget_closed_thought_rereads_only_what_is_new(server, sdk):
    client = sdk(server)
    messages = [{"role": "user", "content": "Plan the refactor of the parser. " * 40}]
    first = await client.chat.completions.create(model="small", messages=messages,
                                                 max_tokens=120, temperature=0,
                                                 extra_headers={"x-session-id": "s1"})
    answer = first.choices[0].message
    # The random model never closes its reasoning itself: the budget did, with a hidden
    # phrase that is in the rows but not in what the client got.
    assert answer.model_extra["reasoning_content"]
    assert first.usage.completion_tokens < 120
    journal = server.app[JOURNAL].tail(1)[0]
    assert journal["extra"]["hidden_tokens"] > 0
    messages += [{"role": "assistant", "content": answer.content,
                  "reasoning_content": answer.model_extra["reasoning_content"]},
                 {"role": "user", "content": "Go on."}]
    second = await client.chat.completions.create(model="small", messages=messages,
                                                  max_tokens=4, temperature=0,
                                                  extra_headers={"x-session-id": "s1"})
    cache = second.usage.model_extra["tandem"]["cache"]
    assert cache["source"] == "end", cache
    assert cache["end_replayed"] == journal["extra"]["hidden_tokens"]
    # Only the new user turn and the template's glue are forwarded, not the 120-token answer.
    assert cache["reread"] < 30
    stats = (await _get(server, "/v1/cache/stats"))["tiers"]["resident"]
    assert stats["replays"] == 1 and stats["end_hits"] == 1


async def _get(server, path):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{server.port}{path}") as r:
            return await r.json()
