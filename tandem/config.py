"""One config tree: frozen msgspec Structs, the only place a knob and its default are declared.

Every leaf field is a *knob* with one canonical name, unique across sections (``prefix_chunk``),
from which its three spellings are derived:

- a key in its section of ``config/tandem.toml`` (``[engine] prefix_chunk = 1024``),
- a flag of ``tandem serve`` (``--prefix-chunk``),
- an environment variable (``TANDEM_PREFIX_CHUNK``).

Precedence: the Struct defaults < the TOML file < the environment < the command line. A field's
doc is its ``Meta(description=...)``: the flag's help and the TOML comment are read from it, and
its constraints (``ge=0``, ...) are checked wherever a value comes from. A bad value (wrong type,
out of range, an unknown key in the TOML) is a :class:`ConfigError` naming the knob in all three
spellings; nothing falls back silently.

``config/tandem.toml`` is :func:`default_toml` written out (a test holds them equal), so the
defaults live here alone: regenerate it with ``python -m tandem.config > config/tandem.toml``.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

ENV_PREFIX = "TANDEM_"
CONFIG_ENV = "TANDEM_CONFIG"  # a config file path; not a knob (it says where the knobs are)

GiB = 1 << 30
MiB = 1 << 20


class ConfigError(ValueError):
    """A config value tandem cannot take; the message names the knob and where the value came
    from."""


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class ServerConfig(_Section):
    """The HTTP server (OpenAI routes, console)."""

    host: Annotated[str, Meta(description="Address the server listens on.")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description=(
        "TCP port the server listens on (0: any free port)."))] = 8000
    max_body_bytes: Annotated[int, Meta(ge=1, description=(
        "Largest request body accepted, in bytes (8 MiB); a larger one gets 413."))] = 8 * MiB
    queue_limit: Annotated[int, Meta(ge=1, description=(
        "Requests waiting for the engine beyond which a new one gets 503 with Retry-After."))] = 16
    request_read_timeout_s: Annotated[float, Meta(gt=0, description=(
        "Seconds a client has to send its whole request before the connection is closed."
        ))] = 30.0
    model: Annotated[str, Meta(min_length=1, description=(
        "Model to serve: 'tiny' (the embedded default, written under home) or a checkpoint "
        "directory."))] = "tiny"
    max_reasoning_tokens: Annotated[int, Meta(ge=0, description=(
        "Reasoning budget a request gets unless it names its own (max_reasoning_tokens): past "
        "it the server closes the reasoning with a hidden phrase and </think>, and the answer "
        "goes on. 0: no budget."))] = 0
    allow_forced_output: Annotated[bool, Meta(description=(
        "Accept the admin request field tandem_forced_output, which makes the engine write a "
        "given answer (replay's forced mode). Only on a server no untrusted client reaches."
        ))] = False
    record_dir: Annotated[str, Meta(description=(
        "Folder where sessions are recorded for replay, relative to home unless absolute; "
        "empty: recording off."))] = ""
    admin_token: Annotated[str, Meta(description=(
        "Bearer token of the routes that change the server's state (POST /v1/memory/limits, "
        "the request field tandem_forced_output): they need 'Authorization: Bearer <token>'. "
        "Empty: they answer loopback clients only."))] = ""
    api_key: Annotated[str, Meta(description=(
        "When set, every /v1/* route needs 'Authorization: Bearer <api_key>', as the OpenAI "
        "clients send it (the admin token is accepted too); /health and /metrics stay open."
        ))] = ""
    allowed_hosts: Annotated[str, Meta(description=(
        "Host names, comma-separated, a request's Host header may name besides localhost, "
        "127.0.0.1, [::1], the bound address and the local address the client connected to "
        "(another gets 421, against DNS rebinding); '*' allows any."))] = ""
    header_timeout_s: Annotated[float, Meta(gt=0, description=(
        "Seconds a connection has to send a request's headers, from its opening or from the "
        "end of the previous response, before it is closed."))] = 10.0
    max_connections: Annotated[int, Meta(ge=1, description=(
        "Open connections at most; at the cap a new one closes the connection that has waited "
        "longest for its headers, and is refused (503) only when every one is mid-request."
        ))] = 1024
    side_requests: Annotated[bool, Meta(description=(
        "Recognise a chat client's side requests (Open WebUI's title, tags and follow-ups: the "
        "last user message starts with '### Task:') and run them keeping nothing, in an empty "
        "slot or over a stash, so the chat's next turn still resumes at its end; off, they are "
        "placed and kept as any other request."))] = True
    max_n: Annotated[int, Meta(ge=1, description=(
        "Most choices a request may ask for (n): the prompt is read once, and every choice "
        "past the first decodes beside it in rows of its own (a copy of the prompt's rows and "
        "state, admitted by the memory governor with the request), never in another "
        "conversation's slot. A larger n is a 400 naming n."))] = 8


class EngineConfig(_Section):
    """The engine: buffers, the prefill grid, threads and dtype."""

    window: Annotated[int, Meta(ge=1, description=(
        "Tokens of KV rows preallocated for one sequence: the longest prompt plus answer."
        ))] = 65536
    prefix_chunk: Annotated[int, Meta(ge=1, description=(
        "Prefill chunk in tokens: prefills run in chunks on multiples of it from token 0, and "
        "cache anchors sit on these grid lines."))] = 1024
    num_threads: Annotated[int, Meta(ge=0, description=(
        "torch CPU threads (0: torch's default); recorded, since results depend on it."))] = 0
    parallel: Annotated[int, Meta(ge=1, le=64, description=(
        "Slots: conversations held in place at once, each a sequence of its own (rows, "
        "recurrent state, anchors, end anchor). A request goes to the slot of its session, "
        "else the one it continues or shares most, else an idle one; a conversation that "
        "leaves a slot is parked. Rows are backed as a slot grows. On a GPU size it to the "
        "memory left after the weights over one conversation's rows at its usual length."
        ))] = 4
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], Meta(description=(
        "Weights and activations dtype; auto: float32 on a CPU, bfloat16 on a GPU."
        ))] = "auto"
    native_kernels: Annotated[bool, Meta(description=(
        "Decode's fp32 CPU work (matmuls, norms, attention) and a prefill's Gated DeltaNet "
        "middle (conv, gates, chunked delta rule, gated norm) on tandem's own kernels "
        "(AVX-512, else AVX2 with FMA), built by the machine's C compiler at first use, where "
        "they build; off keeps torch's ops. The two round differently; each gives a row the "
        "same bits in any batch and a resumed prefill a cold one's."
        ))] = True
    head_screen: Annotated[bool, Meta(description=(
        "Greedy decode's token from the head's int8 screen (a quarter of its bytes) and the "
        "few rows it cannot rule out computed exactly: the full head's argmax, bit for bit, "
        "where a position wants no logprobs, logits processors or grammar. Costs the head's "
        "bytes over four of memory; on the native decode kernels only."
        ))] = True
    device: Annotated[str, Meta(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description=(
        "Where the engine runs: auto (the first CUDA device when torch sees one, else the "
        "CPU), cpu, cuda or cuda:N. A CUDA device the machine lacks is an error at start. On "
        "CUDA the weights keep the checkpoint's dtype, the recurrent state is fp32 and host "
        "copies of device rows are pinned."))] = "auto"
    cuda_graphs: Annotated[Literal["auto", "on", "off"], Meta(description=(
        "CUDA graphs of the decode step and of verify blocks, captured per shape (batch, "
        "block lengths, attention span) under the capture lock: auto is on with CUDA, on "
        "without CUDA is an error at start, and a CPU never captures. A replay gives the "
        "bits of the same step run eagerly."))] = "auto"


class CacheConfig(_Section):
    """Cache tiers and their budgets (spec: caches.txt); sizes in GiB unless named otherwise."""

    caches: Annotated[bool, Meta(description=(
        "Serve through the caches; false serves every request from the engine alone (the "
        "baseline replay --compare measures the caches against)."))] = True
    resident_gb: Annotated[float, Meta(ge=0, description=(
        "Budget of the resident prefix anchors in host memory, GiB."))] = 2.5
    resident_guest_max: Annotated[int, Meta(ge=0, description=(
        "Longest prompt, in tokens, that runs as a guest (it must also be under a quarter of "
        "the resident prompt): the rows it can write are stashed and put back after it."
        ))] = 8192
    resident_stash_gb: Annotated[float, Meta(ge=0, description=(
        "Budget of the guest stash: the resident rows a guest can write over, GiB."
        ))] = 1.0
    resident_pin_gb: Annotated[float, Meta(ge=0, description=(
        "Budget of the pinned head: the old prompt's KV rows and up to 8 anchors, kept when "
        "a compaction replaces the prompt, GiB."))] = 4.0
    resident_park_gb: Annotated[float, Meta(ge=0, description=(
        "Budget of the parked session: the rows another session's request writes over, with "
        "its newest anchors and its end anchor, GiB."))] = 4.0
    end_anchor: Annotated[bool, Meta(description=(
        "Keep the state at the end of the last answer so the next turn resumes there."
        ))] = True
    prompt_end_anchor: Annotated[bool, Meta(description=(
        "Keep the state at the end of the last prompt, before its answer, and its last "
        "position's logits, so the same prompt again (a regenerate, a retry) forwards nothing."
        ))] = True
    end_align: Annotated[bool, Meta(description=(
        "Align a client's copy of the conversation with the end anchor's rows (re-tokenised "
        "text, compacted tool-call JSON, hidden spans put back), so it resumes there."
        ))] = True
    end_align_reasoning: Annotated[bool, Meta(description=(
        "Also align a copy that leaves an answer's reasoning out (Open WebUI): the rows' "
        "reasoning is served, as the template renders it for a client that sends it."
        ))] = True
    cache_gb: Annotated[float, Meta(ge=0, description=(
        "Budget of the state store (whole snapshots in RAM), GiB."))] = 2.0
    store_entry_gb: Annotated[float, Meta(ge=0, description=(
        "Largest single snapshot the state store keeps, GiB."))] = 1.0
    store: Annotated[bool, Meta(description=(
        "Keep whole snapshots in the state store: a prefix snapshot at a prefill's grid line "
        "and a session snapshot after each turn."))] = True
    store_boundaries: Annotated[int, Meta(ge=0, description=(
        "Prefix snapshots a prefill takes: the longest N grid lines whose snapshot fits "
        "store_entry_gb; 0 takes one at every line (they fill the budget fast)."))] = 1
    session_trim: Annotated[bool, Meta(description=(
        "Cut a pending speculative commit back to the committed tokens before a session "
        "snapshot; off, a turn that stopped inside an accepted verify block keeps no session "
        "snapshot (its end anchor still trims). Off by default: a session resume is held to "
        "the greedy gate, not to bit equality."))] = False
    response_cache: Annotated[bool, Meta(description=(
        "Answer an identical greedy request (same prompt ids, same parameters) from memory, "
        "without the engine. Off by default, so that a benchmark never measures a dictionary."
        ))] = False
    response_cache_mb: Annotated[float, Meta(ge=0, description=(
        "Budget of the response cache, MiB."))] = 64.0
    require_cache_salt: Annotated[bool, Meta(description=(
        "Refuse (400) a generation request without a cache_salt. Requests with different "
        "salts share no cached state and no suffix store drafts; requests without one share "
        "one namespace, so a server for several tenants should require it."))] = False


class SpeculationConfig(_Section):
    """Speculative decoding and the suffix store it drafts from."""

    speculation: Annotated[Literal["off", "lookup"], Meta(description=(
        "Speculative decoding: lookup drafts the tokens that followed the longest match of the "
        "context's end, in the request's own tokens and then in the suffix store, and checks "
        "them in one verify block; the output is the target's either way."))] = "lookup"
    draft_max: Annotated[int, Meta(ge=1, le=64, description=(
        "Most tokens drafted for one verify block (k)."))] = 8
    suffix_store: Annotated[bool, Meta(description=(
        "Keep the persistent suffix store: the token ids this engine read and wrote, across "
        "sessions and restarts, for the lookup drafter."))] = True
    suffix_store_dir: Annotated[str, Meta(description=(
        "Folder of the suffix store (mode 0700, never inside the repository), relative to home "
        "unless absolute."))] = "suffix"
    suffix_store_mb: Annotated[float, Meta(gt=0, description=(
        "Cap of the suffix store, MiB (4 bytes a token); over it the oldest half is forgotten "
        "at the next document boundary."))] = 192.0
    suffix_store_scope: Annotated[Literal["all", "outputs"], Meta(description=(
        "What the suffix store keeps: all (prompts and outputs) or outputs (only what the "
        "engine wrote)."))] = "all"
    suffix_store_readonly: Annotated[bool, Meta(description=(
        "Draft from the suffix store but never write to it (a benchmark must not write itself "
        "into a store of real traffic)."))] = False


class MemoryConfig(_Section):
    """The memory governor's limits (spec: "Memory"); 0 takes the spec's share of the machine."""

    mem_ceiling_gib: Annotated[float, Meta(ge=0, description=(
        "What the engine may hold between requests (allocated plus the allocator's reserve), "
        "GiB: a cache grows only while the total stays under this less reserve_slack_gib. 0: "
        "70/128 of the machine's memory (the device's on CUDA)."))] = 0.0
    mem_peak_gib: Annotated[float, Meta(ge=0, description=(
        "What the engine may hold during a prefill, GiB: caches are shed, cheapest first, until "
        "the prefill's estimated workspace fits; one that still does not gets a 503 with "
        "Retry-After. 0: 77/128 of the machine's memory."))] = 0.0
    reserve_slack_gib: Annotated[float, Meta(ge=0, description=(
        "Free blocks the allocator may keep between requests, GiB; more go back after the "
        "request. 0: 2 GiB, or a 16th of the ceiling when that is less."))] = 0.0


class DiskConfig(_Section):
    """The disk tier: repeated heads' grid chunks and anchors on the local disk (spec: "Disk tier")."""

    disk_cache: Annotated[Literal["off", "on"], Meta(description=(
        "The disk tier: on keeps the chunk and anchor files of prompts' repeated heads on the "
        "local disk (O_DIRECT, never the page cache) and resumes later prompts from them, bit "
        "for bit a cold prefill; off: nothing of it runs."))] = "on"
    disk_cache_dir: Annotated[str, Meta(description=(
        "Folder of the disk tier (mode 0700), relative to home unless absolute."))] = "disk"
    disk_cache_gb: Annotated[float, Meta(ge=0, description=(
        "Budget of the disk tier, GB; over it the least valuable entries go first."))] = 16.0
    disk_cache_ttl_days: Annotated[float, Meta(gt=0, description=(
        "Days an entry nobody used is kept on the disk."))] = 7.0
    disk_cache_admit_after: Annotated[int, Meta(ge=1, description=(
        "Cold reads of a grid line after which the longest such line of a prompt gets an "
        "anchor on the disk."))] = 2
    disk_cache_head_anchors: Annotated[int, Meta(ge=0, description=(
        "Anchors a session's first long request gets, at the last grid lines below where its "
        "last user message starts."))] = 4
    disk_cache_min_tokens: Annotated[int, Meta(ge=0, description=(
        "Prompts shorter than this write nothing to the disk tier."))] = 4096
    disk_cache_min_free_gb: Annotated[float, Meta(ge=0, description=(
        "Free space, GB, the disk tier leaves the file system; a write that would go under it "
        "evicts or is skipped. A setting made at run time may raise it, never lower it."
        ))] = 50.0
    disk_adopt_from: Annotated[str, Meta(description=(
        "Folders (colon-separated) a model tree moved from: the disk tier adopts the files "
        "their earlier fingerprint wrote, when their checkpoint files hold what this tree's "
        "hold."))] = ""
    disk_write_budget_gb: Annotated[float, Meta(ge=0, le=1e6, description=(
        "GB the disk tier and the session spill may write in a local day (writes.json beside "
        "the tier, kept across restarts). From it the tier plans nothing and the spill writes "
        "only a planned stop's drain and evictions of conversations of 32,768 tokens or more; "
        "from 1.5 times it, only the drain."))] = 200.0


class SpillConfig(_Section):
    """The session spill: whole conversations on the NVMe (spec: "Live conversations on the NVMe")."""

    session_spill_gb: Annotated[float, Meta(ge=0, description=(
        "Budget of the session spill, GB; entries unused for 48 hours go, then the least "
        "recently used first."))] = 64.0
    session_spill_min_tokens: Annotated[int, Meta(ge=0, description=(
        "A conversation leaving its slot is written to the spill, when the RAM park cannot "
        "hold it, from this many tokens."))] = 16384
    session_spill: Annotated[Literal["off", "on"], Meta(description=(
        "The session spill (with the disk tier on): on writes whole conversations to the "
        "NVMe at a planned stop and as they leave RAM, and reads them back; off: nothing of "
        "it runs."))] = "on"
    session_spill_park_min_tokens: Annotated[int, Meta(ge=0, description=(
        "A conversation parked in RAM is written to the spill as it is parked, from this "
        "many tokens, so that the park may give it up."))] = 4096


class CompactionConfig(_Section):
    """Compaction requests, served as continuations, and their summaries written ahead."""

    compaction: Annotated[Literal["continue", "client"], Meta(description=(
        "A compaction request of a session (no tools, the summarisation system text, the "
        "history as one user message) is served as the continuation of the conversation the "
        "engine holds for it: its rows up to the end of its last answer, then one user turn "
        "with the system text and the instructions, thinking off, so the prefill reads that "
        "turn alone (continue); client: as the client sent it."))] = "continue"
    compaction_prepare: Annotated[Literal["off", "on"], Meta(description=(
        "Write an agent session's compaction summary ahead: when the engine has been idle "
        "compaction_idle_s, no hold is on the box lock and a resident conversation of a "
        "session that sent tools has compaction_min_tokens, its summary is written as a "
        "continuation in scratch rows (a guest over the end anchor, nothing kept), yielding "
        "to any request, a drain, a process waiting for the box lock and, on CUDA, another "
        "program on the GPU; off: nothing is written ahead."))] = "on"
    compaction_idle_s: Annotated[float, Meta(ge=0, description=(
        "Seconds with no request before the preparer writes a summary."))] = 30.0
    compaction_min_tokens: Annotated[int, Meta(ge=0, description=(
        "Shortest conversation, in tokens up to its end anchor, whose summary is written "
        "ahead."))] = 32768
    box_lock: Annotated[str, Meta(description=(
        "The box lock: a file another program locks (flock -w) to borrow the machine; the "
        "preparer writes nothing while someone holds it and stops when someone waits for it. "
        "Relative to home unless absolute; empty: no box lock."))] = "box.lock"


class ImagesConfig(_Section):
    """Images in a prompt: what an image_url part may be, and its limits."""

    image_fetch: Annotated[Literal["off", "on"], Meta(description=(
        "Fetch http(s) image URLs (within image_max_mb and image_fetch_timeout_s); off: only "
        "data: URLs are read, and any other URL is a 400 naming its part."))] = "off"
    image_fetch_timeout_s: Annotated[float, Meta(gt=0, description=(
        "Seconds one image's fetch may take, the connection and the body together."))] = 10.0
    image_max_mb: Annotated[float, Meta(gt=0, description=(
        "Largest encoded image (the data URL's decoded payload, or the fetched body), in "
        "MiB."))] = 20.0
    image_max_pixels: Annotated[int, Meta(ge=1, description=(
        "Largest image, width times height, read from its header before a pixel is "
        "decoded."))] = 40_000_000
    max_images: Annotated[int, Meta(ge=1, description=(
        "Images a prompt keeps: past it the oldest are left out, each replaced by a fixed "
        "text, in steps of half the cap, so the head before the first image still sent stays "
        "the same from turn to turn."))] = 16
    image_cache_mb: Annotated[float, Meta(ge=0, description=(
        "The vision tower's output kept by the digest of an image's patches, least recently "
        "used out first, so an image resent every turn is encoded once; 0: none kept."))] = 512.0
    max_image_tokens: Annotated[int, Meta(ge=1, description=(
        "Image rows a prompt keeps, over all its images: past it the oldest are left out in "
        "steps of half the cap, as past max_images."))] = 16384


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole config. Sections are tables in the TOML; knob names are unique across them."""

    home: Annotated[str, Meta(description=(
        "Folder holding every file tandem writes (models, journal, disk tier, spill); empty: "
        "$XDG_CACHE_HOME/tandem, else ~/.cache/tandem."))] = ""
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Meta(description=(
        "Least severe log level written."))] = "info"
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    memory: MemoryConfig = msgspec.field(default_factory=MemoryConfig)
    speculation: SpeculationConfig = msgspec.field(default_factory=SpeculationConfig)
    disk: DiskConfig = msgspec.field(default_factory=DiskConfig)
    spill: SpillConfig = msgspec.field(default_factory=SpillConfig)
    compaction: CompactionConfig = msgspec.field(default_factory=CompactionConfig)
    images: ImagesConfig = msgspec.field(default_factory=ImagesConfig)

    def home_path(self) -> Path:
        """The home folder, absolute. ``load_config`` resolves an empty ``home`` already; a
        Config built by hand resolves it here from ``os.environ``."""
        return Path(self.home).expanduser() if self.home else default_home(os.environ)

    def models_dir(self) -> Path:
        """Where tandem writes models it creates (the embedded ``tiny``)."""
        return self.home_path() / "models"

    def journal_path(self) -> Path:
        """The JSONL journal: one row per request and per cache event."""
        return self.home_path() / "journal.jsonl"

    def suffix_store_path(self) -> Path:
        path = Path(self.speculation.suffix_store_dir).expanduser()
        return path if path.is_absolute() else self.home_path() / path

    def disk_cache_path(self) -> Path:
        path = Path(self.disk.disk_cache_dir).expanduser()
        return path if path.is_absolute() else self.home_path() / path

    def box_lock_path(self) -> Path | None:
        """The box lock's file, or None when there is none."""
        if not self.compaction.box_lock:
            return None
        path = Path(self.compaction.box_lock).expanduser()
        return path if path.is_absolute() else self.home_path() / path

    def record_path(self) -> Path | None:
        """The recording folder, or None when recording is off."""
        if not self.server.record_dir:
            return None
        path = Path(self.server.record_dir).expanduser()
        return path if path.is_absolute() else self.home_path() / path


def default_home(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/tandem``, else ``~/.cache/tandem``."""
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path(env.get("HOME") or Path.home()) / ".cache"
    return base / "tandem"


# ---------------------------------------------------------------------------------------------
# Knobs: the leaf fields and their spellings


@dataclass(frozen=True)
class Knob:
    """One leaf field of the tree, with its three spellings."""

    name: str  # canonical: the TOML key and the field name
    section: str | None  # None: a top-level key
    annotation: Any  # the field's type, with its Meta constraints
    default: Any
    doc: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def toml(self) -> str:
        return f"[{self.section}] {self.name}" if self.section else self.name

    @property
    def base_type(self) -> Any:
        t = self.annotation
        while typing.get_origin(t) is Annotated:
            t = typing.get_args(t)[0]
        return t

    def spellings(self) -> str:
        return f"`{self.name}` (toml {self.toml}, flag {self.flag}, env {self.env})"

    def convert(self, value: Any, *, from_text: bool, source: str) -> Any:
        """``value`` as this knob's type, its constraints checked. ``from_text``: a string from
        the environment or the command line, parsed ('8000', 'true', '2.5')."""
        try:
            return msgspec.convert(value, self.annotation, strict=not from_text)
        except msgspec.ValidationError as e:
            raise ConfigError(
                f"bad value {value!r} for knob {self.spellings()} from {source}: {e}") from None


def _section_knobs(cls: type, section: str | None) -> list[Knob]:
    hints = typing.get_type_hints(cls, include_extras=True)
    knobs = []
    for f in msgspec.structs.fields(cls):
        t = hints[f.name]
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            continue  # a section: its knobs are listed under it
        meta = [m for m in typing.get_args(t)[1:] if isinstance(m, Meta)]
        doc = meta[0].description if meta and meta[0].description else ""
        assert doc, f"config field {cls.__name__}.{f.name} has no description"
        knobs.append(Knob(f.name, section, t, f.default, doc))
    return knobs


def _sections() -> dict[str | None, type]:
    hints = typing.get_type_hints(Config)
    out: dict[str | None, type] = {None: Config}
    for f in msgspec.structs.fields(Config):
        t = hints[f.name]
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            out[f.name] = t
    return out


def _all_knobs() -> dict[str, Knob]:
    out: dict[str, Knob] = {}
    for section, cls in _sections().items():
        for knob in _section_knobs(cls, section):
            assert knob.name not in out, f"knob name {knob.name!r} is declared twice"
            out[knob.name] = knob
    return out


KNOBS: dict[str, Knob] = _all_knobs()


def knobs() -> list[Knob]:
    """Every knob, in declaration order (top level first, then each section)."""
    return list(KNOBS.values())


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None,
                cli_args: argparse.Namespace | Mapping[str, Any] | Sequence[str] | None = None,
                ) -> Config:
    """The config from the defaults, then the TOML file, then ``TANDEM_*`` variables, then the
    command line, each overriding the one before.

    ``path``: a TOML file; None: ``--config`` from ``cli_args``, else ``$TANDEM_CONFIG``, else no
    file (the defaults, which ``config/tandem.toml`` documents). ``env``: None reads
    ``os.environ``; ``TANDEM_*`` names that are no knob are ignored (other tools share the
    prefix). ``cli_args``: a Namespace from a parser given :func:`add_config_flags`, a mapping
    of knob name to value, or a list of argv strings; None values mean "not given".
    """
    env = os.environ if env is None else env
    cli = _cli_values(cli_args)
    if path is None:
        path = cli.pop("config", None) or env.get(CONFIG_ENV) or None
    cli.pop("config", None)

    values: dict[str, Any] = {}
    if path is not None:
        for name, value in _read_toml(Path(path)).items():
            values[name] = KNOBS[name].convert(value, from_text=False, source=f"file {path}")
    for knob in KNOBS.values():
        if knob.env in env:
            values[knob.name] = knob.convert(env[knob.env], from_text=True,
                                             source=f"env {knob.env}")
    for name, value in cli.items():
        knob = KNOBS.get(name)
        if knob is None:
            raise ConfigError(f"unknown config knob {name!r} on the command line")
        values[name] = knob.convert(value, from_text=isinstance(value, str),
                                    source=f"flag {knob.flag}")

    if not values.get("home"):
        values["home"] = str(default_home(env))
    return _build(values)


def _build(values: Mapping[str, Any]) -> Config:
    tree: dict[str, Any] = {}
    for name, value in values.items():
        section = KNOBS[name].section
        (tree.setdefault(section, {}) if section else tree)[name] = value
    try:
        return msgspec.convert(tree, Config)
    except msgspec.ValidationError as e:  # each value was checked; this is a cross-field rule
        raise ConfigError(f"bad config: {e}") from None


def _read_toml(path: Path) -> dict[str, Any]:
    """The file's knobs by name; an unknown key, a key in the wrong section or a TOML syntax
    error is a ConfigError."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    sections = _sections()
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in sections and key is not None and isinstance(value, dict):
            for name, v in value.items():
                knob = KNOBS.get(name)
                if knob is None or knob.section != key:
                    raise ConfigError(_unknown_key(path, f"[{key}] {name}", name))
                out[name] = v
        else:
            knob = KNOBS.get(key)
            if knob is None or knob.section is not None:
                raise ConfigError(_unknown_key(path, key, key))
            out[key] = value
    return out


def _unknown_key(path: Path, where: str, name: str) -> str:
    knob = KNOBS.get(name)
    hint = f"; it belongs in {knob.toml}" if knob else ""
    return f"unknown key {where} in config file {path}{hint}"


def _cli_values(cli_args: argparse.Namespace | Mapping[str, Any] | Sequence[str] | None,
                ) -> dict[str, Any]:
    if cli_args is None:
        return {}
    if isinstance(cli_args, argparse.Namespace):
        items = vars(cli_args)
        # a parser may carry other arguments (a subcommand's own); keep only knobs and --config
        return {k: v for k, v in items.items() if v is not None and (k in KNOBS or k == "config")}
    if isinstance(cli_args, Mapping):
        return {k: v for k, v in cli_args.items() if v is not None}
    if isinstance(cli_args, (str, bytes)):
        raise TypeError("cli_args: pass a list of argv strings, not one string")
    parser = argparse.ArgumentParser(prog="tandem", add_help=False, exit_on_error=False)
    add_config_flags(parser)
    try:
        ns = parser.parse_args(list(cli_args))
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from None
    return _cli_values(ns)


# ---------------------------------------------------------------------------------------------
# Command line


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per knob to ``parser`` (default None: not given). A value is
    checked as it is parsed; :func:`load_config` takes the resulting Namespace."""
    group = parser.add_argument_group("config", "every knob; also a TOML key and a TANDEM_* "
                                      "variable (see config/tandem.toml)")
    group.add_argument("--config", default=None, metavar="PATH",
                       help=f"TOML config file (also ${CONFIG_ENV}).")
    for knob in KNOBS.values():
        help_text = f"{knob.doc} Default: {_toml_value(knob.default)}; env {knob.env}."
        help_text = help_text.replace("%", "%%")
        t = knob.base_type
        if t is bool:
            group.add_argument(knob.flag, dest=knob.name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
        elif typing.get_origin(t) is Literal:
            group.add_argument(knob.flag, dest=knob.name, default=None,
                               choices=list(typing.get_args(t)), help=help_text)
        else:
            group.add_argument(knob.flag, dest=knob.name, default=None, type=_flag_type(knob),
                               metavar={str: "TEXT"}.get(t, t.__name__.upper()), help=help_text)


def _flag_type(knob: Knob):
    def convert(text: str) -> Any:
        try:
            return knob.convert(text, from_text=True, source=f"flag {knob.flag}")
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = knob.base_type.__name__  # argparse names the type in its messages
    return convert


# ---------------------------------------------------------------------------------------------
# The documented default file


def default_toml() -> str:
    """``config/tandem.toml``: every knob with its default and its doc as a comment."""
    lines = [
        "# tandem's configuration: every knob with its default. Generated from tandem/config.py",
        "# (python -m tandem.config > config/tandem.toml); a test holds the two equal.",
        "#",
        "# Each key is also a flag of `tandem serve` (prefix_chunk: --prefix-chunk) and an",
        "# environment variable (TANDEM_PREFIX_CHUNK). Precedence: this file < environment <",
        "# command line. Point tandem at another file with --config or $TANDEM_CONFIG.",
    ]
    for section, cls in _sections().items():
        lines.append("")
        if section is not None:
            lines.append(f"# {cls.__doc__.strip()}")
            lines.append(f"[{section}]")
            lines.append("")
        for knob in _section_knobs(cls, section):
            lines.extend(textwrap.wrap(knob.doc, width=98, initial_indent="# ",
                                       subsequent_indent="# "))
            lines.append(f"{knob.name} = {_toml_value(knob.default)}")
            lines.append("")
        if lines[-1] == "":
            lines.pop()
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()  # a JSON string is a TOML basic string
    raise TypeError(f"no TOML spelling for {value!r}")


if __name__ == "__main__":
    sys.stdout.write(default_toml())
