"""Loading in about the checkpoint's size: a tensor at a time, converted before the next is read.

What load keeps alive is counted at every read: each raw tensor safetensors hands out is
watched through a weak reference, and before the next read every earlier one still alive is
summed. A bf16 checkpoint loaded in fp32 may keep none of them (the model holds fp32 copies),
so the sum stays within one tensor (the pending weight while its FP8 scale is read); a loader
that reads the checkpoint whole and converts it afterwards holds all of it.
"""

import json
import weakref

import pytest
import structlog
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tandem.models import checkpoint
from tandem.models.hybrid import HybridModel


class _Watched:
    """safe_open with every tensor it returns watched; ``worst`` is the most raw bytes found
    still alive at the start of a read."""

    def __init__(self):
        self.raw: list[tuple[weakref.ref, int]] = []
        self.worst = 0
        self.reads = 0

    def alive(self) -> int:
        return sum(n for ref, n in self.raw if ref() is not None)

    def __call__(self, path, framework="pt"):
        watch, handle = self, safe_open(path, framework=framework)

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_tensor(self, name):
                watch.worst = max(watch.worst, watch.alive())
                watch.reads += 1
                t = handle.get_tensor(name)
                watch.raw.append((weakref.ref(t), t.numel() * t.element_size()))
                return t

        return Handle()


@pytest.fixture(scope="module")
def sharded_bf16(qwen3_5_dir, tmp_path_factory):
    """The oracle's model in bf16, in three files with an index, as Hugging Face shards."""
    d = tmp_path_factory.mktemp("sharded")
    tensors = {k: v.to(torch.bfloat16) for k, v in
               load_file(str(qwen3_5_dir / "model.safetensors")).items()}
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        part = names[i::3]
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in part}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = json.loads((qwen3_5_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg))
    return d, tensors


def test_a_sharded_load_holds_the_model_and_at_most_one_raw_tensor(sharded_bf16, monkeypatch):
    d, tensors = sharded_bf16
    watch = _Watched()
    monkeypatch.setattr(checkpoint, "safe_open", watch)
    model = HybridModel.load(d, dtype=torch.float32)
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    assert watch.reads == len(tensors)
    assert watch.worst <= largest
    assert watch.alive() == 0  # every bf16 view converted and dropped
    held = {t.data_ptr(): t for t in model.w.values()}.values()
    assert all(t.dtype == torch.float32 for t in held)
    assert sum(t.numel() for t in held) == sum(t.numel() for t in tensors.values())


def _mapped_file(ptr: int) -> str | None:
    """The file whose mapping holds address ``ptr`` (Linux), None for anonymous memory."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5] if len(fields) > 5 else None
    return None


def test_weights_already_in_the_compute_dtype_are_the_files_own_pages(sharded_bf16):
    d, _ = sharded_bf16
    same = HybridModel.load(d, dtype=torch.bfloat16)
    w = same.w["layers.0.mlp.up_proj.weight"]
    assert _mapped_file(w.data_ptr()).startswith(str(d / "model-"))  # no copy
    cast = HybridModel.load(d, dtype=torch.float32)
    assert not (_mapped_file(cast.w["layers.0.mlp.up_proj.weight"].data_ptr()) or "").startswith(
        str(d))


def test_the_load_says_in_one_event_what_the_model_holds(sharded_bf16):
    d, tensors = sharded_bf16
    with structlog.testing.capture_logs() as logs:
        HybridModel.load(d, dtype=torch.float32)
    events = [e for e in logs if e["event"] == "checkpoint_loaded"]
    assert len(events) == 1
    e = events[0]
    n = sum(t.numel() for t in tensors.values())
    assert (e["parameters"], e["nbytes"], e["dtype"], e["files"]) == (n, 4 * n, "float32", 3)
    assert (e["quantization"], e["dequantized_tensors"], e["skipped_tensors"]) == ("none", 0, 0)
    assert e["model_type"] == "qwen3_5_text"
