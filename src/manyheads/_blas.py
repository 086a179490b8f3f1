"""Projection GEMMs that take turns with the attention kernel's threads.

The modules' projections use NumPy's matmul (BLAS).  A multi-threaded BLAS
such as OpenBLAS keeps its worker threads spinning for a while after each
call; on a small machine they then compete for the cores with the kernel's
OpenMP threads that run next, and the whole layer slows down.  So inside a
module call the BLAS is limited to one thread (threadpoolctl), and a large
projection is split into row chunks that run on ``num_threads`` Python threads
(NumPy releases the GIL in matmul): the same cores do the same work, and no
idle pool spins while the other works.  Without threadpoolctl the projections
fall back to one plain matmul.

Side effect: while a module call runs, BLAS calls made by other threads of
the process are single-threaded too.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

_MIN_ROWS_PER_CHUNK = 32  # below this a split costs more than it saves
_lock = threading.Lock()
_state: dict[str, Any] = {"controller": None, "checked": False, "pool": None, "workers": 0}


def _controller() -> Any:
    if not _state["checked"]:
        with _lock:
            if not _state["checked"]:
                try:
                    # threadpoolctl ships no type information (no py.typed, no stubs)
                    from threadpoolctl import ThreadpoolController  # type: ignore[import-untyped]

                    ctl = ThreadpoolController().select(user_api="blas")
                    _state["controller"] = ctl if len(ctl.lib_controllers) else None
                except Exception:  # threadpoolctl missing or unable to inspect the process
                    _state["controller"] = None
                _state["checked"] = True
    return _state["controller"]


def _pool(workers: int) -> ThreadPoolExecutor:
    with _lock:
        if _state["pool"] is None or _state["workers"] < workers:
            if _state["pool"] is not None:
                _state["pool"].shutdown(wait=False)
            _state["pool"] = ThreadPoolExecutor(max_workers=workers,
                                                thread_name_prefix="manyheads-gemm")
            _state["workers"] = workers
        pool: ThreadPoolExecutor = _state["pool"]
        return pool


@contextmanager
def single_threaded_blas(rows: int | None = None) -> Iterator[bool]:
    """Limit the BLAS to one thread for the duration; yields whether a limit is in force
    (and so whether :func:`matmul` should run row chunks on several threads).

    With ``rows`` below two chunks there is nothing to chunk and BLAS runs such
    small products on one thread anyway, so no limit is set (it costs ~10 us).
    """
    if rows is not None and rows < 2 * _MIN_ROWS_PER_CHUNK:
        yield False
        return
    ctl = _controller()
    if ctl is None:
        yield False
        return
    with ctl.limit(limits=1):
        yield True


def matmul(a: np.ndarray, w: np.ndarray, num_threads: int, chunked: bool) -> np.ndarray:
    """``a @ w`` for a of shape (..., k): row chunks on ``num_threads`` threads when ``chunked``."""
    rows = math.prod(a.shape[:-1])
    chunks = min(num_threads, rows // _MIN_ROWS_PER_CHUNK) if chunked else 1
    if chunks <= 1:
        product: np.ndarray = a @ w
        return product
    a2 = a.reshape(rows, a.shape[-1])
    out = np.empty((rows, w.shape[1]), dtype=np.result_type(a, w))
    bounds = np.linspace(0, rows, chunks + 1).astype(int)
    pool = _pool(chunks - 1)
    futures: list[Future[Any]] = [
        pool.submit(np.matmul, a2[bounds[i]:bounds[i + 1]], w, out=out[bounds[i]:bounds[i + 1]])
        for i in range(1, chunks)
    ]
    np.matmul(a2[: bounds[1]], w, out=out[: bounds[1]])
    for f in futures:
        f.result()
    return out.reshape(a.shape[:-1] + (w.shape[1],))
