"""Fixtures of the OpenAI route tests: a small real model (session-wide), configs under a
temporary home, a running test server and an OpenAI SDK client on it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestServer

from small_hybrid import make_small_hybrid
from tandem.config import Config, EngineConfig, ServerConfig
from tandem.models import load_model
from tandem.server.connections import GuardedRunner


@pytest.fixture(scope="session")
def small_loaded(tmp_path_factory):
    """The small hybrid with the real Qwen tokenizer, loaded once; served as "small"."""
    path = make_small_hybrid(tmp_path_factory.mktemp("models") / "small")
    return load_model(str(path), Path(path).parent, "float32")


@pytest.fixture
def make_config(tmp_path):
    def make(**server: object) -> Config:
        engine = {k: server.pop(k) for k in ("window", "prefix_chunk", "parallel")
                  if k in server}
        return Config(home=str(tmp_path / "home"),
                      server=ServerConfig(**server),
                      engine=EngineConfig(**{"window": 512, "prefix_chunk": 64, **engine}))
    return make


class GuardedTestServer(TestServer):
    """aiohttp's TestServer through tandem's connection guard, as under `tandem serve`."""

    async def _make_runner(self, **kwargs):
        return GuardedRunner(self.app, **kwargs)


@contextlib.asynccontextmanager
async def running(app):
    """The app on 127.0.0.1 with its actors started; handlers are cancelled when a client
    leaves, as under `tandem serve`."""
    server = GuardedTestServer(app, host="127.0.0.1", handler_cancellation=True)
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


def client_for(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none",
                              max_retries=0, timeout=30)


@pytest.fixture
def serve():
    return running


@pytest.fixture
def sdk():
    return client_for
