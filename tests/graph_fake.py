"""A CUDA graph on a CPU, for the graphs' tests (tandem/models/graphs.py): what a capture records
is the step's ATen ops on the tensors it ran them on, and a replay runs those ops again on the
same tensors, their outputs written back where the capture left them. So a replay, as a CUDA
graph's, reads and writes the memory the capture saw, with every Python value of the capture
(an int, a shape, a list the step read) frozen in it: a step that reads a position from the host
replays the captured position, and its replays then differ from its eager steps.

A capture also refuses what a CUDA capture cannot hold: a host sync (``.item()``, ``int(t)``,
``bool(t)``, nonzero) and an array made from host data (``torch.tensor([...])``), which on a
device is a pageable copy the graph would replay with the captured bytes (a 0-dim one is a
scalar, which a kernel takes as an argument).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
         torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
HOST_DATA = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class NotCapturable(RuntimeError):
    """The step did what a CUDA capture cannot hold."""


def _kind(func, args: tuple, kwargs: dict, out: Any) -> str:
    """mutate: writes an argument (run again on replay); view: its outputs alias an input
    (nothing to run: they still alias what the replay rewrites); pure: new tensors (run again,
    copied back). An op that may alias (``to``, ``contiguous``) is a view only when it did."""
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "mutate"
    if any(r.alias_info is not None for r in schema.returns):
        bases = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor)}
        if all(t.untyped_storage().data_ptr() in bases for t in tree_flatten(out)[0]
               if isinstance(t, torch.Tensor)):
            return "view"
    return "pure"


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCS:
            raise NotCapturable(f"{func} in a captured step: a host sync")
        if func in HOST_DATA and args[0].dim() > 0:
            # a 0-dim host tensor is a scalar a CUDA kernel takes as an argument (a constant,
            # as the graph keeps it); an array would be a copy to the device
            raise NotCapturable(f"{func} in a captured step: a tensor made from host data")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out, _kind(func, args, kwargs, out)))
        return out


class RecordedGraph:
    def __init__(self, ops: list) -> None:
        self.ops = ops
        self.replays = 0

    def replay(self) -> None:
        for func, args, kwargs, out, kind in self.ops:
            if kind == "view":
                continue
            got = func(*args, **kwargs)
            if kind == "mutate":
                continue
            for rec, new in zip(tree_flatten(out)[0], tree_flatten(got)[0]):
                if isinstance(rec, torch.Tensor) and not (
                        rec.data_ptr() == new.data_ptr() and rec.stride() == new.stride()):
                    rec.copy_(new)
        self.replays += 1


class RecordedGraphs:
    """StepGraphs' backend on a CPU: ``on_capture(phase)`` sees "start" and "end" of each
    capture (a test holds it there, or logs who held the capture lock)."""

    device_type = "cpu"

    def __init__(self, on_capture: Callable[[str], None] | None = None) -> None:
        self.on_capture = on_capture
        self.graphs: list[RecordedGraph] = []
        self.threads: set[int] = set()

    def capture(self, step: Callable[[], Any]) -> tuple[RecordedGraph, Any, Any]:
        from tandem.models.graphs import _copied

        self.threads.add(threading.get_ident())
        if self.on_capture is not None:
            self.on_capture("start")
        try:
            with _Recorder() as recorder:
                static = step()  # a CPU runs what it records: the step's own run
        finally:
            if self.on_capture is not None:
                self.on_capture("end")
        graph = RecordedGraph(recorder.ops)
        self.graphs.append(graph)
        return graph, _copied(static), static
