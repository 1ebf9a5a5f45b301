"""What the OpenAI routes share: config, tokenizer, the engine actor, journal and metrics."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from tandem.actors import Actor, ActorStopped, Supervisor
from tandem.actors.engine_messages import CancelGeneration
from tandem.config import Config
from tandem.server.journal import Journal
from tandem.server.metrics import Metrics


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that names no sampling gets: the checkpoint's generation_config.json
    (``do_sample: false`` is greedy), else OpenAI's defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_model_dir(cls, path: Path | None) -> SamplingDefaults:
        if path is None or not (path / "generation_config.json").is_file():
            return cls()
        try:
            raw = json.loads((path / "generation_config.json").read_text())
        except ValueError:
            return cls()
        if raw.get("do_sample") is False:
            return cls(temperature=0.0)
        return cls(temperature=float(raw.get("temperature", 1.0)),
                   top_p=float(raw.get("top_p", 1.0)), top_k=int(raw.get("top_k", 0) or 0))


@dataclass
class ServerState:
    config: Config
    tokenizer: Any  # tandem.models.tokenizer.Tokenizer
    model_name: str
    engine: Actor  # answers Generate / CancelGeneration / Drain and has snapshot()
    journal: Journal
    metrics: Metrics
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    chat_template: str | None = None
    created_s: int = field(default_factory=lambda: int(time.time()))
    supervisor: Supervisor | None = None
    ask_timeout_s: float = 10.0  # waiting for room in the engine's mailbox and its reply
    recorder: Any = None  # a tandem.replay.record.Recorder when record_dir is set
    # The key of the sessions' hashes (tandem.server.sessions.load_secret: the home's).
    session_secret: bytes = b""
    response_cache: Any = None  # a tandem.cache.response.ResponseCache when response_cache is on
    # The compaction requests' counters (tandem.server.compaction.CompactionCounts).
    compaction: Any = None
    images: Any = None  # the model's vision tower and processor (vision.ImageSupport); None: none
    # where the model runs and its weights' dtype, as /health reports them ("cuda:0", "bfloat16")
    device: str = "cpu"
    dtype: str = ""

    def __post_init__(self) -> None:
        if self.compaction is None:
            from tandem.server.compaction import CompactionCounts

            self.compaction = CompactionCounts(mode=self.config.compaction.compaction)
        if self.recorder is None and (folder := self.config.record_path()) is not None:
            from tandem.replay.record import Recorder

            self.recorder = Recorder(folder)

    def created_now(self) -> int:
        return int(time.time())

    def cancel_later(self, request_id: str, choice: int | None = None) -> None:
        """Tell the engine to cancel once its mailbox has room, from a supervisor-owned task
        (``choice``: that choice of the request alone)."""

        async def send() -> None:
            try:
                await self.engine.tell(CancelGeneration(request_id, choice), sender="server")
            except ActorStopped:
                pass  # a stopped engine runs nothing

        if self.supervisor is not None and self.supervisor.running:
            self.supervisor.spawn(send(), name=f"cancel:{request_id}")

    @property
    def window(self) -> int:
        snap = self.engine.snapshot()
        return snap.get("window") or self.config.engine.window

    @property
    def draining(self) -> bool:
        return bool(getattr(self.engine, "draining", False))


STATE: web.AppKey[ServerState] = web.AppKey("tandem_state", ServerState)
