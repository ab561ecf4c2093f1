"""GroupBook and its pieces: the workflow writes the group's state only through them, and each
of their public methods says what it takes, gives back and raises."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from timeslice.workflows.group_accounts import GroupAccounts
from timeslice.workflows.group_book import GroupBook
from timeslice.workflows.lease_ledger import LeaseLedger
from timeslice.workflows.residency import Residency
from timeslice.workflows.waiter_queue import WaiterQueue

REPO = Path(__file__).resolve().parents[2]
# The Temporal side of the group: it runs what the book decides, and writes no state itself.
WORKFLOW_SIDE = ("workflows/gpu_group.py", "workflows/group_switch.py")
MUTATORS = {"append", "clear", "extend", "insert", "pop", "popitem", "remove", "setdefault",
            "update"}  # fmt: skip
PIECES = (GroupBook, WaiterQueue, LeaseLedger, Residency, GroupAccounts)


def _through_state(node: ast.expr) -> bool:
    """Whether an expression reaches into a ``.state`` (``book.state.stats.runs``)."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute) and node.attr == "state":
            return True
        node = node.value
    return False


def _state_writes(source: str) -> list[int]:
    """Lines that assign into the group's state, or call a mutating method on a part of it."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            if any(_through_state(t) for t in targets):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
            and _through_state(node.func.value)
        ):
            lines.append(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize("module", WORKFLOW_SIDE)
def test_the_workflow_writes_the_state_only_through_the_book(module: str) -> None:
    writes = _state_writes((REPO / module).read_text())
    assert not writes, f"{module} writes the group's state itself at lines {writes}"


def test_the_checker_sees_a_state_write() -> None:
    source = (
        "book.state.stats.runs += 1\n"
        "self._book.state.evicted_jobs.remove(job)\n"
        "book.state.queue = []\n"
        "seen = book.state.stats.runs\n"
        "book.accounts.dropped('refused')\n"
    )
    assert _state_writes(source) == [1, 2, 3]


def _public_methods(cls: type) -> list[tuple[str, object]]:
    return [
        (name, member)
        for name, member in vars(cls).items()
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    ]


@pytest.mark.parametrize("cls", PIECES, ids=lambda c: c.__name__)
def test_every_public_method_documents_itself(cls: type) -> None:
    """A docstring on every public method; ``Args:`` where it takes arguments, ``Returns:``
    where it gives something back, ``Raises:`` where it raises (Google style)."""
    assert (cls.__doc__ or "").strip(), f"{cls.__name__} has no docstring"
    missing = []
    for name, member in _public_methods(cls):
        fn = member.fget if isinstance(member, property) else member
        doc = inspect.getdoc(fn) or ""
        if not doc:
            missing.append(f"{name}: no docstring")
            continue
        if isinstance(member, property):
            continue
        signature = inspect.signature(fn)
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
        wants = {
            "Args:": len(signature.parameters) > 1,
            "Returns:": signature.return_annotation not in ("None", None),
            "Raises:": any(isinstance(n, ast.Raise) for n in ast.walk(tree)),
        }
        missing.extend(f"{name}: no {s}" for s, wanted in wants.items() if wanted and s not in doc)
    assert not missing, f"{cls.__name__}: {missing}"
