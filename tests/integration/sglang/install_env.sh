#!/usr/bin/env bash
# Build the venv the SGLang integration tests run in (CPU, no server), fast on
# reruns. Usage: bash tests/integration/sglang/install_env.sh [VENV_DIR]
# SGLANG_VERSION=0.5.20 installs that release instead of requirements.txt's
# (the other pins stay: tests/compat/run.sh proves each release with them),
# plus requirements-extra-VERSION.txt where a release imports more than 0.5.23
# or needs another version of a pinned package (a package named there replaces
# requirements.txt's pin: 0.5.17 needs transformers 5.12.1).
#
# The wheels are kept in a wheelhouse under ~/.cache/pip (CI keeps that folder
# between runs; pip's HTTP cache stays empty with this registry), so a rerun
# installs offline: ~45 s warm, ~85 s cold on 2 cores. --no-compile skips
# byte-compiling ~10k files (Python compiles what the tests import, on use).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-.ci-venv-sglang}"
req="$here/requirements.txt"
if [ -n "${SGLANG_VERSION:-}" ]; then
    req="$(mktemp)"
    sed "s/^sglang==.*/sglang==$SGLANG_VERSION/" "$here/requirements.txt" > "$req"
    extra="$here/requirements-extra-$SGLANG_VERSION.txt"
    if [ -f "$extra" ]; then
        # Pins the extra file names replace requirements.txt's (pip refuses two).
        names="$(grep -v '^#' "$extra" | sed -n 's/^\([A-Za-z0-9_.-]*\).*/\1/p' | tr 'A-Z_.' 'a-z--')"
        keep="$(mktemp)"
        while IFS= read -r line; do
            name="$(printf '%s' "${line%%[=<>!~ ]*}" | tr 'A-Z_.' 'a-z--')"
            printf '%s\n' "$names" | grep -qxF "$name" || printf '%s\n' "$line"
        done < "$req" > "$keep"
        mv "$keep" "$req"
        grep -v '^#' "$extra" >> "$req"
    fi
fi
wheels="${KVCACHED_SGLANG_WHEELHOUSE:-$HOME/.cache/pip/kvcached-sglang-wheels}"

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
pip=("$venv/bin/pip" --disable-pip-version-check -q)
# The CPU wheel that lies on disk; a bare `torch` would download a CUDA build.
"${pip[@]}" install --no-compile torch==2.13.0
if ! "${pip[@]}" install --no-compile --no-deps --no-index --find-links "$wheels" -r "$req" 2>/dev/null; then
    mkdir -p "$wheels"
    "${pip[@]}" download --no-deps -d "$wheels" -r "$req"
    "${pip[@]}" install --no-compile --no-deps --no-index --find-links "$wheels" -r "$req"
fi
# Some releases (0.5.20) import torchvision from `import sglang`: the tests'
# stand-in (stubs/, first on the tests' PYTHONPATH) serves this check too.
PYTHONPATH="$here/stubs${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -c \
    "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
