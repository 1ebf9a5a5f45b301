"""The fingerprint of the arithmetic that wrote a tier file, and which earlier ones a tier adopts.

A file's rows are a cold prefill's only under the arithmetic that computed them, so every tier
file carries a fingerprint and a tier reads only the files of the fingerprints it accepts.

The formulas (spec: "Fingerprint v3", "Fingerprint fp4"):

- ``v3``: what the model's adapter lists in ``manifest()`` (the engine's: the model type, its
  config and dtype, the weights' digest, the code that computes rows, the grid ``prefix_chunk``
  and the thread count), the library versions, and the *extra* by path: each checkpoint file by
  its path and size, each outside setting as written;
- ``fp4`` (the current one): v3 over the extra by content. A checkpoint file counts by its size
  and sha256 (a file over 64 MiB by its first and last MiB and 16 reads spread between), and a
  setting whose value names files counts by what is in them; paths do not count, so a tree that
  moved keeps its files, and a byte that changed sweeps them.

Adoption (spec: "A tree in another folder"): the first start under a formula accepts the files
the formulas before it wrote for the same rows (``legacy_fingerprints``: v3 on this tree, and v3
on each folder named in ``disk_adopt_from`` whose files hold what this tree's hold), and what
those formulas had themselves adopted, once. The record is kept per formula in
``fp-equal.json`` in the tier's folder; later starts under the same fingerprint accept what it
lists, and an arithmetic change under the same formula sweeps it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Mapping, Sequence

import msgspec
import structlog

from tandem.io.tierfile import TierFiles

log = structlog.get_logger()

Formula = Literal["v3", "fp4"]
FORMULA: Formula = "fp4"
BEFORE: dict[Formula, tuple[Formula, ...]] = {"v3": (), "fp4": ("v3",)}
RECORD = "fp-equal.json"

MiB = 1 << 20
WHOLE_UNDER = 64 * MiB  # a file up to this size is hashed whole
SAMPLE_READS = 16  # reads of a MiB between a larger file's first and last MiB

LIBRARIES = ("torch", "triton", "numpy")


def library_versions() -> dict[str, str]:
    """The versions of what computes rows (absent ones: "none")."""
    out = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "none"
    return out


def content_digest(path: str | os.PathLike) -> str:
    """``size:sha256``: over the whole file up to 64 MiB; over a larger one, its first and last
    MiB and 16 MiB-reads spread evenly between them (a checkpoint of tens of GB is read in a
    fraction of a second, and any re-randomised or re-quantised one differs in every read)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= WHOLE_UNDER:
            for block in iter(lambda: f.read(8 * MiB), b""):
                h.update(block)
        else:
            span = size - 3 * MiB  # where the reads between may start
            starts = [0] + [MiB + span * i // (SAMPLE_READS - 1)
                            for i in range(SAMPLE_READS)] + [size - MiB]
            for start in starts:
                f.seek(start)
                h.update(f.read(MiB))
    return f"{size}:{h.hexdigest()}"


def _folder_digest(path: Path) -> str:
    h = hashlib.sha256(b"folder\0")
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(path)).encode() + b"\0" + content_digest(p).encode() + b"\0")
    return h.hexdigest()


def value_by_content(value: str) -> str:
    """A setting's value with the files or folders it names (``os.pathsep``-separated, every
    part an existing one) replaced by what is in them; any other value is itself."""
    paths = [Path(os.path.expanduser(p)) for p in value.split(os.pathsep)] if value else []
    if not paths or not all(p.is_file() or p.is_dir() for p in paths):
        return value
    return os.pathsep.join("file:" + content_digest(p) if p.is_file()
                           else "folder:" + _folder_digest(p) for p in paths)


@dataclass(frozen=True)
class FingerprintInputs:
    """What a fingerprint reads. ``manifest``: the engine's (``Engine.manifest()``). ``files``:
    the checkpoint's files that compute rows (config and weights, drafters' too), under
    ``root`` (the tree the checkpoint lies in) where they came from one. ``extra``: settings from
    outside the manifest that change a row (arithmetic flags, tables); leave out what never
    does."""

    manifest: Mapping[str, str]
    files: tuple[Path, ...] = ()
    extra: Mapping[str, str] = field(default_factory=dict)
    versions: Mapping[str, str] = field(default_factory=library_versions)
    root: Path | None = None

    @classmethod
    def of_checkpoint(cls, manifest: Mapping[str, str], model_dir: str | os.PathLike | None,
                      extra: Mapping[str, str] | None = None) -> "FingerprintInputs":
        """A checkpoint directory's config and weight files (none for a model built in memory,
        whose manifest's weights digest then stands for them)."""
        from tandem.models.checkpoint import weight_files  # the loader, only when one is named
        files: tuple[Path, ...] = ()
        root = None
        if model_dir is not None:
            root = Path(model_dir).absolute()
            files = tuple([root / "config.json"] + [Path(p).absolute()
                                                    for p in weight_files(root)])
        return cls(dict(manifest), files, dict(extra or {}), root=root)

    def moved_to(self, folder: Path) -> "FingerprintInputs":
        """The same inputs as they read from ``folder`` in this tree's place (the paths only)."""
        assert self.root is not None
        old, new = str(self.root), str(folder)

        def move(text: str) -> str:
            return os.pathsep.join(new + p[len(old):] if p == old or p.startswith(old + os.sep)
                                   else p for p in text.split(os.pathsep))

        return replace(self, files=tuple(Path(move(str(p))) for p in self.files),
                       extra={k: move(v) for k, v in self.extra.items()}, root=folder)


def fingerprint(inputs: FingerprintInputs, formula: Formula = FORMULA) -> str:
    """The hex sha256 of ``inputs`` under ``formula``."""
    h = hashlib.sha256(f"tandem fingerprint {formula}\0".encode())

    def put(kind: str, name: str, value: str) -> None:
        h.update(f"{kind}\0{name}\0{value}\0".encode("utf-8", "surrogatepass"))

    for name in sorted(inputs.manifest):
        put("manifest", name, inputs.manifest[name])
    for name in sorted(inputs.versions):
        put("version", name, inputs.versions[name])
    for path in inputs.files:
        if formula == "v3":
            put("file", str(path), str(path.stat().st_size))
        else:
            rel = path.relative_to(inputs.root) if inputs.root else Path(path.name)
            put("file", str(rel), content_digest(path))
    for name in sorted(inputs.extra):
        value = inputs.extra[name]
        put("extra", name, value if formula == "v3" else value_by_content(value))
    return h.hexdigest()


def _same_content(inputs: FingerprintInputs, folder: Path) -> bool:
    """Whether ``folder`` holds what this tree holds, file for file."""
    moved = inputs.moved_to(folder)
    for here, there in zip(inputs.files, moved.files):
        try:
            if content_digest(here) != content_digest(there):
                return False
        except OSError:
            return False
    return True


def legacy_fingerprints(inputs: FingerprintInputs, formula: Formula = FORMULA,
                        adopt_from: Sequence[str | os.PathLike] = ()) -> tuple[list[str],
                                                                                list[str]]:
    """What the formulas before ``formula`` gave for these rows: on this tree, and on each
    folder of ``adopt_from`` (a tree that moved names where it came from) that holds what
    this tree holds. Returns (this tree's, the named folders')."""
    here: list[str] = []
    named: list[str] = []
    for before in BEFORE[formula]:
        here.append(fingerprint(inputs, before))
        for folder in adopt_from:
            folder = Path(os.path.expanduser(str(folder))).absolute()
            if inputs.root is None or folder == inputs.root:
                continue
            if not _same_content(inputs, folder):
                log.info("disk_adopt_refused", formula=before, why="other_content")
                continue
            named.append(fingerprint(inputs.moved_to(folder), before))
    return here, named


# -- the adoption record --------------------------------------------------------------------

class FormulaRecord(msgspec.Struct, frozen=True):
    fingerprint: str
    adopted: list[str] = []


class AdoptionRecord(msgspec.Struct, frozen=True):
    formulas: dict[str, FormulaRecord] = {}


@dataclass(frozen=True)
class Identity:
    """The fingerprint files are written under, and every one a read accepts (``in``)."""

    fingerprint: str
    adopted: frozenset[str] = frozenset()

    def __contains__(self, fp: object) -> bool:
        return fp == self.fingerprint or fp in self.adopted


def adopt(record: AdoptionRecord, formula: Formula, current: str, legacy: Sequence[str],
          named: Sequence[str]) -> tuple[Identity, AdoptionRecord]:
    """Which fingerprints a start under ``formula`` accepts, and the record it leaves.

    The first start under a formula adopts ``legacy`` (the formulas before it on this tree), the
    folders ``named`` in disk_adopt_from, and what the earlier formulas' records had adopted
    when their fingerprint is among ``legacy`` (so what v2 read, v3 reads once more). A later
    start under the same fingerprint accepts what its record lists (and folders named now); a
    start under another fingerprint of the same formula (an arithmetic change) accepts only
    its own, and the folders named now."""
    mine = record.formulas.get(formula)
    if mine is None:
        adopted = set(legacy) | set(named)
        for name, other in record.formulas.items():
            if name != formula and other.fingerprint in legacy:
                adopted |= set(other.adopted)
    elif mine.fingerprint == current:
        adopted = set(mine.adopted) | set(named)
    else:
        adopted = set(named)
    adopted.discard(current)
    formulas = dict(record.formulas)
    formulas[formula] = FormulaRecord(current, sorted(adopted))
    return Identity(current, frozenset(adopted)), AdoptionRecord(formulas)


def tier_identity(files: TierFiles, inputs: FingerprintInputs,
                  disk_adopt_from: Sequence[str | os.PathLike] = (),
                  formula: Formula = FORMULA) -> Identity:
    """The tier's identity at a start: its fingerprint and what it adopts, with the adoption
    record in the tier's folder (``fp-equal.json``) read and, where it changed, rewritten."""
    raw = files.read_record(RECORD)
    record = AdoptionRecord()
    if raw is not None:
        try:
            record = msgspec.json.decode(raw, type=AdoptionRecord)
        except msgspec.DecodeError:
            log.warning("disk_adoption_record_unreadable")
    current = fingerprint(inputs, formula)
    legacy, named = legacy_fingerprints(inputs, formula, disk_adopt_from)
    identity, new = adopt(record, formula, current, legacy, named)
    if new != record:
        files.write_record(RECORD, msgspec.json.encode(new))
    log.info("disk_tier_identity", formula=formula, fingerprint=current[:12],
             adopted=len(identity.adopted), first_start=formula not in record.formulas)
    return identity
