"""The extension is portable: AVX code lives only in the dispatched per-ISA functions."""
import platform
import re
import shutil
import subprocess
import sys

import pytest

from manyheads import _kernels

X86_ELF = sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")


@pytest.mark.skipif(not X86_ELF or shutil.which("objdump") is None,
                    reason="needs objdump and an x86-64 ELF build")
def test_vex_and_evex_instructions_only_in_dispatched_functions():
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _kernels.__file__],
                          capture_output=True, text=True, check=True).stdout
    func = None
    offenders = {}
    seen_isa_funcs = set()
    for line in dump.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if m:
            func = m.group(1).split(".")[0]  # compiler clones: f.isra.0, f.constprop.0, f.cold
            continue
        parts = line.split("\t")
        if len(parts) < 2 or not re.match(r"^\s+[0-9a-f]+:$", parts[0]):
            continue
        mnemonic = parts[1].split()[0] if parts[1].split() else ""
        # every AVX/AVX2/AVX-512 instruction is VEX/EVEX encoded: its mnemonic starts with v
        if mnemonic.startswith("v") and mnemonic not in ("verr", "verw"):
            if func.endswith(("_avx2", "_avx512")):
                seen_isa_funcs.add(func)
            else:
                offenders.setdefault(func, mnemonic)
    assert not offenders, f"AVX instructions outside the dispatched paths: {offenders}"
    assert any(f.endswith("_avx512") for f in seen_isa_funcs)
    assert any(f.endswith("_avx2") for f in seen_isa_funcs)


def test_build_contains_the_baseline_and_reports_openmp():
    assert _kernels.isa_compiled("baseline") and _kernels.cpu_supports("baseline")
    assert isinstance(_kernels.openmp_enabled(), bool)
