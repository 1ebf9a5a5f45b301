"""Model adapters and the one function that turns ``--model tiny|DIR`` into a loaded model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from tandem.models.base import ModelError

log = structlog.get_logger()


@dataclass
class LoadedModel:
    model: object  # a tandem.models.base.Model
    tokenizer: object | None  # a tandem.models.tokenizer.Tokenizer, None for a bare checkpoint
    path: Path
    name: str  # what /v1/models lists


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype | None:
    """``auto`` is fp32 on a CPU (bf16 products run a hundred times slower there) and on a GPU
    the checkpoint's own dtype (None: HybridModel.load reads it, bf16 for an fp32 one)."""
    if name == "auto":
        return None if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ModelError(f"unknown dtype {name!r}; use auto or one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def load_model(spec: str, models_dir: Path, dtype: str = "auto",
               device: torch.device | str = "cpu", cuda_graphs: str = "off") -> LoadedModel:
    """``tiny`` (written under ``models_dir`` on first use) or a checkpoint directory, on
    ``device`` (a resolved one: tandem.devices.resolve_device turns the knob into it), its
    decode steps captured as CUDA graphs where ``cuda_graphs`` (the knob) wants them."""
    from tandem.models.hybrid import HybridModel
    from tandem.models.tiny import TINY_NAME, ensure_tiny

    if spec == TINY_NAME:
        path, name = ensure_tiny(Path(models_dir)), TINY_NAME
    else:
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise ModelError(f"model {spec!r} is neither 'tiny' nor a checkpoint directory")
        name = path.name
    device = torch.device(device)
    model = HybridModel.load(path, dtype=resolve_dtype(dtype, device), device=device)
    from tandem.models import graphs

    graphs.attach(model, cuda_graphs)
    model.prepare_decode()  # the native step's plan and the head's screen, before a request
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer.tiktoken").is_file():
        from tandem.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path)
        if spec == TINY_NAME:
            # tiny renders with tandem's template whatever an older tandem wrote beside it
            tokenizer.chat_template = None
    _return_freed_heap(path)
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, name=name)


def _return_freed_heap(path: Path) -> None:
    """Hands the heap the load freed back to the system (glibc's malloc_trim). A tokenizer.json
    is parsed whole: the tokenizers library's load of Qwen's 16 MB file left 177 MiB of freed
    blocks in the heap beside the 88 MiB it keeps, resident until a later allocation reused
    them; a checkpoint converted to the compute dtype frees its read buffers the same way."""
    from tandem.cache.governor import CpuAllocator

    heap = CpuAllocator()
    try:
        before = heap.measure().held_nbytes
        heap.release_reserve()
        freed = before - heap.measure().held_nbytes
    except OSError:  # no /proc (not Linux): nothing measured, nothing to say
        return
    log.info("heap_trimmed", path=str(path), freed_mib=round(freed / 2**20, 1))

