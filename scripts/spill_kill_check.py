"""kill -9 of a process saving session spill entries, at chosen points, hundreds of times (issue 16,
"Faults"): after each kill a new ``SessionSpill`` opens the folder (the start's scan) and every
entry it lists is restored and checked against the reference the driver computed itself.

One folder lives through every run. Each run forks a child that opens a ``SessionSpill`` over it
(the start's scan, as a restarted server would) and then, in a loop, saves versions of a few
conversations of a deterministic small model: a conversation grows turn by turn (an incremental
re-save keeps its unchanged blocks and anchors), goes back to an older version (a shorter entry
over a longer one), or is deleted; one conversation is another one's branch, one is salted. A
run in three has a budget under two entries, so saves evict other entries and skip some. The
rows, anchors and end each save is handed are host copies the driver took before forking.

The child is stepped: every file-system call it makes (open, mkdir, pwrite, write, fsync, rename,
unlink, rmdir, utime, close), on any of its threads, announces itself on a pipe and waits for a
go. The driver picks a target (inside a save, just before a manifest's rename, just after it
(the old files not yet swept), inside a delete or an eviction, inside the start's scan, or any
moment), lets a random number of the target's
calls pass and kills the child with SIGKILL, either while it waits before the next call or, for
"drift", after letting it run free for a random sub-delay of up to a few milliseconds (then the
kill lands anywhere: in a transfer, in the codec, between two calls).

The child keeps, in a page it shares with the driver, the version each conversation's last
complete save or delete left, and the save or delete it is in. After each kill the driver
checks, after opening a new spill over the folder:

- the start dropped nothing but folders without a manifest (a save cut short): no bad
  manifest, no missing or resized file, nothing refused;
- the folder holds exactly the entries listed, each exactly its manifest and the files it names;
- every entry listed is one of the conversation's two allowed versions (the last complete save,
  or the one in flight at the kill), and restores into a fresh engine (every block read and
  summed, every anchor) with rows, end and anchors torch.equal to that version's, and its
  token ids, taint and end metadata; an absent entry is always allowed (deleted, evicted, or a
  save cut short), a torn one, or another version, never.

    PYTHONPATH=$PWD .venv/bin/python scripts/spill_kill_check.py --runs 200

Prints a summary and exits 1 on any failure (each named, with its run and seed).
"""

from __future__ import annotations

import mmap
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

_REPO = Path(__file__).resolve().parents[1]
for _p in (str(_REPO), str(_REPO / "tests"), str(_REPO / "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from tandem.cache.copies import SectionsCopy  # noqa: E402
from tandem.cache.namespace import SHARED, Namespace, namespace_of  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.io.fingerprint import Identity  # noqa: E402
from tandem.io.spill import (MANIFEST, EntryMeta, SessionSpill, SpillEnd, SpillError,  # noqa: E402
                             session_digest)
from tandem.models.base import CacheState, View  # noqa: E402

import kill_harness  # noqa: E402
from kill_harness import SHM_PHASE, Harness, phased  # noqa: E402

GRID = 64
WINDOW = 512
FP = "5f" * 32
HOOKED = ("open", "mkdir", "pwrite", "write", "fsync", "rename", "unlink", "rmdir", "utime",
          "close")
# How often each target is drawn, and how many of its calls may pass before the kill.
TARGET_WEIGHTS = {"save": 5, "manifest": 1, "landed": 1, "delete": 1, "start": 1, "drift": 2}
SKIP_MAX = {"save": 120, "manifest": 6, "landed": 3, "delete": 12, "start": 30, "drift": 200}
NONE = 255  # a conversation without an entry, or no operation in flight

# The child's phase, in the shared page: what it was doing when it died.
IDLE, START, SAVE, DELETE = 0, 1, 2, 3
PHASES = {IDLE: "between saves", START: "start scan", SAVE: "save", DELETE: "delete"}
# the check's bytes of the shared page, after the harness's: the operation in flight (its
# conversation and version, NONE for a delete), and each conversation's version from _DONE on
_BUSY_CONV, _BUSY_VERSION, _EVICTED = 3, 4, 5
_DONE = 16
HARNESS = Harness(HOOKED, TARGET_WEIGHTS, SKIP_MAX, PHASES, "saver")


# -- the reference ----------------------------------------------------------------------------

@dataclass
class Version:
    """What one save is handed: the rows [0, valid), the anchors the prefill passed, the end."""

    conv: int
    index: int
    token_ids: list[int]
    views: dict[str, View]  # host copies of the whole buffers
    sections: dict[str, torch.Tensor]  # the end: the state at valid
    anchors: dict[int, SectionsCopy]
    taint: int | None

    @property
    def valid(self) -> int:
        return len(self.token_ids)

    @property
    def end_meta(self) -> Any:
        return {"conv": self.conv, "version": self.index, "regions": [[self.valid - 3,
                                                                       self.valid]]}

    def state(self) -> CacheState:
        return CacheState(dict(self.sections), dict(self.views))


@dataclass
class Conversation:
    name: str
    key: str
    namespace: Namespace
    versions: list[Version]

    @property
    def meta(self) -> EntryMeta:
        return EntryMeta(session_digest(self.key), self.namespace, self.versions[0].taint)

    @property
    def entry_id(self) -> str:
        return self.meta.entry_id


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model) -> Engine:
    return Engine(model, window=WINDOW, prefix_chunk=GRID)


def _turns(model, c: int, turns: list[tuple[list[int], int]]) -> list[Version]:
    """One engine through the turns (each a prompt tail and the tokens decoded after it); a
    version after each, its rows those the engine really wrote."""
    eng = engine(model)
    anchors: dict[int, SectionsCopy] = {}

    def on_chunk(end: int) -> None:
        if end % GRID == 0:
            anchors[end] = SectionsCopy.take(eng.cache_state())

    out = []
    for tail, decoded in turns:
        logits = eng.prefill(eng.token_ids + tail, on_chunk=on_chunk)
        for _ in range(decoded):
            logits = eng.decode(int(torch.argmax(logits)))
        state = eng.cache_state()
        out.append(Version(c, len(out), list(eng.token_ids),
                           {k: View(v.tensor.clone(), v.token_axis)
                            for k, v in state.views.items()},
                           {k: t.clone() for k, t in state.sections.items()},
                           {line: a for line, a in anchors.items() if line <= eng.length},
                           eng.taint))
    return out


def make_reference(model) -> list[Conversation]:
    """``a`` grows over three turns; ``b`` is ``a``'s first turn cut and answered otherwise (a
    branch: its first blocks equal ``a``'s, the rest not), over two turns; ``c`` is ``a`` under a
    cache salt; ``d`` is short (one block, no grid anchor)."""
    v = model.vocab_size
    a_turns = [(_tokens(v, 200, 1), 10), (_tokens(v, 120, 2), 5), (_tokens(v, 60, 3), 3)]
    a = _turns(model, 0, a_turns)
    b = _turns(model, 1, [(a[0].token_ids[:150] + _tokens(v, 40, 4), 6), (_tokens(v, 70, 5), 2)])
    c = _turns(model, 2, a_turns[:2])
    d = _turns(model, 3, [(_tokens(v, 40, 6), 3)])
    return [Conversation("a", "chat-a", SHARED, a), Conversation("b", "chat-b", SHARED, b),
            Conversation("c", "chat-a", namespace_of("kill check tenant"), c),
            Conversation("d", "chat-d", SHARED, d)]


def entry_nbytes(conv: Conversation) -> int:
    """About what the conversation's longest version takes on the disk uncompressed."""
    ver = conv.versions[-1]
    rows = sum(t.tensor.numel() // t.tensor.shape[t.token_axis] * t.tensor.element_size()
               for t in ver.views.values()) * ver.valid
    sections = sum(t.numel() * t.element_size() for t in ver.sections.values())
    return rows + 5 * sections


def open_spill(root: Path, budget_nbytes: int = 1 << 40) -> SessionSpill:
    spill = SessionSpill(root, Identity(FP), GRID, budget_nbytes=budget_nbytes,
                         wall=lambda: 1_800_000_000.0)
    spill.open()
    return spill


def save(spill: SessionSpill, conv: Conversation, ver: Version):
    end = SpillEnd(ver.valid, ver.sections, ver.end_meta)
    return spill.save(conv.entry_id, ver.state(), ver.valid, ver.token_ids, ver.anchors, end,
                      EntryMeta(session_digest(conv.key), conv.namespace, ver.taint))


# -- the child --------------------------------------------------------------------------------

def _child(root: Path, ref: list[Conversation], seed: int, budget_nbytes: int, shm: mmap.mmap,
           started: Callable[[], None]) -> None:
    """Saves until killed, stepped (``Harness.kill``)."""
    SessionSpill.save = phased(shm, SAVE, SessionSpill.save)
    real_remove = SessionSpill._remove

    def remove(self, eid):
        if shm[SHM_PHASE] == SAVE:
            shm[_EVICTED] = 1  # an eviction, or a failed save's cleanup
        return phased(shm, DELETE, real_remove)(self, eid)

    SessionSpill._remove = remove

    shm[SHM_PHASE] = START
    spill = open_spill(root, budget_nbytes)
    shm[SHM_PHASE] = IDLE
    # What the start kept: the versions the driver checked after the last kill (those it
    # dropped were never complete saves of this process).
    listed = set(spill.entries())
    for c, conv in enumerate(ref):
        if conv.entry_id not in listed:
            shm[_DONE + c] = NONE
    started()
    rng = random.Random(seed)
    while True:
        c = rng.randrange(len(ref))
        conv = ref[c]
        if rng.random() < 0.1:
            shm[_BUSY_CONV], shm[_BUSY_VERSION] = c, NONE
            spill.delete(conv.entry_id)
            shm[_DONE + c] = NONE
        else:
            ver = rng.choice(conv.versions)
            shm[_BUSY_CONV], shm[_BUSY_VERSION] = c, ver.index
            report = save(spill, conv, ver)
            if report.skipped != "budget":
                shm[_DONE + c] = ver.index
        # every other conversation a save evicted has no entry now
        for k, other in enumerate(ref):
            if k != c and other.entry_id not in spill.entries():
                shm[_DONE + k] = NONE
        shm[_BUSY_CONV] = NONE


# -- the driver -------------------------------------------------------------------------------

@dataclass
class Summary(kill_harness.Summary):
    dropped: Counter = field(default_factory=Counter)  # what each start deleted, by why
    entries_verified: int = 0
    in_flight_served: int = 0  # an entry whose save the kill cut after its manifest landed
    versions_seen: Counter = field(default_factory=Counter)
    absent_allowed: int = 0  # a conversation whose last save's entry was gone (cut or evicted)
    runs_evicting: int = 0

    def detail_lines(self) -> list[str]:
        counted = kill_harness.counted
        return [
            f"phase at the kill: {counted(self.phases)}",
            f"stepped kills before: {counted(self.before_call)}",
            f"dropped by the starts: {counted(self.dropped) or 'nothing'}",
            f"entries restored and verified {self.entries_verified} (versions: "
            f"{counted(self.versions_seen)}); the save in flight served {self.in_flight_served}; "
            f"entries absent where one was allowed {self.absent_allowed}; runs whose saves "
            f"evicted {self.runs_evicting}",
        ]


@dataclass
class Killed(kill_harness.Killed):
    done: list[int]  # each conversation's version after its last complete operation
    busy: tuple[int, int] | None  # the operation in flight: conversation, version (NONE: delete)


def kill_one(root: Path, ref: list[Conversation], done: list[int], rng: random.Random,
             summary: Summary, target: str | None = None,
             writer_fault: Callable[[], None] | None = None) -> Killed:
    """Fork a saver over ``root``, kill it at a point of ``target`` (drawn when None).
    ``done``: each conversation's version as the last check found it. Raises when the child
    failed on its own (``ChildFailed``)."""
    target, skip = HARNESS.draw(rng, target)
    tight = rng.random() < 1 / 3
    budget = int(max(entry_nbytes(c) for c in ref) * rng.uniform(1.1, 1.9)) if tight else 1 << 40
    seed = rng.getrandbits(32)
    shm = mmap.mmap(-1, mmap.PAGESIZE)
    for c, v in enumerate(done):
        shm[_DONE + c] = v
    shm[_BUSY_CONV] = NONE
    was_hit = False
    after_rename = False

    def hit(at: int, op: str, started: bool) -> bool | None:
        nonlocal was_hit, after_rename
        on = {"save": at == SAVE, "start": at == START,
              "manifest": at == SAVE and op == "rename",
              "landed": at == SAVE and after_rename,
              "delete": at == DELETE and started, "drift": started}[target]
        after_rename = at == SAVE and op == "rename"
        if target == "start" and was_hit and not on:
            return None  # the scan ended before the skip ran out: killed just after it
        was_hit |= on
        return on

    HARNESS.kill(root, shm, rng, summary, target, skip, hit,
                 lambda started: _child(root, ref, seed, budget, shm, started), writer_fault)
    summary.runs_evicting += shm[_EVICTED]
    out = Killed(target, [shm[_DONE + c] for c in range(len(ref))],
                 None if shm[_BUSY_CONV] == NONE else (shm[_BUSY_CONV], shm[_BUSY_VERSION]))
    shm.close()
    return out


def check_folder(root: Path, ref: list[Conversation], model, killed: Killed,
                 summary: Summary) -> tuple[list[str], list[int]]:
    """Open a new spill over ``root`` (the start) and check every entry: the failures, and
    each conversation's version as found (NONE: no entry)."""
    bad: list[str] = []
    spill = open_spill(root)
    found = [NONE] * len(ref)
    try:
        dropped = spill.dropped_at_open
        summary.dropped.update(dropped)
        if set(dropped) - {"unfinished"}:
            bad.append(f"the start dropped what a kill must never leave: {dropped}")
        entries = spill.entries()
        folders = {p.name for p in root.iterdir()}
        if folders != set(entries):
            bad.append(f"the folder is not the index: {sorted(folders ^ set(entries))}")
        by_id = {conv.entry_id: c for c, conv in enumerate(ref)}
        for eid, m in entries.items():
            on_disk = {p.name for p in (root / eid).iterdir()}
            if on_disk != {MANIFEST} | {f.name for f in m.files()}:
                bad.append(f"entry {eid[:8]} holds other files: {sorted(on_disk)}")
            if eid not in by_id:
                bad.append(f"an entry nobody saved: {eid[:8]}")
                continue
            c = by_id[eid]
            conv = ref[c]
            allowed = {killed.done[c]} - {NONE}
            if killed.busy is not None and killed.busy[0] == c and killed.busy[1] != NONE:
                allowed.add(killed.busy[1])
            match = [v for v in conv.versions if v.token_ids == m.token_ids]
            if not match:
                bad.append(f"entry {conv.name}: tokens of no version ({m.valid} rows)")
                continue
            ver = match[0]
            if ver.index not in allowed:
                bad.append(f"entry {conv.name}: version {ver.index}, allowed {sorted(allowed)}")
            bad += _restore(spill, model, conv, ver)
            found[c] = ver.index
            summary.entries_verified += 1
            summary.versions_seen[f"{conv.name}{ver.index}"] += 1
            summary.in_flight_served += ver.index != killed.done[c]
        for c, conv in enumerate(ref):
            if found[c] == NONE and killed.done[c] != NONE:
                summary.absent_allowed += 1
    finally:
        spill.close()
    return bad, found


def _restore(spill: SessionSpill, model, conv: Conversation, ver: Version) -> list[str]:
    eng = engine(model)
    try:
        got = spill.restore(conv.entry_id, eng.cache_state(), [])
    except SpillError as exc:
        return [f"entry {conv.name}@{ver.index} listed but does not restore (torn): {exc}"]
    name = f"restored {conv.name}@{ver.index}"
    bad = []
    state = eng.cache_state()
    if got.line != ver.valid or got.token_ids != ver.token_ids or got.taint != (
            ver.taint if ver.taint is not None and ver.taint < ver.valid else None):
        bad.append(f"{name}: line {got.line}, its token ids or taint")
    bad += [f"{name}: rows of {n}" for n, v in ver.views.items()
            if not torch.equal(state.views[n].rows(0, ver.valid), v.rows(0, ver.valid))]
    bad += [f"{name}: section {n}" for n, t in ver.sections.items()
            if not torch.equal(state.sections[n], t)]
    if got.end is None or got.end.meta != ver.end_meta:
        bad.append(f"{name}: the end's metadata")
    want = sorted(ver.anchors)[-4:]
    if sorted(got.anchors) != want:
        bad.append(f"{name}: anchors {sorted(got.anchors)}, not {want}")
    for line, copy in got.anchors.items():
        if line in ver.anchors and any(not torch.equal(t, ver.anchors[line].tensors[n])
                                       for n, t in copy.tensors.items()):
            bad.append(f"{name}: anchor {line}")
    return bad


def run_check(root: Path, runs: int, seed: int, model, *,
              targets: list[str] | None = None,
              progress: Callable[[int, Summary], None] | None = None,
              writer_fault: Callable[[], None] | None = None) -> Summary:
    """``runs`` kills over the folder ``root`` (created), each followed by the check.
    ``targets``: cycled instead of drawn (a test's fixed coverage). ``writer_fault``: called in
    each child before it saves (a test's broken saver, which the check must catch)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    ref = make_reference(model)
    root.mkdir(parents=True, exist_ok=True)
    summary = Summary()
    done = [NONE] * len(ref)

    def check(killed: Killed) -> list[str]:
        nonlocal done
        failures, done = check_folder(root, ref, model, killed, summary)
        return failures

    kill_harness.run_kills(
        summary, runs, seed,
        lambda target: kill_one(root, ref, done, rng, summary, target, writer_fault), check,
        targets=targets, progress=progress)
    summary.seconds = time.perf_counter() - t0
    return summary


def main(argv: list[str] | None = None) -> int:
    return kill_harness.main(argv, __doc__, run_check, what="spill", prefix="spill-kill-",
                             folder="sessions")


if __name__ == "__main__":
    sys.exit(main())
