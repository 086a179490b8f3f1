#!/usr/bin/env bash
# Cross-compile every csrc/*.c for the platforms this machine cannot run: macOS (arm64,
# x86-64) and Windows (x86-64, arm64; the mingw ABI), with `zig cc` (clang) from PyPI's
# ziglang, warnings as errors.  Each file gets the flags setup.py gives it for that target
# (setup.c_sources: the kernel paths' ISA flags on x86-64, none elsewhere); the AVX files
# are compiled for Windows x86-64 only (see jobs below).  Only compiles:
# nothing runs, and MSVC itself is not exercised.  Usage: tools/check_cross.sh
# (needs `pip install ziglang`).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python3}"
if ! "$py" -c "import ziglang" 2>/dev/null; then
    echo "check_cross: ziglang is not installed (pip install ziglang)"; exit 1
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
cd "$root"
# every C file and its flags, as setup.py builds them, for an x86-64 target and another
sources() {
    "$py" - "$1" <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("manyheads_setup", "setup.py")
setup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup)  # (its setup() call only runs as a script)
for name, flags in setup.c_sources(x86=sys.argv[1] == "x86_64"):
    print(name, *flags)
PY
}
jobs() {  # one line per compile: target, file, flags
    for target in aarch64-macos x86_64-macos x86_64-windows-gnu aarch64-windows-gnu; do
        # the AVX files (the build's slowest) are compiled for one x86-64 target, Windows
        # (its 32-bit long is the likelier trap); macOS x86-64 gets the files without ISA
        # flags, the baseline kernels included, on the same clang
        if [ "$target" = x86_64-macos ]; then
            sources x86_64 | awk 'NF == 1'
        else
            sources "${target%%-*}"
        fi | sed "s/^/$target /"
    done
}
compile_one() {  # target file flags...
    local target="$1" file="$2"
    shift 2
    if "$py" -m ziglang cc -target "$target" -O3 -std=c99 -fno-strict-aliasing \
            -Wall -Wextra -Werror "$@" -Icsrc -c "csrc/$file" \
            -o "$out/$target-${file%.c}.o"; then
        echo "ok $target $file"
    else
        echo "FAILED $target $file (flags: ${*:-none})"
    fi
}
export -f compile_one
export py out
jobs | xargs -P "$(nproc 2>/dev/null || echo 2)" -L 1 bash -c 'compile_one "$@"' _ > "$out/log"
cat "$out/log" | grep -v "^ok" || true
for target in aarch64-macos x86_64-macos x86_64-windows-gnu aarch64-windows-gnu; do
    echo "check_cross: $target: $(grep -c "^ok $target " "$out/log") files compiled"
done
if grep -q "^FAILED" "$out/log"; then exit 1; fi
echo "check_cross: the C files compile for macOS and Windows (arm64 and x86-64)"
