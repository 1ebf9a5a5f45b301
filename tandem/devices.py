"""Where the engine runs, and the host memory that copies of its rows take.

``resolve_device`` turns the ``device`` knob into a ``torch.device`` at start: ``auto`` is the
first CUDA device when torch sees one, else the CPU; ``cuda`` or ``cuda:N`` without that device
is a ``ConfigError`` naming the knob, never a traceback later.

Host copies of device rows (the caches' anchors, parks, pins and store entries, the end anchor)
take pinned memory (``host_clone``): a copy to or from it is one DMA at the link's rate, where
pageable memory goes through the driver's own bounce buffer at half of it. The staging buffers
of the disk tier and the spill (``tandem.io.direct.aligned``) are pinned too once an engine of
this process runs on CUDA (``pin_staging``); torch's pinned allocator hands out whole
cudaHostAlloc blocks, page-aligned. On a CPU nothing of this applies: a CPU tensor's copy is
``clone()``, bit for bit and allocation for allocation what it was before there was a device.
"""

from __future__ import annotations

import re

import structlog
import torch

DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first with FP8 tensor cores (torch._scaled_mm)

_pin_staging = False  # an engine of this process runs on CUDA


class DeviceUnavailable(ValueError):
    """The knob names a device this machine lacks (raised as a ConfigError by the caller)."""


def resolve_device(name: str) -> torch.device:
    """The device ``name`` (the knob's value) stands for on this machine."""
    if not DEVICE_RE.match(name):
        raise DeviceUnavailable(f"device {name!r} is none of auto, cpu, cuda, cuda:N")
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {name!r} asked, but torch sees no CUDA device "
                                f"(torch {torch.__version__}, built with CUDA "
                                f"{torch.version.cuda}); use auto or cpu")
    index = int(name.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailable(f"device {name!r} asked, but torch sees {count} CUDA "
                                f"device{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether ``device`` multiplies FP8 natively (compute capability 8.9 and up)."""
    return (device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY)


def pin_staging(on: bool = True) -> None:
    """Pin the disk tier's and the spill's staging from now on (an engine runs on CUDA)."""
    global _pin_staging
    _pin_staging = bool(on) and torch.cuda.is_available()


def staging_pinned() -> bool:
    return _pin_staging


def host_clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory: ``t.clone()`` for a plain CPU tensor (what the caches
    always took), pinned for a device tensor and for a pinned one (a copy of a copy)."""
    if t.device.type == "cpu" and not t.is_pinned():
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)  # synchronous: the copy is whole before the caller's next step
    return out


def engine_device(config) -> torch.device:
    """The config's ``device`` knob resolved, and decode's CPU kernels set by its
    ``native_kernels``, before any model is read; a device the machine lacks is a ConfigError
    that names the knob (the CLI prints it and exits 2)."""
    from tandem.config import KNOBS, ConfigError
    from tandem.kernels import decode, native, screen

    try:
        device = resolve_device(config.engine.device)
    except DeviceUnavailable as exc:
        raise ConfigError(f"{exc} (knob {KNOBS['device'].spellings()})") from None
    on = decode.set_native(config.engine.native_kernels)
    screen.set_enabled(config.engine.head_screen)
    structlog.get_logger(__name__).info("decode_kernels", kernels="native" if on else "torch",
                                        simd=native.flavor() if on else None,
                                        asked=config.engine.native_kernels)
    return device
