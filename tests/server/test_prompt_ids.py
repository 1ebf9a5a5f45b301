"""A prompt of token ids on /v1/completions: checked in C-speed passes (a 100k-token prompt was
two Python loops of the event loop's). Plain ints inside the vocabulary are served; a bool, a
float, a string among ints, or an id outside the vocabulary is a 400 naming the prompt, the
first bad id in the message."""

import aiohttp

from tandem.server.app import build_app


async def test_token_id_prompts_are_checked_and_bad_ones_are_400s(small_loaded, make_config,
                                                                  serve):
    vocab = small_loaded.tokenizer.vocab_size  # the ids a prompt may name
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{server.port}/v1/completions"

        async def post(prompt):
            body = {"model": "small", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            async with http.post(url, json=body) as resp:
                return resp.status, await resp.json()

        status, doc = await post([11, 12, 13, vocab - 1, 0])
        assert status == 200, doc
        assert doc["usage"]["prompt_tokens"] == 5
        status, wrapped = await post([[11, 12, 13, vocab - 1, 0]])  # one prompt in a list
        assert status == 200 and wrapped["choices"][0]["text"] == doc["choices"][0]["text"]
        for prompt, bad in (([11, -1, 12], -1), ([11, vocab, -5], vocab),
                            ([vocab + 7] * 3, vocab + 7)):
            status, doc = await post(prompt)
            assert status == 400, (prompt, doc)
            assert doc["error"]["param"] == "prompt"
            assert f"token id {bad} is outside the vocabulary" in doc["error"]["message"]
        for prompt in ([11, True, 12], [11, 1.0], [11, "a"], [11, None], [True]):
            status, doc = await post(prompt)
            assert status == 400, (prompt, doc)
            assert doc["error"]["param"] == "prompt", doc
