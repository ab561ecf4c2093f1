"""Kept for older imports: this module is :mod:`timeslice.transport.codec`.

It replaces itself with that module, so both paths name one module object: one set of classes
(``isinstance`` agrees), one module state, and a ``monkeypatch`` through either path reaches
both. A module of re-exports would copy the names and leave private ones and patches behind.
``python -m timeslice.codec`` still prints a new key.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("timeslice.transport.codec", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("timeslice.transport.codec")
