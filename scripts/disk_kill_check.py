"""kill -9 of a process writing the disk tier, at chosen points, hundreds of times (issue 15,
"Faults"): after each kill a new tier opens the folder (the start's scan) and every entry is
checked against a reference the driver computed itself.

One folder lives through every run. Each run forks a child that opens a ``DiskTier`` over it
(the start's scan, as a restarted server would) and then writes, in a loop, the chunk and anchor
files of a few prompts of a deterministic small model through ``DiskTier.write_entries``: plans
from the admission (which also rewrites the counts file) and forced plans that overwrite files
already there; a run in three has a budget under what the prompts need, so evictions delete files
too. The prompts share heads (a chain two prompts share, one that extends another) and one is
salted. The rows and sections the child writes are the host copies the driver took from a cold
prefill before forking: what the writer is handed.

The child is stepped: every file-system call it makes (open, mkdir, fchmod, pwrite, write, fsync,
rename, unlink, close) announces itself on a pipe and waits for a go. The driver picks a target
(inside a tier file's write, just before its rename, inside the counts file's write, inside
the start's scan, or any moment), lets a random number of the target's calls pass and kills the
child with SIGKILL, either while it waits before the next call or, for "drift", after letting it
run free for a random sub-delay of up to a few milliseconds (then the kill lands anywhere: in a
transfer, in the crc32, between two calls).

After each kill the driver checks, before and after opening a new tier over the folder:

- no ``.tmp`` anywhere in the folder after the start (before it: counted, "leftovers swept");
- the start refused nothing: no file at its final name failed its header (a torn entry);
- the files on disk are exactly the ones the index lists, and the counts file, when there is one,
  decodes;
- every chunk the index lists reads back whole (its crc32s, key, grid, layout) with token ids
  equal to the prompt's and rows torch.equal to the reference's; every anchor's sections equal
  the reference's at its line and it lists exactly the prompt's chain below it;
- every usable anchor is offered for its prompt and restores through ``DiskTier.restore`` into a
  fresh engine whose sections and rows below the line are torch.equal to the cold prefill's; one
  of them a run is also continued to the prompt's end, its logits torch.equal to the cold ones;
- an anchor without every chunk below it appears only after an eviction (chunks are written
  first, so a kill alone never leaves one).

    PYTHONPATH=$PWD .venv/bin/python scripts/disk_kill_check.py --runs 200

Prints a summary and exits 1 on any failure (each named, with its run and seed).
"""

from __future__ import annotations

import mmap
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

_REPO = Path(__file__).resolve().parents[1]
for _p in (str(_REPO), str(_REPO / "tests"), str(_REPO / "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from tandem.cache.copies import SectionsCopy  # noqa: E402
from tandem.cache.namespace import SHARED, Namespace, namespace_of  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.io import admission as admission_module  # noqa: E402
from tandem.io import tier as tier_module  # noqa: E402
from tandem.io.admission import Admission, CountsError, DiskPlan, decode_counts  # noqa: E402
from tandem.io.chain import Key, chain_keys  # noqa: E402
from tandem.io.fingerprint import Identity  # noqa: E402
from tandem.io.tier import DiskTier, HostRows, _file_nbytes, host_rows  # noqa: E402
from tandem.io.tierfile import TierFileError, TierFiles  # noqa: E402

import kill_harness  # noqa: E402
from kill_harness import SHM_PHASE, Harness, Killed, phased  # noqa: E402

GRID = 64
WINDOW = 512
FP = "5e" * 32
COUNTS = "admission.counts"
TMP = ".tmp"
HOOKED = ("open", "mkdir", "fchmod", "pwrite", "write", "fsync", "rename", "unlink", "close")
# How often each target is drawn, and how many of its calls may pass before the kill.
TARGET_WEIGHTS = {"write": 5, "rename": 1, "counts": 1, "start": 1, "drift": 2}
SKIP_MAX = {"write": 160, "rename": 12, "counts": 9, "start": 40, "drift": 240}

# The child's phase, in the shared page: what it was doing when it died.
IDLE, START, WRITE, COUNTS_WRITE, DELETE = 0, 1, 2, 3, 4
PHASES = {IDLE: "between files", START: "start scan", WRITE: "tier file write",
          COUNTS_WRITE: "counts write", DELETE: "delete"}
_EVICTED = 3  # the check's byte of the shared page, after the harness's
HARNESS = Harness(HOOKED, TARGET_WEIGHTS, SKIP_MAX, PHASES, "writer")


# -- the reference ----------------------------------------------------------------------------

@dataclass
class Prompt:
    name: str
    ids: list[int]
    namespace: Namespace
    chain: list[Key]
    lines: list[int]  # every grid line below the prompt's last token
    staged: dict[int, SectionsCopy]
    rows: dict[int, HostRows]
    logits: torch.Tensor
    cold: Engine


@dataclass
class Reference:
    prompts: list[Prompt]
    chunks: dict[Key, tuple[Prompt, int]]  # key -> a prompt holding it, and its line
    anchors: dict[Key, tuple[Prompt, int]]
    entry_nbytes: int  # every distinct file, about


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model) -> Engine:
    return Engine(model, window=WINDOW, prefix_chunk=GRID)


def _cold(model, name: str, ids: list[int], namespace: Namespace) -> Prompt:
    eng = engine(model)
    lines = list(range(GRID, len(ids), GRID))
    staged: dict[int, SectionsCopy] = {}

    def on_chunk(end: int) -> None:
        if end in lines:
            staged[end] = SectionsCopy.take(eng.cache_state())

    logits = eng.prefill(ids, on_chunk=on_chunk)
    assert sorted(staged) == lines, (name, sorted(staged))
    views = eng.cache_state().views
    rows = {b: host_rows(views, b - GRID, b) for b in lines}
    return Prompt(name, ids, namespace, chain_keys(ids, GRID, namespace), lines, staged, rows,
                  logits, eng)


def make_reference(model) -> Reference:
    """A few prompts whose chains share heads: ``b`` shares ``a``'s first two chunks, ``c``
    extends ``a``, ``d`` shares nothing, ``e`` is ``a`` under a cache salt."""
    v = model.vocab_size
    a = _tokens(v, 4 * GRID + 9, 1)
    prompts = [
        _cold(model, "a", a, SHARED),
        _cold(model, "b", a[:2 * GRID] + _tokens(v, 2 * GRID + 5, 2), SHARED),
        _cold(model, "c", a[:4 * GRID] + _tokens(v, 2 * GRID + 3, 3), SHARED),
        _cold(model, "d", _tokens(v, 3 * GRID + 1, 4), SHARED),
        _cold(model, "e", a, namespace_of("kill check tenant")),
    ]
    chunks: dict[Key, tuple[Prompt, int]] = {}
    anchors: dict[Key, tuple[Prompt, int]] = {}
    nbytes = 0
    for p in prompts:
        for b in p.lines:
            key = p.chain[b // GRID - 1]
            if key in chunks:
                # a key two prompts share names the same rows and state, bit for bit
                q, qb = chunks[key]
                assert qb == b and q.ids[:b] == p.ids[:b]
                for n, t in q.rows[b].tensors.items():
                    assert torch.equal(t, p.rows[b].tensors[n]), (p.name, q.name, n)
                for n, t in q.staged[b].tensors.items():
                    assert torch.equal(t, p.staged[b].tensors[n]), (p.name, q.name, n)
                continue
            chunks[key] = anchors[key] = (p, b)
            nbytes += _file_nbytes(list(p.rows[b].tensors.values()), 1)
            nbytes += _file_nbytes(list(p.staged[b].tensors.values())) + b // GRID * 80
    return Reference(prompts, chunks, anchors, nbytes)


def open_tier(root: Path, budget_nbytes: int = 1 << 40) -> DiskTier:
    admission = Admission(root / COUNTS, grid=GRID, admit_after=2, head_anchors=4,
                          min_tokens=0)
    return DiskTier(root, Identity(FP), GRID, admission=admission,
                    budget_nbytes=budget_nbytes, floor_nbytes=0,
                    free_nbytes=lambda _root: 1 << 50)


# -- the child --------------------------------------------------------------------------------

def _forced_plan(p: Prompt, rng: random.Random) -> DiskPlan:
    """A plan that (re)writes a random set of the prompt's anchors and every chunk below the
    highest: files already on disk are replaced through their ``.tmp``."""
    anchors = sorted(rng.sample(p.lines, rng.randint(1, len(p.lines))))
    top = anchors[-1]
    return DiskPlan(GRID, tuple(anchors), tuple(range(GRID, top + 1, GRID)),
                    tuple(p.chain[:top // GRID]), tuple(("head",) for _ in anchors))


def _child(root: Path, ref: Reference, seed: int, budget_nbytes: int, shm: mmap.mmap,
           started: Callable[[], None]) -> None:
    """Writes until killed, stepped (``Harness.kill``)."""
    TierFiles._write = phased(shm, WRITE, TierFiles._write)
    real_discard = TierFiles.discard

    def discard(self, kind, key):
        if shm[SHM_PHASE] != START:
            shm[_EVICTED] = 1  # an eviction (the child never fails a restore)
        return phased(shm, DELETE, real_discard)(self, kind, key)

    TierFiles.discard = discard
    tier_module.write_atomic = phased(shm, COUNTS_WRITE, admission_module.write_atomic)

    shm[SHM_PHASE] = START
    tier = open_tier(root, budget_nbytes)
    shm[SHM_PHASE] = IDLE
    started()
    rng = random.Random(seed)
    while True:
        p = rng.choice(ref.prompts)
        plan = DiskPlan(GRID)
        if rng.random() < 0.5:
            plan = tier.plan(p.ids, p.namespace, start=0, taint=None,
                             first_of_session=True, last_user_start=len(p.ids))
        if plan.empty:
            plan = _forced_plan(p, rng)
            tier.admission.pending.update(plan.entries())
        tier.write_entries(plan, p.ids, {b: p.staged[b] for b in plan.anchor_lines},
                           {b: p.rows[b] for b in plan.chunk_lines})


# -- the driver -------------------------------------------------------------------------------

@dataclass
class Summary(kill_harness.Summary):
    mid_write: int = 0  # killed inside a tier file's or the counts file's write
    leftovers_seen: int = 0  # .tmp files the kill left
    leftovers_swept: int = 0  # the ones the start deleted
    chunks_verified: int = 0
    anchors_verified: int = 0
    restores: int = 0
    logits_gates: int = 0
    unusable_anchors: int = 0
    evictions_seen: bool = False
    runs_evicting: int = 0

    def detail_lines(self) -> list[str]:
        counted = kill_harness.counted
        return [
            f"kills mid-write {self.mid_write}; phase at the kill: {counted(self.phases)}",
            f"stepped kills before: {counted(self.before_call)}",
            f"leftovers seen after a kill {self.leftovers_seen}, swept by the start "
            f"{self.leftovers_swept}",
            f"entries verified {self.chunks_verified + self.anchors_verified} "
            f"(chunks {self.chunks_verified}, anchors {self.anchors_verified}); restores "
            f"{self.restores}, logits gates {self.logits_gates}; anchors left without a chunk "
            f"(after evictions) {self.unusable_anchors}; runs whose writer evicted "
            f"{self.runs_evicting}",
        ]


def _tmp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith(TMP))


def kill_one(root: Path, ref: Reference, rng: random.Random, summary: Summary,
             target: str | None = None,
             writer_fault: Callable[[], None] | None = None) -> Killed:
    """Fork a writer over ``root``, kill it at a point of ``target`` (drawn when None). Raises
    ``ChildFailed`` when the child failed on its own."""
    target, skip = HARNESS.draw(rng, target)
    tight = rng.random() < 1 / 3
    budget = int(ref.entry_nbytes * rng.uniform(0.3, 0.7)) if tight else 1 << 40
    seed = rng.getrandbits(32)
    shm = mmap.mmap(-1, mmap.PAGESIZE)

    def hit(at: int, op: str, started: bool) -> bool:
        return {"write": at == WRITE, "counts": at == COUNTS_WRITE, "start": at == START,
                "rename": at == WRITE and op == "rename", "drift": started}[target]

    HARNESS.kill(root, shm, rng, summary, target, skip, hit,
                 lambda started: _child(root, ref, seed, budget, shm, started), writer_fault)
    died = shm[SHM_PHASE]
    summary.mid_write += died in (WRITE, COUNTS_WRITE)
    summary.evictions_seen |= bool(shm[_EVICTED])
    summary.runs_evicting += shm[_EVICTED]
    shm.close()
    return Killed(target)


def check_folder(root: Path, ref: Reference, model, rng: random.Random,
                 summary: Summary) -> list[str]:
    """Open a new tier over ``root`` (the start) and check every entry; the failures."""
    bad: list[str] = []
    before = _tmp_files(root)
    summary.leftovers_seen += len(before)
    tier = open_tier(root)
    try:
        after = _tmp_files(root)
        summary.leftovers_swept += len(set(before) - set(after))
        if after:
            bad.append(f"leftovers after the start: {after}")
        scanned = tier.scanned
        if scanned.refused or scanned.other_fingerprint:
            bad.append(f"the start refused files (a torn entry): {scanned.refused}, "
                       f"{scanned.other_fingerprint} of another fingerprint")
        on_disk = set(tier.files.entries())
        listed = ({("chunk", k) for k in tier.index.chunks}
                  | {("anchor", k) for k in tier.index.anchors})
        if on_disk != listed:
            bad.append(f"the index is not the folder: {len(on_disk ^ listed)} apart")
        counts = root / COUNTS
        if counts.exists():
            try:
                decode_counts(counts.read_bytes(), GRID)
            except CountsError as exc:
                bad.append(f"the counts file is torn: {exc.reason}")
        like = engine(model).cache_state()
        for key in sorted(tier.index.chunks):
            if key not in ref.chunks:
                bad.append(f"a chunk nobody wrote: {key[:12]}")
                continue
            p, b = ref.chunks[key]
            try:
                got = tier.files.read_chunk(key, tier.identity, token_ids=p.ids[b - GRID:b],
                                            like=like, grid=GRID)
            except TierFileError as exc:
                bad.append(f"chunk {p.name}@{b} does not read back: {exc.reason} {exc.detail}")
                continue
            if (got.rows.start, got.rows.stop) != (b - GRID, b) or any(
                    not torch.equal(t, p.rows[b].tensors[n]) for n, t in got.rows.tensors.items()):
                bad.append(f"chunk {p.name}@{b} holds other rows")
            summary.chunks_verified += 1
        usable = []
        for key in sorted(tier.index.anchors):
            if key not in ref.anchors:
                bad.append(f"an anchor nobody wrote: {key[:12]}")
                continue
            p, b = ref.anchors[key]
            try:
                got = tier.files.read_anchor(key, tier.identity, like=like, grid=GRID)
            except TierFileError as exc:
                bad.append(f"anchor {p.name}@{b} does not read back: {exc.reason} {exc.detail}")
                continue
            if got.header.stop != b or list(got.header.chunks) != p.chain[:b // GRID] or any(
                    not torch.equal(t, p.staged[b].tensors[n])
                    for n, t in got.sections.tensors.items()):
                bad.append(f"anchor {p.name}@{b} holds another state")
            summary.anchors_verified += 1
            if tier.index.usable(tier.index.anchors[key]):
                usable.append((p, b))
            else:
                summary.unusable_anchors += 1
                if not summary.evictions_seen:
                    bad.append(f"anchor {p.name}@{b} without its chunks, and nothing evicted")
        gate = rng.randrange(len(usable)) if usable else -1
        for i, (p, b) in enumerate(usable):
            bad += _restore(tier, model, p, b, logits=i == gate, summary=summary)
        tier.check_invariants()
    finally:
        tier.close()
    return bad


def _restore(tier: DiskTier, model, p: Prompt, b: int, *, logits: bool,
             summary: Summary) -> list[str]:
    offer = tier.offer(p.ids[:b + 1], p.namespace, start=0)
    if offer is None or offer.line != b or offer.anchor_key != p.chain[b // GRID - 1]:
        return [f"usable anchor {p.name}@{b} not offered: {offer}"]
    eng = engine(model)
    try:
        tier.restore(offer, p.ids, eng.cache_state())
    except Exception as exc:  # noqa: BLE001 (a failure to report, whatever it is)
        return [f"anchor {p.name}@{b} does not restore: {exc!r}"]
    summary.restores += 1
    got, want = eng.cache_state(), p.cold.cache_state()
    bad = [f"restored {p.name}@{b}: section {n}" for n, t in p.staged[b].tensors.items()
           if not torch.equal(got.sections[n], t)]
    bad += [f"restored {p.name}@{b}: rows of {n}" for n, v in want.views.items()
            if not torch.equal(got.views[n].rows(0, b), v.rows(0, b))]
    if logits and not bad:
        eng.resume_at(b, p.ids, taint=None)
        if not torch.equal(eng.prefill(p.ids), p.logits):
            bad.append(f"restored {p.name}@{b}: the continued prefill's logits")
        summary.logits_gates += 1
    return bad


def run_check(root: Path, runs: int, seed: int, model, *,
              targets: list[str] | None = None,
              progress: Callable[[int, Summary], None] | None = None,
              writer_fault: Callable[[], None] | None = None) -> Summary:
    """``runs`` kills over the folder ``root`` (created), each followed by the check.
    ``targets``: cycled instead of drawn (a test's fixed coverage). ``writer_fault``: called in
    each child before it writes (a test's broken writer, which the check must catch)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    ref = make_reference(model)
    root.mkdir(parents=True, exist_ok=True)
    summary = Summary()
    kill_harness.run_kills(
        summary, runs, seed, lambda target: kill_one(root, ref, rng, summary, target, writer_fault),
        lambda killed: check_folder(root, ref, model, rng, summary), targets=targets,
        progress=progress)
    summary.seconds = time.perf_counter() - t0
    return summary


def main(argv: list[str] | None = None) -> int:
    return kill_harness.main(argv, __doc__, run_check, what="tier", prefix="disk-kill-",
                             folder="tier")


if __name__ == "__main__":
    sys.exit(main())
