"""Kept for older imports: this module is :mod:`timeslice.transport.updates`.

It replaces itself with that module, so both paths name one module object: one set of classes
(``isinstance`` agrees), one module state, and a ``monkeypatch`` through either path reaches
both. A module of re-exports would copy the names and leave private ones and patches behind.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("timeslice.transport.updates")
