"""One generation injected into an engine actor through the harness, read to its end."""

from __future__ import annotations

from tandem.actors.engine_messages import (Generate, GenerationFailed, GenerationFinished,
                                           GenerationParams, TokenGenerated)


async def run_generation(harness, client, request_id: str, prompt: list[int],
                         max_tokens: int = 4, session: str | None = None, timeout_s: float = 20):
    """The tokens the engine generated and the generation's last event (finished or failed)."""
    await harness.ask("engine", Generate(request_id, list(prompt),
                                         GenerationParams(max_tokens=max_tokens),
                                         reply_to=client, session=session))
    tokens = []
    while True:
        got = await client.expect((TokenGenerated, GenerationFinished, GenerationFailed),
                                  timeout_s)
        if isinstance(got, TokenGenerated):
            tokens.append(got.token_id)
        else:
            return tokens, got
