"""Process-wide settings: the kernel path (ISA) and the thread count.

The kernel path is chosen once, at import, from the CPU's features; the
environment variable ``MANYHEADS_ISA=<name>`` forces one (the names: ``isa_names()``,
from ``csrc/mh_isa_list.h``).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Literal, TypedDict, overload

from . import _blas, _kernels
from ._platform import library_of
from ._validate import check_int
from ._version import __version__


def isa_names() -> tuple[str, ...]:
    """Every kernel path manyheads knows, best first (from the C dispatcher)."""
    names: tuple[str, ...] = _kernels.isa_names()
    return names



class _State(TypedDict):
    num_threads: int | None
    isa: str | None
    isa_forced: bool
    forked: bool


_state: _State = {"num_threads": None, "isa": None, "isa_forced": False, "forked": False}


def _choose_isa() -> str:
    forced = os.environ.get("MANYHEADS_ISA", "").strip().lower()
    if forced:
        if forced not in isa_names():
            raise ImportError(
                f"MANYHEADS_ISA={forced!r} is not a kernel path; expected one of "
                f"{', '.join(isa_names())}"
            )
        if not _kernels.isa_compiled(forced):
            raise ImportError(f"MANYHEADS_ISA={forced!r}: this build has no {forced} kernels")
        if not _kernels.cpu_supports(forced):
            raise ImportError(f"MANYHEADS_ISA={forced!r}: this CPU does not support {forced}")
        _state["isa_forced"] = True
        return forced
    return runnable_isas()[0]


def runnable_isas() -> list[str]:
    """Kernel paths compiled in that this CPU can run, best first."""
    return [n for n in isa_names() if _kernels.isa_compiled(n) and _kernels.cpu_supports(n)]


def _init() -> None:
    isa = _choose_isa()
    _kernels.set_isa(isa)
    _state["isa"] = isa


def kernel_isa() -> str:
    """Name of the kernel path in use, one of ``isa_names()`` (``"avx512bf16"`` is
    AVX-512 plus AVX512-BF16's pair products for bfloat16 inputs and AVX512-VNNI's
    integer dot products for int4 keys)."""
    return str(_state["isa"])


def set_num_threads(n: int | None) -> None:
    """Set the number of threads the kernels use; ``None`` restores the default.

    The default is OpenMP's own (``OMP_NUM_THREADS`` or the number of cores, and
    whatever limit threadpoolctl has put on the OpenMP runtime).
    """
    _state["num_threads"] = None if n is None else min(check_num_threads(n, "n"),
                                                       max_threads())
    _sync_threads()


_OPENMP = bool(_kernels.openmp_enabled())


def _sync_threads() -> None:
    """Hand the thread settings to the kernels' module, which resolves each call's."""
    _kernels.set_thread_settings(_state["num_threads"] or 0,
                                 not _OPENMP or _state["forked"], _MAX_THREADS)


def get_num_threads() -> int:
    """Number of threads the next kernel call will use.

    1 in a build without OpenMP, and in a process forked from one that had
    loaded manyheads (its OpenMP runtime's threads did not survive the fork).
    """
    n: int = _kernels.default_threads()
    return n


def check_num_threads(n: object, name: str = "num_threads") -> int:
    return check_int(n, name, 1)


_CPUS = os.cpu_count() or 1


_MAX_THREADS = 4 * _CPUS


def cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return _CPUS


def max_threads() -> int:
    """Cap on any thread request: 4 per core (beyond that threads only cost)."""
    return _MAX_THREADS


_sync_threads()


def resolve_num_threads(n: object) -> int:
    """The threads of a call given its ``num_threads`` (None: the default)."""
    t: int = _kernels.call_threads(n) or _kernels.call_threads(check_num_threads(n))
    return t


def _after_fork_in_child() -> None:
    """A forked child has one thread: the parent's OpenMP (and BLAS) pool threads are
    gone, and GNU OpenMP would wait for them forever.  Run serially from now on."""
    _state["forked"] = True
    _kernels.after_fork_in_child()
    _sync_threads()
    _blas.reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def openmp_library() -> str | None:
    """Path of the OpenMP runtime library this extension's OpenMP calls go to.

    With PyTorch imported first, for example, a build that links the system's
    libgomp shares torch's copy.  None without OpenMP or when the platform
    cannot tell.
    """
    return library_of(_kernels.openmp_entry_address())


# the rule that shares the thread budget among concurrent calls lives with the schedule
threads_for_call = _kernels.threads_for_call


def config() -> dict[str, Any]:
    """The build and run-time configuration as a dict (what ``show_config`` prints)."""
    import numpy as np

    return {
        "version": __version__,
        "kernel_isa": kernel_isa(),
        "isa_forced_by_env": bool(_state["isa_forced"]),
        "isa_compiled": [n for n in isa_names() if _kernels.isa_compiled(n)],
        "isa_supported_by_cpu": runnable_isas(),
        "openmp": bool(_kernels.openmp_enabled()),
        "openmp_version": int(_kernels.openmp_version()),
        "openmp_library": openmp_library(),
        "forked_child": bool(_state["forked"]),
        "blas": _blas.describe(),
        "num_threads": get_num_threads(),
        "num_threads_set": _state["num_threads"],
        "block_q": int(_kernels.BLOCK_Q),
        "block_k": int(_kernels.BLOCK_K),
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }


_SHOW_MODES = ("stdout", "dicts")


@overload
def show_config(mode: Literal["stdout"] = ...) -> None: ...


@overload
def show_config(mode: Literal["dicts"]) -> dict[str, Any]: ...


def show_config(mode: str = "stdout") -> dict[str, Any] | None:
    """Print, or return, the build and run-time configuration: kernel path, OpenMP, threads.

    Parameters
    ----------
    mode : {"stdout", "dicts"}
        ``"stdout"`` (default) prints a readable summary and returns None;
        ``"dicts"`` prints nothing and returns the configuration as a dict, as
        ``numpy.show_config(mode="dicts")`` does.

    Returns
    -------
    dict or None
        With ``mode="dicts"``, a new dict of plain values: ``version``,
        ``kernel_isa`` (the path in use), ``isa_forced_by_env`` (chosen by
        ``MANYHEADS_ISA``), ``isa_compiled`` and ``isa_supported_by_cpu``
        (lists of path names, best first), ``openmp`` (bool),
        ``openmp_version`` (the ``_OPENMP`` date, 0 without OpenMP),
        ``openmp_library`` (path or None), ``forked_child`` (bool),
        ``blas`` (the projections' BLAS), ``num_threads`` (what the next
        call will use), ``num_threads_set`` (the count given to
        :func:`set_num_threads`, None while the default applies),
        ``block_q`` and ``block_k`` (the kernels' query and key block
        rows), ``numpy`` and ``python`` (versions).
    """
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, one of {', '.join(map(repr, _SHOW_MODES))}; "
                        f"got {type(mode).__name__}")
    if mode not in _SHOW_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, _SHOW_MODES))}, "
                         f"got {mode!r}")
    c = config()
    if mode == "dicts":
        return c
    omp = (
        f"yes (OpenMP {c['openmp_version']})"
        if c["openmp"]
        else "no (this build runs single-threaded)"
    )
    forced = " (forced by MANYHEADS_ISA)" if c["isa_forced_by_env"] else ""
    lines = [
        f"manyheads {c['version']}",
        f"  kernel path      : {c['kernel_isa']}{forced}",
        f"  compiled paths   : {', '.join(c['isa_compiled'])}",
        f"  CPU can run      : {', '.join(c['isa_supported_by_cpu'])}",
        f"  OpenMP           : {omp}",
        f"  OpenMP runtime   : {c['openmp_library'] or '-'}",
        f"  threads          : {c['num_threads']}"
        + (" (a forked child runs serially)" if c["forked_child"] else ""),
        f"  projection BLAS  : {c['blas']}",
        f"  block (q x k)    : {c['block_q']} x {c['block_k']}",
        f"  numpy            : {c['numpy']}",
        f"  python           : {c['python']}",
    ]
    print("\n".join(lines))
    return None
