"""The native decode matmul (tandem/kernels/csrc/rows.c): x @ W.T for B rows at once, each row's
bits a function of its own input alone, whatever the batch, the kernel shape that covers an
output (16 x 1, 8 x 2, 4 x 4, a lone row), the thread count or the place of a row; and close to
torch's product (it rounds otherwise: one accumulator a lane and a fixed lane tree)."""

import pytest
import torch

from tandem.kernels import decode, native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the native kernel does not build on this machine")

# N past a multiple of 16 and of 4 (the lone-row tail), K past a multiple of 16 (the masked
# tail) and under one vector; tiny's head; a 0.8B-like down projection
SHAPES = [(1000, 300), (37, 7), (16, 16), (5, 1), (248_320, 256), (1024, 3584), (333, 64)]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_is_the_same_bits_alone_at_any_place_in_any_batch_and_on_any_thread_count(shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    rows = torch.randn(13, k, generator=gen)
    alone = native.rows_f32(rows[:1], w)[0]
    for size in (1, 2, 3, 4, 5, 8, 9, 12) if n < 100_000 else (1, 3, 4):
        for place in sorted({0, size // 2, size - 1}):
            batch = rows[1:size + 1].clone() if size > 1 else rows[:1].clone()
            batch[place] = rows[0]
            got = native.rows_f32(batch, w)
            assert torch.equal(got[place], alone), (size, place)
    out = torch.empty(4, n)
    x = rows[:4].contiguous()
    for threads in (1, 2, 3):
        native.function("tandem_rows_f32")(x.data_ptr(), k, 4, w.data_ptr(), n, k,
                                            out.data_ptr(), n, threads)
        assert torch.equal(out[0], alone), threads


def test_the_product_is_x_times_w_transposed_to_fp32_rounding():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(777, 515, generator=gen), torch.randn(6, 515, generator=gen)
    got = native.rows_f32(x, w)
    want = (x.double() @ w.double().T).float()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_rows_apart_in_memory_are_read_where_they_lie():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 40, generator=gen)
    wide = torch.randn(5, 100, generator=gen)
    x = wide[:, 30:70]  # rows 100 floats apart
    assert x.stride() == (100, 1) and native.fits(x, w)
    assert torch.equal(native.rows_f32(x, w), native.rows_f32(x.contiguous(), w))


def test_what_the_kernel_does_not_take_goes_to_torch_and_keeps_its_bits(decode_matmuls):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(50, 32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    assert not native.fits(x.bfloat16(), w.bfloat16())
    assert not native.fits(x, w.t().contiguous().t())  # a weight not contiguous
    assert not native.fits(x.t().contiguous().t(), w)  # rows whose elements are apart
    got = decode.rows_linear(x.bfloat16(), w.bfloat16())
    assert got.dtype == torch.bfloat16
    for b in range(3):
        assert torch.equal(decode.rows_linear(x[b:b + 1].bfloat16(), w.bfloat16())[0], got[b])


def test_the_library_shares_torchs_openmp_runtime():
    """The kernel's GOMP_parallel is the one in the libgomp torch loaded: its regions run on
    torch's team (a second runtime would spin a second set of workers against torch's on two
    cores). Other libraries may bundle their own (pydivsufsort does); ours must not."""
    import ctypes
    import os

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    lib = native._load()
    address = ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value
    info = DlInfo()
    assert ctypes.CDLL(None).dladdr(ctypes.c_void_p(address), ctypes.byref(info))
    where = os.path.realpath(info.dli_fname.decode())
    assert os.path.dirname(where) == os.path.realpath(os.path.join(
        os.path.dirname(torch.__file__), "lib")), where


def test_off_the_model_pads_a_lone_sequence_and_on_it_does_not():
    before = decode.block() == 1
    try:
        assert decode.set_native(False) is False and decode.block() == decode.TORCH_BLOCK
        assert decode.set_native(True) is True and decode.block() == 1
    finally:
        decode.set_native(before)


def test_a_build_that_fails_leaves_decode_on_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "SOURCES", [tmp_path / "broken.c"])
    (tmp_path / "broken.c").write_text("this is not C\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert native._load() is None
    assert native.available() is False


def test_the_row_ops_are_torchs_to_fp32_rounding_and_each_row_its_own():
    gen = torch.Generator().manual_seed(4)
    for d in (64, 200, 1024):
        x = torch.randn(5, d, generator=gen)
        h = torch.randn(5, 2 * d, generator=gen)[:, :d]  # rows apart, as a projection's slice
        gain = 1.0 + torch.randn(d, generator=gen) * 0.1
        eps = 1e-6
        want = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * gain
        got = native.rms_rows(x, gain, eps)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        total, normed = native.add_rms_rows(x, h, gain, eps)
        assert torch.equal(total, x + h)
        assert torch.allclose(normed, native.rms_rows(x + h, gain, eps), rtol=0, atol=0)
        gate_up = torch.randn(5, 2 * d, generator=gen) * 4
        gate, up = gate_up.split([d, d], dim=1)
        act = native.silu_mul_rows(gate, up)
        assert torch.allclose(act, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)
        for r in range(5):  # a row alone is the bits it gets among the others
            assert torch.equal(native.rms_rows(x[r:r + 1], gain, eps)[0], got[r])
            assert torch.equal(native.add_rms_rows(x[r:r + 1], h[r:r + 1], gain, eps)[1][0],
                               normed[r])
            assert torch.equal(native.silu_mul_rows(gate[r:r + 1], up[r:r + 1])[0], act[r])


def test_the_knob_off_keeps_decode_on_torchs_path_and_on_takes_the_kernel():
    import msgspec

    from tandem.config import Config
    from tandem.devices import engine_device

    before = decode.block() == 1
    try:
        off = Config()
        off = msgspec.structs.replace(
            off, engine=msgspec.structs.replace(off.engine, native_kernels=False, device="cpu"))
        engine_device(off)
        assert decode.block() == decode.TORCH_BLOCK
        on = msgspec.structs.replace(off, engine=msgspec.structs.replace(off.engine,
                                                                         native_kernels=True))
        engine_device(on)
        assert decode.block() == 1
    finally:
        decode.set_native(before)


def test_a_damaged_cached_library_is_deleted_and_built_again(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    target = native._build(native._compiler())  # a good build under the test's cache
    target.write_bytes(b"\x7fELF not a library")  # damaged where it lies
    lib = native._load()
    assert lib is not None and target.is_file() and target.read_bytes()[:4] == b"\x7fELF"
    assert target.stat().st_size > 1000  # built again, not the damaged bytes
    x, w = torch.randn(2, 20), torch.randn(30, 20)
    out = torch.empty(2, 30)
    lib.tandem_rows_f32(x.data_ptr(), 20, 2, w.data_ptr(), 30, 20, out.data_ptr(), 30, 1)
    assert torch.allclose(out, x @ w.T, atol=1e-5)


def test_the_build_follows_the_cpu_and_its_digest_names_it(monkeypatch):
    """AVX-512 takes the AVX-512 build unless TANDEM_NATIVE_SIMD asks for AVX2; AVX2 takes
    AVX2's; anything else none. A state decoded by one build names it (the digest), so the
    other's is never taken for it."""
    for capability, env, want in (("AVX512", None, "avx512"), ("AVX512", "avx2", "avx2"),
                                  ("AVX512_BF16", None, "avx512"), ("AVX2", None, "avx2"),
                                  ("AVX2", "avx512", "avx2"), ("DEFAULT", None, None)):
        monkeypatch.setattr(native.torch.backends.cpu, "get_cpu_capability",
                            lambda c=capability: c)
        if env is None:
            monkeypatch.delenv("TANDEM_NATIVE_SIMD", raising=False)
        else:
            monkeypatch.setenv("TANDEM_NATIVE_SIMD", env)
        assert native.flavor() == want, (capability, env)
    digests = set()
    for capability in ("AVX512", "AVX2"):
        monkeypatch.setattr(native.torch.backends.cpu, "get_cpu_capability",
                            lambda c=capability: c)
        monkeypatch.delenv("TANDEM_NATIVE_SIMD", raising=False)
        digests.add(native.digest())
        assert native.ISA[native.flavor()][0] in native._flags()
    assert len(digests) == 2
