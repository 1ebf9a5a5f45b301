"""The embedded default: written once through the ordinary loader path, the same every time."""

import json
import subprocess
import sys

import pytest

from tandem.models import load_model
from tandem.models.tiny import ensure_tiny


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")


def test_tiny_is_an_ordinary_checkpoint_folder_written_once(home):
    path = ensure_tiny(home / "models")
    for name in ("config.json", "model.safetensors", "tokenizer.tiktoken", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny(home / "models") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    loaded = load_model("tiny", home / "models")
    assert loaded.tokenizer.special_ids["<|im_start|>"] == 248045
    assert "<|im_start|>" in json.loads((path / "tokenizer_config.json").read_text())["chat_template"]


def test_tiny_renders_with_tandems_template_whatever_its_folder_holds(home):
    """An older tandem may have written another text beside tiny: tiny is tandem's model."""
    from tandem.models.chat import template_info

    path = ensure_tiny(home / "models")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    stale = dict(config, chat_template=config["chat_template"] + "{#- older -#}")
    config_path.write_text(json.dumps(stale))
    try:
        loaded = load_model("tiny", home / "models")
    finally:
        config_path.write_text(json.dumps(config))
    assert loaded.tokenizer.chat_template is None
    assert template_info(loaded.tokenizer.chat_template).source == "tandem"


def test_two_writes_give_the_same_weights(home, tmp_path):
    a = json.loads((ensure_tiny(home / "models") / "tandem-tiny.json").read_text())
    b = json.loads((ensure_tiny(tmp_path / "other") / "tandem-tiny.json").read_text())
    assert a["weights_sha256"] == b["weights_sha256"]


def test_tandem_generate_json_prints_one_object_with_its_timings(home):
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "generate", "--home", str(home), "--max-tokens", "6",
         "--prompt", "Name three colours.", "--json"],
        capture_output=True, text=True, timeout=120, check=True)
    doc = json.loads(out.stdout)
    assert doc["completion_tokens"] == len(doc["token_ids"]) == 6
    assert doc["prompt_tokens"] > 10 and doc["prefill_ms"] > 0 and doc["decode_tok_s"] > 0
    assert isinstance(doc["text"], str)
    # Greedy is the default: the same command gives the same tokens.
    again = subprocess.run(
        [sys.executable, "-m", "tandem", "generate", "--home", str(home), "--max-tokens", "6",
         "--prompt", "Name three colours.", "--json"],
        capture_output=True, text=True, timeout=120, check=True)
    second = json.loads(again.stdout)
    assert second["token_ids"] == doc["token_ids"]
    # The second drafted the first's answer from the suffix store under home (speculation is
    # on by default), and the output is the same greedy tokens.
    assert doc["speculation"]["mode"] == "lookup"
    assert second["speculation"]["accepted"] == second["speculation"]["drafted"] > 0
    assert (home / "suffix" / "tokens.u32").stat().st_size > 0


def test_tandem_generate_names_a_bad_model_folder(home, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tandem", "generate", "--home", str(home),
                          "--model", str(tmp_path / "missing")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "neither 'tiny' nor a checkpoint directory" in out.stderr
    assert "Traceback" not in out.stderr


def test_tiny_reads_images_and_its_language_model_is_the_one_version_1_drew(home):
    """The tower was added from a generator of its own: every text tensor in the file is what
    the text recipe draws (version 1's), so tiny's text is the same bits."""
    import numpy as np
    import torch
    from safetensors import safe_open

    from tandem.models import image_processor
    from tandem.models.tiny import TINY_CONFIG, TINY_IMAGE_FIELDS, _weights

    path = ensure_tiny(home / "models")
    loaded = load_model("tiny", home / "models")
    text = _weights(TINY_CONFIG)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names - set(text) and all(n.startswith("model.visual.") for n in names - set(text))
        for name, want in text.items():
            assert torch.equal(f.get_tensor(name), want), name
    images = loaded.model.images
    assert images is not None
    for token in ("image", "vision_start", "vision_end"):
        pad = "<|image_pad|>" if token == "image" else f"<|{token}|>"
        assert getattr(images, f"{token}_token_id") == TINY_IMAGE_FIELDS[f"{token}_token_id"] \
            == loaded.tokenizer.special_ids[pad]
    # the smallest image the processor makes, 128 x 128: 64 patches, 16 rows of tiny's width
    rgb = np.random.default_rng(0).integers(0, 256, (100, 100, 3), dtype=np.uint8)
    from PIL import Image

    pre = image_processor.preprocess(Image.fromarray(rgb), images.processor)
    assert pre.grid == (1, 8, 8) and pre.num_tokens == 16
    rows = images.tower.encode(pre.pixel_values, pre.grid)
    assert rows.shape == (16, TINY_CONFIG["hidden_size"]) and torch.isfinite(rows).all()


def test_tiny_is_written_a_tensor_at_a_time_in_save_files_very_bytes(tmp_path):
    """write_safetensors places each tensor as it comes, in any order, and gives the bytes of
    safetensors' save_file over the whole dict (which held every tensor and a bytes copy of
    each: 788 MiB at tiny's first start); a tensor the header does not list, or one that never
    comes, is an error."""
    import pytest
    import torch
    from safetensors.torch import save_file

    from tandem.models.tiny import write_safetensors

    gen = torch.Generator().manual_seed(5)
    tensors = {"model.b": torch.randn(3, 5, generator=gen), "lm_head.weight": torch.randn(7),
               "model.a.weight": torch.randn(2, 2, 2, generator=gen), "z": torch.randn(1)}
    save_file(tensors, str(tmp_path / "whole.safetensors"), metadata={"format": "pt"})
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    order = ["z", "model.b", "lm_head.weight", "model.a.weight"]  # not the file's order
    write_safetensors(tmp_path / "streamed.safetensors", shapes,
                      ((k, tensors[k]) for k in order), metadata={"format": "pt"})
    assert (tmp_path / "streamed.safetensors").read_bytes() \
        == (tmp_path / "whole.safetensors").read_bytes()
    with pytest.raises(ValueError):
        write_safetensors(tmp_path / "short.safetensors", shapes,
                          ((k, tensors[k]) for k in order[:3]), metadata={})
    with pytest.raises(ValueError):
        write_safetensors(tmp_path / "foreign.safetensors", shapes,
                          [("other", torch.zeros(1))], metadata={})


def test_a_load_hands_the_heap_it_freed_back_to_the_system(home):
    """load_model ends with glibc's malloc_trim (heap_trimmed, with what it returned): a
    tokenizer.json's parse left 268 MiB of freed blocks resident on Qwen's vocabulary."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        loaded = load_model("tiny", home / "models")
    trims = [e for e in logs if e["event"] == "heap_trimmed"]
    assert len(trims) == 1 and trims[0]["path"] == str(loaded.path)
    assert trims[0]["freed_mib"] >= 0
