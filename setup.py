"""Build of manyheads' one extension, ``manyheads._kernels``.

* The C kernels in ``csrc/`` are compiled file by file: the baseline and the
  dispatcher with no ISA flags, ``mh_avx2.c``, ``mh_avx512.c`` and
  ``mh_avx512bf16.c`` (the AVX-512 kernels again, with AVX512-BF16) with their
  own target flags.  The run-time dispatcher picks one; nothing is tuned to
  the build machine's CPU and no AVX code exists outside the per-ISA files.
  Host-tuning flags (``-march=...``, ``-mtune=...``, ``-mcpu=...``) that an
  environment's CFLAGS would add are removed, so a wheel built on a new CPU
  still runs on an old one.
* OpenMP is used when the compiler supports it.  Set ``MANYHEADS_NO_OPENMP=1``
  to build without it (the kernels then run on one thread).  ``OPENMP_PREFIX``
  points at a separately installed OpenMP runtime (include/ and lib/), as the
  macOS wheels use.
"""
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"


def _is_x86_target():
    archflags = os.environ.get("ARCHFLAGS", "")
    if sys.platform == "darwin" and "arm64" in archflags and "x86_64" not in archflags:
        return False
    machine = platform.machine().lower()
    if sys.platform == "darwin" and "x86_64" in archflags:
        return True
    return machine in ("x86_64", "amd64", "x64")


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class BuildExt(build_ext):
    def _msvc(self):
        return self.compiler.compiler_type == "msvc"

    def _openmp_flags(self):
        """(compile_args, link_args) for OpenMP, or None when unavailable or disabled."""
        if _env_flag("MANYHEADS_NO_OPENMP"):
            print("manyheads: OpenMP disabled by MANYHEADS_NO_OPENMP")
            return None
        prefix = os.environ.get("OPENMP_PREFIX", "").strip()  # e.g. a libomp built for macOS
        inc = [f"-I{prefix}/include"] if prefix else []
        lib = [f"-L{prefix}/lib", f"-Wl,-rpath,{prefix}/lib"] if prefix else []
        if self._msvc():
            candidates = [(["/openmp"], [])]
        elif sys.platform == "darwin":
            candidates = [(["-Xpreprocessor", "-fopenmp"] + inc, lib + ["-lomp"]),
                          (["-fopenmp"] + inc, lib + ["-fopenmp"])]
        else:
            candidates = [(["-fopenmp"] + inc, lib + ["-fopenmp"])]
        for cflags, ldflags in candidates:
            if self._try_compile_openmp(cflags, ldflags):
                print(f"manyheads: building with OpenMP ({' '.join(cflags)})")
                return cflags, ldflags
        print("manyheads: compiler has no usable OpenMP; building single-threaded")
        return None

    def _try_compile_openmp(self, cflags, ldflags):
        code = (
            "#include <omp.h>\n"
            "int main(void) { int n = 0;\n"
            "#pragma omp parallel reduction(+:n)\n n += 1;\n"
            " return omp_get_max_threads() > 0 && n > 0 ? 0 : 1; }\n"
        )
        tmp = tempfile.mkdtemp()
        try:
            src = os.path.join(tmp, "omp_check.c")
            with open(src, "w") as fh:
                fh.write(code)
            objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=cflags)
            env_ldflags = os.environ.get("LDFLAGS", "").split()  # e.g. sanitizer runtimes
            self.compiler.link_executable(objs, "omp_check", output_dir=tmp,
                                          extra_postargs=ldflags + env_ldflags)
            return True
        except Exception:
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _drop_host_tuning(self):
        """Remove -march/-mtune/-mcpu from the compiler commands (e.g. from CFLAGS)."""
        dropped = set()
        for attr in ("compiler", "compiler_so", "compiler_cxx", "linker_so", "linker_exe"):
            cmd = getattr(self.compiler, attr, None)
            if not isinstance(cmd, list):
                continue
            keep = [f for f in cmd if not f.startswith(("-march=", "-mtune=", "-mcpu="))]
            dropped.update(f for f in cmd if f not in keep)
            setattr(self.compiler, attr, keep)
        if dropped:
            print(f"manyheads: ignoring host-tuning flags {sorted(dropped)} (portable build)")

    def _compile_isa(self, fname, base, flags):
        """Object files of one ISA source; a compiler that rejects the AVX512-BF16
        flags builds mh_avx512bf16.c without them (it then holds no such path)."""
        def compile_with(extra):
            return self.compiler.compile(
                [os.path.join(CSRC, fname)], output_dir=self.build_temp, include_dirs=[CSRC],
                extra_postargs=base + extra,
                depends=[os.path.join(CSRC, h) for h in
                         ("mh_kernels.h", "mh_attention_impl.h", "mh_linear_impl.h",
                          "mh_isa_end.h", "mh_exp.h", "mh_avx512.c")])
        try:
            return compile_with(flags)
        except CompileError:
            if fname != "mh_avx512bf16.c" or self._msvc():
                raise
            print("manyheads: the compiler has no AVX512-BF16; building without that path")
            return compile_with([f for f in flags if f not in ("-mavx512bw", "-mavx512bf16")])

    def build_extensions(self):
        msvc = self._msvc()
        if not msvc:
            self._drop_host_tuning()
        base = ["/O2"] if msvc else ["-O3", "-std=c99", "-fno-strict-aliasing"]
        isa_flags = {"mh_baseline.c": [], "mh_dispatch.c": [], "mh_linear.c": [],
                     "mh_quantize.c": []}
        if _is_x86_target():
            if msvc:
                isa_flags["mh_avx2.c"] = ["/arch:AVX2"]
                isa_flags["mh_avx512.c"] = ["/arch:AVX512"]
                isa_flags["mh_avx512bf16.c"] = ["/arch:AVX512"]
            else:
                isa_flags["mh_avx2.c"] = ["-mavx2", "-mfma", "-mf16c"]
                isa_flags["mh_avx512.c"] = ["-mavx512f", "-mavx2", "-mfma", "-mf16c"]
                isa_flags["mh_avx512bf16.c"] = isa_flags["mh_avx512.c"] + [
                    "-mavx512bw", "-mavx512bf16"]
        omp = self._openmp_flags()
        self.manyheads_openmp = omp is not None
        for ext in self.extensions:
            objects = []
            for fname, flags in isa_flags.items():
                objects += self._compile_isa(fname, base, flags)
            ext.extra_objects = objects + list(ext.extra_objects or [])
            if omp is not None:
                ext.extra_compile_args = list(ext.extra_compile_args or []) + omp[0]
                ext.extra_link_args = list(ext.extra_link_args or []) + omp[1]
            if not msvc:
                ext.extra_compile_args = list(ext.extra_compile_args or []) + ["-O3"]
        super().build_extensions()


extensions = [
    Extension(
        "manyheads._kernels",
        sources=["src/manyheads/_kernels.pyx"],
        include_dirs=[CSRC, np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_9_API_VERSION")],
    )
]

setup(
    ext_modules=cythonize(extensions, language_level=3),
    cmdclass={"build_ext": BuildExt},
)
