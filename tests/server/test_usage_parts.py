"""The usage split (issue 18, part 4): ``usage.tandem.parts`` of a chat with a system text,
tools and history adds up to ``prompt_tokens``; a copy whose reasoning the end alignment put
back counts those rows as ``injected``, so that the five are the prompt the engine read
(cached plus reread); a text prompt is all history."""

from tandem.models.chat import encode_chat
from tandem.server.app import build_app

SYSTEM = "You are a careful assistant who keeps a ledger of words. " * 4
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                          "parameters": {"type": "object", "properties": {
                                              "path": {"type": "string"}}}}}]
QUESTION = "Which words did we keep yesterday, and which ones today? " * 3


def _parts(resp) -> dict:
    return resp.usage.model_extra["tandem"]["parts"]


async def test_the_parts_of_a_chat_add_up_and_a_replayed_span_is_injected(
        small_loaded, make_config, serve, sdk):
    tok = small_loaded.tokenizer
    config = make_config(allow_forced_output=True, window=2048)
    system = {"role": "system", "content": SYSTEM}
    messages = [system, {"role": "user", "content": QUESTION}]
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        first = await client.chat.completions.create(
            model="small", messages=messages, tools=TOOLS, max_tokens=60, temperature=0,
            extra_body={"tandem_forced_output": "Some thought.\n</think>\n\nNone yet."})
        # The copy comes back without its reasoning: the end alignment puts it back.
        messages += [{"role": "assistant", "content": "None yet."},
                     {"role": "user", "content": "And now?"}]
        second = await client.chat.completions.create(
            model="small", messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
        text = await client.completions.create(model="small", prompt=QUESTION, max_tokens=2,
                                               temperature=0)
    p = _parts(first)
    assert p["system"] + p["tools"] + p["history"] + p["images"] == first.usage.prompt_tokens
    # The system text, up to where the template goes on with the tools; then the tools block
    # (with the system turn's close): the head a system text and tools render alone.
    alone = encode_chat(tok, [system], None, add_generation_prompt=False)
    head = len(encode_chat(tok, [system], TOOLS, add_generation_prompt=False))
    assert 0 < p["system"] <= len(alone) and p["system"] + p["tools"] == head
    assert p["tools"] > 0 and p["history"] > 0
    assert p["injected"] == 0
    q = _parts(second)
    cache = second.usage.model_extra["tandem"]["cache"]
    assert cache["source"] == "end" and cache.get("aligned") == "reasoning", cache
    assert q["system"] + q["tools"] + q["history"] == second.usage.prompt_tokens
    assert q["injected"] > 0  # the reasoning rows the copy lacked
    assert sum(q.values()) == cache["cached"] + cache["reread"]
    assert _parts(text) == {"system": 0, "tools": 0, "history": text.usage.prompt_tokens,
                            "injected": 0, "images": 0}
    assert first.usage.model_extra["tandem"]["harness"] is None
