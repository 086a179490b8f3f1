#!/usr/bin/env bash
# Build LLVM's OpenMP runtime (libomp) for the wheel being built by cibuildwheel on macOS:
# same architecture (CIBW_ARCHS_MACOS / ARCHFLAGS) and the MACOSX_DEPLOYMENT_TARGET that
# cibuildwheel sets, so the bundled libomp.dylib loads on every macOS the wheel claims.
# Installs into $OPENMP_PREFIX, which setup.py reads.
set -euo pipefail
LLVM_VERSION="${LLVM_VERSION:-18.1.8}"
PREFIX="${OPENMP_PREFIX:?set OPENMP_PREFIX}"
ARCHS="${CIBW_ARCHS_MACOS:-$(uname -m)}"
TARGET="${MACOSX_DEPLOYMENT_TARGET:-11.0}"
work="$(mktemp -d)"
cd "$work"
base="https://github.com/llvm/llvm-project/releases/download/llvmorg-${LLVM_VERSION}"
curl -fsSL -o openmp.tar.xz "${base}/openmp-${LLVM_VERSION}.src.tar.xz"
curl -fsSL -o cmake.tar.xz "${base}/cmake-${LLVM_VERSION}.src.tar.xz"
tar xf openmp.tar.xz && tar xf cmake.tar.xz
mv "cmake-${LLVM_VERSION}.src" cmake
cmake -S "openmp-${LLVM_VERSION}.src" -B build \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="${PREFIX}" \
    -DCMAKE_OSX_ARCHITECTURES="${ARCHS// /;}" \
    -DCMAKE_OSX_DEPLOYMENT_TARGET="${TARGET}" \
    -DLIBOMP_INSTALL_ALIASES=OFF \
    -DOPENMP_ENABLE_LIBOMPTARGET=OFF
cmake --build build --target install -j "$(sysctl -n hw.ncpu)"
sudo=""; [ -w "${PREFIX}" ] || sudo="sudo"
$sudo install_name_tool -id "${PREFIX}/lib/libomp.dylib" "${PREFIX}/lib/libomp.dylib"
echo "libomp ${LLVM_VERSION} for ${ARCHS} (macOS >= ${TARGET}) in ${PREFIX}"
