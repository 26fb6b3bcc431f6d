"""The embedded demo model: a tiny trained Clef-format release for support-ticket triage.

``DEMO_FOLDER`` is a release folder like any other (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``joint_head.safetensors``, ...); see its ``README.md``. It is made by
``scripts/train_demo.py`` and knows only its synthetic task (``clefserve.testing.triage``).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DEMO_FOLDER = Path(str(files(__name__)))
DEMO_MODEL_NAME = "clef-demo"

__all__ = ["DEMO_FOLDER", "DEMO_MODEL_NAME"]
