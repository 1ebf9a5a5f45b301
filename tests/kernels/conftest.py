"""The Triton kernels' tests run under Triton's interpreter on CPU tensors where there is no GPU
(TRITON_INTERPRET is read when a kernel is decorated, so it is set before any
tandem.kernels.triton_* module is imported); on a CUDA machine they run compiled on the GPU
(scripts/device_check.sh), unless TRITON_INTERPRET=1 is set by hand. Without triton installed
they skip."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    """Where the Triton tests' tensors live: the interpreter runs on CPU tensors."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"
