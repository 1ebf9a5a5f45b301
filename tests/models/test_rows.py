"""Rows backed as they are written and given back (issue 14, part 5): a new state backs none of
its window, a prefill backs the rows it writes, ``release_rows`` returns the pages above a row
to the OS (the process's RssAnon falls), and the state serves after it bit for bit as before.
The grid gate is torch.equal of the logits and the greedy tokens against a cold engine's."""

import math

import pytest
import torch

from small_hybrid import make_small_hybrid
from tandem.engine import Engine
from tandem.models.base import ModelState, View
from tandem.models.hybrid import HybridModel
from tandem.models.rows import release_rows, resident_nbytes
from tandem.models.third import ThirdModel

MiB = 1 << 20
BIG = 1 << 21  # rows: K and V of the small hybrid are 128 MiB each at this window


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> HybridModel:
    return HybridModel.load(make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 240_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(engine: Engine, logits: torch.Tensor, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = int(torch.argmax(logits))
        out.append(token)
        logits = engine.decode(token)
    return out


def view_resident(state: ModelState) -> int:
    return sum(resident_nbytes(v.tensor) for v in state.views.values())


@pytest.mark.parametrize("kind", ["hybrid", "third"])
def test_a_new_state_backs_none_of_its_window_rows(hybrid, kind):
    model = hybrid if kind == "hybrid" else ThirdModel()
    before = rss_anon()
    state = model.new_state(BIG)
    window_nbytes = sum(v.tensor.numel() * v.tensor.element_size() for v in state.views.values())
    assert window_nbytes >= 128 * MiB
    # The zeros of the old new_state touched every page: the window's bytes whole.
    assert view_resident(state) < MiB
    assert rss_anon() - before < 8 * MiB


def test_a_prefill_backs_only_the_pages_of_the_rows_it_writes(hybrid):
    engine = Engine(hybrid, window=BIG, prefix_chunk=256)
    engine.prefill(prompt(600, 1))
    written = engine.cost().row_nbytes * 600
    # Each plane (an index of the axes before the token axis) is a run of rows of its own,
    # whose first and last pages it may share with its neighbours.
    planes = sum(math.prod(v.tensor.shape[:v.token_axis]) for v in engine.state.views.values())
    assert 0 < view_resident(engine.state) <= written + 2 * planes * 4096


def test_release_rows_gives_the_pages_above_a_row_back_and_rss_falls(hybrid):
    state = hybrid.new_state(BIG)
    for view in state.views.values():
        view.rows(0, BIG).fill_(1.0)  # every row written, as a long conversation leaves them
    held = rss_anon()
    assert view_resident(state) >= 250 * MiB
    released = release_rows(state, 1000)
    assert released.skipped == {}
    assert released.nbytes >= 250 * MiB
    assert held - rss_anon() >= 240 * MiB  # the OS has the pages back
    assert view_resident(state) < MiB
    for view in state.views.values():  # the rows under 1,000 are untouched
        assert torch.equal(view.rows(0, 1000), torch.ones_like(view.rows(0, 1000)))


def test_a_state_serves_bit_for_bit_after_its_rows_are_released(hybrid):
    """A long conversation leaves (rows released from 0), another comes: its logits and greedy
    tokens are a fresh engine's; then a release at a grid line and a resume there replays the
    cold prefill's logits bit for bit (the rows under the line kept)."""
    engine = Engine(hybrid, window=BIG, prefix_chunk=256)
    greedy(engine, engine.prefill(prompt(1500, 2)), 4)
    engine.reset()
    assert release_rows(engine.state, 0).nbytes > 0
    assert view_resident(engine.state) < MiB

    cold = Engine(hybrid, window=4096, prefix_chunk=256)
    p = prompt(700, 3)
    want = cold.prefill(p)
    got = engine.prefill(p)
    assert torch.equal(got, want)
    assert greedy(engine, got, 8) == greedy(cold, want, 8)
    assert view_resident(engine.state) > 0  # written again, backed again

    # A resume at grid line 512 after the rows above it went back.
    engine.reset()
    sections: dict[str, torch.Tensor] = {}

    def keep(end: int) -> None:
        if end == 512:
            sections.update({k: t.clone() for k, t in engine.state.sections.items()})

    engine.prefill(p, on_chunk=keep)
    release_rows(engine.state, 512)
    for name, t in sections.items():
        engine.state.sections[name].copy_(t)
    engine.resume_at(512)
    assert torch.equal(engine.prefill(p), want)


def test_a_view_that_is_not_contiguous_is_kept_and_the_release_says_why():
    t = torch.empty(4, 2, 1024, 8)
    state = ModelState(sections={}, views={"K": View(t.transpose(0, 1), 2)})
    released = release_rows(state, 0)
    assert released.nbytes == 0
    assert "contiguous" in released.skipped["K"]
