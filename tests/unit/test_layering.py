"""The import rules of docs/architecture.md ("Package map"), enforced.

Workflow modules run in Temporal's sandbox and are replayed: they import only the standard
library's pure modules, pydantic, temporalio's workflow-side API and each other — no client,
torch, vLLM or I/O module. Every module of the package sits in one part of one layer
(``LAYERS``), and imports only its own part and the layers below: no arrow runs upward or
sideways. Modules are named through pyproject.toml's package-dir mapping
(``client/orchestrator.py`` is ``timeslice.orchestrator``, ``client/session/engine.py`` is
``timeslice.session.engine``), which hides the real imports from graph tools that read
folders. docs/architecture.md's package map names each part's folder; the folders hold what it
says."""

from __future__ import annotations

import ast
import re
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
    # The client's session machinery (the lease session, its retries and diagnosis, the lease,
    # the grant inbox, the snapshot activities, starting a group, the embedded client's engine);
    # the workloads (they name their backends).
    {"session": ("timeslice.session",), "workloads": ("timeslice.workloads",)},
    # The user API; the job runtime and the activities (a job process is a client of the engine).
    {
        "user API": (
            "timeslice",
            "timeslice.jobs",
            "timeslice.orchestrator",
            "timeslice.files",
            "timeslice.pools",
        ),
        "activities": ("timeslice.activities",),
    },
    # The processes users run; the integrations with other libraries' trainers.
    {"workers": ("timeslice.workers",), "integrations": ("timeslice.integrations",)},
    # What users run: the report, the planner (it draws timelines with the report), the CLI.
    {"report": ("timeslice.report",)},
    {"plan": ("timeslice.plan",)},
    {"cli": ("timeslice.cli",)},
]


def package_folders() -> dict[str, Path]:
    """Every package pyproject.toml lists, and its folder, as setuptools finds it: the
    package-dir entry of the package, or of its nearest listed parent with the rest of the name
    as subfolders (``timeslice.session`` is ``client/session``)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped: dict[str, str] = setuptools["package-dir"]
    folders: dict[str, Path] = {}
    for package in setuptools["packages"]:
        parent, rest = package, []
        while parent not in mapped:
            assert "." in parent, f"{package}: no package-dir entry for it or a parent"
            parent, _, child = parent.rpartition(".")
            rest.insert(0, child)
        folders[package] = REPO.joinpath(mapped[parent], *rest)
    return folders


def package_modules() -> dict[str, Path]:
    """Every module of the package by its import name, read through the package-dir mapping."""
    modules: dict[str, Path] = {}
    for package, folder in package_folders().items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def test_every_folder_of_python_files_is_a_listed_package() -> None:
    """A folder of modules that pyproject.toml does not list is left out of the wheel (and out
    of the checks here)."""
    listed = set(package_folders().values())
    unlisted = sorted(
        str(folder.relative_to(REPO))
        for root in {REPO / "client", *listed}
        for folder in [root, *root.rglob("*")]
        if folder.is_dir()
        and "__pycache__" not in folder.parts
        and any(folder.glob("*.py"))
        and folder not in listed
    )
    assert not unlisted, f"folders of modules pyproject.toml does not list: {unlisted}"


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
    """Every import in ``modules`` that runs upward or sideways, or names no module of the
    package (``others``: further modules that exist), and every module no part claims; each
    says where it is and what to do."""
    known = set(modules) | set(others)
    found: list[str] = []
    for module, path in sorted(modules.items()):
        where = part_of(module)
        if where is None:
            found.append(f"{module} ({_shown(path)}) is in no part: add it to LAYERS")
            continue
        layer, part = where
        for line, name in sorted(imported_modules(path, module, known)):
            at = f"{_shown(path)}:{line}: {module} ({part}, layer {layer}) imports {name}"
            if name not in known:
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


def package_map() -> list[tuple[int, str, str]]:
    """(layer, part, folder) for every row of docs/architecture.md's package map (a block whose
    columns are two or more spaces apart; a row without a layer is in the layer above it)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("### Package map", 1)[1].split("```", 2)[1]
    rows: list[tuple[int, str, str]] = []
    layer = -1
    for line in block.strip("\n").splitlines()[1:]:  # the first line names the columns
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 4:
            layer = int(cells[0])
            rows.append((layer, cells[1], cells[3]))
        elif len(cells) == 3:
            rows.append((layer, cells[0], cells[2]))
        # one cell: the "holds" column going on
    return rows


def test_the_package_map_matches_the_folders() -> None:
    """Each row of the documented map is a part of LAYERS, in its layer, and the folder it names
    is where that part's modules are (a file, for a part of one module); every part has a row."""
    modules = package_modules()
    found: list[str] = []
    documented: set[tuple[int, str]] = set()
    for layer, name, folder in package_map():
        parts = LAYERS[layer] if 0 <= layer < len(LAYERS) else {}
        part = next((p for p, prefixes in parts.items() if name in (p, *prefixes)), None)
        if part is None:
            found.append(f"{name}: no part of layer {layer} in LAYERS")
            continue
        documented.add((layer, part))
        where = {
            str(path.relative_to(REPO))
            if folder.endswith(".py")
            else f"{path.parent.relative_to(REPO)}/"
            for module, path in modules.items()
            if part_of(module) == (layer, part)
        }
        if where != {folder}:
            found.append(f"{name}: documented in {folder}, its modules are in {sorted(where)}")
    every = {(layer, part) for layer, parts in enumerate(LAYERS) for part in parts}
    found.extend(f"{part} (layer {layer}) has no row" for layer, part in every - documented)
    assert not found, "docs/architecture.md's package map against the folders:\n" + "\n".join(found)


def test_the_workflow_rule_can_fail(tmp_path: Path) -> None:
    """The workflow checker sees a forbidden import (so a passing run means something)."""
    module = tmp_path / "bad.py"
    module.write_text("import os\nfrom timeslice.client import x\nimport torch\n")
    assert _imports(module) == {"os", "timeslice.client", "torch"}
    assert not ({"os", "torch"} & WORKFLOW_MAY_IMPORT)
    assert "timeslice.client".startswith(WORKFLOW_MUST_NOT_IMPORT_PREFIXES)


def test_the_layering_rule_can_fail(tmp_path: Path) -> None:
    """The checker names an upward (to a folder above, and to the root package), a sideways
    (even inside a function) and an unknown import (a path that moved), and a module no part
    claims (so a passing run means something)."""
    engine = tmp_path / "engine.py"
    engine.write_text(
        "from timeslice.activities.job_runtime import JobRuntime\n"
        "def later():\n"
        "    from timeslice.workloads.base import Workload\n"
        "from timeslice import TimeSliceOrchestratorClient\n"
        "from timeslice.transport.updates import send_update\n"
        "import timeslice.lease_session\n"
    )
    stray = tmp_path / "stray.py"
    stray.write_text("import timeslice.errors\n")
    modules = {"timeslice.session.engine": engine, "timeslice.stray": stray}
    found = offences(modules, set(package_modules()))
    assert found == [
        "engine.py:1: timeslice.session.engine (session, layer 2) imports "
        "timeslice.activities.job_runtime (activities, layer 3): upward",
        "engine.py:3: timeslice.session.engine (session, layer 2) imports "
        "timeslice.workloads.base (workloads, layer 2): sideways",
        "engine.py:4: timeslice.session.engine (session, layer 2) imports timeslice "
        "(user API, layer 3): upward",
        "engine.py:6: timeslice.session.engine (session, layer 2) imports "
        "timeslice.lease_session, which is no module of the package",
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
