"""The BLAS behind the modules' projections, run on manyheads' own threads.

Large projections (more than a few rows) are cut into tiles whose layout
depends on the shape alone; each tile is one single-threaded ``sgemm``/``dgemm``
call made from one of manyheads' OpenMP threads, as scikit-learn's GIL-free
reductions do.  The BLAS is SciPy's: the OpenBLAS its wheels ship, opened
directly (the library ``scipy.linalg.cython_blas`` calls, without importing
``scipy.linalg``, whose modules take some 25 MiB of a process that decodes a
small model), or else the function pointers ``scipy.linalg.cython_blas``
publishes for Cython; nothing is linked at build time.  While such a call runs,
SciPy's BLAS is held at one thread (reference-counted across concurrent calls),
so its own pool never wakes up and every tile runs the same single-threaded
kernel: results are the same bits for any thread count and any number of
concurrent callers.  NumPy's own BLAS is not used inside a module call at all.

Without SciPy the projections fall back to NumPy's matmul on the calling
thread (NumPy's BLAS pool then does the work; correct, but not one pool).
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from . import _kernels

_lock = threading.Lock()
_state: dict[str, Any] = {"loaded": False, "controller": None, "holders": 0, "saved": None,
                          "info": None}


def _capsule_address(capsule: Any) -> int:
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address = get_pointer(capsule, get_name(capsule))
    if not address:
        raise RuntimeError("empty capsule")
    return int(address)


def _wheel_openblas() -> tuple[int, int, str, str] | None:
    """(sgemm, dgemm, library path, SciPy's folder) of the OpenBLAS a SciPy wheel ships
    beside its package (``scipy.libs``, ``scipy/.dylibs``), opened without importing
    SciPy: its 32-bit-integer Fortran gemm, with the wheel's symbol prefix or none.
    None when SciPy is missing or built otherwise (a system BLAS)."""
    spec = importlib.util.find_spec("scipy")  # a top-level name: nothing is imported
    if spec is None or not spec.submodule_search_locations:
        return None
    scipy_dir = os.path.realpath(list(spec.submodule_search_locations)[0])
    found = sorted(glob.glob(os.path.join(scipy_dir + ".libs", "libscipy_openblas*"))
                   + glob.glob(os.path.join(scipy_dir, ".dylibs", "libscipy_openblas*")))
    for path in found:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_", ""):
            try:
                sgemm, dgemm = getattr(lib, prefix + "sgemm_"), getattr(lib, prefix + "dgemm_")
            except AttributeError:
                continue
            return (int(ctypes.cast(sgemm, ctypes.c_void_p).value or 0),
                    int(ctypes.cast(dgemm, ctypes.c_void_p).value or 0), path, scipy_dir)
    return None


def _load() -> None:
    """Find SciPy's gemm functions and its BLAS library's thread control (once)."""
    if _state["loaded"]:
        return
    with _lock:
        if _state["loaded"]:
            return
        try:
            direct = _wheel_openblas()
            if direct is not None and direct[0] and direct[1]:
                _kernels.set_blas(direct[0], direct[1])
                scipy_dir, how = direct[3], "SciPy's OpenBLAS, opened directly"
            else:
                from scipy.linalg import cython_blas  # type: ignore[import-untyped]

                capi = cython_blas.__pyx_capi__
                sgemm = _capsule_address(capi["sgemm"])
                _kernels.set_blas(sgemm, _capsule_address(capi["dgemm"]))
                scipy_dir = os.path.dirname(os.path.dirname(os.path.realpath(
                    cython_blas.__file__)))
                how = "scipy.linalg.cython_blas"
        except Exception as exc:  # SciPy missing or without the Cython BLAS API
            _state["info"] = f"none usable ({type(exc).__name__}: {exc}); NumPy matmul instead"
        else:
            _state["controller"], _state["info"] = _blas_controller(scipy_dir, how)
        _state["loaded"] = True


def _blas_controller(scipy_dir: str, how: str) -> tuple[Any, str]:
    """threadpoolctl's handle on SciPy's BLAS library (reached as ``how``), and a
    description of it.  Wheels keep that library inside SciPy's tree (``scipy.libs``,
    ``scipy/.dylibs``); with one BLAS in the whole process, that one is it."""
    try:
        # threadpoolctl ships no type information (no py.typed, no stubs)
        from threadpoolctl import ThreadpoolController  # type: ignore[import-untyped]

        blas = ThreadpoolController().select(user_api="blas").lib_controllers
    except Exception:
        blas = []
    inside = [c for c in blas if os.path.realpath(c.filepath).startswith((scipy_dir + os.sep,
                                                                           scipy_dir + ".libs"))]
    lib = inside[0] if inside else (blas[0] if len(blas) == 1 else None)
    if lib is None:
        return None, f"{how} (its library's thread count is not controlled)"
    return _ThreadCount(lib), f"{how}: {lib.internal_api} {lib.version} ({lib.filepath})"


class _ThreadCount:
    """Get and set one BLAS library's thread count from any thread.

    threadpoolctl lets only one thread (the first that set it) change OpenBLAS's
    count and silently ignores the others; manyheads' calls come from any thread
    and serialise their changes themselves, so OpenBLAS is driven directly.
    """

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.get, self.set = lib.get_num_threads, lib.set_num_threads
        if lib.internal_api == "openblas":
            for prefix in ("", "scipy_"):
                for suffix in ("", "64_"):
                    get = getattr(lib.dynlib, f"{prefix}openblas_get_num_threads{suffix}", None)
                    set_ = getattr(lib.dynlib, f"{prefix}openblas_set_num_threads{suffix}", None)
                    if get is not None and set_ is not None:
                        get.restype = ctypes.c_int
                        set_.argtypes = [ctypes.c_int]
                        self.get, self.set = get, set_
                        return


def available() -> bool:
    """True when projection tiles can run on manyheads' threads."""
    _load()
    return bool(_kernels.has_blas())


def describe() -> str:
    _load()
    return str(_state["info"])


@contextmanager
def single_threaded() -> Iterator[None]:
    """Hold SciPy's BLAS at one thread while any manyheads projection is running."""
    _load()
    lib = _state["controller"]
    if lib is None:
        yield
        return
    with _lock:
        if _state["holders"] == 0:
            _state["saved"] = lib.get()
            if _state["saved"] != 1:
                lib.set(1)
        _state["holders"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["holders"] -= 1
            if _state["holders"] == 0 and _state["saved"] not in (None, 1):
                lib.set(_state["saved"])


def reset_after_fork() -> None:
    """In a forked child no other thread holds the BLAS: forget the parent's holders."""
    global _lock
    _lock = threading.Lock()
    if _state["holders"]:
        _state["holders"] = 0
        lib = _state["controller"]
        if lib is not None and _state["saved"] not in (None, 1):
            lib.set(_state["saved"])
