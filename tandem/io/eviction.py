"""The disk tier's budget: what to delete, in order, to keep the tier under its budget, the file
system above its free-space floor, and nothing past its TTL (spec: "The disk", in "Disk tier").

An entry is an anchor and its share of the chunks it reads. Its value is

    (hits + 1) x tokens it saves / bytes it holds alone x 2 ** -(days unused)

where it saves its line's tokens (none while a chunk below it is missing: it cannot serve), and
holds its file and, of each chunk it reads, the chunk's bytes over the number of anchors reading
it. The least valuable goes first, and the chunks no other anchor reads go with it (the anchor
is deleted before them, so a crash part way leaves chunks without an anchor, never an anchor
that a lookup finds without its chunks). A chunk no anchor reads (its anchor failed, or a crash
came between the chunks and the anchor) is worth nothing. An entry unused for longer than the
TTL goes whatever the room; a chunk goes by the TTL only when no anchor reads it. ``protect``
names the keys of a write in flight (its chain): none of them goes, so a write never loses the
chunks below the anchor it is about to add.

Usage (hits and when last used) is kept beside the index in ``TierUsage``: at a start it is
seeded from the files' mtimes (``seed_from_files``), so what nobody used still ages across
restarts; an entry it does not know counts as used now. Pure over the index and the usage: no
clock (``now`` is given), no I/O but the seeding's stat calls, no actor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Collection

from tandem.io.chain import Key
from tandem.io.tierfile import FileKind, TierFiles
from tandem.io.tierindex import AnchorEntry, TierIndex

DAY_S = 86_400.0
TTL_S = 7 * DAY_S
BUDGET_NBYTES = 16 << 30
FREE_FLOOR_NBYTES = 50 << 30  # the least free space the tier leaves, whatever is set

Victim = tuple[FileKind, Key]


@dataclass
class Use:
    hits: int = 0
    last_used: float = 0.0


@dataclass
class TierUsage:
    """Hits and last use of the tier's entries, by kind and key; the writer and the reader keep
    it as they write, serve and delete files."""

    uses: dict[tuple[FileKind, Key], Use] = field(default_factory=dict)

    def written(self, kind: FileKind, key: Key, now: float) -> None:
        self.uses[(kind, key)] = Use(0, now)

    def hit(self, anchor: AnchorEntry, now: float) -> None:
        """A restore served from ``anchor``: its hit, and a use of it and of every chunk below."""
        use = self.uses.setdefault(("anchor", anchor.key), Use(0, now))
        use.hits += 1
        use.last_used = now
        for key in anchor.chunks:
            self.uses.setdefault(("chunk", key), Use(0, now)).last_used = now

    def seed(self, kind: FileKind, key: Key, when: float) -> None:
        """What a start knows of an entry it did not see written: its file's mtime."""
        self.uses.setdefault((kind, key), Use(0, when))

    def forget(self, kind: FileKind, key: Key) -> None:
        self.uses.pop((kind, key), None)

    def get(self, kind: FileKind, key: Key, now: float) -> Use:
        return self.uses.get((kind, key)) or Use(0, now)

    def prune(self, index: TierIndex) -> None:
        """Drop the usage of entries no longer in the index."""
        for kind, key in list(self.uses):
            if not index.has(kind, key):
                del self.uses[(kind, key)]


def seed_from_files(usage: TierUsage, files: TierFiles, index: TierIndex) -> None:
    """Seed ``usage`` with every indexed file's mtime (a file that went since: skipped)."""
    for kind, held in (("chunk", index.chunks), ("anchor", index.anchors)):
        for key in held:
            try:
                st = os.lstat(files.path(kind, key))
            except FileNotFoundError:
                continue
            usage.seed(kind, key, st.st_mtime)


@dataclass(frozen=True)
class Room:
    """What to delete, in order, before a write (``fits``: after these, the write fits the
    budget and the floor; when it cannot, ``evict`` holds only what the TTL and the tier's own
    budget and floor ask, and the write is to be skipped)."""

    evict: tuple[Victim, ...]
    fits: bool
    freed_nbytes: int


class _Plan:
    """The index as deletions leave it, one step at a time."""

    def __init__(self, index: TierIndex, usage: TierUsage, now: float,
                 protect: Collection[Key]):
        self.index = index
        self.usage = usage
        self.now = now
        self.protect = frozenset(protect)
        self.anchors = dict(index.anchors)
        self.chunks = dict(index.chunks)
        self.readers: dict[Key, set[Key]] = {k: set() for k in self.chunks}
        for a in self.anchors.values():
            for c in a.chunks:
                if c in self.readers:
                    self.readers[c].add(a.key)
        self.out: list[Victim] = []
        self.freed = 0

    def last_used(self, kind: FileKind, key: Key) -> float:
        return self.usage.get(kind, key, self.now).last_used

    def idle_s(self, kind: FileKind, key: Key) -> float:
        return max(0.0, self.now - self.last_used(kind, key))

    def drop_anchor(self, key: Key) -> None:
        a = self.anchors.pop(key)
        self.out.append(("anchor", key))
        self.freed += a.nbytes
        for c in reversed(a.chunks):  # the longest first: what is left is a chain's prefix
            readers = self.readers.get(c)
            if readers is None:
                continue
            readers.discard(key)
            if not readers and c not in self.protect and c in self.chunks:
                self.drop_chunk(c)

    def drop_chunk(self, key: Key) -> None:
        c = self.chunks.pop(key)
        del self.readers[key]
        self.out.append(("chunk", key))
        self.freed += c.nbytes

    def orphans(self) -> list[Key]:
        return [k for k in self.chunks if not self.readers[k] and k not in self.protect]

    def value(self, a: AnchorEntry) -> float:
        use = self.usage.get("anchor", a.key, self.now)
        alone = float(a.nbytes)
        usable = True
        for c in a.chunks:
            chunk = self.chunks.get(c)
            if chunk is None:
                usable = False
            else:
                alone += chunk.nbytes / len(self.readers[c])
        if not usable or alone <= 0:
            return 0.0
        idle_days = max(0.0, self.now - use.last_used) / DAY_S
        return (use.hits + 1) * a.line / alone * 2.0 ** -idle_days

    def expire(self, ttl_s: float) -> None:
        for key in sorted((k for k in self.anchors if k not in self.protect),
                          key=lambda k: (self.last_used("anchor", k), k)):
            if key in self.anchors and self.idle_s("anchor", key) > ttl_s:
                self.drop_anchor(key)
        for key in sorted(self.orphans(), key=lambda k: (self.last_used("chunk", k), k)):
            if self.idle_s("chunk", key) > ttl_s:
                self.drop_chunk(key)

    def cheapest(self) -> Victim | None:
        """The least valuable entry left: an unread chunk (worth nothing) or an anchor, the
        longest unused first among equals."""
        best: tuple | None = None
        victim: Victim | None = None
        for key in self.orphans():
            rank = (0.0, self.last_used("chunk", key), 0, key)
            if best is None or rank < best:
                best, victim = rank, ("chunk", key)
        for key, a in self.anchors.items():
            if key in self.protect:
                continue
            rank = (self.value(a), self.last_used("anchor", key), 1, key)
            if best is None or rank < best:
                best, victim = rank, ("anchor", key)
        return victim

    def drop(self, victim: Victim) -> None:
        kind, key = victim
        if kind == "anchor":
            self.drop_anchor(key)
        else:
            self.drop_chunk(key)


def room_for(nbytes: int, index: TierIndex, usage: TierUsage, now: float, *,
             budget_nbytes: int, free_nbytes: int, floor_nbytes: int, ttl_s: float = TTL_S,
             protect: Collection[Key] = ()) -> Room:
    """What a write of ``nbytes`` must evict first: everything past the TTL, then the least
    valuable entries until the tier and the write fit ``budget_nbytes`` and leave
    ``floor_nbytes`` of the file system's ``free_nbytes`` free. Entries of ``protect`` stay."""
    if nbytes < 0:
        raise ValueError("a write has no negative size")
    p = _Plan(index, usage, now, protect)
    held = index.nbytes
    p.expire(ttl_s)

    def need(extra: int) -> int:
        return max(held - p.freed + extra - budget_nbytes,
                   floor_nbytes + extra - (free_nbytes + p.freed))

    # The tier's own budget and floor first (a lowered budget, a disk that other files fill):
    # these go whether or not the write fits.
    while need(0) > 0 and (victim := p.cheapest()) is not None:
        p.drop(victim)
    base = len(p.out), p.freed
    while need(nbytes) > 0 and (victim := p.cheapest()) is not None:
        p.drop(victim)
    if need(nbytes) > 0:
        return Room(tuple(p.out[:base[0]]), False, base[1])
    return Room(tuple(p.out), True, p.freed)


def plan_eviction(index: TierIndex, usage: TierUsage, now: float, *, budget_nbytes: int,
                  free_nbytes: int, floor_nbytes: int, ttl_s: float = TTL_S,
                  protect: Collection[Key] = ()) -> list[Victim]:
    """What to delete, in order, so the tier holds no entry past the TTL, fits its budget and
    leaves the floor free (as much of it as deleting the whole tier can)."""
    return list(room_for(0, index, usage, now, budget_nbytes=budget_nbytes,
                         free_nbytes=free_nbytes, floor_nbytes=floor_nbytes, ttl_s=ttl_s,
                         protect=protect).evict)


def value_of(anchor: AnchorEntry, index: TierIndex, usage: TierUsage, now: float) -> float:
    """An anchor's eviction value over the index as it is (for the console and the tests)."""
    return _Plan(index, usage, now, ()).value(anchor)
