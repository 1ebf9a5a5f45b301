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


def one_openmp_thread_here() -> bool:
    """On a thread that is not the torch thread and calls native code that uses OpenMP (the
    suffix store's sort): its parallel regions run on this thread alone, so the torch thread's
    team stays the process's only one. Any second thread that opened regions with more threads
    slowed the torch thread's prefill for good (on `tiny`, 1k tokens: 75 ms to 170 ms, pydivsufsort
    too, whose regions reach torch's runtime). Sets this thread's own OpenMP setting (an ICV)
    in the runtime torch loaded; False where there is none to find."""
    import ctypes
    import os

    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if not os.path.exists(path):
        return False
    # torch sets a thread's OpenMP threads to its own count on the thread's first parallel
    # op (at::internal::lazy_init_num_threads), which would undo the setting below: that
    # first initialisation runs here, before it
    torch.get_num_threads()
    try:
        ctypes.CDLL(path).omp_set_num_threads(1)
    except (OSError, AttributeError):
        return False
    return True
