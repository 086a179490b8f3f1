#!/usr/bin/env bash
# Prove the aarch64 build on an x86-64 Debian host, under user-mode emulation:
#   1. qemu-user-static and binfmt_misc, so the host runs arm64 programs (and chroots into them);
#   2. an arm64 Debian root filesystem (debootstrap, the host's release, the Debian mirror named
#      in the host's apt sources) with gcc and a Python venv holding the build and test
#      requirements; both are cached between runs (see below);
#   3. the host's CA certificates copied in (pip inside reaches PyPI with them);
#   4. manyheads built from this checkout's tracked files with pip, as a user would; the build
#      must pick the baseline kernel path with OpenMP;
#   5. the disassembly of the arm64 extension must hold NEON fused multiply-adds (fmla) in both
#      baseline instantiations: FMA is part of every aarch64 CPU, and the baseline path uses it;
#   6. the test suite without torch (the tests needing torch or transformers skip themselves);
#      pytest's summary line is the last line printed.
# 10-25 minutes once the root filesystem and the venv are cached (the first run also builds
# them, which takes longer). Not part of .ci/run.
# Needs root (chroot, mounts, apt-get) and a Debian host.   Usage: tools/check_aarch64.sh
#
# Environment:
#   MANYHEADS_AARCH64_CACHE   cache folder (default: $XDG_CACHE_HOME or $HOME/.cache, then
#                             manyheads-aarch64); delete it (no run going) to start afresh
#   MANYHEADS_AARCH64_MIRROR  Debian mirror to bootstrap from (default: the host's apt sources)
#   MANYHEADS_AARCH64_SUITE   Debian release (default: the host's)
#   PYTEST_ARGS               extra pytest arguments (e.g. "-x" or "-k cache")
source "$(dirname "$0")/_tracked_copy.sh"

step() { printf '\n=== %s\n' "$*"; }
die() { echo "check_aarch64: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (chroot, mounts, apt-get)"
[ "$(uname -m)" = x86_64 ] || die "meant for an x86-64 host (on aarch64, run the test suite natively)"
[ -r /etc/os-release ] && . /etc/os-release
[ "${ID:-}" = debian ] || die "needs a Debian host (debootstrap of Debian arm64)"

cache="${MANYHEADS_AARCH64_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/manyheads-aarch64}"
case "$cache" in "$root"|"$root"/*) die "the cache folder must lie outside the repository";; esac
suite="${MANYHEADS_AARCH64_SUITE:-${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}}"
rootfs="$cache/rootfs-$suite-arm64"
venv=/opt/manyheads-venv            # inside the root filesystem
mkdir -p "$cache"
exec 9>"$cache/lock"
flock -n 9 || { echo "waiting for another check_aarch64 run to release $cache"; flock 9; }

# The chroot's mounts and the copied tree go away on exit, before _tracked_copy.sh's folder.
build_dir=""
mounted=()
cleanup() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[i]}" || umount -l "${mounted[i]}"; done
    if [ -n "$build_dir" ] && [ -d "$rootfs$build_dir" ]; then rm -rf "${rootfs:?}$build_dir"; fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'echo "check_aarch64: failed at line $LINENO: $BASH_COMMAND" >&2' ERR

# Run a command inside the arm64 root filesystem with a clean environment (the host's pip
# settings point at host folders); proxies pass through, pip trusts the copied CA bundle.
in_arm64() {
    local pass=() v
    for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_INDEX_URL \
             PIP_DEFAULT_TIMEOUT; do
        if [ -n "${!v:-}" ]; then pass+=("$v=${!v}"); fi
    done
    chroot "$rootfs" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
        PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin \
        SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
        PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
        ${pass[@]+"${pass[@]}"} "$@"
}

# The first http(s) URI of the host's apt sources that serves the release itself (not
# -updates or -security); one-line (.list) and deb822 (.sources) formats.
host_mirror() {
    "$py" - "$suite" /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources <<'PY'
import os, sys
suite, files = sys.argv[1], sys.argv[2:]
entries = []  # (uri, suites)
for path in files:
    if not os.path.isfile(path):
        continue
    text = open(path, encoding="utf-8", errors="replace").read()
    if path.endswith(".sources"):
        for stanza in text.split("\n\n"):
            fields, key = {}, None
            for line in stanza.splitlines():
                if line.lstrip().startswith("#") or not line.strip():
                    continue
                if line[0].isspace() and key:
                    fields[key] += " " + line.strip()
                    continue
                key, _, value = line.partition(":")
                key = key.strip().lower()
                fields[key] = value.strip()
            if "deb" not in fields.get("types", "").split():
                continue
            if fields.get("enabled", "yes").lower() == "no":
                continue
            for uri in fields.get("uris", "").split():
                entries.append((uri, fields.get("suites", "").split()))
    else:
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            if not words or words[0] != "deb":
                continue
            words = words[1:]
            if words and words[0].startswith("["):  # options: [arch=... signed-by=...]
                while words and not words[0].endswith("]"):
                    words.pop(0)
                words = words[1:]
            if len(words) >= 2:
                entries.append((words[0], [words[1]]))
for uri, suites in entries:
    if uri.startswith(("http://", "https://")) and suite in suites:
        print(uri.rstrip("/"))
        break
PY
}

step "host: qemu-user-static, binfmt_misc, debootstrap"
missing=()
for pkg in qemu-user-static binfmt-support debootstrap debian-archive-keyring; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" > "$work/apt.log" 2>&1 \
        || { tail -20 "$work/apt.log"; die "apt-get install failed"; }
fi
binfmt=/proc/sys/fs/binfmt_misc
mountpoint -q "$binfmt" || mount -t binfmt_misc binfmt_misc "$binfmt"
[ -e "$binfmt/qemu-aarch64" ] || update-binfmts --enable qemu-aarch64
grep -q '^enabled' "$binfmt/qemu-aarch64" || update-binfmts --enable qemu-aarch64
# the F flag: the kernel opens the interpreter now, so the chroot needs no copy of it
grep -q '^flags:.*F' "$binfmt/qemu-aarch64" \
    || die "binfmt entry qemu-aarch64 lacks the F flag (use Debian's qemu-user-static)"
sed -n 's/^interpreter /aarch64 interpreter: /p' "$binfmt/qemu-aarch64"

step "arm64 root filesystem ($suite) in $cache"
if [ ! -e "$rootfs/.manyheads-rootfs-ready" ]; then
    mirror="${MANYHEADS_AARCH64_MIRROR:-$(host_mirror)}"
    [ -n "$mirror" ] || die "no mirror for '$suite' in the host's apt sources; set MANYHEADS_AARCH64_MIRROR"
    echo "debootstrap from $mirror (first run: several minutes)"
    rm -rf "$rootfs"
    debootstrap --arch=arm64 --variant=minbase \
        --include=python3,python3-venv,python3-dev,gcc,libc6-dev,binutils \
        "$suite" "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
        || { tail -30 "$work/debootstrap.log"; die "debootstrap failed"; }
    touch "$rootfs/.manyheads-rootfs-ready"
else
    echo "cached"
fi
in_arm64 uname -m | grep -qx aarch64 || die "the root filesystem does not run as aarch64"
in_arm64 python3 --version

# what the build and the tests need, from pyproject.toml: the build-system requires, the
# runtime dependencies and the test extra without torch and transformers (no arm64 torch here;
# the tests that need them skip themselves)
reqs="$("$py" - "$work/src/pyproject.toml" <<'PY'
import re, sys, tomllib
with open(sys.argv[1], "rb") as fh:
    p = tomllib.load(fh)
test = [r for r in p["project"]["optional-dependencies"]["test"]
        if re.split(r"[<>=!~ ;\[]", r)[0].lower() not in ("torch", "transformers")]
reqs = p["build-system"]["requires"] + p["project"]["dependencies"] + test
print("\n".join(sorted(set(reqs))))
PY
)"

step "host CA certificates into the root filesystem"
ca="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
[ -r "$ca" ] || ca=/etc/ssl/certs/ca-certificates.crt
mkdir -p "$rootfs/etc/ssl/certs"
cp "$ca" "$rootfs/etc/ssl/certs/ca-certificates.crt"
echo "$(grep -c 'BEGIN CERTIFICATE' "$rootfs/etc/ssl/certs/ca-certificates.crt") certificates"

# /proc, /sys and /dev/shm for the tests (thread counts, subprocesses, memory readings); one
# left over by a killed run is reused, and unmounted at exit like the others (we hold the lock)
for m in proc sys dev/shm; do
    mkdir -p "$rootfs/$m"
    if ! mountpoint -q "$rootfs/$m"; then
        case "$m" in
            proc) mount -t proc proc "$rootfs/proc" ;;
            sys) mount -t sysfs sysfs "$rootfs/sys" ;;
            dev/shm) mount -t tmpfs -o mode=1777 tmpfs "$rootfs/dev/shm" ;;
        esac
    fi
    mounted+=("$rootfs/$m")
done

step "venv in the root filesystem ($venv)"
if [ "$(cat "$rootfs$venv/.manyheads-reqs" 2>/dev/null)" != "$reqs" ]; then
    rm -rf "${rootfs:?}$venv"
    in_arm64 python3 -m venv "$venv"
    printf '%s\n' "$reqs" > "$rootfs/tmp/manyheads-reqs.txt"
    in_arm64 "$venv/bin/python" -m pip install --quiet --upgrade pip > "$work/venv.log" 2>&1 \
        && in_arm64 "$venv/bin/python" -m pip install --quiet -r /tmp/manyheads-reqs.txt \
            >> "$work/venv.log" 2>&1 \
        || { tail -30 "$work/venv.log"; die "pip install of the requirements failed"; }
    rm -f "$rootfs/tmp/manyheads-reqs.txt"
    printf '%s\n' "$reqs" > "$rootfs$venv/.manyheads-reqs"
else
    echo "cached"
fi
names="$(printf '%s\n' "$reqs" | sed -E 's/[<>=!~ ;\[].*//' | paste -sd '|')"
in_arm64 "$venv/bin/python" -m pip list 2>/dev/null | grep -iE "^($names) " | tr -s ' ' | paste -sd ';'

step "build manyheads from the tracked files (pip install, baseline path, OpenMP)"
build_dir="/tmp/manyheads-check.$$"
mkdir -p "$rootfs$build_dir"
cp -a "$work/src" "$rootfs$build_dir/src"
# the build requirements are in the venv already: no isolated build environment to download
in_arm64 "$venv/bin/python" -m pip install -v --no-build-isolation --no-deps --force-reinstall \
    "$build_dir/src" > "$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log"; die "pip install of manyheads failed"; }
# pip -v indents the build's output: setup.py's own lines, then compiler or packaging warnings
grep -E "^\s*manyheads: " "$work/build.log" | sed 's/^\s*//' | sort -u || true
if grep -iE "(warning|error):" "$work/build.log"; then echo "(build warnings above)"; fi
cat > "$rootfs$build_dir/config.py" <<'PY'
import manyheads as mh
mh.show_config()
c = mh.show_config(mode="dicts")
assert c["kernel_isa"] == "baseline", c
assert c["openmp"], "built without OpenMP"
print(mh._kernels.__file__)
PY
in_arm64 sh -c "cd $build_dir && $venv/bin/python config.py" > "$work/config.txt" \
    || { cat "$work/config.txt"; die "the build is not the baseline path with OpenMP"; }
head -n -1 "$work/config.txt"
so="$(tail -1 "$work/config.txt")"

step "NEON fused multiply-adds (fmla) in the baseline kernels"
in_arm64 objdump -d --no-show-raw-insn "$so" > "$work/kernels.dis"
# per instantiation (function names end in _f32_baseline or _f64_baseline, clones included):
# fused multiply-adds on .4s (float) and .2d (double) vectors, and the separate vector
# multiplies and adds that remain
awk '
    /^[0-9a-f]+ <.*>:$/ { f = ""; if ($0 ~ /_f32_baseline/) f = "f32"; else if ($0 ~ /_f64_baseline/) f = "f64"; next }
    f != "" && $2 ~ /^(fmla|fmul|fadd)$/ && $3 ~ /\.(4s|2d),$/ { n[f, $2]++ }
    END {
        for (i = 1; i <= 2; i++) {
            t = i == 1 ? "f32" : "f64"
            printf "%s baseline: %d fmla, %d fmul, %d fadd (vector)\n", t, n[t, "fmla"], n[t, "fmul"], n[t, "fadd"]
        }
    }' "$work/kernels.dis" | tee "$work/fma.txt"
if grep -q ": 0 fmla" "$work/fma.txt"; then
    die "no NEON fmla in a baseline instantiation: its multiply-adds are not fused"
fi
echo "NEON fmla present in both baseline instantiations"

step "test suite under emulation (several minutes)"
rc=0
in_arm64 sh -c "cd $build_dir && $venv/bin/python -m pytest $build_dir/src/tests -q \
    -p no:cacheprovider -W ignore::pytest.PytestUnraisableExceptionWarning ${PYTEST_ARGS:-}" \
    > "$work/pytest.log" 2>&1 || rc=$?
# the skip reasons (-ra), or the failures; the summary line comes last
tail -n "$([ "$rc" -eq 0 ] && echo 25 || echo 200)" "$work/pytest.log" \
    | grep -vE "^(=+ )?[0-9]+ (passed|failed|errors?|skipped)" || true
summary="$(grep -E "^(=+ )?([0-9]+ (passed|failed|errors?|skipped)|no tests ran)" "$work/pytest.log" | tail -1)"
[ -n "$summary" ] || summary="$(tail -1 "$work/pytest.log")"
echo
if [ "$rc" -eq 0 ]; then echo "check_aarch64: all steps passed"; else echo "check_aarch64: the test suite failed (exit $rc)"; fi
echo "$summary"
exit "$rc"
