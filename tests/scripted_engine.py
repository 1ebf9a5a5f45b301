"""A stand-in for tandem.engine.Engine whose output is scripted, for the engine actor and the
routes: it "generates" given token ids, optionally one at a time as a test opens a gate."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from tandem.engine import ContextOverflow, GenerationResult, SamplingParams


class ScriptedEngine:
    def __init__(self, script: Sequence[int] | Callable[[list[int]], Sequence[int]] = (),
                 *, window: int = 4096, prefix_chunk: int = 64, gated: bool = False,
                 fail_with: BaseException | None = None) -> None:
        self.script = script
        self.window = window
        self.prefix_chunk = prefix_chunk
        self.num_threads = 1
        self.taint: int | None = None
        self.token_ids: list[int] = []
        self.gate = threading.Semaphore(0) if gated else None
        self.fail_with = fail_with
        self.threads: set[int] = {threading.get_ident()}  # built on the engine thread
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []  # of every generation, as the engine got them
        self.running = threading.Event()  # set while generate runs
        self.resets = 0

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def reset(self) -> None:
        """The rows are gone (after a failed request)."""
        self.resets += 1
        self.token_ids = []
        self.taint = None

    def step(self, n: int = 1) -> None:
        """Let ``n`` more tokens out (gated engines)."""
        for _ in range(n):
            self.gate.release()

    def _wait_gate(self, should_cancel) -> bool:
        """Wait for the test to let a token out; False when cancelled meanwhile (a real engine
        would see the cancel after its token in progress)."""
        for _ in range(2000):
            if self.gate.acquire(timeout=0.005):
                return True
            if should_cancel is not None and should_cancel():
                return False
        raise TimeoutError("the test never let the next token out")

    def generate(self, prompt_ids, params: SamplingParams, on_token=None, should_cancel=None,
                 on_chunk=None, force=None) -> GenerationResult:
        self.threads.add(threading.get_ident())
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        self.running.set()
        try:
            if self.fail_with is not None:
                raise self.fail_with
            if len(prompt_ids) > self.window:
                raise ContextOverflow(len(prompt_ids), self.window)
            n = len(self.token_ids)
            reuse = n if n < len(prompt_ids) and list(prompt_ids[:n]) == self.token_ids else 0
            script = self.script(list(prompt_ids)) if callable(self.script) else self.script
            out: list[int] = []
            finish, stop_token = "stop", None
            for scripted in script:
                token = scripted
                if force is not None and (forced := force(out)) is not None:
                    token = forced
                if len(out) >= params.max_tokens:
                    finish = "length"
                    break
                if self.gate is not None and not self._wait_gate(should_cancel):
                    finish = "cancelled"
                    break
                if token in params.stop_token_ids:
                    stop_token = token
                    break
                out.append(token)
                if on_token is not None and on_token(token):
                    break
                if should_cancel is not None and should_cancel():
                    finish = "cancelled"
                    break
            self.token_ids = list(prompt_ids) + out[:-1]
            if out and self.taint is None:
                self.taint = len(prompt_ids)
            return GenerationResult(token_ids=out, finish_reason=finish,
                                    prompt_tokens=len(prompt_ids), reused_tokens=reuse,
                                    prefill_ms=1.0, decode_ms=float(len(out)),
                                    stop_token=stop_token)
        finally:
            self.running.clear()
