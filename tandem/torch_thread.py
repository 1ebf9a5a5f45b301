"""The thread a server process runs its torch work on: the model's load, then the engine's.

GNU OpenMP (torch's intra-op backend on Linux) keeps a fast team of worker threads for the
first thread that opens a parallel region; every other thread's regions each pay about 65 us to
wake (or make) theirs. On `tiny` a 1k-token prefill that took 70 ms on the first thread took
170 ms on a second one, the batched triangular solve of the delta rule ten times slower
(MKL's nested calls). `tandem serve` therefore loads the model on this thread before anything
else touches torch and hands the same thread to the engine actor as its executor.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def torch_thread() -> ThreadPoolExecutor:
    """The process's one torch thread (a single-worker executor, made on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="tandem-torch")
        return _executor
