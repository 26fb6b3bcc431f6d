"""Run a test script in a fresh interpreter: for what depends on the threads a process has used (OpenMP
teams, floating-point control registers), which pytest's own process has touched already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_reporting_json(script: str, *args: str) -> Any:
    """Run ``script`` (``sys.argv[1:]`` = ``args``) with two OpenMP threads; what its last line of output
    says, as JSON."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])
