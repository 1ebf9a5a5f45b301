"""The Triton kernels' tests run under Triton's interpreter on CPU tensors where there is no GPU
(TRITON_INTERPRET is read when a kernel is decorated, so it is set before any
tandem.kernels.triton_* module is imported); on a CUDA machine they run compiled on the GPU
(scripts/device_check.sh), unless TRITON_INTERPRET=1 is set by hand. Without triton installed
they skip, and so they do under the interpreter of a triton before 3.7, which hands a loop's
runtime bound (``range(0, n, BLOCK)``) to ``int()`` as a one-element array, a TypeError with
numpy 2 (3.5.1 and 3.6.0 fail so; 3.7.1 and later run them; compiled on a GPU it never arises)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_too_old() -> str | None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        import triton
    except ImportError:
        return None
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 7):
        return f"triton {triton.__version__}'s interpreter passes loop bounds as arrays (3.7+ runs)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _interpreter_too_old()
    if reason is None:
        return
    for item in items:
        if item.path.name.startswith("test_triton_"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device() -> str:
    """Where the Triton tests' tensors live: the interpreter runs on CPU tensors."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"
