#!/usr/bin/env bash
# flash-linear-attention's Triton kernels on a CPU, under Triton's interpreter, in their own virtualenv.
#
# fla and triton must never be installed in the main test environment (.venv): with them, transformers routes
# its own CPU Qwen3.5 forward into fla and fails ("0 active drivers"). So this script builds a second venv,
# by default under ~/.cache/clef-serve/kernel-venv (CLEF_KERNEL_VENV to move it; reused while the pins below
# are unchanged), with the CPU torch pin, triton and fla, and runs tests/test_fla_kernels.py there with
# TRITON_INTERPRET=1 (set before anything imports triton). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_PIN="triton==3.9.0"
FLA_PINS=("fla-core==0.6.0" "flash-linear-attention==0.6.0")
VENV="${CLEF_KERNEL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/clef-serve/kernel-venv}"
STAMP="$VENV/.clef-pins"
PINS="$(cat constraints-cpu.txt) $TRITON_PIN ${FLA_PINS[*]} $(sha1sum pyproject.toml | cut -c1-12)"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$PINS" ]]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -c constraints-cpu.txt -e . pytest "$TRITON_PIN" einops packaging
    # --no-deps: fla's own requirements would pull another torch; einops and packaging are what it imports
    "$VENV/bin/pip" install -q --no-deps -c constraints-cpu.txt "${FLA_PINS[@]}"
    echo "$PINS" > "$STAMP"
else
    "$VENV/bin/pip" install -q --no-deps -c constraints-cpu.txt -e . >/dev/null
fi
export TRITON_INTERPRET=1
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_fla_kernels.py "$@"
