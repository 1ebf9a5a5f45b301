"""An Open WebUI chat whose second turn came back from the state store (its title, tags and
follow-up requests, each the chat as text and too long to be a guest, took the end and the park
from it; side_requests off, so that they are placed as turns, as a client's unrecognised side
requests are: tests/server/test_side_requests.py has them marked): the turn after that, its copy without the reasoning of either answer, must resume at
the end anchor the second turn kept, which costs nothing, and not at the first turn's session
snapshot (a whole copy, and the second turn's text re-read). The end's record must carry the
first turn's regions (where its reasoning is in the rows) across the restore, or the copy no
longer aligns with it. Greedy gate: the last turn's greedy tokens equal those of the same chat
on a server that saw no other request."""

from tandem.server.app import build_app
from tandem.server.keys import CACHE_STATS

QUESTION = ("I am planning a small vegetable garden on a balcony that gets morning sun. What "
            "should I grow first, and how deep do the pots need to be? ") * 8
ANSWERS = [("The user asks about a balcony garden; morning sun suits leafy greens.",
            "Start with lettuce and herbs in pots 20 cm deep."),
           ("A follow-up on tomatoes, which need deeper pots.",
            "Tomatoes want pots of 40 cm and a stake.")]
FOLLOWS = ["And what about tomatoes?", "How often should I water them?"]


def _cache(resp) -> dict:
    return resp.usage.model_extra["tandem"]["cache"]


async def _chat(client, messages, forced=None, max_tokens=120):
    extra = {} if forced is None else {"tandem_forced_output": forced}
    return await client.chat.completions.create(model="small", messages=messages,
                                                max_tokens=max_tokens, temperature=0,
                                                extra_body=extra)


async def _conversation(client, tasks: bool) -> list:
    """Two forced answers (reasoning, then the answer), the client's copies without the
    reasoning, then a greedy third turn; with ``tasks``, Open WebUI's three task requests
    after the first answer. Each turn's response."""
    messages = [{"role": "user", "content": QUESTION}]
    out = []
    for turn, (reasoning, answer) in enumerate(ANSWERS):
        resp = await _chat(client, messages, f"{reasoning}\n</think>\n\n{answer}")
        assert resp.choices[0].message.content == answer
        out.append(resp)
        if tasks and turn == 0:
            history = f"USER: {QUESTION}\nASSISTANT: {answer}"
            for task in ("Generate a concise title", "Generate tags",
                         "Suggest follow-up questions"):
                await _chat(client, [{"role": "user", "content": f"### Task:\n{task}\n"
                                      f"### Chat History:\n<chat_history>\n{history}\n"
                                      "</chat_history>"}], "Ok.\n</think>\n\n{\"x\": 1}")
        # Open WebUI sends the answer back without its reasoning.
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": FOLLOWS[turn]}]
    out.append(await _chat(client, messages, max_tokens=8))
    return out


async def test_the_turn_after_a_store_resume_resumes_at_the_end_anchor(small_loaded, make_config,
                                                                       serve, sdk):
    config = make_config(allow_forced_output=True, window=2048, parallel=1,
                         side_requests=False)
    async with serve(build_app(config, small_loaded)) as server:
        first, second, third = await _conversation(sdk(server), tasks=True)
        stats = (await server.app[CACHE_STATS]())["tiers"]
    async with serve(build_app(config, small_loaded)) as server:
        alone = await _conversation(sdk(server), tasks=False)
    assert _cache(second)["source"] == "store" and _cache(second)["aligned"] == "reasoning"
    cache = _cache(third)
    assert (cache["source"], cache["aligned"]) == ("end", "reasoning"), cache
    # Nothing re-read beyond the new turn: the same reread as the chat that was never left.
    assert cache == _cache(alone[2])
    assert stats["store"]["session_hits"] == 1
    assert third.choices[0].message.model_extra.get("reasoning_content") \
        == alone[2].choices[0].message.model_extra.get("reasoning_content")
    assert third.choices[0].message.content == alone[2].choices[0].message.content
    assert third.usage.completion_tokens == alone[2].usage.completion_tokens
