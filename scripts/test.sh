#!/usr/bin/env bash
# Installs the project with its test oracles into .venv (CPU torch pinned) and runs lint + the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# the ray extra: tests/test_batch_http.py runs Ray Data actors on a local instance (about 30 s to install)
.venv/bin/pip install -q -c constraints-cpu.txt -e ".[test,ray]"
# Cloudflare's reference code (test-only oracle); --no-deps keeps it from pulling anything else.
.venv/bin/pip install -q --no-deps -c constraints-cpu.txt "clef-finetune==0.1.0"
.venv/bin/ruff check clefserve tests benchmarks scripts
.venv/bin/python -m pytest -q "$@"
