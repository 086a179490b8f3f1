"""Which shared library holds a given code address (for show_config's report)."""
from __future__ import annotations

import ctypes
import os
import sys


def library_of(address: int) -> str | None:
    """Real path of the shared library that contains ``address``, or None if unknown."""
    if not address:
        return None
    if sys.platform == "win32":  # pragma: no cover - Windows only
        return _windows_module_of(address)

    class _DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    for lib in (None, "libdl.so.2"):  # glibc before 2.34 keeps dladdr in libdl
        try:
            dladdr = ctypes.CDLL(lib).dladdr
        except (OSError, AttributeError):
            continue
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        info = _DlInfo()
        if dladdr(ctypes.c_void_p(address), ctypes.byref(info)) and info.dli_fname:
            path: str = os.path.realpath(info.dli_fname.decode())
            return path
    return None


def _windows_module_of(address: int) -> str | None:  # pragma: no cover - Windows only
    from ctypes import wintypes

    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    handle = wintypes.HMODULE()
    # GET_MODULE_HANDLE_EX_FLAG_FROM_ADDRESS | ..._UNCHANGED_REFCOUNT
    if not kernel32.GetModuleHandleExW(0x4 | 0x2, ctypes.c_void_p(address),
                                       ctypes.byref(handle)):
        return None
    buf = ctypes.create_unicode_buffer(1024)
    kernel32.GetModuleFileNameW(handle, buf, 1024)
    return str(buf.value) or None
