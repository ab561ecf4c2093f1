"""Sandbox hygiene: what a workflow run loads inside Temporal's sandbox, and what it shares."""

from __future__ import annotations

import ast
import asyncio
import sys
import uuid
from collections.abc import Collection
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker
from timeslice.workers.sandbox import PASSED_THROUGH, workflow_runner

from .sandbox_probe import SandboxProbe

REPO = Path(__file__).resolve().parent.parent
QUEUE = "test-sandbox"


def _loaded_in_sandbox(address: str) -> dict[str, int]:
    async def go() -> dict[str, int]:
        client = await Client.connect(address)
        async with Worker(
            client, task_queue=QUEUE, workflows=[SandboxProbe], workflow_runner=workflow_runner()
        ):
            return await client.execute_workflow(
                SandboxProbe.run, id=f"sandbox-probe-{uuid.uuid4().hex[:8]}", task_queue=QUEUE
            )

    return asyncio.run(go())


def test_only_workflow_modules_load_in_the_sandbox(address):
    loaded = _loaded_in_sandbox(address)
    # Importing a workflow module must not drag the client, its worker, telemetry or the
    # snapshot backends into every workflow run (the root package loads lazily).
    allowed = {"timeslice", "timeslice.workflows", "timeslice.protocol"}
    outside = sorted(
        name
        for name in loaded
        if name not in allowed
        and not name.startswith(("timeslice.workflows.", "timeslice.protocol."))
    )
    assert outside == [], f"non-workflow modules loaded in the sandbox: {outside}"
    assert "timeslice.workflows.gpu_group" in loaded and "timeslice.workflows.rl_job" in loaded


def test_protocol_and_group_core_are_passed_through_the_rest_reimported(address):
    loaded = _loaded_in_sandbox(address)
    shared = {
        name
        for name, ident in loaded.items()
        if name in sys.modules and id(sys.modules[name]) == ident
    }
    copies = set(loaded) - shared  # imported again inside the sandbox, for this run
    passed = {name for name in PASSED_THROUGH if name.startswith("timeslice")}
    # The models and the workflows' helpers load once per worker, not once per workflow run
    # (the protocol package with every module under it; a helper that only another passed
    # module imports is not in the sandbox's modules at all) ...
    assert not copies & passed, sorted(copies & passed)
    assert not [name for name in copies if name.startswith("timeslice.protocol")], copies
    assert {"timeslice.protocol.group", "timeslice.workflows.job_leases"} <= shared
    # ... and the modules that define workflows stay sandboxed (their state is per run).
    for defines in ("gpu_group", "rl_job", "async_rl_job", "job_base", "pool", "snapshot_job"):
        assert f"timeslice.workflows.{defines}" in loaded
        assert f"timeslice.workflows.{defines}" not in shared


def test_passthrough_is_declared_in_one_place():
    """Workflow modules import plainly; workers/sandbox.py says what is passed through."""
    offenders = [
        str(path.relative_to(REPO))
        for folder in ("workflows", "tests")
        for path in (REPO / folder).glob("*.py")
        if "imports_passed_through" in path.read_text() and path.name != "test_sandbox.py"
    ]
    assert offenders == []


_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "Counter", "deque", "OrderedDict"}
_MUTABLE_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
_MUTATORS = {
    "append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem",
    "remove", "discard", "clear", "sort", "reverse", "appendleft", "popleft",
}  # fmt: skip


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, _MUTABLE_NODES):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        return name in _MUTABLE_CALLS
    return False


def _bound(body: list[ast.stmt]) -> dict[str, ast.expr | None]:
    """The names a module's or a class's body binds, with their values."""
    bound: dict[str, ast.expr | None] = {}
    for stmt in body:
        if isinstance(stmt, ast.Assign):
            bound |= {t.id: stmt.value for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            bound[stmt.target.id] = stmt.value
    return bound


def _changed_in_place(tree: ast.Module, names: set[str]) -> set[str]:
    """Which of ``names`` the module's functions change in place (an item stored or deleted, an
    augmented assignment, a mutating method called); its body runs once, at import."""
    changed: set[str] = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for node in (inner for function in functions for inner in ast.walk(function)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            base = node.value
        elif isinstance(node, ast.AugAssign):
            base = node.target
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = node.func.value if node.func.attr in _MUTATORS else None
        else:
            continue
        if isinstance(base, ast.Name) and base.id in names:
            changed.add(base.id)
    return changed


def _shared_state(tree: ast.Module, models: Collection[str] = ()) -> list[str]:
    """State that one workflow run could change under another outside the sandbox: a
    ``global`` statement, a module-level name the module changes in place, a mutable class
    attribute (not a pydantic model's field default, which each instance copies)."""
    found = [f"global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    found += sorted(_changed_in_place(tree, set(_bound(tree.body))))
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if cls.name not in models:
            bound = _bound(cls.body)
            found += [f"{cls.name}.{name}" for name, value in bound.items() if _mutable(value)]
    return found


def test_workflow_modules_hold_no_state_a_run_could_change():
    """The control worker runs workflows outside the sandbox (workers/sandbox.py,
    ``control_workflow_runner``), where every run shares the modules, so none may hold state
    that a run changes."""
    shared: dict[str, list[str]] = {}
    for folder in ("workflows", "protocol"):
        for path in sorted((REPO / folder).glob("*.py")):
            tree = ast.parse(path.read_text())
            models = {
                n.name
                for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef)
                and any(ast.unparse(b).endswith(("BaseModel", "Model")) for b in n.bases)
            }
            if found := _shared_state(tree, models):
                shared[str(path.relative_to(REPO))] = found
    assert shared == {}


def test_the_probe_for_shared_state_finds_it():
    tree = ast.parse(
        "import collections\nCACHE = {}\nSEEN: list[int] = []\nKINDS = ('a',)\nUNITS = {}\n"
        "UNITS.update(k=1)\n"
        "class W:\n    runs = collections.Counter()\n    name = 'w'\n"
        "def f(x):\n    global RUNS\n    CACHE[x] = 1\n    SEEN.append(x)\n    KINDS.count(x)\n"
    )
    assert _shared_state(tree) == ["global RUNS", "CACHE", "SEEN", "W.runs"]
