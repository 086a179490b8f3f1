#!/usr/bin/env bash
# Build the extension with AddressSanitizer + UndefinedBehaviorSanitizer and run the test suite
# under them; then a small valgrind memcheck run.  Linux + gcc.  Usage: tools/sanitize.sh
source "$(dirname "$0")/_tracked_copy.sh"

asan="$(gcc -print-file-name=libasan.so)"
ubsan="$(gcc -print-file-name=libubsan.so)"
"$py" -m venv "$work/env"
"$work/env/bin/python" -m pip install --quiet --disable-pip-version-check pytest hypothesis \
    threadpoolctl ml_dtypes 2>&1 | { grep -v "^WARNING: Location" || true; }
echo "=== build with -fsanitize=address,undefined"
CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g" \
LDFLAGS="-fsanitize=address,undefined" \
    "$work/env/bin/python" -m pip install --quiet --no-cache-dir "$work/src" > "$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log"; exit 1; }
LD_PRELOAD="$asan $ubsan" ASAN_OPTIONS=detect_leaks=0 \
    "$work/env/bin/python" -c "import manyheads as mh; assert mh.show_config(mode='dicts')['openmp']"

echo "=== test suite under ASan/UBSan"
# Python itself is not instrumented: preload the runtimes; CPython's arenas look like leaks
(cd "$work" && LD_PRELOAD="$asan $ubsan" \
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    "$work/env/bin/python" -m pytest "$work/src/tests" -q -p no:cacheprovider -x \
        -k "not ten_thousand_calls and not vex_and_evex" 2>&1 | tail -4)
# (ASan's quarantine keeps freed memory resident, so the flat-memory test is left to the
#  plain build; the disassembly test reads the plain build's instructions)

echo "=== valgrind memcheck (plain build, small inputs)"
"$py" -m venv "$work/vg"
# (CFLAGS=-g keeps the debug information setup.py otherwise leaves out: file:line in reports)
CFLAGS=-g "$work/vg/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-cache-dir "$work/src" > "$work/vg.log" 2>&1 || { tail -30 "$work/vg.log"; exit 1; }
cat > "$work/vg_case.py" <<'PY'
import numpy as np, manyheads as mh
rng = np.random.default_rng(0)
for L, S, E in [(1, 700, 17), (65, 65, 64), (3, 1100, 64), (130, 200, 80)]:
    q = rng.standard_normal((1, 2, L, E)).astype(np.float32)
    k = rng.standard_normal((1, 2, S, E)).astype(np.float32)
    mh.scaled_dot_product_attention(q, k, k, num_threads=1)
    mh.scaled_dot_product_attention(q, k, k, return_weights=True, num_threads=1)
m = mh.MultiHeadAttention(32, 64, 64, 0.0, 2, window=8, seed=0)
x = rng.standard_normal((1, 40, 32)).astype(np.float32)
for fmt in (np.float16, "int8", "int4"):
    c = m.new_cache(1, 64, dtype=fmt)
    m(x[:, :30], cache=c)
    for t in range(30, 40):
        m(x[:, t:t + 1], cache=c)
mh.linear(x[0, :3], rng.standard_normal((32, 50)).astype(np.float32))
print("valgrind case done")
PY
PYTHONMALLOC=malloc valgrind --tool=memcheck --errors-for-leak-kinds=none \
    --log-file="$work/valgrind.txt" \
    "$work/vg/bin/python" "$work/vg_case.py"
# report only errors whose stack passes through manyheads' code
if grep -B2 -A25 -E "Invalid (read|write)|uninitialised" "$work/valgrind.txt" | grep "_kernels" > /dev/null; then
    grep -B2 -A25 -E "Invalid (read|write)|uninitialised" "$work/valgrind.txt" | head -80
    echo "valgrind: errors in manyheads' code"; exit 1
fi
grep -E "ERROR SUMMARY" "$work/valgrind.txt"
echo "valgrind: no invalid read or write in manyheads' code"
echo "sanitize: all steps passed"
