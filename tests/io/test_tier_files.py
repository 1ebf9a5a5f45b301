"""The disk tier's chunk and anchor files: a restore from them is a cold prefill bit for bit
(torch.equal: logits, sections, rows), and every way a file can be wrong is refused with a typed
error before a byte of it reaches a state, and the file deleted by the helper the caller uses."""

import errno
import os
import stat
import struct

import pytest
import torch

from tandem.io import direct
from tandem.io.chain import chain_keys
from tandem.io.direct import ALIGN, RefusedEntry
from tandem.io.fingerprint import Identity
from tandem.io.tierfile import (CorruptFile, FingerprintMismatch, ForeignFile, KeyMismatch,
                                LayoutMismatch, MissingFile, RefusedFile, TierFileError,
                                TierFiles, TokensMismatch, TruncatedFile, VersionMismatch)
from tandem.io.tierindex import scan
from tandem.models.base import View
from tandem.models.third import ThirdModel
from tandem.cache.namespace import SHARED

from resident_rig import assert_bit_exact
from tier_rig import ACCEPT, FP, GRID, engine, restore, tokens, write_prompt


def _models(hybrid):
    return {"hybrid": hybrid, "third": ThirdModel(), "third_bf16": ThirdModel(dtype=torch.bfloat16)}


@pytest.mark.parametrize("which", ["hybrid", "third", "third_bf16"])
def test_a_restore_through_a_reopened_tier_is_a_cold_prefill_bit_for_bit(tmp_path, hybrid,
                                                                          which):
    model = _models(hybrid)[which]
    prompt = tokens(model.vocab_size, 3 * GRID + 21, 1)
    with TierFiles(tmp_path / "tier") as files:
        cold, want, _ = write_prompt(files, model, prompt, [2 * GRID, 3 * GRID])
    with TierFiles(tmp_path / "tier") as files:  # another process's view: only the files
        index, report = scan(files, ACCEPT, GRID)
        assert (len(index.chunks), len(index.anchors), report.kept) == (3, 2, 5)
        fresh = engine(model)
        assert restore(files, fresh, prompt, index) == 3 * GRID
    reference = engine(model)
    reference.prefill(prompt[:3 * GRID])
    assert_bit_exact(fresh, reference, 3 * GRID)  # the sections and rows the files held
    logits = fresh.prefill(prompt)
    assert torch.equal(logits, want)
    assert_bit_exact(fresh, cold, len(prompt))


def test_a_read_chunk_holds_the_views_rows_and_token_ids_exactly(files, hybrid):
    prompt = tokens(hybrid.vocab_size, 2 * GRID, 2)
    cold, _, chain = write_prompt(files, hybrid, prompt, [2 * GRID])
    got = files.read_chunk(chain[1], ACCEPT, token_ids=prompt[GRID:], grid=GRID)
    assert got.token_ids == prompt[GRID:]
    assert (got.rows.start, got.rows.stop) == (GRID, 2 * GRID)
    for name, view in cold.cache_state().views.items():
        assert torch.equal(got.rows.tensors[name], view.rows(GRID, 2 * GRID)), name
    anchor = files.read_anchor(chain[1], ACCEPT)
    assert anchor.header.chunks == list(chain[:2])


def _many_sections(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"layer.{i:03d}.a_rather_long_section_name": torch.randn(i % 5 + 1, 3, generator=gen)
            for i in range(n)}


def test_a_header_takes_as_many_4_kib_lines_as_its_metadata_needs(files):
    chain = chain_keys(list(range(GRID)), GRID, SHARED)
    sections = _many_sections(150)
    h = files.write_anchor(chain[0], GRID, chain, sections, fingerprint=FP, grid=GRID)
    header_nbytes = struct.unpack("<I", files.path("anchor", chain[0]).read_bytes()[12:16])[0]
    assert header_nbytes > ALIGN and header_nbytes % ALIGN == 0
    assert h.tensors[0].offset == header_nbytes
    got = files.read_anchor(chain[0], ACCEPT)
    assert list(got.sections.tensors) == list(sections)
    for name, t in sections.items():
        assert torch.equal(got.sections.tensors[name], t)
    # a cut inside the header's second line
    os.truncate(files.path("anchor", chain[0]), ALIGN + 100)
    with pytest.raises(TruncatedFile):
        files.read_anchor(chain[0], ACCEPT)


# -- faults ---------------------------------------------------------------------------------

@pytest.fixture
def written(files):
    """A chunk and an anchor of the third architecture (small files: every byte can be
    flipped), with the prompt and chain."""
    model = ThirdModel(dtype=torch.bfloat16)
    prompt = tokens(model.vocab_size, GRID, 4)
    write_prompt(files, model, prompt, [GRID])
    return files, prompt, chain_keys(prompt, GRID, SHARED)


def _read(files, kind, key, prompt):
    if kind == "chunk":
        return files.read_chunk(key, ACCEPT, token_ids=prompt, grid=GRID)
    return files.read_anchor(key, ACCEPT, grid=GRID)


def _flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def _probes(files, kind, key) -> list[int]:
    """Bytes of every region of a file: the whole 24-byte prefix, a stride through the metadata
    and the header's padding, and each section's first, middle and last bytes and its padding.
    (A flip anywhere is a flip in one of these regions, each covered by its own check; a flip
    costs a write-back before the O_DIRECT read, so not every byte is tried here.)"""
    h = files.read_header(kind, key)
    header_nbytes = h.sections[0].offset
    out = set(range(24)) | set(range(24, header_nbytes, 13)) | {header_nbytes - 1}
    for s in h.sections:
        end = s.offset + s.nbytes
        out |= set(range(s.offset, s.offset + 8)) | {s.offset + s.nbytes // 2}
        out |= set(range(end - 8, end)) | {end, end + 1, -(-end // ALIGN) * ALIGN - 1}
    return sorted(at for at in out if at < h.file_nbytes)


@pytest.mark.parametrize("kind", ["chunk", "anchor"])
def test_a_flipped_byte_anywhere_in_a_file_is_refused(written, kind):
    files, prompt, chain = written
    key = chain[0]
    path = files.path(kind, key)
    h = files.read_header(kind, key)
    data = [range(s.offset, s.offset + s.nbytes) for s in h.sections]
    reasons = set()
    for at in _probes(files, kind, key):
        _flip(path, at)
        with pytest.raises(TierFileError) as err:
            _read(files, kind, key, prompt)
        reasons.add(err.value.reason)
        if any(at in r for r in data):
            assert isinstance(err.value, CorruptFile), at
        _flip(path, at)
    assert reasons >= {"foreign", "version", "corrupt"}
    _read(files, kind, key, prompt)  # each flip undone: the file reads again


@pytest.mark.parametrize("kind", ["chunk", "anchor"])
def test_a_refused_file_is_deleted_by_the_helper_and_then_missing(written, kind):
    files, prompt, chain = written
    h = files.read_header(kind, chain[0])
    _flip(files.path(kind, chain[0]), h.tensors[-1].offset + 1)
    with pytest.raises(CorruptFile) as err:
        _read(files, kind, chain[0], prompt)
    assert files.drop(err.value)
    assert not files.path(kind, chain[0]).exists()
    with pytest.raises(MissingFile) as err:
        _read(files, kind, chain[0], prompt)
    assert not files.drop(err.value)


@pytest.mark.parametrize("kind", ["chunk", "anchor"])
def test_every_truncation_and_an_appended_byte_are_refused(written, kind):
    files, prompt, chain = written
    path = files.path(kind, chain[0])
    whole = path.read_bytes()
    for cut in sorted({0, 1, 7, 23, 24, 100, ALIGN - 1, ALIGN, ALIGN + 1, len(whole) // 2,
                       len(whole) - ALIGN, len(whole) - 1}):
        path.write_bytes(whole[:cut])
        with pytest.raises(TruncatedFile):
            _read(files, kind, chain[0], prompt)
    path.write_bytes(whole + b"\0")
    with pytest.raises(CorruptFile):
        _read(files, kind, chain[0], prompt)
    path.write_bytes(whole)
    _read(files, kind, chain[0], prompt)


def test_a_foreign_file_is_refused(written):
    files, prompt, chain = written
    path = files.path("chunk", chain[0])
    anchor = files.path("anchor", chain[0]).read_bytes()
    for foreign in [b"GGUF" + bytes(ALIGN * 2), os.urandom(3 * ALIGN), b"{}\n", anchor]:
        path.write_bytes(foreign)
        with pytest.raises(ForeignFile):
            _read(files, "chunk", chain[0], prompt)


def test_another_format_version_is_refused(written):
    files, prompt, chain = written
    path = files.path("chunk", chain[0])
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", 99)
    path.write_bytes(bytes(raw))
    with pytest.raises(VersionMismatch):
        _read(files, "chunk", chain[0], prompt)


def test_a_file_of_another_fingerprint_is_refused_unless_adopted(files):
    model = ThirdModel()
    prompt = tokens(model.vocab_size, GRID, 5)
    write_prompt(files, model, prompt, [GRID], fingerprint="ab" * 32)
    key = chain_keys(prompt, GRID, SHARED)[0]
    with pytest.raises(FingerprintMismatch):
        files.read_chunk(key, ACCEPT, token_ids=prompt)
    with pytest.raises(FingerprintMismatch):
        files.read_anchor(key, ACCEPT)
    adopting = Identity(FP, frozenset({"ab" * 32}))
    files.read_chunk(key, adopting, token_ids=prompt)
    files.read_anchor(key, adopting)


def test_a_file_under_another_key_is_refused(written):
    files, prompt, chain = written
    other = chain_keys(tokens(97, GRID, 99), GRID, SHARED)[0]
    files.path("chunk", other).parent.mkdir(mode=0o700, exist_ok=True)
    files.path("chunk", other).write_bytes(files.path("chunk", chain[0]).read_bytes())
    with pytest.raises(KeyMismatch):
        files.read_chunk(other, ACCEPT)


def test_a_chunk_whose_token_ids_are_not_the_prompts_is_refused(written):
    files, prompt, chain = written
    other = list(prompt)
    other[-1] = (other[-1] + 1) % 97
    with pytest.raises(TokensMismatch):
        files.read_chunk(chain[0], ACCEPT, token_ids=other)


def test_a_file_of_another_layout_or_grid_is_refused(written, hybrid):
    files, prompt, chain = written
    state = engine(hybrid).cache_state()
    with pytest.raises(LayoutMismatch):
        files.read_chunk(chain[0], ACCEPT, token_ids=prompt, like=state)
    with pytest.raises(LayoutMismatch):
        files.read_anchor(chain[0], ACCEPT, like=state)
    with pytest.raises(LayoutMismatch):
        files.read_chunk(chain[0], ACCEPT, grid=2 * GRID)


@pytest.mark.parametrize("kind", ["chunk", "anchor"])
def test_a_symlink_in_a_files_place_is_refused_and_never_followed(written, tmp_path, kind):
    files, prompt, chain = written
    path = files.path(kind, chain[0])
    target = tmp_path / "elsewhere"
    target.write_bytes(path.read_bytes())  # a valid file: only the link is wrong
    path.unlink()
    path.symlink_to(target)
    with pytest.raises(RefusedFile) as err:
        _read(files, kind, chain[0], prompt)
    assert files.drop(err.value)
    assert not os.path.lexists(path) and target.exists()


def test_a_symlinked_fanout_folder_and_a_fifo_are_refused(written, tmp_path):
    files, prompt, chain = written
    sub = files.path("chunk", chain[0]).parent
    copy = tmp_path / "copy"
    os.rename(sub, copy)
    sub.symlink_to(copy)
    with pytest.raises(RefusedFile):
        _read(files, "chunk", chain[0], prompt)
    assert files.discard("chunk", chain[0])  # the link where the folder was goes
    assert not os.path.lexists(sub) and (copy / f"{chain[0]}.chunk").exists()
    sub.mkdir(mode=0o700)
    os.mkfifo(files.path("chunk", chain[0]), 0o600)
    with pytest.raises(RefusedFile):  # and the open did not block on it
        _read(files, "chunk", chain[0], prompt)


def test_the_folders_are_0700_and_the_files_0600_whatever_the_umask(tmp_path):
    root = tmp_path / "tier"
    root.mkdir(mode=0o755)
    old = os.umask(0)
    try:
        with TierFiles(root) as files:
            model = ThirdModel()
            prompt = tokens(model.vocab_size, GRID, 6)
            write_prompt(files, model, prompt, [GRID])
            files.write_record("fp-equal.json", b"{}")
    finally:
        os.umask(old)
    key = chain_keys(prompt, GRID, SHARED)[0]
    mode = lambda p: stat.S_IMODE(os.lstat(p).st_mode)  # noqa: E731
    assert mode(root) == 0o700
    assert mode(root / key[:2]) == 0o700
    assert mode(root / key[:2] / f"{key}.chunk") == 0o600
    assert mode(root / key[:2] / f"{key}.anchor") == 0o600
    assert mode(root / "fp-equal.json") == 0o600


def test_a_symlink_as_the_tiers_folder_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "tier").symlink_to(tmp_path / "real")
    with pytest.raises(RefusedEntry):
        TierFiles(tmp_path / "tier")


def test_names_come_from_keys_alone(written):
    files, prompt, chain = written
    names = sorted(p.name for p in files.root.rglob("*"))
    assert names == sorted([chain[0][:2], f"{chain[0]}.chunk", f"{chain[0]}.anchor"])
    with pytest.raises(ValueError):
        files.path("chunk", "../../etc/passwd")


# -- writes: atomic, and through O_DIRECT or around the page cache --------------------------

def test_a_failed_write_leaves_neither_the_file_nor_its_temp(files, monkeypatch):
    model = ThirdModel()
    prompt = tokens(model.vocab_size, GRID, 7)

    def fail(self):
        raise OSError(errno.EIO, "injected fsync failure")

    monkeypatch.setattr(direct.DirectFile, "finish_write", fail)
    with pytest.raises(OSError):
        write_prompt(files, model, prompt, [GRID])
    assert [p for p in files.root.rglob("*") if p.is_file()] == []


def test_a_start_deletes_leftovers_and_what_fails_its_header(written):
    files, prompt, chain = written
    sub = files.path("chunk", chain[0]).parent
    (sub / f"{chain[0]}.chunk.tmp").write_bytes(b"half a write")
    bad = chain_keys(tokens(97, GRID, 8), GRID, SHARED)[0]
    files.path("chunk", bad).parent.mkdir(mode=0o700, exist_ok=True)
    files.path("chunk", bad).write_bytes(os.urandom(ALIGN))
    index, report = scan(files, ACCEPT, GRID)
    assert report.leftovers == 1 and report.refused == {"foreign": 1}
    assert set(index.chunks) == {chain[0]} and set(index.anchors) == {chain[0]}
    assert files.leftovers() == [] and not files.path("chunk", bad).exists()


def test_a_start_sweeps_files_of_a_fingerprint_it_does_not_accept(files):
    model = ThirdModel()
    a, b = tokens(model.vocab_size, GRID, 9), tokens(model.vocab_size, GRID, 10)
    write_prompt(files, model, a, [GRID])
    write_prompt(files, model, b, [GRID], fingerprint="cd" * 32)
    index, report = scan(files, ACCEPT, GRID)
    assert report.other_fingerprint == 2
    assert set(index.chunks) == {chain_keys(a, GRID, SHARED)[0]}
    assert not files.path("chunk", chain_keys(b, GRID, SHARED)[0]).exists()


def _direct_works(folder) -> bool:
    fd = -1
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        return True
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)
        (folder / "probe").unlink(missing_ok=True)


def test_files_go_through_o_direct_where_the_file_system_takes_it(written, tmp_path):
    if not _direct_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    files, prompt, chain = written
    _read(files, "chunk", chain[0], prompt)
    assert files.transfers["write_direct"] == 2 and files.transfers["write_buffered"] == 0
    assert files.transfers["read_direct"] >= 1 and files.transfers["read_buffered"] == 0


@pytest.mark.parametrize("refuses_at", ["open", "transfer"])
def test_a_file_system_that_refuses_o_direct_is_written_and_read_around_the_page_cache(
        tmp_path, hybrid, monkeypatch, refuses_at):
    """tmpfs and some FUSE file systems answer EINVAL to O_DIRECT, at the open or at the first
    transfer: the file goes through the page cache, fsynced, and its pages are dropped."""
    real_open, real_pwrite, real_preadv = os.open, os.pwrite, os.preadv
    dropped = []
    real_fadvise = os.posix_fadvise

    def is_direct(fd):
        import fcntl
        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT

    def fake_open(path, flags, mode=0o777, *, dir_fd=None):
        if refuses_at == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def fake_pwrite(fd, data, offset):
        if is_direct(fd):
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return real_pwrite(fd, data, offset)

    def fake_preadv(fd, buffers, offset):
        if is_direct(fd):
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return real_preadv(fd, buffers, offset)

    def fadvise(fd, offset, length, advice):
        dropped.append(advice)
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(direct.os, "open", fake_open)
    monkeypatch.setattr(direct.os, "pwrite", fake_pwrite)
    monkeypatch.setattr(direct.os, "preadv", fake_preadv)
    monkeypatch.setattr(direct.os, "posix_fadvise", fadvise)
    prompt = tokens(hybrid.vocab_size, 2 * GRID + 5, 11)
    with TierFiles(tmp_path / "tier") as files:
        cold, want, _ = write_prompt(files, hybrid, prompt, [2 * GRID])
        fresh = engine(hybrid)
        assert restore(files, fresh, prompt) == 2 * GRID
        assert files.transfers["write_direct"] == 0 and files.transfers["write_buffered"] == 3
        assert files.transfers["read_direct"] == 0
    assert os.POSIX_FADV_DONTNEED in dropped
    assert torch.equal(fresh.prefill(prompt), want)
    assert_bit_exact(fresh, cold, len(prompt))


def test_a_chunk_is_one_grid_step_and_an_anchor_lists_every_chunk_below_it(files):
    model = ThirdModel()
    state = engine(model).cache_state()
    chain = chain_keys(list(range(2 * GRID)), GRID, SHARED)
    with pytest.raises(ValueError):
        files.write_chunk(chain[0], list(range(GRID)), state.views, 0, GRID + 1,
                          fingerprint=FP, grid=GRID)
    with pytest.raises(ValueError):
        files.write_anchor(chain[1], 2 * GRID, chain[1:], state.sections, fingerprint=FP,
                           grid=GRID)
    with pytest.raises(ValueError):
        files.write_anchor(chain[1], 2 * GRID, chain[::-1], state.sections, fingerprint=FP,
                           grid=GRID)
    assert isinstance(state.views["keys"], View)
