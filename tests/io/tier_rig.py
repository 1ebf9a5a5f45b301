"""Writing a prompt's chunk and anchor files as a cold prefill passes its lines, and restoring a
fresh engine from them, as the disk tier's writer and reader will."""

from __future__ import annotations

import torch

from tandem.cache.copies import SectionsCopy
from tandem.cache.namespace import SHARED, Namespace
from tandem.engine import Engine
from tandem.io.chain import Key, chain_keys
from tandem.io.fingerprint import Identity
from tandem.io.tierfile import TierFiles
from tandem.io.tierindex import TierIndex, scan

GRID = 64
FP = "0f" * 32
ACCEPT = Identity(FP)


def tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model, window: int = 512) -> Engine:
    return Engine(model, window=window, prefix_chunk=GRID)


def write_prompt(files: TierFiles, model, prompt: list[int], lines: list[int],
                 namespace: Namespace = SHARED, fingerprint: str = FP,
                 chunks: bool = True) -> tuple[Engine, torch.Tensor, list[Key]]:
    """A cold prefill of ``prompt``; every chunk up to the highest of ``lines`` and an anchor at
    each of them, its sections taken as the prefill passed the line. Returns the cold engine, its
    logits and the prompt's chain."""
    cold = engine(model)
    taken: dict[int, SectionsCopy] = {}

    def on_chunk(end: int) -> None:
        if end in lines:
            taken[end] = SectionsCopy.take(cold.cache_state())

    logits = cold.prefill(prompt, on_chunk=on_chunk)
    chain = chain_keys(prompt, GRID, namespace)
    state = cold.cache_state()
    if chunks:
        for i in range(max(lines) // GRID):
            files.write_chunk(chain[i], prompt[i * GRID:(i + 1) * GRID], state.views,
                              i * GRID, (i + 1) * GRID, fingerprint=fingerprint, grid=GRID)
    for line in lines:
        n = line // GRID
        files.write_anchor(chain[n - 1], line, chain[:n], taken[line].tensors,
                           fingerprint=fingerprint, grid=GRID)
    return cold, logits, chain


def restore(files: TierFiles, eng: Engine, prompt: list[int], index: TierIndex | None = None,
            namespace: Namespace = SHARED) -> int:
    """Resume ``eng`` at the longest usable anchor of ``prompt`` on disk, every chunk below it
    read and checked before any is written into the engine. The line resumed at (0: none)."""
    if index is None:
        index, _ = scan(files, ACCEPT, GRID)
    hit = index.longest_anchor(chain_keys(prompt, GRID, namespace))
    if hit is None:
        return 0
    state = eng.cache_state()
    rows = [files.read_chunk(key, ACCEPT, token_ids=prompt[i * GRID:(i + 1) * GRID],
                             like=state, grid=GRID).rows
            for i, key in enumerate(hit.chunks)]
    anchor = files.read_anchor(hit.anchor.key, ACCEPT, like=state, grid=GRID)
    for r in rows:
        r.restore(state)
    anchor.sections.restore(state)
    eng.resume_at(hit.line, prompt, taint=None)
    return hit.line
