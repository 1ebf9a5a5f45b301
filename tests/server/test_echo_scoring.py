"""max_tokens 0 on /v1/completions (issue 12, part 8): with echo the prompt is scored and
nothing is generated, as OpenAI's legacy completions and vLLM answer it (lm-eval-harness reads a
prompt's log-likelihood that way); without echo there is nothing to generate nor to score: a
400, as vLLM's.

Gates: the prompt's logprobs with max_tokens 0 equal those of the same request with max_tokens 1
exactly (floats compared with ==); the rows a scoring run leaves are a cold prefill's, so the
next request resumed over them answers as a cold server does (bit-exact at a grid line).
"""

from __future__ import annotations

import msgspec
import pytest
from test_logprobs import P, Q, post, quiet, stream

from tandem.server.app import build_app
from tandem.server.keys import JOURNAL

TEXT = "The quick brown fox jumps over the lazy dog."
SCORE = {"model": "small", "max_tokens": 0, "temperature": 0, "echo": True, "logprobs": 3}


@pytest.fixture
async def server(small_loaded, make_config, serve):
    async with serve(build_app(quiet(make_config(parallel=1), response_cache=False),
                               small_loaded)) as s:
        yield s


async def scored(server, prompt, **extra) -> dict:
    status, body = await post(server, "/v1/completions", {**SCORE, "prompt": prompt, **extra})
    assert status == 200, body
    return body


@pytest.mark.parametrize("prompt", [TEXT, P], ids=["text", "three_chunks"])
async def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(server, prompt):
    zero = await scored(server, prompt)
    one = await scored(server, prompt, max_tokens=1)
    choice = zero["choices"][0]
    n = zero["usage"]["prompt_tokens"]
    assert zero["usage"]["completion_tokens"] == 0 and zero["usage"]["total_tokens"] == n
    assert one["usage"]["completion_tokens"] == 1
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert len(zero["choices"]) == 1
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(v) == n for v in lp.values())
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI's
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    # The prompt's part of max_tokens 1's answer, exactly: tokens, floats, tops, offsets.
    assert lp == {k: v[:n] for k, v in one["choices"][0]["logprobs"].items()}
    assert one["choices"][0]["text"].startswith(choice["text"])
    if isinstance(prompt, str):
        assert choice["text"] == prompt == "".join(lp["tokens"])


async def test_a_streamed_scoring_is_one_chunk_of_echo_then_the_finish(server):
    whole = await scored(server, P)
    chunks = await stream(server, "/v1/completions", {
        **SCORE, "prompt": P, "stream_options": {"include_usage": True}})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    echo, finish = choices
    assert echo["text"] == whole["choices"][0]["text"] and echo["finish_reason"] is None
    assert echo["logprobs"] == whole["choices"][0]["logprobs"]
    assert finish["text"] == "" and finish["finish_reason"] == "length"
    assert not any(finish["logprobs"].values())  # no generated token to score
    usage = chunks[-1]["usage"]
    assert not chunks[-1]["choices"] and usage["completion_tokens"] == 0
    assert usage["prompt_tokens"] == usage["total_tokens"] == len(P)


async def test_echo_without_logprobs_and_max_tokens_0_echoes_the_prompt_alone(server):
    body = await scored(server, TEXT, logprobs=None)
    choice = body["choices"][0]
    assert choice["text"] == TEXT and choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    chunks = await stream(server, "/v1/completions", {**SCORE, "prompt": TEXT, "logprobs": None})
    assert [c["choices"][0]["text"] for c in chunks] == [TEXT, ""]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "small", "prompt": TEXT, "max_tokens": 0}),
    ("/v1/completions", {"model": "small", "prompt": TEXT, "max_tokens": 0, "logprobs": 2}),
    ("/v1/completions", {"model": "small", "prompt": TEXT, "max_tokens": 0, "stream": True}),
    ("/v1/completions", {**SCORE, "prompt": TEXT, "max_tokens": -1}),
    ("/v1/chat/completions", {"model": "small", "max_tokens": 0, "echo": True,
                              "messages": [{"role": "user", "content": "hi"}]}),
], ids=["plain", "logprobs", "stream", "negative", "chat"])
async def test_max_tokens_0_without_echo_is_a_400_naming_max_tokens(server, path, body):
    status, answer = await post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == "max_tokens"
    assert answer["error"]["type"] == "invalid_request_error"


async def test_the_openai_sdk_reads_a_scoring(server, sdk):
    done = await sdk(server).completions.create(model="small", prompt=TEXT, max_tokens=0,
                                                temperature=0, logprobs=2, echo=True)
    choice = done.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == done.usage.prompt_tokens
    assert done.usage.completion_tokens == 0


# -- the caches after a scoring run ----------------------------------------------------------


async def answer(server, prompt) -> dict:
    status, body = await post(server, "/v1/completions", {
        "model": "small", "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 5})
    assert status == 200, body
    return body


async def test_after_a_scoring_the_next_requests_answer_as_a_cold_servers(small_loaded,
                                                                        make_config, serve):
    """A scoring run forwards its prompt cold and samples nothing: the prompt-end anchor it
    keeps serves the same prompt again, the rows it leaves at a grid line serve an extension,
    both bit for bit a cold server's; an extension of an off-grid scoring (its end is no grid
    line) holds the greedy gate."""
    config = quiet(make_config(), response_cache=False)
    head, off = P[:128], P + Q  # a grid line; 190, off the grid
    async with serve(build_app(config, small_loaded)) as server:
        await scored(server, head)
        again = await answer(server, head)
        await scored(server, head)
        extended = await answer(server, head + Q)
        await scored(server, off)
        off_extended = await answer(server, off + [7000, 7001])
    assert again["usage"]["tandem"]["cache"]["source"] == "prompt_end"
    assert extended["usage"]["tandem"]["cache"]["cached"] == 128
    assert off_extended["usage"]["tandem"]["cache"]["cached"] == len(off)
    colds = []
    for i, prompt in enumerate((head, head + Q, off + [7000, 7001])):
        # Each in a fresh home: the spill would bring the last server's conversation back.
        fresh = msgspec.structs.replace(config, home=f"{config.home}-cold{i}")
        async with serve(build_app(fresh, small_loaded)) as server:
            colds.append(await answer(server, prompt))
    assert all(c["usage"]["tandem"]["cache"]["source"] == "cold" for c in colds)
    assert again["choices"][0]["logprobs"] == colds[0]["choices"][0]["logprobs"]  # floats, ==
    assert extended["choices"][0]["logprobs"] == colds[1]["choices"][0]["logprobs"]
    assert off_extended["choices"][0]["text"] == colds[2]["choices"][0]["text"]


async def test_a_scoring_run_as_a_guest_puts_the_conversation_back(small_loaded, make_config,
                                                                  serve):
    """A short scoring after a long turn runs as a guest (its stash sized for no output): the
    conversation's next turn resumes where it would have and answers as if it had not come."""
    long = list(range(1000, 1300))
    follow = long + [5000, 5001, 5002]
    config = quiet(make_config(parallel=1), response_cache=False)
    answers = []
    for with_guest in (True, False):
        app = build_app(config, small_loaded)
        async with serve(app) as server:
            await answer(server, long)
            if with_guest:
                guest = await scored(server, long[:70])
                guest_row = app[JOURNAL].tail(1)[-1]
            answers.append(await answer(server, follow))
    after, alone = answers
    assert guest["usage"]["completion_tokens"] == 0 and guest_row["extra"]["guest"] is True
    assert after["usage"]["tandem"]["cache"] == alone["usage"]["tandem"]["cache"]
    assert after["usage"]["tandem"]["cache"]["cached"] == 256  # the anchor under the guest
    assert after["choices"][0]["logprobs"] == alone["choices"][0]["logprobs"]
