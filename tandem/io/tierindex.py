"""What the disk tier holds, by key: its chunks and anchors, and what a prompt's chain finds.

The files are the index: ``scan`` builds a ``TierIndex`` from their verified headers at a start,
deleting what a crash left (``.tmp``), what another fingerprint wrote and what fails its header's
checks. After that the index is pure bookkeeping, kept by whoever writes and deletes the files:
no I/O, no clock, no actor. A prompt's chain (``tandem.io.chain.chain_keys``) is looked up in it:
which of its chunks are on disk, and the longest anchor every chunk below which is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Container, Sequence

import structlog

from tandem.io.chain import Key
from tandem.io.tierfile import FileKind, FingerprintMismatch, TierFileError, TierFiles

log = structlog.get_logger()


@dataclass(frozen=True)
class ChunkEntry:
    key: Key
    start: int
    stop: int
    nbytes: int  # the file's
    fingerprint: str


@dataclass(frozen=True)
class AnchorEntry:
    key: Key
    line: int
    chunks: tuple[Key, ...]  # key(G) ... key(line): every chunk it needs
    nbytes: int
    fingerprint: str


@dataclass(frozen=True)
class AnchorHit:
    """The longest usable anchor of a prompt: resume at ``line`` from ``anchor`` and ``chunks``."""

    line: int
    anchor: AnchorEntry

    @property
    def chunks(self) -> tuple[Key, ...]:
        return self.anchor.chunks


@dataclass
class TierIndex:
    chunks: dict[Key, ChunkEntry] = field(default_factory=dict)
    anchors: dict[Key, AnchorEntry] = field(default_factory=dict)

    # -- bookkeeping ----------------------------------------------------------------------

    def add_chunk(self, entry: ChunkEntry) -> None:
        self.chunks[entry.key] = entry

    def add_anchor(self, entry: AnchorEntry) -> None:
        self.anchors[entry.key] = entry

    def remove(self, kind: FileKind, key: Key) -> bool:
        held = self.chunks if kind == "chunk" else self.anchors
        return held.pop(key, None) is not None

    def has(self, kind: FileKind, key: Key) -> bool:
        return key in (self.chunks if kind == "chunk" else self.anchors)

    @property
    def nbytes(self) -> int:
        return (sum(e.nbytes for e in self.chunks.values())
                + sum(e.nbytes for e in self.anchors.values()))

    # -- a prompt's chain -----------------------------------------------------------------

    def chunks_present(self, chain: Sequence[Key]) -> int:
        """How many of the chain's first chunks are all on disk: rows ``[0, n * G)`` can be
        read from the tier, for ``n`` the answer."""
        n = 0
        for key in chain:
            if key not in self.chunks:
                break
            n += 1
        return n

    def missing_chunks(self, chain: Sequence[Key]) -> list[int]:
        """The indices of the chain's chunks not on disk (the ones a write below a new anchor
        must add)."""
        return [i for i, key in enumerate(chain) if key not in self.chunks]

    def usable(self, anchor: AnchorEntry) -> bool:
        """An anchor serves only with every chunk below it on disk."""
        return all(k in self.chunks for k in anchor.chunks)

    def longest_anchor(self, chain: Sequence[Key], stop: int | None = None) -> AnchorHit | None:
        """The longest anchor of the chain (at most ``stop`` lines up) that is usable and lists
        exactly the chain's chunks below it; None when there is none."""
        top = len(chain) if stop is None else min(stop, len(chain))
        present = self.chunks_present(chain[:top])
        for i in range(present - 1, -1, -1):
            anchor = self.anchors.get(chain[i])
            if anchor is not None and anchor.chunks == tuple(chain[:i + 1]):
                return AnchorHit(anchor.line, anchor)
        return None

    def readers(self, key: Key) -> list[AnchorEntry]:
        """The anchors that need the chunk ``key``, shortest first."""
        return sorted((a for a in self.anchors.values() if key in a.chunks),
                      key=lambda a: a.line)

    def check_invariants(self) -> None:
        for key, e in self.chunks.items():
            assert e.key == key and e.stop > e.start >= 0, e
        for key, a in self.anchors.items():
            assert a.key == key and a.chunks and a.chunks[-1] == key, a
            assert a.line > 0 and a.line % len(a.chunks) == 0, a


@dataclass(frozen=True)
class ScanReport:
    kept: int
    leftovers: int  # .tmp files a crash left
    other_fingerprint: int
    refused: dict[str, int]  # reason -> files deleted for it


def scan(files: TierFiles, accept: Container[str], grid: int) -> tuple[TierIndex, ScanReport]:
    """The index of what is on disk, from each file's verified header, after deleting every
    leftover, every file of a fingerprint ``accept`` does not hold and every file whose header
    fails (the sections' crc32 are checked when a file is read, not here)."""
    leftovers = files.remove_leftovers()
    index = TierIndex()
    other = 0
    refused: Counter[str] = Counter()
    for kind, key in list(files.entries()):
        try:
            h = files.read_header(kind, key, accept, grid)
        except FingerprintMismatch:
            files.discard(kind, key)
            other += 1
            continue
        except TierFileError as exc:
            files.discard(kind, key)
            refused[exc.reason] += 1
            continue
        if kind == "chunk":
            index.add_chunk(ChunkEntry(key, h.start, h.stop, h.file_nbytes, h.fingerprint))
        else:
            index.add_anchor(AnchorEntry(key, h.stop, tuple(Key(k) for k in h.chunks),
                                         h.file_nbytes, h.fingerprint))
    report = ScanReport(len(index.chunks) + len(index.anchors), leftovers, other, dict(refused))
    log.info("disk_tier_scanned", chunks=len(index.chunks), anchors=len(index.anchors),
             nbytes=index.nbytes, leftovers=leftovers, other_fingerprint=other,
             refused=sum(refused.values()))
    return index, report
