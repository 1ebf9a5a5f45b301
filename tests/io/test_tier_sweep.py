"""Every single-byte flip and every truncation of one small chunk file and one small anchor
file, each refused by the reader with a typed error and deleted by the caller's helper; one flip
in each region of a file, through the tier, recomputed; and files copied in from another salt's
chain, another model or another grid, never served through ``DiskTier.offer``/``restore``
(issue 15, "Faults"; test_tier_files probes each region's edges, this tries every byte).

The flips run on tmpfs where there is one, through the page cache (``direct=False``): the
checks are the same code either way, and an O_DIRECT read after each flip would write the page
back first, 36,864 times."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tandem.cache.namespace import SHARED, namespace_of
from tandem.engine import Engine
from tandem.io.chain import chain_keys
from tandem.io.direct import ALIGN
from tandem.io.tier import DiskReadFailed
from tandem.io.tierfile import (CorruptFile, ForeignFile, MissingFile, TierFileError, TierFiles,
                                TruncatedFile, VersionMismatch)
from tandem.models.third import ThirdModel

from disk_rig import (FP, GRID, assert_same_as_cold, cold_prefill, head_plan, make_tier,
                      restore_fresh, tokens, write_plan)
from tier_rig import ACCEPT, write_prompt

SHM = Path("/dev/shm")


@pytest.fixture
def fast_root(tmp_path):
    """A folder on tmpfs when the machine has one (removed after), else the test's own."""
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        root = Path(os.path.realpath(SHM)) / f"tandem-sweep-{os.getpid()}-{id(tmp_path)}"
        yield root
        shutil.rmtree(root, ignore_errors=True)
    else:
        yield tmp_path / "sweep"


@pytest.fixture
def small_files(fast_root):
    """A chunk and an anchor of the third architecture in bf16: 20 KiB and 16 KiB."""
    with TierFiles(fast_root, direct=False) as files:
        model = ThirdModel(dtype=torch.bfloat16)
        prompt = tokens(model.vocab_size, GRID, 21)
        write_prompt(files, model, prompt, [GRID])
        yield files, prompt, chain_keys(prompt, GRID, SHARED)[0]


def _read(files: TierFiles, kind: str, key: str, prompt: list[int]):
    if kind == "chunk":
        return files.read_chunk(key, ACCEPT, token_ids=prompt, grid=GRID)
    return files.read_anchor(key, ACCEPT, grid=GRID)


def _expected(files: TierFiles, kind: str, key: str):
    """The refusal a flip at each byte must raise: by the field or region it falls in."""
    h = files.read_header(kind, key)
    n = h.file_nbytes
    want: list[tuple[type[TierFileError], ...]] = [(CorruptFile,)] * n
    want[0:8] = [(ForeignFile,)] * 8  # the magic
    want[8:12] = [(VersionMismatch,)] * 4
    want[12:16] = [(CorruptFile, TruncatedFile)] * 4  # the header's size: wrong, or past the end
    return h, want  # the metadata's size, the crc32, the metadata, every section: corrupt


@pytest.mark.parametrize("kind", ["chunk", "anchor"])
def test_every_single_byte_flip_is_refused_typed_and_the_file_deleted(small_files, kind):
    files, prompt, key = small_files
    path = files.path(kind, key)
    whole = path.read_bytes()
    h, want = _expected(files, kind, key)
    assert len(whole) == h.file_nbytes == len(want) and h.sections[0].offset == ALIGN
    seen: set[str] = set()
    for at in range(len(whole)):
        flipped = bytearray(whole)
        flipped[at] ^= 0xA5
        path.write_bytes(flipped)
        with pytest.raises(TierFileError) as err:
            _read(files, kind, key, prompt)
        assert isinstance(err.value, want[at]), (at, err.value)
        assert (err.value.kind, err.value.key) == (kind, key)
        seen.add(err.value.reason)
        assert files.drop(err.value), at  # the caller's helper deletes what was refused
        assert not os.path.lexists(path), at
    assert seen == {"foreign", "version", "corrupt", "truncated"}
    with pytest.raises(MissingFile):
        _read(files, kind, key, prompt)
    path.write_bytes(whole)
    _read(files, kind, key, prompt)  # the sweep changed nothing else


@pytest.mark.parametrize("kind", ["chunk", "anchor"])
def test_every_truncation_is_refused_as_truncated_and_the_file_deleted(small_files, kind):
    files, prompt, key = small_files
    path = files.path(kind, key)
    whole = path.read_bytes()
    for cut in range(len(whole)):
        path.write_bytes(whole[:cut])
        with pytest.raises(TruncatedFile) as err:
            _read(files, kind, key, prompt)
        assert files.drop(err.value), cut
        assert not os.path.lexists(path), cut
    path.write_bytes(whole)
    _read(files, kind, key, prompt)


def _regions(files: TierFiles, kind: str, key: str) -> dict[str, int]:
    """One byte of each region of a file (its prefix's fields, the metadata, the header's
    padding, each section's bytes and padding)."""
    h = files.read_header(kind, key)
    out = {"magic": 3, "version": 9, "header size": 13, "metadata size": 17, "crc32": 21,
           "metadata": 40, "header padding": h.sections[0].offset - 1}
    for s in h.sections:
        out[f"{s.name or 'tokens'} data"] = s.offset + s.nbytes // 2
        if s.nbytes % ALIGN:
            out[f"{s.name or 'tokens'} padding"] = s.offset + s.nbytes
    return out


@pytest.mark.parametrize("kind", ["chunk", "anchor"])
def test_a_flip_in_each_region_fails_the_restore_and_is_recomputed(tmp_path, kind):
    """Through the tier: the restore raises, the file is gone, the state never took a byte of
    the anchor, the next plan admits it again, and its rewrite serves bit for bit."""
    model = ThirdModel(dtype=torch.bfloat16)
    prompt = tokens(model.vocab_size, GRID + 5, 22)
    key = chain_keys(prompt, GRID, SHARED)[0]
    root = tmp_path / "disk"
    tier = make_tier(root, head_anchors=1)
    cold, want, report = write_plan(tier, model, prompt, head_plan(tier, prompt))
    assert len(report.written) == 2
    paths = {k: tier.files.path(k, key) for k in ("chunk", "anchor")}
    whole = {k: p.read_bytes() for k, p in paths.items()}
    regions = _regions(tier.files, kind, key)
    tier.close()
    for region, at in regions.items():
        for k, data in whole.items():
            paths[k].write_bytes(data)
        tier = make_tier(root, head_anchors=1)
        offer = tier.offer(prompt, SHARED, start=0)
        assert offer is not None and offer.line == GRID, region
        path = tier.files.path(kind, key)
        flipped = bytearray(whole[kind])
        flipped[at] ^= 0x5A
        path.write_bytes(flipped)
        fresh = Engine(model, window=512, prefix_chunk=GRID)
        before = {n: t.clone() for n, t in fresh.cache_state().sections.items()}
        with pytest.raises(DiskReadFailed) as failed:
            tier.restore(offer, prompt, fresh.cache_state())
        assert failed.value.kind == kind, region
        assert not path.exists() and not tier.index.has(kind, key), region
        for n, t in fresh.cache_state().sections.items():
            assert torch.equal(t, before[n]), (region, n)
        plan = head_plan(tier, prompt)  # recomputed: the next plan writes it again
        assert plan.chunk_lines == ((GRID,) if kind == "chunk" else ()), region
        assert plan.anchor_lines == ((GRID,) if kind == "anchor" else ()), region
        _, _, rewrite = write_plan(tier, model, prompt, plan)
        assert rewrite.written == [(kind, key)], region
        offer = tier.offer(prompt, SHARED, start=0)
        assert_same_as_cold(restore_fresh(tier, model, prompt, offer), cold, prompt, want)
        tier.close()


# -- files copied in from elsewhere ----------------------------------------------------------

def _copy(src: TierFiles, kind: str, src_key: str, dst: TierFiles, dst_key: str) -> None:
    to = dst.path(kind, dst_key)
    to.parent.mkdir(mode=0o700, exist_ok=True)
    to.write_bytes(src.path(kind, src_key).read_bytes())


def test_files_copied_under_another_salts_keys_are_never_served(tmp_path):
    model = ThirdModel()
    prompt = tokens(model.vocab_size, 2 * GRID + 5, 23)
    a, b = namespace_of("tenant a"), namespace_of("tenant b")
    ka, kb = chain_keys(prompt, GRID, a), chain_keys(prompt, GRID, b)
    root = tmp_path / "disk"
    tier = make_tier(root)
    write_plan(tier, model, prompt, head_plan(tier, prompt, a))
    for i in range(2):
        for kind in ("chunk", "anchor"):
            _copy(tier.files, kind, ka[i], tier.files, kb[i])
    assert tier.offer(prompt, b, start=0) is None  # the live index never listed them
    tier.close()
    again = make_tier(root)  # the start reads each header: another key, deleted
    assert again.scanned.refused == {"key": 4}
    assert not any(again.files.path(k, key).exists() for k in ("chunk", "anchor") for key in kb)
    assert again.offer(prompt, b, start=0) is None
    assert again.offer(prompt, a, start=0).line == 2 * GRID  # tenant a's own still serve

    # tenant b's own files listed, then swapped for tenant a's behind the tier's back
    write_plan(again, model, prompt, head_plan(again, prompt, b))
    offer = again.offer(prompt, b, start=0)
    assert offer.line == 2 * GRID
    for kind in ("chunk", "anchor"):
        _copy(again.files, kind, ka[1], again.files, kb[1])
    with pytest.raises(DiskReadFailed) as failed:
        restore_fresh(again, model, prompt, offer)
    assert failed.value.reason == "key"
    assert again.offer(prompt, b, start=0) is None or \
        again.offer(prompt, b, start=0).anchor_key != kb[1]
    again.check_invariants()


def _foreign(tmp_path: Path, name: str, model, prompt: list[int], grid: int,
             fingerprint: str) -> TierFiles:
    """Another process's folder: a cold prefill of ``prompt`` by ``model`` at ``grid``, its
    chunks and an anchor at each line, under ``fingerprint``."""
    files = TierFiles(tmp_path / name)
    cold = Engine(model, window=512, prefix_chunk=grid)
    staged = {}
    lines = list(range(grid, len(prompt), grid))

    def on_chunk(end: int) -> None:
        if end in lines:
            staged[end] = {n: t.clone() for n, t in cold.cache_state().sections.items()}

    cold.prefill(prompt, on_chunk=on_chunk)
    chain = chain_keys(prompt, grid, SHARED)
    views = cold.cache_state().views
    for b in lines:
        files.write_chunk(chain[b // grid - 1], prompt[b - grid:b], views, b - grid, b,
                          fingerprint=fingerprint, grid=grid)
        files.write_anchor(chain[b // grid - 1], b, chain[:b // grid], staged[b],
                           fingerprint=fingerprint, grid=grid)
    return files


@pytest.mark.parametrize("fingerprint,reason", [("ab" * 32, "fingerprint"), (FP, "layout")])
def test_another_models_files_are_never_served(tmp_path, hybrid, fingerprint, reason):
    """The hybrid's files for the same tokens have the same names; under its own fingerprint
    they are refused for it, and under this tier's (a fingerprint that failed to tell the two
    models apart) for their layout."""
    model = ThirdModel()
    prompt = tokens(min(model.vocab_size, hybrid.vocab_size), 2 * GRID + 5, 24)
    chain = chain_keys(prompt, GRID, SHARED)
    other = _foreign(tmp_path, "other", hybrid, prompt, GRID, fingerprint)
    root = tmp_path / "disk"
    tier = make_tier(root)
    cold, want, _ = write_plan(tier, model, prompt, head_plan(tier, prompt))
    offer = tier.offer(prompt, SHARED, start=0)
    assert offer.line == 2 * GRID
    for kind in ("chunk", "anchor"):  # swapped behind the live tier's back
        for key in chain:
            _copy(other, kind, key, tier.files, key)
    fresh = Engine(model, window=512, prefix_chunk=GRID)
    before = {n: t.clone() for n, t in fresh.cache_state().sections.items()}
    with pytest.raises(DiskReadFailed) as failed:
        tier.restore(offer, prompt, fresh.cache_state())
    assert failed.value.reason == reason
    for n, t in fresh.cache_state().sections.items():
        assert torch.equal(t, before[n]), n
    tier.close()
    again = make_tier(root)
    if reason == "fingerprint":  # a start sweeps every file of a fingerprint it does not take
        assert again.scanned.other_fingerprint == 3 and not list(again.files.entries())
    # under this tier's fingerprint the start cannot tell (it knows no state's layout): what is
    # left is offered, and each restore fails and deletes it, until none is offered
    for _ in range(4):
        offer = again.offer(prompt, SHARED, start=0)
        if offer is None:
            break
        with pytest.raises(DiskReadFailed) as failed:
            restore_fresh(again, model, prompt, offer)
        assert failed.value.reason == reason
    assert again.offer(prompt, SHARED, start=0) is None and not again.index.anchors
    fresh.resume_at(0)
    assert_same_as_cold(fresh, cold, prompt, want)  # the request goes on cold, bit for bit


def test_files_of_another_grid_are_never_served(tmp_path):
    model = ThirdModel()
    prompt = tokens(model.vocab_size, 2 * GRID + 5, 25)
    chain = chain_keys(prompt, GRID, SHARED)
    half = GRID // 2
    other = _foreign(tmp_path, "other", model, prompt, half, FP)
    half_chain = chain_keys(prompt, half, SHARED)
    root = tmp_path / "disk"
    tier = make_tier(root)
    tier.close()
    files = TierFiles(root)
    for kind in ("chunk", "anchor"):
        for key in half_chain:  # under their own names
            _copy(other, kind, key, files, key)
    # and a grid-32 file under a grid-64 key: its header names the key, its grid is 32
    cold, _, staged = cold_prefill(model, prompt, [GRID])
    files.write_chunk(chain[0], prompt[half:GRID], cold.cache_state().views, half, GRID,
                      fingerprint=FP, grid=half)
    files.write_anchor(chain[0], GRID, [half_chain[0], chain[0]], staged[GRID].tensors,
                       fingerprint=FP, grid=half)
    files.close()
    again = make_tier(root)
    assert again.scanned.refused == {"layout": 2 * len(half_chain) + 2}
    assert not again.index.chunks and not again.index.anchors
    assert again.offer(prompt, SHARED, start=0) is None

    # this grid's own files, then swapped for the other grid's under the same names
    cold, want, _ = write_plan(again, model, prompt, head_plan(again, prompt))
    offer = again.offer(prompt, SHARED, start=0)
    assert offer.line == 2 * GRID
    for kind in ("chunk", "anchor"):
        _copy(other, kind, half_chain[3], again.files, chain[1])  # line 128 at either grid
    with pytest.raises(DiskReadFailed) as failed:
        restore_fresh(again, model, prompt, offer)
    assert failed.value.reason == "key"
    assert not again.files.path("anchor", chain[1]).exists()
    again.check_invariants()
