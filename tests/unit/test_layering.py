"""The import rules of docs/architecture.md ("Package map"), enforced.

Workflow modules run in Temporal's sandbox and are replayed: they import only the standard
library's pure modules, pydantic, temporalio's workflow-side API and each other — no client,
torch, vLLM or I/O module. Every module of the package sits in one part of one layer
(``LAYERS``), and imports only its own part and the layers below: no arrow runs upward or
sideways. Modules are named through pyproject.toml's package-dir mapping (``client/engine.py``
is ``timeslice.engine``), which hides the real imports from graph tools that read folders."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

WORKFLOW_MAY_IMPORT = {
    "__future__",
    "asyncio",
    "collections",
    "collections.abc",
    "contextlib",
    "dataclasses",
    "datetime",
    "enum",
    "functools",
    "hashlib",
    "hmac",
    "itertools",
    "json",
    "math",
    "re",
    "typing",
    "pydantic",
    "temporalio",
    "temporalio.common",
    "temporalio.exceptions",
    "temporalio.workflow",
}
# The client-side part of temporalio, and anything that does I/O or touches a device.
WORKFLOW_MUST_NOT_IMPORT_PREFIXES = ("temporalio.client", "temporalio.worker", "timeslice.")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("path", sorted((REPO / "workflows").glob("*.py")), ids=lambda p: p.name)
def test_workflow_modules_import_only_pure_modules(path: Path) -> None:
    bad = {
        name
        for name in _imports(path)
        if name not in WORKFLOW_MAY_IMPORT
        and not name.startswith(("timeslice.workflows.", "timeslice.protocol."))
    }
    assert not bad, f"{path.name} imports {sorted(bad)}: not allowed in a workflow module"


@pytest.mark.parametrize("path", sorted((REPO / "protocol").glob("*.py")), ids=lambda p: p.name)
def test_the_contract_is_a_leaf(path: Path) -> None:
    """The message contract imports what a workflow may, and of Timeslice only itself: the
    workflows, the activities and the client all build on it."""
    bad = {
        name
        for name in _imports(path)
        if name not in WORKFLOW_MAY_IMPORT and not name.startswith("timeslice.protocol.")
    }
    assert not bad, f"protocol/{path.name} imports {sorted(bad)}: the contract is a leaf"


# The layers, lowest first. Within a layer, each part imports only itself and the layers below
# it, never a sibling part: the siblings stay independent of each other. A part is a list of
# module prefixes ("timeslice.snapshot" holds timeslice.snapshot.base, not
# timeslice.snapshot_activities); the root package "timeslice" is only its __init__.
LAYERS: list[dict[str, tuple[str, ...]]] = [
    # The contract and the typed errors: leaves that every layer uses.
    {"protocol": ("timeslice.protocol",), "errors": ("timeslice.errors",)},
    # Pure workflow code; the snapshot backends; the plumbing every process talks to Temporal
    # through (connection, updates, telemetry, codec).
    {
        "workflows": ("timeslice.workflows",),
        "snapshot": ("timeslice.snapshot",),
        "transport": ("timeslice.transport",),
    },
    # The client engine and what it serves itself; the workloads (they name their backends).
    {
        "engine": (
            "timeslice.engine",
            "timeslice.grants",
            "timeslice.group_start",
            "timeslice.lease",
            "timeslice.lease_session",
            "timeslice.snapshot_activities",
        ),
        "workloads": ("timeslice.workloads",),
    },
    # The user API; the job runtime and the activities (a job process is a client of the engine).
    {
        "user API": ("timeslice", "timeslice.jobs", "timeslice.orchestrator"),
        "activities": ("timeslice.activities",),
    },
    # The processes users run; the integrations with other libraries' trainers.
    {"workers": ("timeslice.workers",), "integrations": ("timeslice.integrations",)},
    # What users run: the report, the planner (it draws timelines with the report), the CLI.
    {"report": ("timeslice.report",)},
    {"plan": ("timeslice.plan",)},
    {"cli": ("timeslice.cli",)},
]

# Older import paths kept for users (each module replaces itself with the new one). Code of
# the package imports the new path.
ALIASES = {
    "timeslice.codec": "timeslice.transport.codec",
    "timeslice.connection": "timeslice.transport.connection",
    "timeslice.telemetry": "timeslice.transport.telemetry",
    "timeslice.updates": "timeslice.transport.updates",
}


def package_modules() -> dict[str, Path]:
    """Every module of the package by its import name, read through the package-dir mapping."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules: dict[str, Path] = {}
    for package, folder in setuptools["package-dir"].items():
        for path in sorted((REPO / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def part_of(module: str) -> tuple[int, str] | None:
    """The layer (its index) and part a module belongs to; None if no part claims it."""
    best: tuple[int, int, str] | None = None
    for layer, parts in enumerate(LAYERS):
        for part, prefixes in parts.items():
            for prefix in prefixes:
                claims = module == prefix or (
                    prefix != "timeslice" and module.startswith(prefix + ".")
                )
                if claims and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), layer, part)
    return None if best is None else (best[1], best[2])


def imported_modules(path: Path, module: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every Timeslice module ``path`` imports, anywhere in it (a lazy import
    inside a function and a TYPE_CHECKING import count too). ``from timeslice import telemetry``
    imports the submodule when there is one; relative imports are resolved."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((node.lineno, submodule if submodule in known else base))
    return [(line, name) for line, name in found if name.split(".")[0] == "timeslice"]


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def offences(modules: dict[str, Path], others: set[str] = frozenset()) -> list[str]:
    """Every import in ``modules`` that runs upward or sideways, or names an alias or no module
    of the package (``others``: further modules that exist), and every module no part claims;
    each says where it is and what to do."""
    known = set(modules) | set(others) | set(ALIASES)
    found: list[str] = []
    for module, path in sorted(modules.items()):
        if module in ALIASES:
            continue  # kept for users; it imports its new path by name
        where = part_of(module)
        if where is None:
            found.append(f"{module} ({_shown(path)}) is in no part: add it to LAYERS")
            continue
        layer, part = where
        for line, name in sorted(imported_modules(path, module, known)):
            at = f"{_shown(path)}:{line}: {module} ({part}, layer {layer}) imports {name}"
            if name in ALIASES:
                found.append(f"{at}, an alias kept for users: import {ALIASES[name]}")
            elif name not in known:
                found.append(f"{at}, which is no module of the package")
            elif (target := part_of(name)) is None:
                found.append(f"{at}, which is in no part of LAYERS")
            elif target[0] > layer:
                found.append(f"{at} ({target[1]}, layer {target[0]}): upward")
            elif target[0] == layer and target[1] != part:
                found.append(f"{at} ({target[1]}, layer {target[0]}): sideways")
    return found


def test_no_import_runs_upward_or_sideways() -> None:
    found = offences(package_modules())
    for offence in found:
        print(offence)
    assert not found, "imports against docs/architecture.md's package map:\n" + "\n".join(found)


def test_every_layer_names_real_modules() -> None:
    """A prefix that claims no module is a stale rule (a module renamed or moved)."""
    modules = package_modules()
    stale = [
        prefix
        for parts in LAYERS
        for prefixes in parts.values()
        for prefix in prefixes
        if not any(m == prefix or m.startswith(prefix + ".") for m in modules)
    ]
    assert not stale, f"LAYERS names no module for {stale}"


def test_the_workflow_rule_can_fail(tmp_path: Path) -> None:
    """The workflow checker sees a forbidden import (so a passing run means something)."""
    module = tmp_path / "bad.py"
    module.write_text("import os\nfrom timeslice.client import x\nimport torch\n")
    assert _imports(module) == {"os", "timeslice.client", "torch"}
    assert not ({"os", "torch"} & WORKFLOW_MAY_IMPORT)
    assert "timeslice.client".startswith(WORKFLOW_MUST_NOT_IMPORT_PREFIXES)


def test_the_layering_rule_can_fail(tmp_path: Path) -> None:
    """The checker names an upward, a sideways (even inside a function), an alias and an
    unknown import, and a module no part claims (so a passing run means something)."""
    engine = tmp_path / "engine.py"
    engine.write_text(
        "from timeslice.activities.job_runtime import JobRuntime\n"
        "def later():\n"
        "    from timeslice.workloads.base import Workload\n"
        "from timeslice import connection\n"
        "from timeslice.transport.updates import send_update\n"
        "import timeslice.nowhere\n"
    )
    stray = tmp_path / "stray.py"
    stray.write_text("import timeslice.errors\n")
    modules = {"timeslice.engine": engine, "timeslice.stray": stray}
    found = offences(modules, set(package_modules()))
    assert found == [
        "engine.py:1: timeslice.engine (engine, layer 2) imports "
        "timeslice.activities.job_runtime (activities, layer 3): upward",
        "engine.py:3: timeslice.engine (engine, layer 2) imports timeslice.workloads.base "
        "(workloads, layer 2): sideways",
        "engine.py:4: timeslice.engine (engine, layer 2) imports timeslice.connection, an alias "
        "kept for users: import timeslice.transport.connection",
        "engine.py:6: timeslice.engine (engine, layer 2) imports timeslice.nowhere, which is no "
        "module of the package",
        "timeslice.stray (stray.py) is in no part: add it to LAYERS",
    ], found


def test_relative_imports_are_resolved(tmp_path: Path) -> None:
    module = tmp_path / "job_runtime.py"
    module.write_text("from . import state_homes\nfrom ..cli import main\nfrom .. import jobs\n")
    known = set(package_modules())
    assert imported_modules(module, "timeslice.activities.job_runtime", known) == [
        (1, "timeslice.activities.state_homes"),
        (2, "timeslice.cli.main"),
        (3, "timeslice.jobs"),
    ]
