"""Reading a Hugging Face checkpoint directory: config.json and one or many *.safetensors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

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


def load_tensors(model_dir: Path, prefixes: tuple[str, ...] = ("",)) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with one of ``prefixes``, the prefix stripped."""
    out: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    for prefix in prefixes:
                        if name.startswith(prefix):
                            out[name[len(prefix):]] = f.get_tensor(name)
                            break
        except Exception as exc:  # safetensors raises its own types for a bad header
            raise ModelError(f"cannot read {path.name}: {exc}") from exc
    return out


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
