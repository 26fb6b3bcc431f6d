#!/usr/bin/env bash
# Downloads the wheels of scripts/gpu-wheels.txt into DIR (default .whl) for a GPU host that cannot reach a
# package index: Linux x86-64, CPython PYTHON_VERSION (default 3.12). Run it where pip can reach PyPI, copy DIR
# beside the checkout on the GPU host, then run `bash scripts/gpu_check.sh --wheels DIR` there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
mkdir -p "$DIR"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version "$PYTHON_VERSION" "${platforms[@]}" -d "$DIR" -r scripts/gpu-wheels.txt
echo "$(ls "$DIR"/*.whl | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1))"
