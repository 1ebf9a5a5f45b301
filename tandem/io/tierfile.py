"""The disk tier's files: chunk files (rows of every view and their token ids) and anchor files
(every recurrent section at a line), each verified whole before a byte of it is handed on.

Layout (every offset and length a multiple of 4 KiB, so O_DIRECT can move every byte)::

    header   as many 4 KiB lines as the metadata needs:
             magic (8 bytes) | format version | header bytes | metadata bytes | crc32  (u32 LE)
             then the metadata (JSON, ``Header``), then zeros to the end of the last line
    sections one after another in the header's order, each at a 4 KiB-aligned offset and
             padded with zeros to the next 4 KiB

The crc32 of the first line covers the 20 bytes before it and the metadata; each section has
its own crc32 over its bytes; the padding must be zeros. So every byte of a file is covered by a
check, and a flipped byte or a cut anywhere is refused. The metadata names the file's kind, its
key, its fingerprint and grid, and for each section its name, dtype, shape, offset, byte count
and crc32; a view's section also names the token axis its rows lie along.

A chunk file holds rows ``[b - G, b)`` of every position-indexed view (named as the state names
them) and those G token ids; an anchor file holds every recurrent section at line ``b`` and the
keys of the chunks below it (``key(G) ... key(b)``), and is usable only with all of them on disk.
Both are named by ``key(b)`` (tandem.io.chain): ``<root>/<first two hex digits>/<key>.chunk``
and ``.anchor``. A file is written to ``<name>.tmp``, fsynced, renamed into place and its folder
fsynced, so a crash leaves at most a ``.tmp``, which ``leftovers`` finds and the next start
deletes.

A reader refuses (``TierFileError``, whose ``reason`` says why) a missing file, a symlink or other
non-file, a foreign file, another format version, a fingerprint the tier does not accept, another
key, a truncation, a bad crc32 or non-zero padding, a layout other than the state's, and a chunk
whose token ids are not the prompt's. The caller then deletes the file (``discard``) and
recomputes what it held.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import threading
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Container, Iterator, Literal, Mapping, Sequence

import msgspec
import numpy as np
import torch

from tandem.cache.copies import RowsCopy, SectionsCopy
from tandem.io.chain import Key, is_key
from tandem.io.direct import (ALIGN, DirectFile, RefusedEntry, aligned, fsync_folder,
                              open_folder, round_up)
from tandem.models.base import CacheState, View

try:
    # The same CRC-32 as zlib's (the format's), folded with PCLMULQDQ: about ten times the
    # system zlib 1.2's rate, so a restore's sums keep up with the NVMe; it releases the GIL.
    from zlib_ng.zlib_ng import crc32
except ImportError:  # a platform without its wheel: the stdlib's, slower, same sums
    from zlib import crc32

MAGIC = b"TANDEMDT"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIIII")  # magic, version, header bytes, metadata bytes, crc32
_CRC_AT = 20  # the crc32 field ends the prefix; it covers the 20 bytes before it and the metadata
MAX_HEADER_NBYTES = 64 << 20  # a header claiming more is not one of ours
STAGE_NBYTES = 16 << 20
_NO_CRC = 0xFFFFFFFF  # the widest crc32, for sizing the header before the sums are known

FileKind = Literal["chunk", "anchor"]
SUFFIXES: dict[FileKind, str] = {"chunk": ".chunk", "anchor": ".anchor"}
TMP = ".tmp"

# What a section may hold, by the name a header writes (str(dtype) without "torch.").
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                 "uint8", "bool", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)}


# -- errors ---------------------------------------------------------------------------------

Refusal = Literal["missing", "refused", "foreign", "version", "fingerprint", "key", "truncated",
                  "corrupt", "layout", "tokens"]


class TierFileError(Exception):
    """A tier file that must not be served; ``reason`` says why. The message names the file's
    kind and key, never a token."""

    reason: ClassVar[Refusal]

    def __init__(self, kind: FileKind, key: str, detail: str):
        super().__init__(f"{kind} {key[:16]}: {detail}")
        self.kind = kind
        self.key = key
        self.detail = detail


class MissingFile(TierFileError):
    reason = "missing"


class RefusedFile(TierFileError):
    """A symlink, a folder, a FIFO or another user's file where the tier's file should be."""
    reason = "refused"


class ForeignFile(TierFileError):
    reason = "foreign"


class VersionMismatch(TierFileError):
    reason = "version"


class FingerprintMismatch(TierFileError):
    reason = "fingerprint"


class KeyMismatch(TierFileError):
    reason = "key"


class TruncatedFile(TierFileError):
    reason = "truncated"


class CorruptFile(TierFileError):
    reason = "corrupt"


class LayoutMismatch(TierFileError):
    """The file's sections are not the state's (names, dtypes, shapes or token axes)."""
    reason = "layout"


class TokensMismatch(TierFileError):
    """A chunk's token ids are not the prompt's: its key collided, or the file was swapped."""
    reason = "tokens"


# -- the header -----------------------------------------------------------------------------

class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    crc32: int
    token_axis: int = -1  # a view's: the axis its rows lie along; -1 for a recurrent section


class Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: FileKind
    key: str
    fingerprint: str
    grid: int
    start: int  # a chunk's rows are [start, stop); an anchor's line is stop, its start 0
    stop: int
    file_nbytes: int
    tensors: list[Section]  # a chunk's views or an anchor's sections, in the state's order
    tokens: Section | None = None  # a chunk's token ids (int64)
    chunks: list[str] = []  # an anchor's: key(grid), key(2 grid), ... key(stop)

    @property
    def sections(self) -> list[Section]:
        """Every section in file order."""
        return ([self.tokens] if self.tokens is not None else []) + list(self.tensors)

    @property
    def data_nbytes(self) -> int:
        return sum(s.nbytes for s in self.sections)


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Header).decode


@dataclass
class ChunkRead:
    header: Header
    token_ids: list[int]
    rows: RowsCopy  # rows [start, stop) of every view, restorable into a state


@dataclass
class AnchorRead:
    header: Header
    sections: SectionsCopy


@dataclass
class Loaded:
    """A file's bytes in one host buffer at the file's own offsets, its header verified, its
    sections not yet (``verify``). Its tensors are views of ``buf``, never copies: they live as
    long as the buffer is not handed back to its ``Staging``."""

    kind: FileKind
    key: str
    header: Header
    buf: np.ndarray

    def verify(self, token_ids: Sequence[int] | None = None) -> None:
        """Every section's crc32 and zero padding, and a chunk's token ids equal to
        ``token_ids`` element by element (the tokens first: a cut there names the file
        corrupt before it names it another prompt's). Raises the ``TierFileError``."""
        for s in self.header.sections:
            self.check(s, token_ids)

    def check(self, s: Section, token_ids: Sequence[int] | None = None) -> None:
        """One section's crc32 and zero padding; for a chunk's tokens, their ids too."""
        if crc32(self._bytes(s)) != s.crc32:
            raise CorruptFile(self.kind, self.key, f"section {s.name!r} crc32")
        if self.buf[s.offset + s.nbytes:s.offset + round_up(s.nbytes)].any():
            raise CorruptFile(self.kind, self.key, f"section {s.name!r} padding")
        if s is self.header.tokens and token_ids is not None:
            ids = self._bytes(s).view(np.int64)
            want = np.asarray(token_ids, dtype=np.int64)
            if ids.shape != want.shape or not np.array_equal(ids, want):
                raise TokensMismatch(self.kind, self.key, "its token ids are not the prompt's")

    def _bytes(self, s: Section) -> np.ndarray:
        return self.buf[s.offset:s.offset + s.nbytes]

    def tensor(self, s: Section) -> torch.Tensor:
        return torch.from_numpy(self._bytes(s)).view(DTYPES[s.dtype]).reshape(s.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {s.name: self.tensor(s) for s in self.header.tensors}

    def chunk(self) -> ChunkRead:
        h = self.header
        assert h.tokens is not None
        return ChunkRead(h, self._bytes(h.tokens).view(np.int64).tolist(),
                         RowsCopy(h.start, h.stop, self.tensors()))

    def anchor(self) -> AnchorRead:
        return AnchorRead(self.header, SectionsCopy(self.tensors()))


class Staging:
    """Page-aligned host buffers a restore reads its files into, kept between restores by size
    (a tier's chunk files are all of one size, its anchors near another): a fresh buffer's pages
    are faulted in by the first read into them, at a cost that, on a VM, rivals the read itself;
    a kept one costs nothing. At most ``keep_nbytes`` are kept; a restore that reads more
    allocates the rest and lets it go after."""

    GRANULE = 1 << 16  # sizes that differ by a header line or two share buffers

    def __init__(self, keep_nbytes: int):
        self.keep_nbytes = keep_nbytes
        self.kept_nbytes = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` (a whole number of granules, its address a multiple
        of ``ALIGN``); ``give`` it back whole."""
        size = -(-nbytes // self.GRANULE) * self.GRANULE
        with self._lock:
            free = self._free.get(size)
            if free:
                self.kept_nbytes -= size
                return free.pop()
        return aligned(size)

    def give(self, bufs: Sequence[np.ndarray]) -> None:
        """Buffers ``take`` handed out, back (nothing may view them any more)."""
        with self._lock:
            for buf in bufs:
                if self.kept_nbytes + buf.nbytes > self.keep_nbytes:
                    continue
                self._free.setdefault(buf.nbytes, []).append(buf)
                self.kept_nbytes += buf.nbytes


def _take(staging: Staging | None, nbytes: int) -> np.ndarray:
    return staging.take(nbytes) if staging is not None else aligned(nbytes)


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes in row-major order, on the host (a copy only where it must be one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


# -- the folder -----------------------------------------------------------------------------

class TierFiles:
    """The tier's folder (0700) and its files (0600): write, verify and read, delete.

    Names come from keys alone. Every name below the root is opened relative to its folder's
    descriptor with O_NOFOLLOW, so a symlink in a file's or a fan-out folder's place is refused,
    never followed. One writer at a time (it owns the staging buffer); reads take their buffers
    from a ``Staging`` (a restore's) or allocate their own, and may run beside it.
    """

    def __init__(self, root: str | os.PathLike, *, direct: bool = True,
                 stage_nbytes: int = STAGE_NBYTES):
        root = Path(root)
        root.parent.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.direct = direct
        self.root_fd = open_folder(root)
        self._stage_nbytes = round_up(stage_nbytes)
        self._stage: np.ndarray | None = None
        # How files went to and from the disk: O_DIRECT, or through the page cache (then
        # dropped from it) where the file system refused O_DIRECT.
        self.transfers = {"write_direct": 0, "write_buffered": 0, "read_direct": 0,
                          "read_buffered": 0}

    def close(self) -> None:
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    def __enter__(self) -> "TierFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def file_name(kind: FileKind, key: str) -> str:
        if not is_key(key):
            raise ValueError("a tier file is named by a key (64 hex digits)")
        return key + SUFFIXES[kind]

    def path(self, kind: FileKind, key: str) -> Path:
        """Where the file lies (for a report or a test; the tier itself opens by descriptor)."""
        return self.root / key[:2] / self.file_name(kind, key)

    def _folder(self, sub: str, create: bool) -> int:
        """The fan-out folder ``sub`` (a key's first two hex digits)."""
        return open_folder(sub, dir_fd=self.root_fd, create=create)

    # -- writing --------------------------------------------------------------------------

    def write_chunk(self, key: Key, token_ids: Sequence[int], views: Mapping[str, View],
                    start: int, stop: int, *, fingerprint: str, grid: int) -> Header:
        """Rows ``[start, stop)`` of every view and their token ids, as ``key``'s chunk file."""
        if stop - start != grid or start % grid or len(token_ids) != grid:
            raise ValueError(f"a chunk is one grid step of {grid} rows on the grid, "
                             f"not [{start}, {stop}) with {len(token_ids)} token ids")
        tokens = torch.as_tensor(list(token_ids), dtype=torch.int64)
        tensors = [(name, v.rows(start, stop), v.token_axis) for name, v in views.items()]
        return self._write("chunk", key, fingerprint, grid, start, stop, tensors,
                           tokens=tokens, chunks=[])

    def write_anchor(self, key: Key, line: int, chunk_keys: Sequence[Key],
                     sections: Mapping[str, torch.Tensor], *, fingerprint: str,
                     grid: int) -> Header:
        """Every section at ``line`` as ``key``'s anchor file, listing the chunks below it."""
        if line <= 0 or line % grid or len(chunk_keys) != line // grid:
            raise ValueError(f"an anchor at {line} lists the {line // grid} chunks below it, "
                             f"not {len(chunk_keys)}")
        if chunk_keys[-1] != key:
            raise ValueError("an anchor's key is the key of the last chunk below it")
        tensors = [(name, t, -1) for name, t in sections.items()]
        return self._write("anchor", key, fingerprint, grid, 0, line, tensors,
                           tokens=None, chunks=[str(k) for k in chunk_keys])

    def _write(self, kind: FileKind, key: str, fingerprint: str, grid: int, start: int,
               stop: int, tensors: list[tuple[str, torch.Tensor, int]],
               tokens: torch.Tensor | None, chunks: list[str]) -> Header:
        name = self.file_name(kind, key)
        sources = ([("", tokens, -1)] if tokens is not None else []) + tensors

        def header(crcs: list[int], header_nbytes: int) -> Header:
            offset = header_nbytes
            sections = []
            for (sname, t, axis), crc in zip(sources, crcs):
                nbytes = t.numel() * t.element_size()
                sections.append(Section(sname, str(t.dtype).removeprefix("torch."),
                                        list(t.shape), offset, nbytes, crc, axis))
                offset += round_up(nbytes)
            return Header(kind, key, fingerprint, grid, start, stop, offset,
                          sections[1:] if tokens is not None else sections,
                          sections[0] if tokens is not None else None, chunks)

        for _, t, _ in sources:
            if str(t.dtype).removeprefix("torch.") not in DTYPES:
                raise ValueError(f"no tier file holds {t.dtype}")
        # The header's size is fixed before the sums are known: sized with the widest ones, the
        # real metadata fits the same lines. Its size moves the offsets it lists, so settle it.
        header_nbytes = 0
        while True:
            plan = header([_NO_CRC] * len(sources), header_nbytes)
            need = round_up(_PREFIX.size + len(_encode(plan)))
            if need == header_nbytes:
                break
            header_nbytes = need

        folder = self._folder(key[:2], create=True)
        tmp = name + TMP
        try:
            f = DirectFile.create(folder, tmp, self.direct)
            try:
                crcs = [self._write_section(f, _host_bytes(t), s.offset)
                        for (_, t, _), s in zip(sources, plan.sections)]
                final = header(crcs, header_nbytes)
                f.pwrite_from(self._header_bytes(final, header_nbytes), 0)
                f.finish_write()
                self.transfers["write_direct" if f.direct else "write_buffered"] += 1
            finally:
                f.close()
            os.rename(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            fsync_folder(folder)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            raise
        finally:
            os.close(folder)
        return final

    def _write_section(self, f: DirectFile, src: np.ndarray, offset: int) -> int:
        if self._stage is None:
            self._stage = aligned(self._stage_nbytes, pinned=False)  # host copies only
        stage = self._stage
        crc = 0
        for a in range(0, src.nbytes, stage.nbytes):
            n = min(stage.nbytes, src.nbytes - a)
            stage[:n] = src[a:a + n]
            crc = crc32(stage[:n], crc)
            padded = round_up(n)
            stage[n:padded] = 0
            f.pwrite_from(stage[:padded], offset + a)
        return crc

    @staticmethod
    def _header_bytes(h: Header, header_nbytes: int) -> np.ndarray:
        meta = _encode(h)
        if _PREFIX.size + len(meta) > header_nbytes:
            raise AssertionError("the metadata outgrew the lines sized for it")
        buf = aligned(header_nbytes)
        prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, header_nbytes, len(meta), 0)
        buf[:_PREFIX.size] = np.frombuffer(prefix, dtype=np.uint8)
        buf[_PREFIX.size:_PREFIX.size + len(meta)] = np.frombuffer(meta, dtype=np.uint8)
        crc = zlib.crc32(meta, zlib.crc32(prefix[:_CRC_AT]))
        buf[_CRC_AT:_CRC_AT + 4] = np.frombuffer(struct.pack("<I", crc), dtype=np.uint8)
        return buf

    # -- reading --------------------------------------------------------------------------

    def _open(self, kind: FileKind, key: str) -> DirectFile:
        name = self.file_name(kind, key)
        try:
            folder = self._folder(key[:2], create=False)
        except FileNotFoundError:
            raise MissingFile(kind, key, "no such file") from None
        except RefusedEntry as exc:
            raise RefusedFile(kind, key, f"its folder is refused: {exc.strerror}") from None
        try:
            return DirectFile.open_read(folder, name, self.direct)
        except FileNotFoundError:
            raise MissingFile(kind, key, "no such file") from None
        except RefusedEntry as exc:
            raise RefusedFile(kind, key, exc.strerror or "refused") from None
        except IsADirectoryError:
            raise RefusedFile(kind, key, "a folder") from None
        finally:
            os.close(folder)

    @contextmanager
    def _reading(self, kind: FileKind, key: str) -> Iterator[DirectFile]:
        f = self._open(kind, key)
        try:
            yield f
        finally:
            # counted after the transfers: a refusal of O_DIRECT shows at the first of them
            self.transfers["read_direct" if f.direct else "read_buffered"] += 1
            f.close()

    def _header(self, f: DirectFile, kind: FileKind, key: str, accept: Container[str] | None,
                grid: int | None, first: np.ndarray | None = None, got: int = 0) -> Header:
        """The file's verified header. ``first`` may hold the file's first ``got`` bytes
        already (a restore reads a file whole in one transfer); what the header needs beyond
        them is read here."""
        if first is None or got < ALIGN:
            first = aligned(ALIGN)
            got = f.pread_into(first, 0)
        raw = bytes(first[:_PREFIX.size])
        seen = raw[:min(got, len(MAGIC))]
        if seen != MAGIC[:len(seen)]:
            raise ForeignFile(kind, key, "not a tier file (magic)")
        if got < _PREFIX.size:
            raise TruncatedFile(kind, key, f"{got} bytes, shorter than a header")
        magic, version, header_nbytes, meta_nbytes, crc = _PREFIX.unpack(raw)
        if version != FORMAT_VERSION:
            raise VersionMismatch(kind, key, f"format {version}, this build reads "
                                             f"{FORMAT_VERSION}")
        if (header_nbytes < ALIGN or header_nbytes % ALIGN or header_nbytes > MAX_HEADER_NBYTES
                or _PREFIX.size + meta_nbytes > header_nbytes):
            raise CorruptFile(kind, key, "header sizes")
        if f.size < header_nbytes or got < ALIGN:
            raise TruncatedFile(kind, key, f"{f.size} bytes, shorter than its header")
        if header_nbytes > min(got, first.nbytes):
            rest = aligned(header_nbytes)
            rest[:ALIGN] = first[:ALIGN]
            if f.pread_into(rest[ALIGN:], ALIGN) < header_nbytes - ALIGN:
                raise TruncatedFile(kind, key, "shorter than its header")
            first = rest
        meta = bytes(first[_PREFIX.size:_PREFIX.size + meta_nbytes])
        if zlib.crc32(meta, zlib.crc32(raw[:_CRC_AT])) != crc:
            raise CorruptFile(kind, key, "header crc32")
        if first[_PREFIX.size + meta_nbytes:header_nbytes].any():
            raise CorruptFile(kind, key, "header padding")
        try:
            h = _decode(meta)
        except msgspec.ValidationError as exc:
            raise CorruptFile(kind, key, f"header metadata: {exc}") from None
        if h.kind != kind:
            raise ForeignFile(kind, key, f"holds a {h.kind}")
        if h.key != key:
            raise KeyMismatch(kind, key, "its header names another key")
        if accept is not None and h.fingerprint not in accept:
            raise FingerprintMismatch(kind, key, f"fingerprint {h.fingerprint[:12]} not accepted")
        self._check_layout(h, kind, key, header_nbytes)
        if grid is not None and h.grid != grid:
            raise LayoutMismatch(kind, key, f"grid {h.grid}, not {grid}")
        if f.size < h.file_nbytes:
            raise TruncatedFile(kind, key, f"{f.size} of {h.file_nbytes} bytes")
        if f.size > h.file_nbytes:
            raise CorruptFile(kind, key, f"{f.size - h.file_nbytes} bytes past its end")
        return h

    @staticmethod
    def _check_layout(h: Header, kind: FileKind, key: str, header_nbytes: int) -> None:
        """The sections tile the file from the header on, each where and as large as its dtype
        and shape say: no byte of the file is outside a check."""
        offset = header_nbytes
        for s in h.sections:
            dtype = DTYPES.get(s.dtype)
            if (dtype is None or s.offset != offset or any(d < 0 for d in s.shape)
                    or s.nbytes != _nbytes(s.shape, dtype)):
                raise CorruptFile(kind, key, f"section {s.name!r} layout")
            offset += round_up(s.nbytes)
        if offset != h.file_nbytes:
            raise CorruptFile(kind, key, "sections do not tile the file")
        g = h.grid
        if kind == "chunk":
            ok = (h.tokens is not None and h.tokens.dtype == "int64" and h.tokens.shape == [g]
                  and h.stop - h.start == g and h.start % g == 0 and not h.chunks
                  and all(0 <= s.token_axis < len(s.shape) and s.shape[s.token_axis] == g
                          for s in h.tensors))
        else:
            ok = (h.tokens is None and h.start == 0 and h.stop > 0 and h.stop % g == 0
                  and len(h.chunks) == h.stop // g and h.chunks[-1] == h.key
                  and all(is_key(k) for k in h.chunks)
                  and all(s.token_axis == -1 for s in h.tensors))
        if g <= 0 or not ok:
            raise CorruptFile(kind, key, "header fields")

    def load(self, kind: FileKind, key: Key, accept: Container[str], *,
             like: CacheState | None = None, grid: int | None = None,
             staging: "Staging | None" = None, expect_nbytes: int | None = None) -> "Loaded":
        """The file of ``key`` read whole into one host buffer (from ``staging``, else a fresh
        one), its header verified (and its layout against ``like``'s); its sections are not
        yet: ``Loaded.verify`` checks them, on any thread. When the file is ``expect_nbytes``
        long (the index's word) it is read in one transfer, header and all."""
        with self._reading(kind, key) as f:
            buf = first = None
            got = 0
            if expect_nbytes is not None and f.size == expect_nbytes and f.size % ALIGN == 0:
                first = buf = _take(staging, f.size)
                got = f.pread_into(buf[:f.size], 0)
            try:
                h = self._header(f, kind, key, accept, grid, first, got)
                if like is not None:
                    (_match_views if kind == "chunk" else _match_sections)(h, like, key)
                header_nbytes = h.sections[0].offset if h.sections else h.file_nbytes
                if buf is None:
                    buf = _take(staging, h.file_nbytes)
                    got = header_nbytes + f.pread_into(buf[header_nbytes:h.file_nbytes],
                                                       header_nbytes)
                if got < h.file_nbytes:
                    raise TruncatedFile(kind, key, f"{got} of {h.file_nbytes} bytes read")
            except BaseException:
                if staging is not None and buf is not None:
                    staging.give([buf])
                raise
        return Loaded(kind, key, h, buf)

    def read_header(self, kind: FileKind, key: str, accept: Container[str] | None = None,
                    grid: int | None = None) -> Header:
        """The verified header alone (what the index is built from): magic, version, header
        crc32, kind, key, fingerprint (when ``accept`` is given) and the file's length."""
        with self._reading(kind, key) as f:
            return self._header(f, kind, key, accept, grid)

    def read_chunk(self, key: Key, accept: Container[str], *,
                   token_ids: Sequence[int] | None = None, like: CacheState | None = None,
                   grid: int | None = None) -> ChunkRead:
        """The chunk file of ``key``, every check passed: its header; its token ids equal to
        ``token_ids`` (the prompt's rows there) element by element; its views laid out as
        ``like``'s; every section's crc32. Nothing is returned before all of them passed."""
        loaded = self.load("chunk", key, accept, like=like, grid=grid)
        loaded.verify(token_ids)
        return loaded.chunk()

    def read_anchor(self, key: Key, accept: Container[str], *,
                    like: CacheState | None = None, grid: int | None = None) -> AnchorRead:
        """The anchor file of ``key``, every check passed (see ``read_chunk``). Whether every
        chunk it lists is on disk is the index's to say."""
        loaded = self.load("anchor", key, accept, like=like, grid=grid)
        loaded.verify()
        return loaded.anchor()

    # -- deleting and listing -------------------------------------------------------------

    def discard(self, kind: FileKind, key: str) -> bool:
        """Delete the file of ``key`` (a symlink in its place: the link, never its target);
        False when there was none."""
        name = self.file_name(kind, key)
        try:
            folder = self._folder(key[:2], create=False)
        except FileNotFoundError:
            return False
        except RefusedEntry:
            os.unlink(key[:2], dir_fd=self.root_fd)  # a symlink where the fan-out folder was
            fsync_folder(self.root_fd)
            return True
        try:
            try:
                os.unlink(name, dir_fd=folder)
            except FileNotFoundError:
                return False
            except IsADirectoryError:
                return False
            fsync_folder(folder)
            return True
        finally:
            os.close(folder)

    def drop(self, refused: TierFileError) -> bool:
        """Delete the file a read refused, so that what it held is recomputed (a missing one:
        nothing to do)."""
        if isinstance(refused, MissingFile):
            return False
        return self.discard(refused.kind, refused.key)

    def entries(self) -> Iterator[tuple[FileKind, Key]]:
        """Every chunk and anchor name in the folder (not yet verified). Names the tier never
        makes are left alone and not listed; ``.tmp`` files are ``leftovers``."""
        for sub, names in self._listing():
            for name in names:
                for kind, suffix in SUFFIXES.items():
                    if name.endswith(suffix) and is_key(name[:-len(suffix)]) \
                            and name.startswith(sub):
                        yield kind, Key(name[:-len(suffix)])

    def leftovers(self) -> list[str]:
        """Every ``.tmp`` a crash left: a file's (``sub/name``) or, in the root, the counts
        file's or a record's (``name``)."""
        return ([name for name in sorted(os.listdir(self.root_fd)) if name.endswith(TMP)]
                + [f"{sub}/{name}" for sub, names in self._listing() for name in names
                   if name.endswith(TMP)])

    def remove_leftovers(self) -> int:
        """Delete every ``.tmp`` (a write a crash cut short) and every symlink where a fan-out
        folder should be. The count of what went."""
        gone = 0
        for entry in self.leftovers():
            if "/" not in entry:  # in the root: no writer runs while a start scans
                try:
                    os.unlink(entry, dir_fd=self.root_fd)
                    fsync_folder(self.root_fd)
                    gone += 1
                except (FileNotFoundError, IsADirectoryError):
                    pass
                continue
            sub, name = entry.split("/")
            folder = self._folder(sub, create=False)
            try:
                os.unlink(name, dir_fd=folder)
                fsync_folder(folder)
                gone += 1
            except FileNotFoundError:
                pass
            finally:
                os.close(folder)
        for name in os.listdir(self.root_fd):
            if _is_fanout(name) and os.path.islink(self.root / name):
                os.unlink(name, dir_fd=self.root_fd)
                gone += 1
        return gone

    def _listing(self) -> Iterator[tuple[str, list[str]]]:
        for sub in sorted(os.listdir(self.root_fd)):
            if not _is_fanout(sub):
                continue
            try:
                folder = self._folder(sub, create=False)
            except (FileNotFoundError, RefusedEntry, NotADirectoryError):
                continue
            try:
                yield sub, sorted(os.listdir(folder))
            finally:
                os.close(folder)

    # -- small records beside the files (fp-equal.json) -----------------------------------

    def read_record(self, name: str) -> bytes | None:
        """A small file in the root (0600, no symlink followed); None when there is none."""
        _check_record_name(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         dir_fd=self.root_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RefusedEntry(exc.errno, "a symlink", name) from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RefusedEntry(errno.EINVAL, "not a regular file", name)
            return f.read(1 << 20)

    def write_record(self, name: str, data: bytes) -> None:
        """Replace a small file in the root atomically (temp, fsync, rename, fsync the root)."""
        _check_record_name(name)
        tmp = name + TMP
        f = DirectFile.create(self.root_fd, tmp, direct=False)
        try:
            os.write(f.fd, data)
            f.finish_write()
        finally:
            f.close()
        os.rename(tmp, name, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
        fsync_folder(self.root_fd)


def _is_fanout(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _check_record_name(name: str) -> None:
    if "/" in name or name.startswith(".") or not name:
        raise ValueError(f"a record lies in the tier's root: {name!r}")


def _match_views(h: Header, like: CacheState, key: str) -> None:
    want = {name: (str(v.tensor.dtype).removeprefix("torch."), v.token_axis,
                   [h.grid if i == v.token_axis else d for i, d in enumerate(v.tensor.shape)])
            for name, v in like.views.items()}
    got = {s.name: (s.dtype, s.token_axis, s.shape) for s in h.tensors}
    if want != got:
        raise LayoutMismatch("chunk", key, "its views are not the state's")


def _match_sections(h: Header, like: CacheState, key: str) -> None:
    want = {name: (str(t.dtype).removeprefix("torch."), list(t.shape))
            for name, t in like.sections.items()}
    got = {s.name: (s.dtype, s.shape) for s in h.tensors}
    if want != got:
        raise LayoutMismatch("anchor", key, "its sections are not the state's")
