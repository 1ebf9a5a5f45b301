"""Reading a Hugging Face checkpoint directory: config.json and one or many *.safetensors."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from tandem.models import quant
from tandem.models.base import ModelError


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelError(f"no config.json in {model_dir}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"config.json in {model_dir} is not valid JSON: {exc}") from exc


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files in the index's order, or every one in the folder when unindexed."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"the index of {model_dir} names missing files: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors in {model_dir}")
    return files


@dataclass(frozen=True)
class ReadReport:
    """What ``read_weights`` did, for the load's log event."""

    files: int
    tensors: int  # read, converted and kept
    skipped: int  # in the files but not the model's (``mtp.*``, ``model.visual.*``, ...)
    dequantized: int  # of ``tensors``, FP8 blocks turned into the compute dtype
    native: int = 0  # of ``tensors``, FP8 blocks kept FP8 (models/fp8.py Fp8Weight)
    # of ``tensors``, those kept as the file's mapping itself: where their bytes lie in the file
    views: dict[str, "Extent"] = field(default_factory=dict)


@dataclass(frozen=True)
class Extent:
    """Where a tensor's bytes lie in its safetensors file (from the file's header)."""

    path: Path
    offset: int  # from the file's start
    nbytes: int


def tensor_extents(path: Path) -> dict[str, Extent]:
    """Each tensor's extent in one safetensors file: an 8-byte little-endian header length,
    the JSON header (``data_offsets`` relative to the bytes after it), then the data."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    return {name: Extent(Path(path), base + int(v["data_offsets"][0]),
                         int(v["data_offsets"][1]) - int(v["data_offsets"][0]))
            for name, v in header.items() if name != "__metadata__"}


def read_weights(model_dir: Path, rename: Callable[[str], str | None], dtype: torch.dtype,
                 fp8: quant.Fp8Blocks | None, *, fp8_device: torch.device | None = None,
                 keep_fp8: Callable[[str], bool] | None = None,
                 ) -> tuple[dict[str, torch.Tensor], ReadReport]:
    """The tensors ``rename`` keeps (under the names it gives), each in ``dtype``.

    One tensor at a time, a file at a time: a tensor is a lazy view of the file's mapping, read
    and converted (dequantized where FP8, cast) before the next is touched, and the raw view is
    dropped then, so what load holds at any moment is the converted model so far plus one
    tensor (two for an FP8 weight and its scale), never the checkpoint whole in another dtype.
    A tensor already in ``dtype`` is kept as the view itself: file-backed pages, no copy.
    ``fp8_device``: an FP8 weight and its scale move there before they are dequantised (a GPU
    with FP8 matmuls: half the bytes over the link, the product on the device); None: on the
    host, as on a CPU and a GPU without FP8. ``keep_fp8(name)`` (with ``fp8_device``): that
    matrix stays FP8 there, its scales beside it (models/fp8.py: native FP8 products).
    """
    files = weight_files(model_dir)
    where: dict[str, Path] = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                where[name] = path
    out: dict[str, torch.Tensor] = {}
    views: dict[str, Extent] = {}
    skipped = dequantized = native = 0
    for path in files:
        extents = None
        with _open(path) as f:
            for name in f.keys():
                if quant.is_scale(name):
                    continue  # read beside its weight
                target = rename(name)
                if target is None:
                    skipped += 1
                    continue
                t = _read(f, path, name)
                if t.dtype in quant.FP8_DTYPES:
                    if fp8 is None:
                        raise ModelError(f"tensor {name!r} is stored as {t.dtype} but config.json "
                                         f"has no quantization_config to say how to scale it")
                    scale = _scale(f, path, where, name)
                    if fp8_device is not None:
                        t, scale = t.to(fp8_device), scale.to(fp8_device)
                    if fp8_device is not None and keep_fp8 is not None and t.dim() == 2 \
                            and keep_fp8(target):
                        from tandem.models.fp8 import Fp8Weight

                        t = Fp8Weight(t, scale, (fp8.block_rows, fp8.block_cols))
                        native += 1
                    else:
                        t = quant.dequantize(t, scale, fp8, name)
                        dequantized += 1
                    del scale
                elif quant.scale_name(name) in where:
                    raise ModelError(f"tensor {name!r} is {t.dtype} but has a "
                                     f"{quant.scale_name(name)!r} beside it; a scaled weight "
                                     f"must be stored as FP8")
                elif t.dtype == dtype and t.device.type == "cpu":
                    if extents is None:
                        extents = tensor_extents(path)
                    if name in extents and extents[name].nbytes == t.numel() * t.element_size():
                        views[target] = extents[name]
                out[target] = t.to(dtype)
                del t
    return out, ReadReport(files=len(files), tensors=len(out), skipped=skipped,
                           dequantized=dequantized, native=native, views=views)


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own types for a bad header
        raise ModelError(f"cannot read {path.name}: {exc}") from exc


def _read(f, path: Path, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as exc:
        raise ModelError(f"cannot read tensor {name!r} from {path.name}: {exc}") from exc


def _scale(f, path: Path, where: dict[str, Path], name: str) -> torch.Tensor:
    sname = quant.scale_name(name)
    home = where.get(sname)
    if home is None:
        raise ModelError(f"FP8 tensor {name!r} has no {sname!r} in the checkpoint")
    if home == path:
        return _read(f, path, sname)
    with _open(home) as g:  # a shard boundary fell between the weight and its scale
        return _read(g, home, sname)


def weights_digest(model_dir: Path) -> str:
    """A sha256 over each weight file's name, size and header (names, dtypes, shapes, offsets).

    Hashing every byte of a large checkpoint at each start would cost minutes; the header pins
    the layout and the size, and the code digest beside it pins what computes the rows.
    """
    h = hashlib.sha256()
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(path.name.encode())
            h.update(str(path.stat().st_size).encode())
            h.update(f.read(min(header_len, 100_000_000)))
            # A sample of the data pins a re-randomised checkpoint of the same layout.
            h.update(f.read(1 << 20))
    return h.hexdigest()


def code_digest(*modules) -> str:
    h = hashlib.sha256()
    for module in modules:
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()
