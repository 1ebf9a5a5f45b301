"""Qwen's byte-level BPE in a few megabytes, tiktoken's ids to the id.

tiktoken's Rust tables for Qwen's 248,320-id vocabulary hold about 60 MiB (each token's bytes
three times, each an allocation of its own): on the embedded model, a fifth of the server's
anonymous memory, and the largest item beyond what llama-server holds for the same weights
(issue 14's peak-RSS figure). ``CompactBpe`` keeps the vocabulary as one blob of every id's
bytes, their offsets and an open-addressing table of the ranks by hash (about 5 MiB in all, in
arrays this class owns), and encodes in C (``tandem/kernels/csrc/bpe.c``): Qwen's pre-tokenizer
regex written out as the match each alternative makes, then tiktoken's byte-pair merge.

It is used only where its ids are tiktoken's by construction: the model's ``pat_str`` is
Qwen's (``QWEN_PAT``), the native library builds, and each codepoint's class (L, M, N,
White_Space) is known. The classes come from this Python's ``unicodedata``; a codepoint it
does not know (unassigned in its Unicode version, which may be older than the one tiktoken's
regex crate was built with) makes that text go to tiktoken, built from the same blob on first
need. ``TiktokenBpe`` is the same interface over tiktoken itself, for any other ``pat_str``
and for machines without the native library. tests/models/test_bpe.py compares the two on every
codepoint Unicode assigns, in several contexts, and on hypothesis's texts.
"""

from __future__ import annotations

import ctypes
import re
import threading
import unicodedata
from array import array
from functools import lru_cache

import numpy as np
import structlog

log = structlog.get_logger(__name__)

# Qwen3.5's pre-tokenizer (tokenizer_config.json's pat_str), the one csrc/bpe.c implements.
QWEN_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
            r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# csrc/bpe.c's class bits
C_L, C_M, C_N, C_WS, C_UNSURE = 1, 2, 4, 8, 16
# Unicode's White_Space property: what \s means in tiktoken's regex (not str.isspace, which
# also takes U+001C..U+001F)
WHITE_SPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])


@lru_cache(maxsize=1)
def classes() -> tuple[np.ndarray, np.ndarray]:
    """Every codepoint's class bits as a two-level table: stage1[cp >> 8] is the page,
    stage2[page * 256 + (cp & 255)] the bits. Built once a process."""
    bits = {cat: (C_L if cat[0] == "L" else C_M if cat[0] == "M" else C_N if cat[0] == "N"
                  else C_UNSURE if cat == "Cn" else 0)
            for cat in ("Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc",
                        "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl",
                        "Zp", "Cc", "Cf", "Cs", "Co", "Cn")}
    # one pass of C-level iterators over every codepoint (a Python loop takes seconds)
    flat = bytearray(map(bits.__getitem__, map(unicodedata.category, map(chr, range(0x110000)))))
    for cp in WHITE_SPACE:
        flat[cp] = C_WS
    for plane in range(17):  # the noncharacters: unassigned for good, so never UNSURE
        flat[(plane << 16) | 0xFFFE] = flat[(plane << 16) | 0xFFFF] = 0
    for cp in range(0xFDD0, 0xFDF0):
        flat[cp] = 0
    pages: dict[bytes, int] = {}
    stage1 = np.zeros(0x1100, np.uint16)
    for hi in range(0x1100):
        stage1[hi] = pages.setdefault(bytes(flat[hi << 8:(hi + 1) << 8]), len(pages))
    stage2 = np.frombuffer(b"".join(pages), dtype=np.uint8).copy()
    return stage1, stage2


class _Tables(ctypes.Structure):
    _fields_ = [("blob", ctypes.c_void_p), ("off", ctypes.c_void_p), ("table", ctypes.c_void_p),
                ("cap", ctypes.c_long), ("n", ctypes.c_long), ("stage1", ctypes.c_void_p),
                ("stage2", ctypes.c_void_p)]  # csrc/bpe.c's struct tandem_bpe


def _utf8(text: str) -> bytes:
    """The text's UTF-8; a lone surrogate becomes U+FFFD first, as tiktoken's encode does."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


class Ranks:
    """A tiktoken file's ranks as arrays: every token's bytes one after another in the file's
    order, their offsets and their ids. A dict of Qwen's 248k ranks is 37 MiB of Python objects
    (the server's start peaked that much higher while it lived); these are 3 MiB."""

    def __init__(self, blob: bytes, off: np.ndarray, ids: np.ndarray):
        self.blob, self.off, self.ids = blob, off, ids

    @classmethod
    def parse(cls, lines, decode) -> "Ranks":
        """From the file's lines (an iterable of ``b"base64 rank"``, blank ones skipped);
        ``decode`` is the base64 decoder. Raises ValueError (with the line's number in its
        args) on a bad line."""
        blob = bytearray()
        lengths = array("q")
        ids = array("q")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                data = decode(token)
                ids.append(int(rank))
            except ValueError:
                raise ValueError(n) from None
            blob += data
            lengths.append(len(data))
        off = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(np.frombuffer(lengths, np.int64), out=off[1:])
        return cls(bytes(blob), off, np.frombuffer(ids, np.int64).copy())

    def __len__(self) -> int:
        return len(self.ids)

    def as_dict(self) -> dict[bytes, int]:
        """bytes -> rank, a later line's rank winning as a dict built line by line lets it."""
        blob, off = self.blob, self.off.tolist()
        return {blob[off[i]:off[i + 1]]: rank for i, rank in enumerate(self.ids.tolist())}


class TiktokenBpe:
    """tiktoken's Encoding behind the interface ``CompactBpe`` has."""

    def __init__(self, ranks: Ranks, specials: dict[str, int], pat_str: str):
        import tiktoken

        self._enc = tiktoken.Encoding("tandem", pat_str=pat_str, mergeable_ranks=ranks.as_dict(),
                                      special_tokens=specials)
        # The Encoding keeps the ranks dict only to pickle itself (tiktoken 0.14's core.py; its
        # Rust CoreBPE holds its own copy). Nothing here pickles a tokenizer, and the dict is
        # 37 MiB of Python objects at Qwen's 248k ranks: let it go.
        self._enc._mergeable_ranks = {}
        # One token's bytes is called once a row when the loop reads a record's byte streams
        # (tandem/cache/endalign.py: 16k rows of a record at once): the Rust call itself
        # rather than through Encoding's wrapper, where the wrapper only passes it on.
        core = getattr(self._enc, "_core_bpe", None)
        self._single = getattr(core, "decode_single_token_bytes",
                               self._enc.decode_single_token_bytes)
        self.n_vocab = self._enc.n_vocab

    def encode_ordinary(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode(self, text: str, allowed: frozenset[str]) -> list[int]:
        return self._enc.encode(text, allowed_special=allowed, disallowed_special=())

    def decode_bytes(self, ids: list[int]) -> bytes | None:
        try:
            return self._enc.decode_bytes(ids)
        except (KeyError, OverflowError, TypeError, ValueError):  # an id with no token
            return None

    def token_bytes(self, token_id: int) -> bytes | None:
        try:
            return self._single(token_id)
        except (KeyError, OverflowError, TypeError, ValueError):
            return None


class CompactBpe:
    """The vocabulary as arrays, encoded and decoded by csrc/bpe.c (see the module's doc)."""

    @classmethod
    def build(cls, ranks: Ranks, specials: dict[str, int],
              pat_str: str) -> "CompactBpe | None":
        """The compact tokenizer, or None where its ids would not be tiktoken's by
        construction (another pre-tokenizer, a rank given twice or two ranks with the same
        bytes) or the native library does not build."""
        if pat_str != QWEN_PAT or not len(ranks) or int(ranks.ids.min()) < 0 \
                or len(np.unique(ranks.ids)) != len(ranks):
            return None
        from tandem.kernels import native

        if not native.available():
            return None
        made = cls(ranks, specials, native)
        return made if made._placed == len(ranks) else None

    def __init__(self, ranks: Ranks, specials: dict[str, int], native) -> None:
        n = max(int(ranks.ids.max()), max(specials.values(), default=-1)) + 1
        lengths = np.zeros(n, np.int64)
        lengths[ranks.ids] = np.diff(ranks.off)
        special_bytes = {token_id: text.encode("utf-8") for text, token_id in specials.items()}
        for token_id, data in special_bytes.items():
            lengths[token_id] = len(data)
        off = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=off[1:])
        if off[-1] >= 1 << 32:
            raise ValueError("a vocabulary of 4 GiB of token bytes")
        # every id's bytes at its offset: the ranks' moved from the file's order in one numpy
        # gather (the file's order is the ids' in Qwen's, so it is a copy there)
        blob = np.zeros(max(1, int(off[-1])), np.uint8)
        src = np.frombuffer(ranks.blob, np.uint8) if ranks.blob else np.zeros(0, np.uint8)
        for lo in range(0, len(ranks), 1 << 15):  # in slices: each index array a few MiB
            hi = min(len(ranks), lo + (1 << 15))
            a, b = int(ranks.off[lo]), int(ranks.off[hi])
            shift = np.repeat(off[ranks.ids[lo:hi]] - ranks.off[lo:hi], np.diff(ranks.off[lo:hi + 1]))
            blob[shift + np.arange(a, b)] = src[a:b]
        for token_id, data in special_bytes.items():
            blob[off[token_id]:off[token_id] + len(data)] = np.frombuffer(data, np.uint8)
        present = np.zeros(n, np.uint8)
        present[ranks.ids] = 1
        is_rank = present.copy()
        present[list(special_bytes)] = 1
        self.n_vocab = n
        self._blob = blob[:int(off[-1])].tobytes()
        self._off = array("I", off.astype(np.uint32).tobytes())
        self._present = present.tobytes()
        self._is_rank = is_rank.tobytes()
        self._specials = dict(specials)
        cap = 1 << max(4, (2 * len(ranks)).bit_length())  # at most half full
        self._table = np.full(cap, -1, dtype=np.int32)
        self._stage1, self._stage2 = classes()
        blob = np.frombuffer(self._blob, dtype=np.uint8) if self._blob else np.zeros(1, np.uint8)
        off = np.frombuffer(self._off, dtype=np.uint32)
        self._keep = (blob, off)  # the arrays the C reads, alive as long as this is
        # the ranks placed, or -1 where two have the same bytes (then build gives None)
        self._placed = native.function("tandem_bpe_index")(
            blob.ctypes.data, off.ctypes.data, self._is_rank, n, self._table.ctypes.data, cap)
        self._c = _Tables(blob.ctypes.data, off.ctypes.data, self._table.ctypes.data, cap, n,
                          self._stage1.ctypes.data, self._stage2.ctypes.data)
        self._encode_fn = native.function("tandem_bpe_encode")
        self._decode_fn = native.function("tandem_bpe_decode")
        self._patterns: dict[frozenset[str], re.Pattern] = {}
        self._fallback: TiktokenBpe | None = None
        self._fallback_lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """What the vocabulary holds: blob, offsets, flags, hash table and class pages."""
        return (len(self._blob) + self._off.itemsize * len(self._off) + len(self._present)
                + len(self._is_rank) + self._table.nbytes + self._stage1.nbytes
                + self._stage2.nbytes)

    def tiktoken(self) -> TiktokenBpe:
        """tiktoken over the same vocabulary, built on first need (about 60 MiB from then on):
        for a text with a codepoint this Python's Unicode data does not assign."""
        with self._fallback_lock:
            if self._fallback is None:
                ids = np.flatnonzero(np.frombuffer(self._is_rank, np.uint8))
                off = np.frombuffer(self._off, np.uint32).astype(np.int64)
                lengths = off[ids + 1] - off[ids]
                ranks = Ranks(b"".join(self._blob[off[i]:off[i + 1]] for i in ids.tolist()),
                              np.concatenate([[0], np.cumsum(lengths)]), ids.astype(np.int64))
                self._fallback = TiktokenBpe(ranks, self._specials, QWEN_PAT)
                log.info("tokenizer_tiktoken_loaded", reason="a codepoint this Python's "
                         "Unicode data does not assign", unidata=unicodedata.unidata_version)
            return self._fallback

    def encode_ordinary(self, text: str) -> list[int]:
        data = _utf8(text)
        if not data:
            return []
        out = np.empty(len(data), dtype=np.int32)
        count = self._encode_fn(ctypes.byref(self._c), data, len(data), out.ctypes.data)
        if count < 0:
            return self.tiktoken().encode_ordinary(text)
        return out[:count].tolist()

    def encode(self, text: str, allowed: frozenset[str]) -> list[int]:
        """Ids of ``text``, where the text of a special token in ``allowed`` is that token."""
        if not allowed:
            return self.encode_ordinary(text)
        pattern = self._patterns.get(allowed)
        if pattern is None:  # the longest first, so one that begins another is not cut short
            pattern = re.compile("|".join(map(re.escape, sorted(allowed, key=len,
                                                                reverse=True))))
            self._patterns[allowed] = pattern
        ids: list[int] = []
        start = 0
        for m in pattern.finditer(text):
            ids += self.encode_ordinary(text[start:m.start()])
            ids.append(self._specials[m.group()])
            start = m.end()
        ids += self.encode_ordinary(text[start:])
        return ids

    def decode_bytes(self, ids: list[int]) -> bytes | None:
        """The ids' bytes one after another; None where an id has no token."""
        try:
            arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
        except (OverflowError, TypeError, ValueError):
            return None
        size = self._decode_fn(ctypes.byref(self._c), self._present, arr.ctypes.data, len(arr),
                               None)
        if size < 0:
            return None
        out = ctypes.create_string_buffer(size)
        self._decode_fn(ctypes.byref(self._c), self._present, arr.ctypes.data, len(arr), out)
        return out.raw

    def token_bytes(self, token_id: int) -> bytes | None:
        if 0 <= token_id < self.n_vocab and self._present[token_id]:
            return self._blob[self._off[token_id]:self._off[token_id + 1]]
        return None
