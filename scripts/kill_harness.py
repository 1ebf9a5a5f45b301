"""The fork/step/kill harness of scripts/disk_kill_check.py and scripts/spill_kill_check.py:
a child that writes until killed, each of its file-system calls announced on a pipe and held
until the driver says go; the driver that forks it, lets a target's calls pass and kills it
with SIGKILL; the run loop, the summary's frame and the command line both checks share.

The child and the driver share a page: its first bytes are the harness's (``SHM_FREE``: the
child runs without stepping; ``SHM_PHASE``: what the child is doing, set by the check's
``phased`` wrappers; ``SHM_OP``: the index of the call announced last), the rest the check's.
On the pipes: ``o`` a call announced, ``s`` the child started (its start's scan done); ``g`` go
on, ``f`` go on and stop stepping (a drift kill).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

DRIFT_MAX_S = 0.004
MAX_CALLS = 20_000  # a target never reached: killed anyway, counted as "missed"
CHILD_TIMEOUT_S = 30.0
SHM_FREE, SHM_PHASE, SHM_OP = 0, 1, 2  # the harness's bytes of the shared page; a check's follow

# What the child does once stepped, handed the call that tells the driver it started.
Body = Callable[[Callable[[], None]], None]
# Whether a call (the child's phase, the call's name, whether it started) is the target's:
# None kills now (the target's moment passed before the skip ran out).
Hit = Callable[[int, str, bool], bool | None]


class ChildFailed(RuntimeError):
    """The child failed on its own (or was not killed): a failure of the run, not its check."""


@dataclass
class Killed:
    target: str


@dataclass
class Summary:
    runs: int = 0
    kills: int = 0
    targets: Counter = field(default_factory=Counter)
    phases: Counter = field(default_factory=Counter)
    before_call: Counter = field(default_factory=Counter)  # a stepped kill: the call not made
    missed: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def detail_lines(self) -> list[str]:
        """The check's own lines, between the kills' and the failures'."""
        raise NotImplementedError

    def lines(self) -> list[str]:
        return [
            f"runs {self.runs}, kills {self.kills} ({counted(self.targets)}), "
            f"targets missed {self.missed}",
            *self.detail_lines(),
            f"failures {len(self.failures)}",
            *[f"  FAIL {f}" for f in self.failures[:40]],
            f"{self.seconds:.1f} s",
        ]


def counted(c: Counter) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(c.items(), key=lambda kv: -kv[1]))


def phased(shm: mmap.mmap, which: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the child's phase ``which`` while it runs (the one before restored)."""
    def wrapped(*args, **kwargs):
        before = shm[SHM_PHASE]
        shm[SHM_PHASE] = which
        try:
            return fn(*args, **kwargs)
        finally:
            shm[SHM_PHASE] = before
    return wrapped


@dataclass(frozen=True)
class Harness:
    hooked: tuple[str, ...]  # the os calls the child announces
    target_weights: dict[str, int]  # how often each target is drawn
    skip_max: dict[str, int]  # how many of its calls may pass before the kill
    phases: dict[int, str]  # the child's phases, named
    noun: str  # the child, in the failures: "writer", "saver"

    def draw(self, rng: random.Random, target: str | None) -> tuple[str, int]:
        """The target (drawn when None) and how many of its calls pass before the kill."""
        target = target or rng.choices(list(self.target_weights),
                                       list(self.target_weights.values()))[0]
        return target, rng.randint(0, self.skip_max[target])

    def kill(self, root: Path, shm: mmap.mmap, rng: random.Random, summary: Summary,
             target: str, skip: int, hit: Hit, body: Body,
             writer_fault: Callable[[], None] | None) -> None:
        """Fork a child that runs ``body`` stepped, let ``skip`` of the calls ``hit`` names
        pass and kill it before the next (for "drift", a moment after it, running free); the
        kill counted in ``summary``. Raises ``ChildFailed`` when the child failed on its own."""
        ctl_r, ctl_w = os.pipe()
        ann_r, ann_w = os.pipe()
        err_path = root.parent / f"{root.name}.child-error"
        err_path.unlink(missing_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(ctl_w)
            os.close(ann_r)
            self._child(shm, ctl_r, ann_w, err_path, writer_fault, body)
        os.close(ctl_r)
        os.close(ann_w)
        killed_before: str | None = None
        started = False
        try:
            calls = 0
            while True:
                tag = _wait_tag(ann_r)
                if tag == b"s":
                    started = True
                    continue
                calls += 1
                h = hit(shm[SHM_PHASE], self.hooked[shm[SHM_OP]], started)
                if h is None:
                    break
                if h or calls >= MAX_CALLS:
                    if not h:
                        summary.missed += 1
                    if skip == 0 or not h:
                        break
                    skip -= 1
                os.write(ctl_w, b"g")
            if target == "drift":
                os.write(ctl_w, b"f")
                time.sleep(rng.uniform(0.0, DRIFT_MAX_S))
            else:
                killed_before = self.hooked[shm[SHM_OP]]
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        except (TimeoutError, EOFError) as exc:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            detail = err_path.read_text() if err_path.exists() else str(exc)
            raise ChildFailed(f"the {self.noun} failed on its own: {detail}") from None
        finally:
            os.close(ctl_w)
            os.close(ann_r)
        if not os.WIFSIGNALED(status) or os.WTERMSIG(status) != signal.SIGKILL:
            detail = err_path.read_text() if err_path.exists() else f"status {status}"
            raise ChildFailed(f"the {self.noun} was not killed: {detail}")
        summary.kills += 1
        summary.targets[target] += 1
        summary.phases[self.phases[shm[SHM_PHASE]]] += 1
        if killed_before is not None:
            summary.before_call[killed_before] += 1

    def _child(self, shm: mmap.mmap, ctl_r: int, ann_w: int, err_path: Path,
               writer_fault: Callable[[], None] | None, body: Body) -> None:
        """Never returns: runs ``body`` until killed (or exits 3 with its traceback at
        ``err_path``)."""
        try:
            if writer_fault is not None:
                writer_fault()
            torch.set_num_threads(1)  # forked after the parent's threads: stay on this one
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            real = {name: getattr(os, name) for name in self.hooked + ("read",)}
            write, read = real["write"], real["read"]
            ops = {name: i for i, name in enumerate(self.hooked)}
            stepping = threading.Lock()  # a writer's I/O thread steps too: one call at a time

            def step(name: str) -> None:
                if shm[SHM_FREE]:
                    return
                with stepping:
                    shm[SHM_OP] = ops[name]
                    write(ann_w, b"o")
                    if read(ctl_r, 1) == b"f":
                        shm[SHM_FREE] = 1

            def hook(name: str) -> Callable[..., Any]:
                fn = real[name]

                def hooked(*args, **kwargs):
                    if not (name == "write" and args and args[0] == ann_w) and \
                            not (name == "close" and args and args[0] in (ann_w, ctl_r)):
                        step(name)
                    return fn(*args, **kwargs)
                return hooked

            for name in self.hooked:
                setattr(os, name, hook(name))
            body(lambda: write(ann_w, b"s"))
        except BaseException:
            try:
                err_path.write_text(traceback.format_exc())
            finally:
                os._exit(3)


def _wait_tag(fd: int) -> bytes:
    r, _, _ = select.select([fd], [], [], CHILD_TIMEOUT_S)
    if not r:
        raise TimeoutError("the child went quiet")
    tag = os.read(fd, 1)
    if not tag:
        raise EOFError("the child exited")
    return tag


def run_kills(summary: Summary, runs: int, seed: int, kill: Callable[[str | None], Killed],
              check: Callable[[Killed], list[str]], *, targets: list[str] | None = None,
              progress: Callable[[int, Summary], None] | None = None) -> None:
    """``runs`` kills, each followed by its check: ``kill(target)`` (drawn when None, cycled
    from ``targets`` when given); ``check(killed)``, the failures."""
    for run in range(runs):
        target = targets[run % len(targets)] if targets else None
        summary.runs += 1
        try:
            killed = kill(target)
        except ChildFailed as exc:
            summary.failures.append(f"run {run} (seed {seed}): {exc}")
            continue
        for failure in check(killed):
            summary.failures.append(f"run {run} (seed {seed}, {killed.target}): {failure}")
        if progress:
            progress(run, summary)


def load_model(kind: str, scratch: Path):
    if kind == "third":
        from tandem.models.third import ThirdModel
        return ThirdModel()
    from small_hybrid import make_small_hybrid
    from tandem.models.hybrid import HybridModel
    return HybridModel.load(make_small_hybrid(scratch / "small", tokenizer=False))


def main(argv: list[str] | None, doc: str, run_check: Callable[..., Summary], *, what: str,
         prefix: str, folder: str) -> int:
    """A check's command line: ``what`` names the folder in the help, ``prefix`` the scratch
    folder, ``folder`` the one checked inside it."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=["third", "hybrid"], default="third")
    ap.add_argument("--root", type=Path, default=None,
                    help=f"the {what}'s folder (default: a new temporary one, removed after)")
    args = ap.parse_args(argv)
    import logging

    import structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        root = args.root or Path(scratch) / folder
        model = load_model(args.model, Path(scratch))

        def progress(run: int, s: Summary) -> None:
            if (run + 1) % 25 == 0:
                print(f"  {run + 1} runs, {len(s.failures)} failures", flush=True)

        summary = run_check(root, args.runs, args.seed, model, progress=progress)
    print("\n".join(summary.lines()))
    return 1 if summary.failures else 0
