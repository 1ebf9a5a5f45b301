"""The session spill's block codec (spec: "Size on the disk, and the drive": the codec).

A block (one buffer's rows of one spill block, or a section of an anchor) is stored as

    version 1 (``PLANES_ZSTD``): its byte planes (tandem.kernels.planes, cut on the device), each
        plane cut in frames of 8 MiB, each frame a zstandard frame (with its content size and
        checksum) or, where zstd does not take at least 1/32 off it, the frame's bytes raw (the
        low byte of bf16 does not shrink: its decode would cost time for nothing);
    version 0 (``RAW``): the block's bytes in C order, as the first spill wrote them.

The stored bytes are the frames one after another; the ``BlockHeader`` says the version, the
block's dtype and shape, and for each frame its plane, its raw and stored lengths and whether it
is stored raw. A block is decoded by the version it was written with, so an entry of an older
codec still reads, and a rewrite keeps its unchanged blocks as they are.

Lossless by construction; what the codec itself checks is structure: a header that does not
describe the block, stored bytes of another length, a frame that does not decode (zstd's own
checksum) or decodes to another length. Each raises ``CodecError``. A raw frame's bytes are not
checked here: the spill sums every block it joins back (tandem.kernels.blocksums) before the
engine resumes from it.

Frames compress and decompress on ``SpillCodec.threads`` threads (zstandard releases the GIL);
``SpillCodec`` owns its pool and is closed by its owner.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, NamedTuple

import msgspec
import numpy as np
import torch
import zstandard

from tandem import devices
from tandem.kernels.planes import cut_planes, join_planes
from tandem.torch_thread import one_openmp_thread_here

RAW = 0
PLANES_ZSTD = 1
CODEC_VERSION = PLANES_ZSTD  # what a new block is written with
VERSIONS = (RAW, PLANES_ZSTD)  # what a reader decodes
FRAME_NBYTES = 8 << 20
MAX_FRAME_NBYTES = 256 << 20  # a header claiming larger frames is not one of ours
MIN_SAVING = 1 / 32  # a frame compressed by less is stored raw
DEFAULT_LEVEL = 1
DEFAULT_THREADS = 8

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}

Reason = Literal["version", "header", "length", "frame"]


class CodecError(ValueError):
    """A block that cannot be decoded as its header says; ``reason`` says why. The spill
    treats it as any bad file: the entry goes and the prefill starts from what is in place."""

    def __init__(self, reason: Reason, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason: Reason = reason


class Frame(msgspec.Struct, frozen=True, array_like=True):
    plane: int
    raw_nbytes: int  # the plane bytes it holds
    nbytes: int  # the bytes stored
    stored_raw: bool


class BlockHeader(msgspec.Struct, frozen=True):
    version: int
    dtype: str
    shape: list[int]
    frames: list[Frame] = []  # version 1 only

    @property
    def element_size(self) -> int:
        return _DTYPES[self.dtype].itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # Python ints: exact, and no numpy call a frame

    @property
    def raw_nbytes(self) -> int:
        return self.numel * self.element_size

    @property
    def nbytes(self) -> int:
        """The stored bytes the header describes."""
        if self.version == RAW:
            return self.raw_nbytes
        return sum(f.nbytes for f in self.frames)

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> "BlockHeader":
        try:
            header = msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as e:
            raise CodecError("header", f"not a block header ({e})") from None
        header.check()
        return header

    def check(self) -> None:
        """Refuse a header that does not describe one block of its codec."""
        if self.version not in VERSIONS:
            raise CodecError("version", f"codec version {self.version}, this reader knows "
                                        f"{list(VERSIONS)}")
        if self.dtype not in _DTYPES or any(d < 0 for d in self.shape):
            raise CodecError("header", f"dtype {self.dtype!r} shape {self.shape}")
        if self.version == RAW:
            if self.frames:
                raise CodecError("header", "a raw block with frames")
            return
        e, n, planes = self.element_size, self.numel, [0] * self.element_size
        last = 0
        for f in self.frames:
            if not (last <= f.plane < e and 0 < f.raw_nbytes <= MAX_FRAME_NBYTES
                    and (f.nbytes == f.raw_nbytes if f.stored_raw
                         else 0 < f.nbytes < f.raw_nbytes)):
                raise CodecError("header", f"frame {f} in a block of {e} planes")
            last = f.plane
            planes[f.plane] += f.raw_nbytes
        if planes != [n] * e:
            raise CodecError("header", f"frames cover planes of {planes} bytes, not {n} each")


class EncodedBlock(NamedTuple):
    data: memoryview  # the stored bytes: the frames one after another
    header: BlockHeader


class SpillCodec:
    """Compresses and decompresses frames on ``threads`` threads (1: on the caller's)."""

    def __init__(self, threads: int = DEFAULT_THREADS, level: int = DEFAULT_LEVEL,
                 frame_nbytes: int = FRAME_NBYTES):
        if threads < 1 or not 0 < frame_nbytes <= MAX_FRAME_NBYTES:
            raise ValueError(f"threads {threads}, frame_nbytes {frame_nbytes}")
        self.threads, self.level, self.frame_nbytes = threads, level, frame_nbytes
        self._pool = (ThreadPoolExecutor(threads, thread_name_prefix="spill-codec",
                                         initializer=one_openmp_thread_here)
                      if threads > 1 else None)
        self._local = threading.local()  # a zstd context is not shared between threads

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> "SpillCodec":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- encode -----------------------------------------------------------------------------

    def encode(self, block: torch.Tensor, version: int = CODEC_VERSION,
               out: memoryview | None = None) -> EncodedBlock:
        """Cut the block's planes where it lies, bring them to the host, compress the frames.
        ``out`` (e.g. an aligned staging buffer for the O_DIRECT write), when given, receives
        the stored bytes and ``data`` is a slice of it."""
        if version == RAW:
            host = block.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
            header = BlockHeader(RAW, _dtype_name(block.dtype), list(block.shape))
            return EncodedBlock(_place([memoryview(host)], out), header)
        if version != PLANES_ZSTD:
            raise ValueError(f"codec version {version} is not written; this codec writes "
                             f"{list(VERSIONS)}")
        planes = cut_planes(block.detach()).cpu().numpy()
        return self.compress_planes(planes, block.dtype, list(block.shape), out)

    def compress_planes(self, planes: np.ndarray, dtype: torch.dtype, shape: list[int],
                        out: memoryview | None = None) -> EncodedBlock:
        """The host half of ``encode``: planes uint8 ``[element_size, numel]`` on the host."""
        cuts = [(j, a, min(a + self.frame_nbytes, planes.shape[1]))
                for j in range(planes.shape[0])
                for a in range(0, planes.shape[1], self.frame_nbytes)]
        stored = self._map(lambda cut: self._compress(memoryview(planes[cut[0], cut[1]:cut[2]])),
                           cuts)
        frames = [Frame(j, b - a, len(s), stored_raw=len(s) == b - a)
                  for (j, a, b), s in zip(cuts, stored)]
        header = BlockHeader(PLANES_ZSTD, _dtype_name(dtype), list(shape), frames)
        return EncodedBlock(_place(stored, out), header)

    def _compress(self, raw: memoryview) -> memoryview:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = zstandard.ZstdCompressor(
                level=self.level, write_checksum=True, write_content_size=True)
        packed = cctx.compress(raw)
        return memoryview(packed) if len(packed) <= len(raw) * (1 - MIN_SAVING) else raw

    # -- decode -----------------------------------------------------------------------------

    def decode(self, data: bytes | memoryview, header: BlockHeader, out: torch.Tensor,
               staging: torch.Tensor | None = None) -> torch.Tensor:
        """Decode the stored bytes into ``out`` (the block's dtype and shape, any device, any
        layout) and return it. ``staging`` is a host uint8 tensor of at least the block's
        bytes (pinned, for the copy to a device: that copy is asynchronous, so staging is
        reused only after the stream has passed it); without it one is allocated."""
        planes = self.decompress_into(data, header, staging)
        return self.join_into(planes, header, out)

    def decompress_into(self, data: bytes | memoryview, header: BlockHeader,
                        staging: torch.Tensor | None = None) -> torch.Tensor:
        """The host half of ``decode``: the planes (version 1) or the raw bytes (version 0),
        decompressed into ``staging``; returns the uint8 tensor over the bytes written."""
        header.check()
        data = memoryview(data).cast("B")
        if len(data) != header.nbytes:
            raise CodecError("length", f"{len(data)} bytes stored, the header says "
                                       f"{header.nbytes}")
        n = header.raw_nbytes
        if staging is None:
            staging = torch.empty(n, dtype=torch.uint8, pin_memory=devices.staging_pinned())
        if staging.dtype != torch.uint8 or staging.device.type != "cpu" or staging.numel() < n:
            raise ValueError(f"staging {staging.dtype} {staging.device} of {staging.numel()} "
                             f"bytes for a block of {n}")
        dest = staging.reshape(-1)[:n]
        target = memoryview(dest.numpy())
        if header.version == RAW:
            target[:] = data
            return dest
        numel = header.numel
        jobs, at, offset = [], 0, [0] * header.element_size
        for f in header.frames:
            start = f.plane * numel + offset[f.plane]
            offset[f.plane] += f.raw_nbytes
            stored, into = data[at:at + f.nbytes], target[start:start + f.raw_nbytes]
            at += f.nbytes
            if f.stored_raw:  # a copy: on this thread, a pool's round trip costs more
                into[:] = stored
            else:
                jobs.append((f, stored, into))
        # one zstd frame (a small block's high plane) on this thread; the pool for two or more
        self._map(lambda job: self._decompress(*job), jobs)
        return dest.view(header.element_size, numel)

    def _decompress(self, f: Frame, stored: memoryview, target: memoryview) -> None:
        if f.stored_raw:
            target[:] = stored
            return
        try:
            size = zstandard.frame_content_size(stored)
        except zstandard.ZstdError as e:
            raise CodecError("frame", f"plane {f.plane}: not a zstd frame ({e})") from None
        if size != f.raw_nbytes:
            raise CodecError("frame", f"plane {f.plane}: a frame of {size} bytes, the header "
                                      f"says {f.raw_nbytes}")
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        try:
            reader = dctx.stream_reader(stored, read_across_frames=False)
            got = 0
            while got < f.raw_nbytes:
                k = reader.readinto(target[got:])
                if not k:
                    break
                got += k
            # the read past the end checks the frame's epilogue (its checksum)
            extra = reader.readinto(bytearray(1))
        except zstandard.ZstdError as e:
            raise CodecError("frame", f"plane {f.plane}: {e}") from None
        if got != f.raw_nbytes or extra:
            raise CodecError("frame", f"plane {f.plane}: decoded {got + extra} bytes, the "
                                      f"header says {f.raw_nbytes}")

    def join_into(self, planes: torch.Tensor, header: BlockHeader,
                  out: torch.Tensor) -> torch.Tensor:
        """The device half of ``decode``: join the planes into ``out`` where it lies."""
        if _dtype_name(out.dtype) != header.dtype or list(out.shape) != header.shape:
            raise CodecError("header", f"a block of {header.dtype} {header.shape} into "
                                       f"{out.dtype} {list(out.shape)}")
        if header.version == RAW:
            if header.numel == 0:
                return out
            raw = planes.to(out.device, non_blocking=planes.is_pinned())
            return out.copy_(raw.view(out.dtype).reshape(out.shape))
        return join_planes(planes, out)

    def _map(self, fn, items: list) -> list:
        if self._pool is None or len(items) < 2:
            return [fn(item) for item in items]
        return list(self._pool.map(fn, items))


def encode_block(block: torch.Tensor, codec: SpillCodec | None = None,
                 version: int = CODEC_VERSION) -> EncodedBlock:
    """``(data, header)`` of one block; without a codec, on the caller's thread."""
    if codec is None:
        with SpillCodec(threads=1) as codec:
            return codec.encode(block, version)
    return codec.encode(block, version)


def decode_block(data: bytes | memoryview, header: BlockHeader, out: torch.Tensor,
                 codec: SpillCodec | None = None) -> torch.Tensor:
    """Decode ``data`` as ``header`` says into ``out`` and return it."""
    if codec is None:
        with SpillCodec(threads=1) as codec:
            return codec.decode(data, header, out)
    return codec.decode(data, header, out)


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"the spill codec does not store {dtype}")
    return name


def _place(parts: list, out: memoryview | None) -> memoryview:
    """The parts one after another, in ``out`` where given."""
    total = sum(len(p) for p in parts)
    if out is None:
        out = memoryview(bytearray(total))
    out = memoryview(out).cast("B")
    if len(out) < total:
        raise ValueError(f"{total} bytes stored into a buffer of {len(out)}")
    at = 0
    for p in parts:
        out[at:at + len(p)] = p
        at += len(p)
    return out[:total]
