"""The import rules of docs/architecture.md ("Package map"), enforced.

Workflow modules run in Temporal's sandbox and are replayed: they import only the standard
library's pure modules, pydantic, temporalio's workflow-side API and each other — no client,
torch, vLLM or I/O module. Nothing below the client imports the client."""

from __future__ import annotations

import ast
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


# What each folder below the top must never import. The job process's activities embed the
# client engine (they take leases the way any client does), so the client never imports the
# activities back: what the engine serves itself (the grant inbox, the snapshot activities,
# starting a group) sits beside it in client/. Nothing below the top imports the CLI, the
# embedded server, the report or the planner.
TOP = ("timeslice.cli", "timeslice.report", "timeslice.plan")
CLIENT = (
    "timeslice.orchestrator",
    "timeslice.engine",
    "timeslice.grants",
    "timeslice.group_start",
    "timeslice.snapshot_activities",
    *TOP,
)
MUST_NOT_IMPORT = {
    "client": ("timeslice.activities", "timeslice.workers", *TOP),
    "transport": ("timeslice.activities", "timeslice.workers", *CLIENT),
    "workflows": CLIENT,
    "snapshot": CLIENT,
    "workloads": CLIENT,
    "activities": TOP,
    "workers": TOP,
}


@pytest.mark.parametrize("package", sorted(MUST_NOT_IMPORT))
def test_lower_packages_do_not_import_what_sits_above_them(package: str) -> None:
    offenders = {
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted((REPO / package).rglob("*.py"))
        for name in _imports(path)
        if name.startswith(MUST_NOT_IMPORT[package])
    }
    assert not offenders, sorted(offenders)


def test_the_rules_can_fail(tmp_path: Path) -> None:
    """The checker sees a forbidden import (so a passing run means something)."""
    module = tmp_path / "bad.py"
    module.write_text("import os\nfrom timeslice.client import x\nimport torch\n")
    assert _imports(module) == {"os", "timeslice.client", "torch"}
    assert not ({"os", "torch"} & WORKFLOW_MAY_IMPORT)
    assert "timeslice.client".startswith(WORKFLOW_MUST_NOT_IMPORT_PREFIXES)


def test_the_client_rule_can_fail(tmp_path: Path) -> None:
    """An import of the activities from client/ is one the client rule names."""
    module = tmp_path / "engine.py"
    module.write_text("from timeslice.activities.grants import GrantInbox\n")
    assert any(name.startswith(MUST_NOT_IMPORT["client"]) for name in _imports(module))
