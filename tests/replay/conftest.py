"""Fixtures of the replay tests: the small real model (session-wide) and configs under a
temporary home, small enough a window and chunk that a library session replays in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from small_hybrid import make_small_hybrid
from tandem.config import Config, EngineConfig, ServerConfig
from tandem.models import load_model

SESSIONS = Path(__file__).resolve().parents[2] / "sessions"


@pytest.fixture(scope="session")
def replay_loaded(tmp_path_factory):
    """The small hybrid with the real Qwen tokenizer, loaded once."""
    path = make_small_hybrid(tmp_path_factory.mktemp("models") / "small")
    return load_model(str(path), Path(path).parent, "float32")


@pytest.fixture
def replay_config(tmp_path, replay_loaded):
    def make(**server: object) -> Config:
        return Config(home=str(tmp_path / "home"),
                      server=ServerConfig(model=str(replay_loaded.path), **server),
                      engine=EngineConfig(window=12288, prefix_chunk=256))
    return make
