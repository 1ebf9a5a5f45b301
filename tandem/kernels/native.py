"""Decode's CPU kernels as our own C (``csrc/*.c``: the matmul, the row ops, attention, the GDN
layer's middle) on 16-lane vectors, built once by the machine's C compiler into one library and
loaded with ctypes: AVX-512 where the CPU has it, else AVX2 with FMA, where ``csrc/simd16.h``
makes each 16-lane operation of two 8-lane halves, lane for lane the same arithmetic (so the
same kernels, and a row's bits its own at any batch, on both).

Why our own: a decode step reads every weight once a token, so its rate is the rate its matmuls
read memory at, and a batched step must give each sequence the bits it gets alone (issue 14).
torch's CPU matmuls (MKL) meet neither at once: at M = 1 a GEMV rounds otherwise than at M >= 2,
which M share bits depends on the shape, and at M = 4 a head reads at half the GEMV's rate, so
tandem ran every call at exactly two rows and read the weights once a pair of sequences
(``decode.rows_linear``'s torch path). ``rows.c`` computes every output with one fixed sequence
of FMAs and one fixed lane tree, so a row's bits are its own at any B, and it reads the weights
once for up to any number of rows: measured on this machine's two cores (fp32, quiet), a
248,320 x 256 head at 23.6 GB/s at B = 1 against numpy's 20.7 and torch's 21.2, and at B = 4
21.8 GB/s where torch's two calls of two rows read it twice.

A C compiler is on every machine tandem builds on (the CPU torch wheel's install needs none,
but the Python headers' packages do), and the build takes a second or two; where there is
none, or the CPU has neither AVX-512 nor AVX2 with FMA, or the build fails, ``available()`` is
False and decode keeps torch's path, whose bits are its own too. The library links the libgomp
torch loaded (the same soname), so its parallel regions run on torch's one OpenMP team
(tandem/torch_thread.py).
Built libraries live under ``$XDG_CACHE_HOME/tandem/native`` (else ``~/.cache/tandem/native``,
else a temporary directory), named by a hash of the sources and headers, the flags and the
compiler, and written by rename so that processes building at once never load half a file; one
that does not load is deleted and built again.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.c"))  # one library of them all
TOKENIZER_SOURCES = ("bpe.c",)  # in the library, but no kernel: not in digest()
# -ffp-contract=off: no a * b + c in the C fused by the compiler (only the kernels' own FMAs),
# so that the two builds' scalar code rounds alike too.
COMMON = ("-O3", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
# The instruction set's flags, by build (``flavor()``): the same sources for each.
ISA = {"avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
       "avx2": ("-mavx2",)}
LIBS = ("-lm",)  # after the sources: gdn.c's expf, log1pf and sqrtf

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def flavor() -> str | None:
    """The build this CPU runs: "avx512", "avx2" (AVX2 with FMA: torch's AVX2 capability
    requires both), or None. ``TANDEM_NATIVE_SIMD=avx2`` takes the AVX2 build on an AVX-512
    CPU too (to compare the two on one machine)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX512_BF16"):
        return "avx2" if os.environ.get("TANDEM_NATIVE_SIMD") == "avx2" else "avx512"
    return "avx2" if capability == "AVX2" else None


def _flags() -> tuple[str, ...]:
    """The compiler's flags for this CPU's build (``flavor()`` is not None)."""
    return COMMON + ISA[flavor()]


def _cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tandem" / "native"


def _compiler() -> str | None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    return cc if cc and shutil.which(cc) else None


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()[:1]
    flags = _flags()
    digest = hashlib.sha256(_sources_bytes() + repr((flags, LIBS, version)).encode()).hexdigest()
    for root in (_cache_dir(), Path(tempfile.gettempdir()) / f"tandem-native-{os.getuid()}"):
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        target = root / f"tandem-{digest[:16]}.so"
        if target.is_file():
            return target
        tmp = root / f".{target.name}.{os.getpid()}.tmp"
        try:
            subprocess.run([cc, *flags, *map(str, SOURCES), *LIBS, "-o", str(tmp)], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)
            log.info("native_kernel_built", path=str(target), compiler=cc, simd=flavor())
            return target
        except OSError:
            tmp.unlink(missing_ok=True)
            continue
    raise OSError("no writable directory for the native kernel")


def _sources_bytes(leave_out: tuple[str, ...] = ()) -> bytes:
    headers = sorted(SOURCES[0].parent.glob("*.h")) if SOURCES else []
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in SOURCES + headers
                    if p.name not in leave_out)


_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
# Every exported function's C signature (argtypes; void unless RESTYPES says).
SIGNATURES: dict[str, list] = {
    "tandem_rows_f32": [_P, _L, _L, _P, _L, _L, _P, _L, _I],
    "tandem_rms_rows_f32": [_P, _L, _L, _L, _P, _F, _P],
    "tandem_add_rms_rows_f32": [_P, _L, _P, _L, _L, _L, _P, _F, _P, _P],
    "tandem_silu_mul_rows_f32": [_P, _P, _L, _L, _L, _P],
    "tandem_attn_rows_f32": [_P, _L, _P, _L, _P, _L, _L, _L, _L, _L, _L, _P, _P, _F, _P, _P,
                             _P, _P, _P, _P, _F, _P, _P],
}

# csrc/gdn.c: a GDN layer's decode middle (decode.GdnLayer), its conv and its recurrent step
SIGNATURES.update({
    "tandem_conv_rows_f32": [_L, _P, _L, _P, _P, _L, _L, _P, _L],
    "tandem_delta_rows_f32": [_L, _P, _P, _P, _P, _P, _P, _L, _L, _L, _P, _I],
    "tandem_gdn_rows_f32": [_P, _L, _P, _P, _L, _P, _L, _P, _L, _P, _L, _P, _P, _L, _I],
    # a prefill chunk's middle (decode.GdnLayer.prefill): 0, or -1 without its buffers
    "tandem_gdn_prefill_f32": [_P, _L, _P, _L, _P, _L, _P, _L, _P, _L, _P, _P, _P, _L, _I],
})
# csrc/step.c: a whole decode step (step.NativeStep); it returns 0, or -1 where it could not
# allocate its buffers (decodes, and verify blocks with their GDN middle in waves)
SIGNATURES["tandem_step_f32"] = [_P, _L, _P, _L, _P, _P, _P, _P, _L, _P, _P, _P, _P, _I, _P]
# csrc/rows.c: greedy's token from the head's screen (screen.py); -1 where it gets the full head
SIGNATURES["tandem_head_argmax_rows_f32"] = [_P, _L, _L, _P, _L, _P, _P, _P, _P, _F, _P, _P, _P,
                                              _P, _I, _P]
# csrc/rows.c: an embedding lookup by pread (screen.RowsFile.gather); 0, or -1 (an id out of
# range, a short read)
SIGNATURES["tandem_gather_rows_fd"] = [_I, _L, _L, _L, _P, _L, _P, _I]
SIGNATURES["tandem_head_screen_rows_f32"] = [_P, _L, _L, _P, _P, _P, _P, _P, _P, _L, _I]
# csrc/bpe.c: Qwen's byte-level BPE in a few megabytes (tandem/models/bpe.py)
SIGNATURES["tandem_bpe_index"] = [_P, _P, _P, _L, _P, _L]
SIGNATURES["tandem_bpe_encode"] = [_P, _P, _L, _P]
SIGNATURES["tandem_bpe_decode"] = [_P, _P, _P, _L, _P]
RESTYPES = {"tandem_step_f32": _I, "tandem_gdn_prefill_f32": _I, "tandem_gather_rows_fd": _L,
            "tandem_bpe_index": _L, "tandem_bpe_encode": _L, "tandem_bpe_decode": _L}
# the rest return void


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if flavor() is None:
            log.info("native_kernel_off", reason="neither AVX-512 nor AVX2 with FMA on this CPU")
            return None
        cc = _compiler()
        if cc is None:
            log.info("native_kernel_off", reason="no C compiler")
            return None
        lib = None
        for attempt in range(2):
            try:
                path = _build(cc)
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("native_kernel_off", reason="build failed", error=str(exc)[-400:])
                return None
            try:
                lib = ctypes.CDLL(str(path))
                for name, argtypes in SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = argtypes, RESTYPES.get(name)
                break
            except (OSError, AttributeError) as exc:
                # a cached library that does not load or lacks a function (a damaged or
                # foreign file under our name): deleted and built again, once
                log.warning("native_kernel_rebuilt", path=str(path), error=str(exc)[-200:])
                path.unlink(missing_ok=True)
                lib = None
        if lib is None:
            log.warning("native_kernel_off", reason="the built library does not load")
            return None
        _lib = lib
        return lib


def digest() -> str:
    """The kernel's source hash: what a saved state decoded by it names (a model's manifest).
    The tokenizer's source (bpe.c) computes no state, so it is not in it."""
    simd = (flavor() or "").encode()  # the builds' scalar code may round otherwise
    return "native:" + hashlib.sha256(_sources_bytes(TOKENIZER_SOURCES) + simd).hexdigest()[:16]


def available() -> bool:
    """Whether the native kernels build and load on this machine (decode.set_native chooses
    whether decode uses them)."""
    return _load() is not None


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` is the kernel's: fp32 CPU tensors, weight contiguous, x's rows
    contiguous."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and weight.is_contiguous() and x.stride(1) == 1)


def rows_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for x [B, K], weight [N, K] (``fits``), each row's bits its own."""
    b, k = x.shape
    n = weight.shape[0]
    out = torch.empty(b, n, dtype=torch.float32)
    function("tandem_rows_f32")(x.data_ptr(), x.stride(0), b, weight.data_ptr(), n, k,
                                out.data_ptr(), n, torch.get_num_threads())
    return out


def function(name: str):
    """The library's function ``name`` (``SIGNATURES``); available() must be True. Looked up
    once: decode calls these hundreds of times a token."""
    fn = _FUNCTIONS.get(name)
    if fn is None:
        lib = _load()
        if lib is None:
            raise RuntimeError("the native kernels are not available (check available() first)")
        fn = _FUNCTIONS[name] = getattr(lib, name)
    return fn


_FUNCTIONS: dict[str, object] = {}


def held(name: str):
    """``function(name)`` called without letting go of the GIL (the library through
    ctypes.PyDLL), for a call of microseconds between two decode steps: a ctypes call lets go
    of it, and the event loop, woken by the last step's tokens, then held it until it blocked
    again, while the step waited for it before its native call."""
    fn = _HELD.get(name)
    if fn is None:
        function(name)  # the library loaded (built first), or the error that it is not
        fn = getattr(ctypes.PyDLL(_lib._name), name)
        fn.argtypes, fn.restype = SIGNATURES[name], RESTYPES.get(name)
        _HELD[name] = fn
    return fn


_HELD: dict[str, object] = {}


def rows_fit(*xs: torch.Tensor) -> bool:
    """Whether fp32 CPU rows [R, D] (each row contiguous) are the row ops' (csrc/norms.c)."""
    return all(x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
               and x.stride(1) == 1 for x in xs)


def rms_rows(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x * x) + eps) * gain`` a row of x [R, D] at a time (``rows_fit``)."""
    r, d = x.shape
    out = torch.empty(r, d, dtype=torch.float32)
    function("tandem_rms_rows_f32")(x.data_ptr(), x.stride(0), r, d, gain.data_ptr(), eps,
                                    out.data_ptr())
    return out


def add_rms_rows(x: torch.Tensor, h: torch.Tensor, gain: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual ``x + h`` and its rms norm, [R, D] each, in one pass (``rows_fit``)."""
    r, d = x.shape
    total = torch.empty(r, d, dtype=torch.float32)
    out = torch.empty(r, d, dtype=torch.float32)
    function("tandem_add_rms_rows_f32")(x.data_ptr(), x.stride(0), h.data_ptr(), h.stride(0),
                                        r, d, gain.data_ptr(), eps, total.data_ptr(),
                                        out.data_ptr())
    return total, out


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for [R, D] halves of one projection (the same row stride)."""
    r, d = gate.shape
    if up.shape != gate.shape or up.stride(0) != gate.stride(0):
        raise ValueError("gate and up must be halves of one projection's rows")
    out = torch.empty(r, d, dtype=torch.float32)
    function("tandem_silu_mul_rows_f32")(gate.data_ptr(), up.data_ptr(), gate.stride(0), r, d,
                                         out.data_ptr())
    return out


def attention_rows(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                   kv_heads: int, head_dim: int, q_gain: torch.Tensor, k_gain: torch.Tensor,
                   eps: float, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
                   values: list[torch.Tensor], positions: list[int],
                   scale: float) -> torch.Tensor:
    """Decode's gated attention over R rows (csrc/attn.c): row r's q and gate heads in qg [R,
    nh * 2hd], its k and v heads in k, v [R, nkv * hd] (rows of one projection), its rotary
    cos and sin [R, rd] (sin's first half negated); it writes its normed, rotated key and its
    value at ``positions[r]`` of ``keys[r]``/``values[r]`` ([nkv, window, hd] fp32, contiguous)
    and attends over that sequence's rows up to it. Returns [R, nh * hd], the attention times
    sigmoid(gate)."""
    rows, rd = qg.shape[0], cos.shape[1]
    if head_dim > 1024 or not all(t.is_contiguous() and t.dtype == torch.float32
                                  for t in (*keys, *values, cos, sin, q_gain, k_gain)):
        raise ValueError("attention_rows takes contiguous fp32 rows of head_dim <= 1024")
    out = torch.empty(rows, heads * head_dim, dtype=torch.float32)
    scores = torch.empty(max(positions) + 1, dtype=torch.float32)
    kptr = (ctypes.c_long * rows)(*(t.data_ptr() for t in keys))
    vptr = (ctypes.c_long * rows)(*(t.data_ptr() for t in values))
    if any(kt.stride(0) != vt.stride(0) for kt, vt in zip(keys, values)):
        raise ValueError("a sequence's key and value rows must be of one window")
    if any(not 0 <= at < kt.shape[1] for kt, at in zip(keys, positions)):
        raise IndexError("a position is outside its sequence's window")  # written unchecked
    hs = (ctypes.c_long * rows)(*(t.stride(0) for t in keys))
    at = (ctypes.c_long * rows)(*positions)
    function("tandem_attn_rows_f32")(
        qg.data_ptr(), qg.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), rows,
        heads, kv_heads, head_dim, rd, q_gain.data_ptr(), k_gain.data_ptr(), eps,
        cos.data_ptr(), sin.data_ptr(), kptr, vptr, hs, at, scale,
        scores.data_ptr(), out.data_ptr())
    return out
