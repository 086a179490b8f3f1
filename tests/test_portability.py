"""The extension is portable: AVX code lives only in the dispatched per-ISA functions."""
import platform
import re
import shutil
import subprocess
import sys

import pytest

from manyheads import _kernels

X86_ELF = sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")
AARCH64_ELF = sys.platform.startswith("linux") and platform.machine().lower() in ("aarch64", "arm64")


def disassembly():
    """(function, mnemonic, operands) for every instruction of the extension (objdump -d)."""
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _kernels.__file__],
                          capture_output=True, text=True, check=True).stdout
    func = None
    for line in dump.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if m:
            func = m.group(1).split(".")[0]  # compiler clones: f.isra.0, f.constprop.0, f.cold
            continue
        addr, _, insn = line.partition("\t")
        words = insn.split(None, 1)  # the mnemonic, then its operands
        if not re.match(r"^\s+[0-9a-f]+:$", addr) or not words:
            continue
        yield func, words[0], words[1] if len(words) > 1 else ""


@pytest.mark.skipif(not X86_ELF or shutil.which("objdump") is None,
                    reason="needs objdump and an x86-64 ELF build")
def test_vex_and_evex_instructions_only_in_dispatched_functions():
    offenders, pair_dots = {}, set()
    seen_isa_funcs = set()
    for func, mnemonic, _ in disassembly():
        # every AVX/AVX2/AVX-512 instruction is VEX/EVEX encoded: its mnemonic starts with v
        if mnemonic.startswith("v") and mnemonic not in ("verr", "verw"):
            if func.endswith(("_avx2", "_avx512", "_avx512bf16")):
                seen_isa_funcs.add(func)
            else:
                offenders.setdefault(func, mnemonic)
        if mnemonic == "vdpbf16ps":
            pair_dots.add(func)
    assert not offenders, f"AVX instructions outside the dispatched paths: {offenders}"
    assert any(f.endswith("_avx512") for f in seen_isa_funcs)
    assert any(f.endswith("_avx2") for f in seen_isa_funcs)
    # AVX512-BF16 only where the dispatcher checked for it (and there, when built)
    assert all(f.endswith("_avx512bf16") for f in pair_dots), pair_dots
    assert bool(pair_dots) == _kernels.isa_compiled("avx512bf16")


@pytest.mark.skipif(not AARCH64_ELF or shutil.which("objdump") is None,
                    reason="needs objdump and an aarch64 ELF build")
def test_aarch64_baseline_fuses_its_multiply_adds():
    # FMA is part of every aarch64 CPU: both baseline instantiations use NEON fmla
    fused = {"f32": 0, "f64": 0}
    for func, mnemonic, operands in disassembly():
        for t, arrangement in (("f32", ".4s"), ("f64", ".2d")):
            if func.endswith(f"_{t}_baseline") and mnemonic == "fmla" and arrangement in operands:
                fused[t] += 1
    assert fused["f32"] > 0 and fused["f64"] > 0, fused


@pytest.mark.skipif(not AARCH64_ELF or shutil.which("objdump") is None,
                    reason="needs objdump and an aarch64 ELF build")
def test_aarch64_baseline_exp_and_float16_reads_are_neon_code():
    # the exp works on whole vectors (no libm call, no scalar compare per lane) in both
    # types, and the float32 instantiation widens float16 keys and values with fcvtl
    exp_funcs = ("mh_exp_array_f32_baseline", "mh_exp_array_f64_baseline")
    seen = {f: {"fmla": 0, "exp call": 0, "fcmp": 0} for f in exp_funcs}
    fcvtl = 0
    for func, mnemonic, operands in disassembly():
        if func in seen:
            n = seen[func]
            n["fmla"] += mnemonic == "fmla"
            n["exp call"] += mnemonic == "bl" and "<exp" in operands
            n["fcmp"] += mnemonic in ("fcmp", "fcmpe")
        if func.endswith("_f32_baseline") and mnemonic == "fcvtl" and ".4s" in operands:
            fcvtl += 1
    for f, n in seen.items():
        assert n["fmla"] > 0 and n["exp call"] == 0 and n["fcmp"] == 0, (f, n)
    assert fcvtl > 0


def test_build_contains_the_baseline_and_reports_openmp():
    assert _kernels.isa_compiled("baseline") and _kernels.cpu_supports("baseline")
    assert isinstance(_kernels.openmp_enabled(), bool)
