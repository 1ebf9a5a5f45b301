"""The head as rows its file holds (tandem/kernels/screen.py RowsFile): the screen built, its
exact rows read and the embedding looked up by pread, so that greedy decode maps none of the
head's pages.

Gates: the screen built from the file is the screen built from the mapping (torch.equal on
every tensor); the argmax, the screened logits and the exact count are the same with the rows
read from the file as from the mapping; the embedding rows are F.embedding's (torch.equal);
greedy generation gives the same tokens; and after a greedy generation the head's pages are
still unmapped (counted in /proc/self/pagemap), where one read of the full head maps them."""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from small_hybrid import make_small_hybrid
from tandem.engine import Engine, SamplingParams, run_steps
from tandem.kernels import native, screen
from tandem.models import checkpoint
from tandem.models.hybrid import HybridModel

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the native kernel does not build on this machine")

PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _native(native_on):
    yield


@pytest.fixture
def small(tmp_path) -> HybridModel:
    return HybridModel.load(make_small_hybrid(tmp_path / "small", tokenizer=False))


def _mapped_pages(t: torch.Tensor) -> tuple[int, int]:
    """(pages of t's bytes mapped in this process, pages in all), from /proc/self/pagemap (bit
    63 of a page's entry: present)."""
    lo = t.data_ptr() // PAGE
    hi = (t.data_ptr() + t.numel() * t.element_size() + PAGE - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo * 8)
        raw = f.read((hi - lo) * 8)
    entries = memoryview(raw).cast("Q")
    return sum(1 for e in entries if e >> 63), hi - lo


def _pagemap_readable() -> bool:
    try:
        with open("/proc/self/pagemap", "rb") as f:
            return len(f.read(8)) == 8
    except OSError:
        return False


def test_load_records_where_a_mapped_weight_lies_in_its_file(small):
    extent = small.file_extents["embed_tokens.weight"]
    head = small.w["lm_head.weight"]
    assert small.file_extents["lm_head.weight"] == extent  # tied: one matrix
    assert extent.nbytes == head.numel() * 4
    with open(extent.path, "rb") as f:
        f.seek(extent.offset + 5 * head.shape[1] * 4)
        row = torch.frombuffer(bytearray(f.read(head.shape[1] * 4)), dtype=torch.float32)
    assert torch.equal(row, head[5])


def test_the_screen_built_from_the_file_is_the_screen_built_from_the_mapping(small):
    head = small.w["lm_head.weight"]
    rows = small._rows_file("lm_head.weight")
    assert rows is not None
    a, b = screen.build(head, rows), screen.build(head)
    for name in ("q", "scale", "radius", "rq"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.wmax == b.wmax
    assert a.file is rows and b.file is None


def test_the_exact_pass_reads_the_files_rows_and_gives_the_same_bits(small):
    head = small.w["lm_head.weight"]
    by_file = screen.build(head, small._rows_file("lm_head.weight"))
    by_map = screen.build(head)
    g = torch.Generator().manual_seed(3)
    for r in (1, 2, 4):
        xs = torch.randn(r, head.shape[1], generator=g) * 3
        one, two = screen.argmax_rows(xs, head, by_file), screen.argmax_rows(xs, head, by_map)
        assert one.tokens == two.tokens
        assert one.tokens == [int(row.argmax()) for row in native.rows_f32(xs, head).numpy()]
        assert torch.equal(one.approx, two.approx) and one.exact == two.exact > 0


def test_the_embedding_read_from_the_file_is_f_embedding(small):
    plan = small._native_step()
    assert plan is not None and plan.screen is not None and plan.screen.file is not None
    table = small.w["embed_tokens.weight"]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, table.shape[0], (3, 300), generator=g)
    ids[0, 0], ids[1, 1] = 0, table.shape[0] - 1
    assert torch.equal(small._embedding(ids), F.embedding(ids, table))
    assert torch.equal(small._embedding(ids[0].to(torch.int32)), F.embedding(ids[0], table))
    few = ids[1, :5]  # a decode step's few rows: the call that keeps the GIL (HELD_ROWS)
    assert few.numel() <= screen.HELD_ROWS < ids.numel()
    assert torch.equal(small._embedding(few), F.embedding(few, table))
    for bad in (-1, table.shape[0]):
        with pytest.raises(IndexError):
            small._embedding(torch.tensor([1, bad]))


def test_a_file_whose_bytes_are_not_the_mappings_is_not_read(small, tmp_path):
    head = small.w["lm_head.weight"]
    extent = small.file_extents["lm_head.weight"]
    shifted = checkpoint.Extent(extent.path, extent.offset + 4, extent.nbytes)
    assert screen.RowsFile.open(shifted, head) is None
    short = tmp_path / "short.safetensors"
    short.write_bytes(Path(extent.path).read_bytes()[:extent.offset + extent.nbytes // 2])
    assert screen.RowsFile.open(checkpoint.Extent(short, extent.offset, extent.nbytes),
                                head) is None
    # a file cut short after it was opened: the gather says so (the lookup reads the mapping)
    fd = os.open(short, os.O_RDONLY)
    cut = screen.RowsFile(fd, extent.offset, head.shape[0], head.shape[1] * 4)
    assert cut.gather(torch.tensor([0, 1])) is not None
    assert cut.gather(torch.tensor([0, head.shape[0] - 1])) is None
    cut.close()


@pytest.mark.skipif(not _pagemap_readable(), reason="no /proc/self/pagemap here")
def test_greedy_generation_maps_none_of_the_heads_pages_and_gives_the_same_tokens(small):
    """The head (63.6 MB here) stays unmapped through load, the screen's build, a prefill and
    48 greedy tokens; the same generation with the mapping read (no file) gives the same
    tokens; one read of the full head maps it whole (the count is not blind)."""
    head = small.w["lm_head.weight"]
    assert _mapped_pages(head)[0] * 100 < _mapped_pages(head)[1]
    plan = small._native_step()
    assert plan.screen.file is not None
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, small.vocab_size, (300,), generator=g).tolist()
    params = SamplingParams(max_tokens=48)
    out = run_steps(Engine(small, window=512, prefix_chunk=64).generate_steps(prompt, params))
    assert len(out.token_ids) == 48
    mapped, pages = _mapped_pages(head)
    assert mapped * 100 < pages, (mapped, pages)

    kept = plan.screen
    plan.set_screen(screen.HeadScreen(kept.q, kept.scale, kept.radius, kept.rq, kept.wmax))
    try:
        again = run_steps(Engine(small, window=512, prefix_chunk=64).generate_steps(prompt,
                                                                                   params))
    finally:
        plan.set_screen(kept)
    assert again.token_ids == out.token_ids
    native.rows_f32(torch.ones(1, head.shape[1]), head)
    mapped, pages = _mapped_pages(head)
    assert mapped * 10 > pages * 9, (mapped, pages)


@pytest.mark.skipif(not _pagemap_readable(), reason="no /proc/self/pagemap here")
def test_an_untied_embedding_is_looked_up_from_the_file_and_stays_unmapped(tmp_path):
    """An untied checkpoint: its embedding table is never read whole, so its lookups go by
    pread too: after a prefill and greedy tokens the table's pages are still unmapped, the
    rows are F.embedding's, and the head's screen reads its own file's rows."""
    import json

    from safetensors.torch import save_file

    from small_hybrid import SMALL_CONFIG, _long_memory
    from tandem.models.tiny import _weights

    config = dict(SMALL_CONFIG, tie_word_embeddings=False)
    path = tmp_path / "untied"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(_long_memory(_weights(config)), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    model = HybridModel.load(path)
    table, head = model.w["embed_tokens.weight"], model.w["lm_head.weight"]
    assert table.data_ptr() != head.data_ptr()
    plan = model._native_step()
    assert plan.screen.file is not None and model._embed_file() is not None
    assert model._embed_file() is not plan.screen.file  # each matrix its own extent
    ids = torch.tensor([0, 7, table.shape[0] - 1])
    assert torch.equal(model._embedding(ids), F.embedding(ids, table))
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, model.vocab_size, (200,), generator=g).tolist()
    out = run_steps(Engine(model, window=512, prefix_chunk=64).generate_steps(
        prompt, SamplingParams(max_tokens=24)))
    assert len(out.token_ids) == 24
    for t in (table, head):
        mapped, pages = _mapped_pages(t)
        assert mapped * 100 < pages, (mapped, pages)
