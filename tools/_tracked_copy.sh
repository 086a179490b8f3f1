# Sourced by the tools scripts: strict mode, the repository root, a Python, and a temporary
# folder ($work, removed on exit) holding a copy of the tracked files as they are in the
# working tree ($work/src).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[1]}")/.." && pwd)"
py="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
(cd "$root" && git ls-files -z | xargs -0 cp --parents -t "$work/src")
