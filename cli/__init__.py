"""What users run: the ``timeslice`` command, the embedded Temporal server, service start-up.

``main`` holds the commands (``timeslice.cli:entry`` is the console script and
``python -m timeslice.cli`` runs the same), ``server`` starts the embedded dev server and
``services`` starts and stops ``timeslice`` processes from Python (the demo, the benchmarks and
the tests run real processes through it). ``entry`` and ``main`` load on first use, so importing
``timeslice.cli.server`` does not load every command's imports.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["entry", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("timeslice.cli.main"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
