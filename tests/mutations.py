"""Broken restores, to show that the cache tests notice them (issue 12, part 7).

Every restore a cache makes goes through ``SectionsCopy.restore``, ``RowsCopy.restore`` or
``keep.swap_rows`` (the park's in-place exchange). Each mutation replaces those with a restore
that loses one part of the state:

- ``skip_sections``: the recurrent sections are not written back (the conv tails are);
- ``skip_conv``: the conv tails are not written back (the recurrent sections are);
- ``skip_rows``: no view rows are written back or swapped;
- ``scale``: every section is written back times 1.001.

A mutated restore notes whether it left the state other than the true restore would have
(``hits``): a restore of a copy equal to what is already in place changes nothing under any
mutation, so a test that survives without a hit restored nothing a mutation could break.

As a pytest plugin (``-p mutations`` with ``TANDEM_MUTATION=<name>``) it mutates a whole run and
writes each test's outcome and hit to ``TANDEM_MUTATION_REPORT`` (JSON); scripts/mutation_check.py
drives it. ``apply(name, monkeypatch)`` mutates one in-process test (tests/cache/test_mutations.py).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import torch

from tandem.cache import copies, keep, store

# The short-memory sections of each test architecture: the last inputs of a causal conv.
CONV_TAILS = frozenset({"gdn.conv", "tail.x"})
SCALE = 1.001
NAMES = ("skip_sections", "skip_conv", "skip_rows", "scale")


class _Hits:
    count = 0


hits = _Hits()


def _written(name: str, held: torch.Tensor, live: torch.Tensor, mutation: str) -> torch.Tensor:
    """What the mutated restore writes into ``live`` for section ``name``."""
    if mutation == "skip_sections" and name not in CONV_TAILS:
        return live.clone()
    if mutation == "skip_conv" and name in CONV_TAILS:
        return live.clone()
    if mutation == "scale":
        return held * SCALE
    return held


def _sections_restore(mutation: str):
    def restore(self, state):
        for name, t in state.sections.items():
            held = self.tensors[name]
            out = _written(name, held, t, mutation)
            if not torch.equal(out, held):
                hits.count += 1
            t.copy_(out)
    return restore


def _rows_restore(self, state, start=None, stop=None):
    start = self.start if start is None else start
    stop = self.stop if stop is None else stop
    if not self.start <= start <= stop <= self.stop:
        raise ValueError(f"rows [{start}, {stop}) outside the copy [{self.start}, {self.stop})")
    for name, v in state.views.items():
        src = self.tensors[name].narrow(v.token_axis, start - self.start, stop - start)
        if not torch.equal(v.rows(start, stop), src):
            hits.count += 1  # rows left as they were, where the copy's differ


def _swap_rows(state, buffer, start, stop):
    for name, view in state.views.items():
        held = buffer.tensors[name].narrow(view.token_axis, start - buffer.start, stop - start)
        if not torch.equal(view.rows(start, stop), held):
            hits.count += 1


def _replacements(mutation: str) -> dict:
    if mutation not in NAMES:
        raise ValueError(f"unknown mutation {mutation!r}; one of {NAMES}")
    out = {}
    if mutation in ("skip_sections", "skip_conv", "scale"):
        out[(copies.SectionsCopy, "restore")] = _sections_restore(mutation)
    if mutation == "skip_rows":
        out[(copies.RowsCopy, "restore")] = _rows_restore
        out[(keep, "swap_rows")] = _swap_rows  # the park's exchange (keep.make_park)
    return out


def apply(mutation: str, monkeypatch) -> None:
    """Mutate the restores for one test (undone with the monkeypatch)."""
    hits.count = 0
    for (owner, attr), fn in _replacements(mutation).items():
        monkeypatch.setattr(owner, attr, fn)


@contextmanager
def mutated(mutation: str):
    saved = {key: getattr(*key) for key in _replacements(mutation)}
    try:
        for (owner, attr), fn in _replacements(mutation).items():
            setattr(owner, attr, fn)
        yield
    finally:
        for (owner, attr), fn in saved.items():
            setattr(owner, attr, fn)


# -- the pytest plugin (whole runs) ---------------------------------------------------------

_report: dict[str, dict] = {}
_undo = None


def pytest_configure(config):
    global _undo
    mutation = os.environ.get("TANDEM_MUTATION")
    if mutation and mutation != "none":
        _undo = mutated(mutation)
        _undo.__enter__()
    # store is imported so that its module-level names (SectionsCopy, RowsCopy) are the classes
    # patched above, not copies of them.
    assert store.SectionsCopy is copies.SectionsCopy


def pytest_runtest_setup(item):
    hits.count = 0


def pytest_runtest_logreport(report):
    entry = _report.setdefault(report.nodeid, {"outcome": "passed", "hit": False})
    if report.failed:
        entry["outcome"] = "failed"
    elif report.skipped and report.when != "teardown":
        entry["outcome"] = "skipped"
    if report.when == "call":
        entry["hit"] = hits.count > 0


def pytest_unconfigure(config):
    if _undo is not None:
        _undo.__exit__(None, None, None)
    path = os.environ.get("TANDEM_MUTATION_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_report, f, indent=1, sort_keys=True)
