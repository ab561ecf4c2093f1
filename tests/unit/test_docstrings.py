"""The public API documents itself: every name `timeslice`, `timeslice.snapshot` and
`timeslice.workloads` export has a docstring of its own, and so does every public method of the
clients and of the interfaces users implement (SnapshotBackend, Workload); every call of the
user API (both clients, `Lease`, `timeslice.jobs`) says what it takes, returns and raises. The
extension points go further: every public method of the snapshot interface, of every backend
Timeslice ships, of the workload interface and of every built-in workload (and its options)
says what it takes, what it gives back and what it raises (Google style: Args / Returns /
Raises)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import timeslice
from timeslice import AsyncTimeSliceOrchestratorClient, Lease, TimeSliceOrchestratorClient, jobs
from timeslice.snapshot import SizedSnapshotBackend, SnapshotBackend
from timeslice.snapshot.base import BlockingBackend
from timeslice.snapshot.registry import BACKENDS
from timeslice.workloads import PhaseContext, Workload
from timeslice.workloads.base import AsyncWorkload
from timeslice.workloads.registry import BUILTIN

PACKAGES = ("timeslice", "timeslice.snapshot", "timeslice.workloads")
DOCUMENTED_METHODS = (
    TimeSliceOrchestratorClient,
    AsyncTimeSliceOrchestratorClient,
    SnapshotBackend,
    SizedSnapshotBackend,
    Workload,
    PhaseContext,
)
# The interfaces' calls say what they take, give back and raise (Google style).
SECTIONED = {
    (TimeSliceOrchestratorClient, "acquire"): ("Args:", "Returns:", "Raises:"),
    (TimeSliceOrchestratorClient, "release"): ("Args:", "Raises:"),
    (AsyncTimeSliceOrchestratorClient, "acquire"): ("Args:", "Returns:", "Raises:"),
    (SnapshotBackend, "snapshot"): ("Args:", "Returns:", "Raises:"),
    (SnapshotBackend, "restore"): ("Args:", "Returns:", "Raises:"),
    (Workload, "sample"): ("Args:", "Returns:", "Raises:"),
}


# The user API's calls say what they take, give back and raise, as their signatures show:
# Args when they take arguments, Returns when they give a value back, Raises but for these,
# which raise nothing of their own: the async close (it logs a lease it cannot release; its
# docstring says so), and the functions that only put a status or a progress into words.
USER_API_CLASSES = (TimeSliceOrchestratorClient, AsyncTimeSliceOrchestratorClient, Lease)
RAISE_NOTHING = {
    "AsyncTimeSliceOrchestratorClient.close",
    "jobs.job_failure",
    "jobs.describe_progress",
    "jobs.describe_async_progress",
    "jobs.no_control_worker",
}


def _user_api_calls() -> list[tuple[str, Callable[..., Any]]]:
    calls = []
    for cls in USER_API_CLASSES:
        for name in sorted(dir(cls)):
            member = inspect.getattr_static(cls, name)
            if not name.startswith("_") and inspect.isfunction(member):
                calls.append((f"{cls.__name__}.{name}", member))
    for name, member in sorted(vars(jobs).items()):
        defined_here = inspect.isfunction(member) and member.__module__ == jobs.__name__
        if not name.startswith("_") and defined_here:
            calls.append((f"jobs.{name}", member))
    return calls


def _missing_sections(qualname: str, call: Callable[..., Any]) -> list[str]:
    doc = _own_docstring(call)
    takes = [name for name in inspect.signature(call).parameters if name not in ("self", "cls")]
    # Annotations are strings here (postponed evaluation).
    returns = call.__annotations__.get("return") not in (None, "None")
    wanted = [
        *(["Args:"] if takes else []),
        *(["Returns:"] if returns else []),
        *(["Raises:"] if qualname not in RAISE_NOTHING else []),
    ]
    return [section for section in wanted if section not in doc]


def _public_names(package: str) -> list[str]:
    module = importlib.import_module(package)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return sorted(names)


def _own_docstring(obj: object) -> str:
    """The object's own docstring: not one inherited from a base class, nor the signature a
    dataclass writes for a class without one."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__") or ""
        if dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
            return ""
        return doc.strip()
    if isinstance(obj, property):
        return (obj.fget.__doc__ or "").strip() if obj.fget else ""
    return (getattr(obj, "__doc__", None) or "").strip()


def _undocumented_methods(cls: type) -> list[str]:
    missing = []
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue  # constructors are described in their class docstring
        member = inspect.getattr_static(cls, name)
        if isinstance(member, staticmethod | classmethod):
            member = member.__func__
        if not (inspect.isfunction(member) or isinstance(member, property)):
            continue  # data attributes are described in the class docstring
        if not _own_docstring(member):
            missing.append(f"{cls.__name__}.{name}")
    return missing


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_has_a_docstring(package: str) -> None:
    module = importlib.import_module(package)
    assert (module.__doc__ or "").strip(), f"{package} has no module docstring"
    missing = [name for name in _public_names(package) if not _own_docstring(getattr(module, name))]
    assert not missing, f"{package} exports names without a docstring: {missing}"


@pytest.mark.parametrize("cls", DOCUMENTED_METHODS, ids=lambda c: c.__name__)
def test_public_methods_have_docstrings(cls: type) -> None:
    missing = _undocumented_methods(cls)
    assert not missing, f"public methods without a docstring: {missing}"


@pytest.mark.parametrize(("owner", "method"), sorted(SECTIONED, key=str), ids=str)
def test_interface_calls_say_what_they_take_return_and_raise(owner: type, method: str) -> None:
    doc = _own_docstring(inspect.getattr_static(owner, method))
    missing = [section for section in SECTIONED[owner, method] if section not in doc]
    assert not missing, f"{owner.__name__}.{method} lacks {missing}"


@pytest.mark.parametrize(
    ("qualname", "call"), _user_api_calls(), ids=[name for name, _ in _user_api_calls()]
)
def test_every_user_api_call_says_what_it_takes_returns_and_raises(
    qualname: str, call: Callable[..., Any]
) -> None:
    missing = _missing_sections(qualname, call)
    assert not missing, f"{qualname} lacks {missing}"


def test_the_user_api_check_covers_the_calls_and_can_fail() -> None:
    """The calls are found (both clients' acquire, the jobs' start), and a call whose docstring
    lacks a section is named."""
    found = dict(_user_api_calls())
    assert {
        "TimeSliceOrchestratorClient.acquire",
        "AsyncTimeSliceOrchestratorClient.release",
        "jobs.start_rl_job",
    } <= set(found)

    def take(group_id: str) -> int:
        """Takes a group.

        Raises:
            ValueError: never."""
        return 0

    assert _missing_sections("take", take) == ["Args:", "Returns:"]
    assert set(RAISE_NOTHING) <= set(found), "RAISE_NOTHING names a call that is gone"


def test_the_constructor_parameters_are_each_described() -> None:
    """The clients' 14 constructor parameters, each named in their class docstring's Args."""
    params = [p for p in inspect.signature(timeslice.orchestrator._ClientBase.__init__).parameters]
    params.remove("self")
    for cls in (TimeSliceOrchestratorClient, AsyncTimeSliceOrchestratorClient):
        doc = _own_docstring(cls)
        args = doc.split("Args:", 1)[1] if "Args:" in doc else ""
        missing = [p for p in params if f"\n        {p}: " not in args]
        assert not missing, f"{cls.__name__} does not describe {missing}"


def test_the_checker_finds_what_is_missing() -> None:
    """The checks can fail: a class, a dataclass and a method without docstrings are found,
    and an inherited docstring does not count."""

    class Base:
        """Documented."""

        def call(self) -> None:
            """Documented."""

    class Bare(Base):
        def call(self) -> None:
            pass

        @property
        def size(self) -> int:
            return 0

    @dataclasses.dataclass
    class Plain:
        x: int

    assert not _own_docstring(Bare) and not _own_docstring(Plain)
    assert _undocumented_methods(Bare) == ["Bare.call", "Bare.size"]
    assert _undocumented_methods(Base) == []


# ------------------------------------------------------------ the extension points, sectioned


def _extension_entries() -> list[str]:
    """What the extension-point check covers, by name (resolved when a test runs, so that
    collecting the tests imports no workload's framework): the interfaces, every shipped
    backend (the registry's table) and every built-in workload (the registry's)."""
    return ["interfaces", *(f"backend:{n}" for n in BACKENDS), *(f"workload:{n}" for n in BUILTIN)]


def _classes_of(entry: str) -> list[type]:
    """The classes one entry stands for: a workload with its bases and the options it parses."""
    kind, _, name = entry.partition(":")
    if kind == "interfaces":
        return [SnapshotBackend, SizedSnapshotBackend, BlockingBackend, Workload, AsyncWorkload,
                PhaseContext]  # fmt: skip
    if kind == "backend":
        return [BACKENDS[name].load()]
    module_name, _, factory = BUILTIN[name].partition(":")
    workload = type(getattr(importlib.import_module(module_name), factory)())
    classes = [c for c in workload.__mro__ if c.__module__.startswith("timeslice.")]
    options = getattr(workload, "options_type", None)
    if options is not None:
        classes += [c for c in options.__mro__ if c.__module__.startswith("timeslice.")]
    return classes


def _extension_classes() -> list[type]:
    return list(dict.fromkeys(c for entry in _extension_entries() for c in _classes_of(entry)))


def _raises(function: object) -> bool:
    """Whether the function's own body has a ``raise`` (not one in a function it defines)."""
    try:
        source = textwrap.dedent(inspect.getsource(function))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    (definition,) = ast.parse(source).body
    stack = list(ast.iter_child_nodes(definition))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Raise):
            return True
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))
    return False


def _missing_class_sections(cls: type) -> list[str]:
    """Each public method ``cls`` itself defines that lacks a section it needs: ``Args:`` when
    it takes arguments, ``Returns:`` when it returns a value (a property's docstring is what it
    is), ``Raises:`` when its body raises."""
    missing = []
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_"):
            continue
        if isinstance(member, staticmethod | classmethod):
            member = member.__func__
        if isinstance(member, property):
            if not _own_docstring(member):
                missing.append(f"{cls.__name__}.{name}: a docstring")
            continue
        if not inspect.isfunction(member):
            continue
        doc = _own_docstring(member)
        signature = inspect.signature(member)
        params = [p for p in signature.parameters if p not in ("self", "cls")]
        needs = {
            "Args:": bool(params),
            "Returns:": signature.return_annotation not in ("None", None),
            "Raises:": _raises(member),
        }
        missing += [
            f"{cls.__name__}.{name}: {s}" for s, needed in needs.items() if needed and s not in doc
        ]
    return missing


@pytest.mark.parametrize("entry", _extension_entries())
def test_every_extension_point_method_says_what_it_takes_returns_and_raises(entry: str) -> None:
    missing = [gap for cls in _classes_of(entry) for gap in _missing_class_sections(cls)]
    assert not missing, f"docstrings lacking sections: {missing}"


def test_the_extension_points_are_all_checked() -> None:
    """Every shipped backend and built-in workload is among the classes checked."""
    names = {c.__name__ for c in _extension_classes()}
    assert {"TorchBackend", "JaxBackend", "NoopBackend", "CudaCheckpointBackend"} <= names
    assert {"GrpoToyWorkload", "GrpoJaxWorkload", "HfGrpoWorkload", "GrpoToyOptions"} <= names
    assert len(names) >= len(BACKENDS) + len(BUILTIN) + 6


def test_the_section_checker_finds_what_is_missing() -> None:
    class Backend:
        def snapshot(self, request: object) -> int:
            """Moves it.

            Args:
                request: What.
            """
            if request is None:
                raise ValueError("no request")
            return 0

        def health(self) -> None:
            """Fine."""

        def close(self) -> None:
            """Closes, raising only in what it defines."""

            def inner() -> None:
                raise ValueError

    assert _missing_class_sections(Backend) == [
        "Backend.snapshot: Returns:",
        "Backend.snapshot: Raises:",
    ]


def test_the_async_twin_takes_what_the_blocking_client_takes() -> None:
    """The async client shares the blocking client's Args (``_twin_of``): each of its public
    calls takes the very parameters of its blocking original, and is a coroutine."""
    blocking, twin = TimeSliceOrchestratorClient, AsyncTimeSliceOrchestratorClient
    calls = [n for n in dir(twin) if not n.startswith("_") and inspect.isfunction(getattr(twin, n))]
    assert set(calls) == {
        n
        for n in dir(blocking)
        if not n.startswith("_") and inspect.isfunction(getattr(blocking, n))
    }
    for name in calls:
        if name == "on_accelerators":
            continue  # one method of the base for both
        ours, theirs = (
            inspect.signature(getattr(twin, name)),
            inspect.signature(getattr(blocking, name)),
        )
        assert list(ours.parameters.values()) == list(theirs.parameters.values()), name
        assert inspect.iscoroutinefunction(getattr(twin, name)), name
