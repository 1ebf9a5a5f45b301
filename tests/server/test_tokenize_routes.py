"""/tokenize and /detokenize as vLLM and llama-server have them, on the small real model with the
real Qwen tokenizer: a text, a chat body (the very ids a chat request's prompt has), and the
ids back to their text; every bad form is a 400 naming its field, another model a 404."""

import aiohttp
import pytest

from tandem.models.chat import encode_chat
from tandem.server.app import build_app


async def _post(server, path: str, body) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}{path}", json=body) as resp:
            return resp.status, await resp.json()


async def test_a_text_and_a_chat_body_tokenize_as_the_server_reads_them_and_come_back(
        small_loaded, make_config, serve):
    tok = small_loaded.tokenizer
    text = "Hello there <|im_start|> friend"
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    async with serve(build_app(make_config(), small_loaded)) as server:
        status, vllm = await _post(server, "/tokenize", {"model": "small", "prompt": text})
        _, llama = await _post(server, "/tokenize", {"content": text, "with_pieces": True})
        _, special = await _post(server, "/tokenize", {"prompt": text,
                                                       "add_special_tokens": True})
        _, chat = await _post(server, "/tokenize", {"messages": messages})
        _, back = await _post(server, "/detokenize", {"tokens": vllm["tokens"]})
    assert status == 200
    # A client's text is text: the control token's text is not its id, unless asked for.
    assert vllm["tokens"] == llama["tokens"] == tok.encode_text(text)
    assert special["tokens"] == tok.encode(text, True) != vllm["tokens"]
    assert vllm["count"] == len(vllm["tokens"]) and vllm["max_model_len"] == 512
    assert [p["id"] for p in llama["pieces"]] == llama["tokens"]
    assert chat["tokens"] == encode_chat(tok, messages, None)
    assert back == {"prompt": text, "content": text}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "content": "b"}, "prompt"),
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {"content": "a", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, True]}, "tokens[1]"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens[0]"),
])
async def test_a_bad_body_is_a_400_naming_its_field(small_loaded, make_config, serve, path,
                                                    body, param):
    async with serve(build_app(make_config(), small_loaded)) as server:
        status, doc = await _post(server, path, body)
    assert status == 400 and doc["error"]["param"] == param, doc


async def test_another_model_is_a_404(small_loaded, make_config, serve):
    async with serve(build_app(make_config(), small_loaded)) as server:
        status, doc = await _post(server, "/tokenize", {"model": "gpt-9", "prompt": "x"})
    assert status == 404 and doc["error"]["code"] == "model_not_found"
