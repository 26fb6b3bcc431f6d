#!/usr/bin/env bash
# Installs the project with its test oracles into .venv (CPU torch pinned) and runs lint + the test suite,
# then (with no arguments) flash-linear-attention's GPU kernels under Triton's interpreter in their own venv.
# With CI=true it first installs Debian's chromium for the console's browser tests when it is missing
# (elsewhere those tests skip and say how to install it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${CI:-}" = "true" ]; then
  bash scripts/install_browser.sh
fi
python3 -m venv .venv
# the ray extra: tests/test_batch_http.py runs Ray Data actors on a local instance (about 30 s to install)
.venv/bin/pip install -q -c constraints-cpu.txt -e ".[test,ray]"
# Cloudflare's reference code (test-only oracle); --no-deps keeps it from pulling anything else.
.venv/bin/pip install -q --no-deps -c constraints-cpu.txt "clef-finetune==0.1.0"
.venv/bin/ruff check clefserve tests benchmarks scripts
.venv/bin/python -m pytest -q "$@"
if [ $# -eq 0 ]; then
  bash scripts/test_kernels.sh
fi
