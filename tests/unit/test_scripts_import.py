"""The scripts beside the package (benchmarks, the demo, the history recorders) import: a module
that moves breaks them at once, not when someone next runs them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    [
        *(REPO / "bench").glob("*.py"),
        REPO / "examples" / "demo.py",
        REPO / "docs" / "screenshots.py",
        REPO / "tests" / "histories" / "record.py",
        REPO / "tests" / "histories" / "record_rl.py",
        REPO / "tests" / "histories" / "record_async.py",
    ]
)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_script_imports(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As `python path` or `python -m` would: the repository and the script's folder on the path.
    monkeypatch.setattr(sys, "path", [str(REPO), str(path.parent), *sys.path])
    name = f"_script_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)  # imports only: each runs its work under __main__
