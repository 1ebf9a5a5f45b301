"""csrc/simd16.h's AVX2 side: each 16-lane operation the native kernels use, built of two 8-lane
halves, does what AVX-512's does (its documented result, lane for lane), so the kernels written
once compute the same arithmetic on both. Gate: exact equality with the operation's definition
(v_scalef_ps against a * 2^n rounded once, the masked loads and stores lane by lane, the gather
and scatter), on any x86-64 CPU with AVX2 and a C compiler (an AVX-512 one included: the
header's AVX2 side is what is built here). The kernels themselves are held to torch and to
their own batch invariance by the other tests in this folder, on whichever build the machine
runs."""

import ctypes
import mmap
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tandem.kernels import native

HEADER = Path(native.__file__).with_name("csrc") / "simd16.h"

SOURCE = r"""
#include "simd16.h"

void scalef(const float *a, const float *n, float *out, long count) {
  for (long i = 0; i < count; i += 16)
    v_storeu_ps(out + i, v_scalef_ps(v_loadu_ps(a + i), v_loadu_ps(n + i)));
}

/* dst's lanes in m from src's, through a masked load and a masked store */
void masked(const float *src, int m, float *dst) {
  v_mask_storeu_ps(dst, (mask16)m, v_maskz_loadu_ps((mask16)m, src));
}

/* out = gather(base[idx]) where m, else fill; then scatter src into base2 at idx where m */
void gather_scatter(const float *base, const int *idx, int m, float fill, float *out,
                    float *base2, const float *src) {
  vi16 at = v_set_epi32(idx[15], idx[14], idx[13], idx[12], idx[11], idx[10], idx[9], idx[8],
                        idx[7], idx[6], idx[5], idx[4], idx[3], idx[2], idx[1], idx[0]);
  v_storeu_ps(out, v_mask_i32gather_ps(v_set1_ps(fill), (mask16)m, at, base, 4));
  v_mask_i32scatter_ps(base2, (mask16)m, at, v_loadu_ps(src), 4);
}

float sum_tree(const float *a) { return tree1(v_loadu_ps(a)); }

/* the lanes where a >= b, and where either is NaN */
int compare(const float *a, const float *b, int unordered) {
  vf16 x = v_loadu_ps(a), y = v_loadu_ps(b);
  return unordered ? v_cmp_ps_mask(x, y, _CMP_UNORD_Q) : v_cmp_ps_mask(x, y, _CMP_GE_OQ);
}
"""


def _cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or not _cpu_has_avx2(),
                                reason="needs gcc and an x86-64 CPU with AVX2 and FMA")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("simd16")
    (d / "check.c").write_text(SOURCE)
    out = d / "check.so"
    subprocess.run(["gcc", "-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared",
                    f"-I{HEADER.parent}", str(d / "check.c"), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.sum_tree.restype = ctypes.c_float
    lib.gather_scatter.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p]
    return lib


def _p(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def test_scalef_rounds_a_times_two_to_the_n_once_down_to_denormals_and_up_to_inf(lib):
    """exp16's scalef: a in [0.7, 1.5] and every n in [-150, 128], where a * 2^n runs from
    0 through the denormals (rounded) to inf; the float64 product is exact, so its cast to
    fp32 is the once-rounded result AVX-512's scalef gives."""
    gen = torch.Generator().manual_seed(0)
    n = torch.arange(-150, 129, dtype=torch.float32).repeat(8)
    a = 0.7 + 0.8 * torch.rand(n.numel(), generator=gen)
    pad = (-n.numel()) % 16
    n, a = torch.cat([n, torch.zeros(pad)]), torch.cat([a, torch.ones(pad)])
    out = torch.empty_like(a)
    lib.scalef(_p(a), _p(n), _p(out), ctypes.c_long(a.numel()))
    want = (a.double() * torch.pow(2.0, n.double())).float()
    assert torch.equal(out, want)
    assert (want == 0).any() and torch.isinf(want).any() and (
        (want > 0) & (want < torch.finfo(torch.float32).tiny)).any()


def test_masked_loads_and_stores_touch_exactly_the_masked_lanes(lib):
    src = torch.arange(1, 17, dtype=torch.float32)
    for m in list(range(0, 1 << 16, 257)) + [0xFFFF, 0x00FF, 0xFF00, 1, 0x8000, 0x7FFF]:
        dst = torch.full((16,), -1.0)
        lib.masked(_p(src), m, _p(dst))
        want = torch.tensor([src[i].item() if m >> i & 1 else -1.0 for i in range(16)])
        assert torch.equal(dst, want), hex(m)


def test_a_masked_load_reads_no_lane_past_its_mask(lib):
    """Three floats that end at a page whose next page is unreadable: a masked load of them
    must not touch it (AVX-512 suppresses the fault, and so must the halves; a fault would
    end the run)."""
    page = mmap.PAGESIZE
    buf = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ctypes.memmove(base + page - 12, torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes(), 12)
    assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE
    try:
        dst = torch.zeros(16)
        lib.masked(ctypes.c_void_p(base + page - 12), 0b111, _p(dst))
        assert dst[:3].tolist() == [1.0, 2.0, 3.0] and not dst[3:].any()
    finally:
        libc.mprotect(base + page, page, 3)  # PROT_READ | PROT_WRITE, for the unmap


def test_gather_and_scatter_move_the_masked_lanes_by_index(lib):
    base = torch.arange(100, dtype=torch.float32) * 0.5
    idx = torch.tensor([3 * i + 1 for i in range(16)], dtype=torch.int32)
    src = torch.arange(16, dtype=torch.float32) + 1000
    for m in (0xFFFF, 0x0F0F, 0x8001, 0):
        out, base2 = torch.empty(16), torch.zeros(100)
        lib.gather_scatter(_p(base), _p(idx), m, -7.0, _p(out), _p(base2), _p(src))
        for lane in range(16):
            on = m >> lane & 1
            assert out[lane].item() == (base[idx[lane]].item() if on else -7.0)
            assert base2[idx[lane]].item() == (src[lane].item() if on else 0.0)


def test_the_lane_tree_adds_i_and_i_plus_8_then_4_then_2_then_1(lib):
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        a = torch.randn(16, generator=gen) * torch.exp(torch.randn(16, generator=gen) * 8)
        s = a.clone()
        for half in (8, 4, 2, 1):
            s = s[:half] + s[half:2 * half]
        assert lib.sum_tree(_p(a)) == s.item()


def test_compare_masks_follow_the_predicate_and_nans(lib):
    a = torch.tensor([1, 2, 3, float("nan")] * 4)
    b = torch.tensor([2, 2, 2, 2] * 3 + [float("nan"), 0, 0, 0])
    ge = lib.compare(_p(a), _p(b), 0)
    un = lib.compare(_p(a), _p(b), 1)
    assert ge == sum(1 << i for i in range(16) if a[i] >= b[i])
    assert un == sum(1 << i for i in range(16) if a[i].isnan() or b[i].isnan())
