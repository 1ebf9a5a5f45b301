import os
import sys
from pathlib import Path

# Every snapshot that lends a slot's rows keeps a witness copy and checks it on every read
# (tandem.cache.copies.CHECK_LENT), here and in the servers the tests start: a path that writes
# a slot's rows without telling its borrowers fails whichever test runs it.
os.environ.setdefault("TANDEM_CHECK_LENT", "1")

# The oracle is transformers' torch path. Where flash-linear-attention is installed (install.sh
# adds it on a GPU, for scripts/bench_engine.py; device_check.sh carries it to a lent machine)
# transformers' Qwen3.5 and Qwen3-Next take its kernels instead, which multiply fp32 in TF32 on
# Ampere and later (its triangular solve asks for it): about 1e-3 relative, against an fp32
# oracle the device tests hold to 1e-4, and on a CPU they fail outright (no Triton driver). The
# suite hides fla before any transformers modelling module is imported.
sys.modules.setdefault("fla", None)

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from oracle import make_qwen3_5, make_qwen3_5_moe, make_qwen3_next  # noqa: E402


@pytest.fixture(autouse=True)
def _two_threads():
    """The bit-exact gate holds at one thread count; every test runs at the same one."""
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory) -> Path:
    return make_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="session")
def qwen3_next_dir(tmp_path_factory) -> Path:
    return make_qwen3_next(tmp_path_factory.mktemp("qwen3_next"))


@pytest.fixture(scope="session")
def qwen3_5_moe_dir(tmp_path_factory) -> Path:
    return make_qwen3_5_moe(tmp_path_factory.mktemp("qwen3_5_moe"))


@pytest.fixture(params=["native", "torch"])
def decode_matmuls(request):
    """Decode's matmuls on the native kernel (tandem.kernels.native, skipped where it does not
    build) and on torch's, each in turn; the process's setting put back after."""
    from tandem.kernels import decode, native

    if request.param == "native" and not native.available():
        pytest.skip("the native kernel does not build on this machine")
    before = decode.block() == 1
    decode.set_native(request.param == "native")
    yield request.param
    decode.set_native(before)


def _decode_native(on: bool):
    """Decode's matmuls and a prefill's GDN middle on the native kernel (on) or torch's path for
    one test, put back after."""
    from tandem.kernels import decode

    before = decode.block() == 1
    decode.set_native(on)
    yield
    decode.set_native(before)


@pytest.fixture
def torch_matmuls():
    """Decode's matmuls and a prefill's GDN middle on torch's path for one test (what it asserts
    is torch's bits, or what the reference ops see)."""
    yield from _decode_native(False)


@pytest.fixture
def native_on():
    """Decode on the native kernels for one test (tandem.kernels.native, where it builds)."""
    yield from _decode_native(True)
