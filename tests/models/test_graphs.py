"""CUDA graphs of the decode step and of verify blocks (issue 20, part 3; tandem/models/graphs.py).

On a CPU, through the recorded graph of tests/graph_fake.py (a replay runs the captured ops again
on the captured tensors, every host value of the capture frozen in it): a replay gives the bits
of the static step run eagerly, for decodes at B = 1, 2, 4 and verify blocks among them, every
sequence's logits, recurrent state, conv tails and K/V rows (the gate: torch.equal); the static
step's greedy tokens are the dynamic step's; the graphs are keyed per shape (batch, block
lengths, span, memory); the knob. On a GPU (skipped here): the same replays against eager
static steps with torch.cuda.CUDAGraph, bit for bit."""

from __future__ import annotations

import pytest
import torch

from graph_fake import NotCapturable, RecordedGraphs
from small_hybrid import make_small_hybrid
from tandem.config import ConfigError, load_config
from tandem.engine import DecodeStep, Engine, VerifyStep, decode_batch
from tandem.models import graphs as graphs_mod
from tandem.models.base import ModelError
from tandem.models.graphs import CudaGraphs, StepGraphs, engine_graphs, graphs_wanted, span
from tandem.models.hybrid import HybridModel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
WINDOW = 600


# The recorded graph sees torch's ops alone: decode's native CPU kernels bypass torch's
# dispatch, so these tests run torch's matmuls (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("torch_matmuls")


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False)


@pytest.fixture
def small(small_dir) -> HybridModel:
    return HybridModel.load(small_dir, dtype=torch.float32)


def _declining(backend) -> StepGraphs:
    """The static step, always eager: a gate that declines every capture."""
    graphs = StepGraphs(backend)
    graphs.gate = lambda capture: None
    return graphs


def _script(model, graphs, batch: int, device="cpu", steps: int = 10):
    """``batch`` sequences (prompts across the 256 span line) decoded ``steps`` times together,
    then verify blocks beside a decode, accepted at several lengths, then decodes alone: every
    step's logits and every sequence's state at the end."""
    model.graphs = graphs
    engines = [Engine(model, window=WINDOW, prefix_chunk=64) for _ in range(batch)]
    for i, e in enumerate(engines):
        e.prefill(list(range(10 + 7 * i, 250 + 3 * i)))
    out = []
    for t in range(steps):
        out += decode_batch([DecodeStep(e, 100 + t + j) for j, e in enumerate(engines)])
    for accept in (1, 2, 0, 0):
        block = [VerifyStep(engines[0], (5, 6, 7))]
        out += decode_batch(block + [DecodeStep(e, 9) for e in engines[1:]])
        engines[0].accept(accept)
    for token in (3, 4, 5):
        out.append(engines[-1].decode(token))
    for e in engines:
        e.settle()
    if graphs is not None:
        graphs.check_invariants()
    model.graphs = None
    return [t.cpu() for t in out], engines


def _same_state(a: Engine, b: Engine) -> None:
    assert a.token_ids == b.token_ids
    for name in a.state.sections:
        assert torch.equal(a.state.sections[name], b.state.sections[name]), name
    for name in a.state.views:
        assert torch.equal(a.state.views[name].rows(0, a.length),
                           b.state.views[name].rows(0, b.length)), name


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_a_replay_gives_the_bits_of_the_eager_static_step(small, batch):
    graphs = StepGraphs(RecordedGraphs())
    replayed, a = _script(small, graphs, batch)
    eager, b = _script(small, _declining(RecordedGraphs()), batch)
    counts = graphs.statistics()
    assert counts["captures"] >= 3 and counts["replays"] >= 6  # decode, verify, alone
    assert len(replayed) == len(eager)
    for i, (x, y) in enumerate(zip(replayed, eager)):
        assert torch.equal(x, y), i
    for ea, eb in zip(a, b):
        _same_state(ea, eb)


def test_the_static_step_gives_the_dynamic_steps_greedy_tokens(small):
    static, _ = _script(small, StepGraphs(RecordedGraphs()), 2)
    dynamic, _ = _script(small, None, 2)
    for x, y in zip(static, dynamic):
        assert torch.equal(x.argmax(-1), y.argmax(-1))
        assert torch.allclose(x, y, atol=1e-4, rtol=1e-4)


def test_a_cpu_step_with_no_graphs_is_the_dynamic_one_unchanged(small):
    # graphs None (every CPU): forward_batch never reaches the static step
    small.graphs = None
    engines = [Engine(small, window=WINDOW, prefix_chunk=64) for _ in range(2)]
    for e in engines:
        e.prefill(list(range(40)))
    calls = []
    original = graphs_mod.StepGraphs.decode
    try:
        graphs_mod.StepGraphs.decode = lambda *a, **k: calls.append(a)
        decode_batch([DecodeStep(e, 7) for e in engines])
    finally:
        graphs_mod.StepGraphs.decode = original
    assert calls == []


def test_graphs_are_keyed_per_batch_block_span_and_memory(small):
    graphs = StepGraphs(RecordedGraphs())
    small.graphs = graphs
    one, two = (Engine(small, window=WINDOW, prefix_chunk=64) for _ in range(2))
    one.prefill(list(range(250)))
    two.prefill(list(range(100)))
    for token in range(3):  # positions 250..252: one shape, eager, captured, replayed
        one.decode(token)
    assert graphs.counts == dict(graphs.counts, eager=1, captures=1, replays=1)
    assert len(graphs.entries) == 1
    decode_batch([DecodeStep(one, 1), DecodeStep(two, 2)])  # B = 2: another shape
    decode_batch([DecodeStep(two, 2), DecodeStep(one, 1)])  # the other order: another
    two.decode(3)  # B = 1 on other memory: another
    assert len(graphs.entries) == 4
    while one.length < 256:
        one.decode(4)
    one.decode(5)  # position 256 reads 512 keys: another span
    keys = list(graphs.entries)
    assert {k.spans for k in keys} >= {(256,), (512,), (256, 256)}
    assert len({k.memory for k in keys if k.blocks == (1,)}) == 2
    decode_batch([VerifyStep(one, (1, 2, 3)), DecodeStep(two, 6)])
    assert list(graphs.entries)[-1].blocks == (3, 1)
    assert list(graphs.entries)[-1].verify == (True, False)
    small.graphs = None


def test_the_least_recently_used_shape_goes_past_max_graphs(small):
    graphs = StepGraphs(RecordedGraphs(), max_graphs=2)
    small.graphs = graphs
    engines = [Engine(small, window=WINDOW, prefix_chunk=64) for _ in range(3)]
    for e in engines:
        e.prefill(list(range(30)))
    for e in engines:
        e.decode(1)
    assert len(graphs.entries) == 2 and graphs.counts["evicted"] == 1
    assert [k.memory for k in graphs.entries] == [
        (graphs_mod._memory(e.state),) for e in engines[1:]]
    small.graphs = None


def test_a_longer_block_grows_the_sequences_arena_and_drops_the_shapes_that_wrote_the_old(small):
    graphs = StepGraphs(RecordedGraphs())
    small.graphs = graphs
    e = Engine(small, window=WINDOW, prefix_chunk=64)
    e.prefill(list(range(30)))
    for _ in range(2):
        e.verify((1, 2))
        e.accept(0)
    assert graphs.statistics()["graphs"] == 1 and graphs.statistics()["arenas"] == 1
    e.verify((1, 2, 3, 4))  # its arena grows: the two-row shape's graph wrote the old one
    assert [k.blocks for k in graphs.entries] == [(4,)] and graphs.counts["evicted"] == 1
    small.graphs = None


def test_a_graph_never_writes_an_arena_let_go(small):
    """More verify blocks in a batch than arenas kept: each step lets one go and makes it
    again elsewhere; the graphs of the old addresses are never replayed on the new ones."""
    def run(graphs):
        small.graphs = graphs
        engines = [Engine(small, window=WINDOW, prefix_chunk=64) for _ in range(2)]
        for i, e in enumerate(engines):
            e.prefill(list(range(20 + i, 60)))
        out = []
        for accept in (0, 1, 0, 2, 0):
            out += decode_batch([VerifyStep(e, (4, 5, 6)) for e in engines])
            graphs.check_invariants()
            for e in engines:
                e.accept(accept)
        for e in engines:
            e.settle()
        small.graphs = None
        return out, engines

    graphs = StepGraphs(RecordedGraphs(), capture_after=1, max_arenas=1)
    got, a = run(graphs)
    want, b = run(_declining(RecordedGraphs()))
    assert graphs.statistics()["arenas"] == 1 and graphs.counts["captures"] >= 2
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    for ea, eb in zip(a, b):
        _same_state(ea, eb)


def test_a_token_id_out_of_range_is_refused_before_any_row_is_written(small):
    small.graphs = StepGraphs(RecordedGraphs())
    e = Engine(small, window=WINDOW, prefix_chunk=64)
    e.prefill(list(range(30)))
    before = {k: t.clone() for k, t in e.state.sections.items()}
    with pytest.raises(ModelError, match="outside the model"):
        e.decode(small.vocab_size)
    with pytest.raises(ModelError, match="outside the model"):
        e.verify((1, -1))
    assert all(torch.equal(before[k], e.state.sections[k]) for k in before)
    small.graphs = None


def test_a_model_with_experts_keeps_its_eager_steps(qwen3_5_moe_dir, qwen3_next_dir, small):
    graphs = StepGraphs(RecordedGraphs())
    assert graphs.takes(small)
    for path in (qwen3_5_moe_dir, qwen3_next_dir):
        assert not graphs.takes(HybridModel.load(path, dtype=torch.float32))
    assert not StepGraphs(CudaGraphs(torch.device("cuda", 0))).takes(small)  # a CPU model


def test_span_is_a_power_of_two_from_the_floor_capped_by_the_window():
    assert [span(p, 4096) for p in (0, 255, 256, 511, 512, 3000)] == [
        256, 256, 512, 512, 1024, 4096]
    assert span(5000, 600) == 600


# -- the fake is a graph: what it captured is frozen ---------------------------------------------

def test_the_recorded_graph_replays_a_host_value_as_it_was_captured():
    # the fake must be able to fail: a step that reads the host at capture replays that value
    backend = RecordedGraphs()
    acc, host = torch.zeros(3), [1.0]
    graph, _, _ = backend.capture(lambda: acc.add_(host[0]))
    host[0] = 5.0
    graph.replay()
    assert acc.tolist() == [2.0, 2.0, 2.0]  # 1 + 1: the captured value, not 5
    with pytest.raises(NotCapturable, match="host sync"):
        backend.capture(lambda: int(acc[0]))
    with pytest.raises(NotCapturable, match="host data"):
        backend.capture(lambda: torch.tensor([1, 2]) + acc[:2])


# -- the knob -------------------------------------------------------------------------------------

def test_cuda_graphs_auto_is_on_with_cuda_and_never_on_a_cpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert [graphs_wanted(m, cpu) for m in ("auto", "off")] == [False, False]
    assert [graphs_wanted(m, gpu) for m in ("auto", "on", "off")] == [True, True, False]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        graphs_wanted("on", cpu)
    assert load_config(env={}).engine.cuda_graphs == "auto"
    config = load_config(env={"TANDEM_CUDA_GRAPHS": "on"})
    with pytest.raises(ConfigError, match=r"needs a CUDA device.*--cuda-graphs.*"
                                          r"TANDEM_CUDA_GRAPHS"):
        engine_graphs(config, cpu)
    with pytest.raises(ConfigError, match="cuda.graphs"):
        load_config(cli_args=["--cuda-graphs", "sometimes"])


def test_a_cpu_load_has_no_graphs_whatever_the_knob(small_dir):
    from tandem.models import load_model

    for mode in ("auto", "off"):
        assert load_model(str(small_dir), small_dir.parent, "auto", "cpu",
                          mode).model.graphs is None


def test_tandem_generate_with_cuda_graphs_on_without_a_gpu_says_so_and_exits_2(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "tandem", "generate", "--home", str(tmp_path),
                          "--cuda-graphs", "on", "--max-tokens", "1"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "needs a CUDA device" in run.stderr and "--cuda-graphs" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "models").exists()  # refused before any model was read


# -- on a GPU -------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_a_cuda_graph_replay_gives_the_bits_of_the_eager_static_step(small_dir, batch, dtype):
    model = HybridModel.load(small_dir, dtype=dtype, device="cuda")
    device = torch.device("cuda", 0)
    graphs = StepGraphs(CudaGraphs(device))
    replayed, a = _script(model, graphs, batch)
    eager, b = _script(model, _declining(CudaGraphs(device)), batch)
    assert graphs.statistics()["captures"] >= 3 and graphs.statistics()["replays"] >= 6
    for i, (x, y) in enumerate(zip(replayed, eager)):
        assert torch.equal(x, y), i
    for ea, eb in zip(a, b):
        _same_state(ea, eb)


@cuda
def test_cuda_graphs_give_the_greedy_tokens_of_the_eager_dynamic_step(small_dir):
    model = HybridModel.load(small_dir, dtype=torch.float32, device="cuda")
    static, _ = _script(model, StepGraphs(CudaGraphs(torch.device("cuda", 0))), 2)
    dynamic, _ = _script(model, None, 2)
    for x, y in zip(static, dynamic):
        assert torch.equal(x.argmax(-1), y.argmax(-1))
        assert torch.allclose(x, y, atol=1e-3, rtol=1e-3)
