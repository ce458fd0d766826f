#!/usr/bin/env bash
# Download the Python 3.12 x86_64 wheels SGLang's pool, allocator and scheduler
# modules need, for a GPU machine without a registry.
# Usage: bash tests/integration/sglang/gpu_wheelhouse.sh DIR [REQUIREMENTS]
# (REQUIREMENTS: a file name in this folder, default requirements-gpu-py312.txt;
# requirements-gpu-py312-pools.txt is the smaller set the pool/allocator GPU
# test needs, 58.6 MiB, which fits one device call's carry.)
# Then, there: pip install --no-deps --no-index --find-links DIR -r REQUIREMENTS
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="${1:?usage: gpu_wheelhouse.sh DIR [REQUIREMENTS]}"
req="$here/${2:-requirements-gpu-py312.txt}"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 \
         manylinux1_x86_64 linux_x86_64 any; do
    platforms+=(--platform "$p")
done
python3 -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    "${platforms[@]}" -d "$dest" -r "$req"
du -sh "$dest"
