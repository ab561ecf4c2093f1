"""Which packages the GPU run needs are there: one line each, MISSING where one is not.

Standard library only, so it reports even where the project could not be installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

# module to import, distribution that provides it
NEEDED = [
    ("timeslice", "timeslice"),
    ("temporalio", "temporalio"),
    ("pydantic", "pydantic"),
    ("pytest", "pytest"),
    ("torch", "torch"),
    ("numpy", "numpy"),
    ("cuda.bindings.driver", "cuda-bindings"),
    ("vllm", "vllm"),
]
# Importing vLLM takes many seconds and starts its plugin machinery: finding it is enough here
# (tests/test_vllm_backend.py imports it).
FIND_ONLY = {"vllm"}


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(no metadata)"


def main() -> None:
    for module, dist in NEEDED:
        try:
            if module in FIND_ONLY:
                if importlib.util.find_spec(module) is None:
                    raise ModuleNotFoundError(f"No module named {module!r}")
            else:
                importlib.import_module(module)
        except Exception as err:  # a broken install is reported like a missing one
            print(f"{dist}: MISSING ({type(err).__name__}: {err})")
        else:
            print(f"{dist}: {version(dist)}")


if __name__ == "__main__":
    main()
