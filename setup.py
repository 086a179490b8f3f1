"""Build of manyheads' one extension, ``manyheads._kernels``.

* The C kernels in ``csrc/`` are compiled file by file, in parallel: each
  kernel path's file with the target flags ``csrc/mh_isa_list.h`` gives it
  (on an x86-64 target; elsewhere with none, and the x86 files then hold
  empty tables), every other file (the dispatcher, the planner, the
  projection tiles, the quantiser) with no ISA flags.  The run-time
  dispatcher picks one path; nothing is tuned to the build machine's CPU and
  no AVX code exists outside the per-ISA files.  A kernel file whose flags
  the compiler rejects is built without them if it can be (the avx512bf16
  file then holds no path).  A kernel file that fails with flags the compiler
  takes is an error in the file, and stops the build (rather than leave the
  path out unseen).
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
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"


def isa_flags(csrc=CSRC):
    """{file: (gcc/clang flags, MSVC flags)} of every kernel path in MH_ISA_LIST, best first."""
    with open(os.path.join(csrc, "mh_isa_list.h")) as fh:
        text = fh.read()
    body = text[text.index("#define MH_ISA_LIST(X)"):].replace("\\\n", " ")
    entries = re.findall(r'X\(\s*\w+\s*,\s*\w+\s*,[^"]*"([^"]+)"\s*,\s*"([^"]*)"\s*,\s*"([^"]*)"\s*\)',
                         body)
    if not entries:
        raise RuntimeError("no kernel path found in csrc/mh_isa_list.h")
    return {file: (gcc.split(), msvc.split()) for file, gcc, msvc in entries}


def c_sources(x86=True, msvc=False, csrc=CSRC):
    """(file, flags) for every C file of csrc/: a kernel path's file with its target
    flags on an x86-64 target, everything else with none."""
    flags = isa_flags(csrc)
    return [(f, list(flags[f][1 if msvc else 0]) if x86 and f in flags else [])
            for f in sorted(os.listdir(csrc)) if f.endswith(".c")]


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

    def _takes_flags(self, base, flags):
        """Whether the compiler takes target flags ``flags`` at all: a file of one
        function that includes the intrinsics' header (on x86), compiled once."""
        key = tuple(base + flags)
        with self._probe_lock:
            if key not in self._probes:
                tmp = tempfile.mkdtemp()
                try:
                    src = os.path.join(tmp, "flags_check.c")
                    with open(src, "w") as fh:
                        fh.write("#if defined(__x86_64__) || defined(_M_X64)\n"
                                 "#include <immintrin.h>\n#endif\n"
                                 "int manyheads_flags_check(int x) { return x + 1; }\n")
                    self.compiler.compile([src], output_dir=tmp, extra_postargs=base + flags)
                    self._probes[key] = True
                except CompileError:
                    self._probes[key] = False
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            return self._probes[key]

    def _compile_c(self, fname, base, flags):
        """Object files of one csrc/ file; a kernel file whose target flags the
        compiler rejects is compiled without them, which only a file that guards
        itself on the ISA's macros survives (it then holds an empty table).  A
        file that fails with flags the compiler takes does not compile: that
        error stops the build."""
        def compile_with(extra):
            return self.compiler.compile(
                [os.path.join(CSRC, fname)], output_dir=self.build_temp, include_dirs=[CSRC],
                extra_postargs=base + extra,
                depends=[os.path.join(CSRC, h) for h in os.listdir(CSRC) if h.endswith(".h")])
        try:
            return compile_with(flags)
        except CompileError:
            if not flags or self._takes_flags(base, flags):
                raise
            print(f"manyheads: the compiler rejects {' '.join(flags)}; building {fname} "
                  "without them")
            return compile_with([])

    def build_extensions(self):
        self._probes, self._probe_lock = {}, threading.Lock()
        msvc = self._msvc()
        if not msvc:
            self._drop_host_tuning()
        base = ["/O2"] if msvc else ["-O3", "-std=c99", "-fno-strict-aliasing"]
        sources = c_sources(_is_x86_target(), msvc)
        omp = self._openmp_flags()
        self.manyheads_openmp = omp is not None
        for ext in self.extensions:
            # one small file alone (the compiler object sets itself up), the rest in
            # parallel, the kernel paths' files first (they take nearly all the time:
            # started first, the threads end close together)
            paths = list(isa_flags())
            kernels = sorted((src for src in sources if src[0] in paths),
                             key=lambda src: paths.index(src[0]))
            others = [src for src in sources if src[0] not in paths]
            first = (others or kernels)[0]
            objects = self._compile_c(first[0], base, first[1])
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                for objs in pool.map(lambda src: self._compile_c(src[0], base, src[1]),
                                     [src for src in kernels + others if src is not first]):
                    objects += objs
            ext.extra_objects = objects + list(ext.extra_objects or [])
            if omp is not None:
                ext.extra_compile_args = list(ext.extra_compile_args or []) + omp[0]
                ext.extra_link_args = list(ext.extra_link_args or []) + omp[1]
            if not msvc:
                ext.extra_compile_args = list(ext.extra_compile_args or []) + ["-O3"]
                if not (self.debug or _debug_build()):
                    # debug information (Python's -g) was 9/10 of the library's 22 MB;
                    # the linker leaves it out, unless CFLAGS asks for -g
                    ext.extra_link_args = list(ext.extra_link_args or []) + ["-Wl,-S"]
        super().build_extensions()


def _debug_build():
    """Whether CFLAGS asks for debug information (-g, -g3, -ggdb; not -g0)."""
    return any(f.startswith("-g") and f != "-g0" for f in os.environ.get("CFLAGS", "").split())


if __name__ == "__main__":  # (tools/check_cross.sh and a test import c_sources from here,
    # where neither Cython nor NumPy's headers need be installed)
    import numpy as np
    from Cython.Build import cythonize

    extensions = [
        Extension(
            "manyheads._kernels",
            sources=["src/manyheads/_kernels.pyx"],
            include_dirs=[CSRC, np.get_include()],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_9_API_VERSION")],
        )
    ]
    setup(
        ext_modules=cythonize(extensions, language_level=3, include_path=["src"]),
        cmdclass={"build_ext": BuildExt},
    )
