"""The snapshot backend registry and the request interface, without servers or devices."""

from __future__ import annotations

import asyncio

import pytest
from timeslice.errors import InvalidArgumentError
from timeslice.orchestrator import _backends, _whole_process
from timeslice.snapshot import (
    Capability,
    NoopBackend,
    SimulatedBackend,
    SizedSnapshotBackend,
    SnapshotBackend,
    SnapshotError,
    SnapshotRequest,
)
from timeslice.snapshot.base import registered_bytes
from timeslice.snapshot.cuda_checkpoint import CudaCheckpointBackend
from timeslice.snapshot.registry import (
    BACKENDS,
    BackendEntry,
    Placement,
    create,
    entry,
    node_agent_backends,
)
from timeslice.workers.node_agent import build_node_agent

# Loading it imports torch (seconds); the rest load in milliseconds.
HEAVY = {"torch"}


@pytest.mark.parametrize("name", sorted(set(BACKENDS) - HEAVY))
def test_each_entry_names_a_backend_class_that_declares_what_it_can_do(name: str) -> None:
    cls = entry(name).load()
    assert cls.name == name
    assert isinstance(cls.capabilities, frozenset)
    assert all(isinstance(c, Capability) for c in cls.capabilities)


def test_the_node_agent_runs_the_whole_process_backends() -> None:
    assert node_agent_backends() == ["cuda-checkpoint"]
    for name, found in BACKENDS.items():
        if name in HEAVY:
            continue
        whole = Capability.WHOLE_PROCESS in found.capabilities()
        assert whole == (found.placement is Placement.NODE_AGENT), name


def test_a_backend_whose_package_is_missing_says_which_extra_brings_it() -> None:
    missing = BackendEntry(
        "gone", Placement.JOB_PROCESS, "nothing", "timeslice_no_such_module:Gone", extra="torch"
    )
    with pytest.raises(SnapshotError, match=r"'gone' cannot load: .*install timeslice\[torch\]"):
        missing.load()


def test_unknown_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(SnapshotError, match="unknown snapshot backend 'nope': the backends are"):
        entry("nope")
    with pytest.raises(InvalidArgumentError, match=r"name one of \['noop', 'simulated'\]"):
        _backends(["nope"])


def test_the_client_builds_by_name_only_backends_that_need_nothing_of_the_job() -> None:
    built = _backends(["noop", "simulated"])
    assert isinstance(built["noop"], NoopBackend) and isinstance(
        built["simulated"], SimulatedBackend
    )
    with pytest.raises(InvalidArgumentError, match="'torch' moves objects of yours"):
        _backends(["torch"])
    with pytest.raises(InvalidArgumentError, match="'jax' moves objects of yours"):
        _backends(["jax"])


def test_create_passes_the_backends_own_options() -> None:
    backend = create("simulated", nbytes=7)
    assert isinstance(backend, SnapshotBackend)
    assert registered_bytes(backend) == 7  # it declares KNOWS_SIZE
    assert registered_bytes(NoopBackend()) is None  # it does not
    with pytest.raises(TypeError):
        create("noop", nbytes=1)


def test_a_request_reaches_the_backend_whole() -> None:
    backend = SimulatedBackend(nbytes=3)
    request = SnapshotRequest("job-a", "gpus", "evict for gpus")
    out = asyncio.run(backend.snapshot(request))
    assert (out.job_id, out.bytes) == ("job-a", 3)
    assert asyncio.run(backend.snapshot(request)).bytes == 0  # already out: nothing moves
    assert asyncio.run(backend.restore(request)).bytes == 3


def test_the_client_sends_node_agent_backends_to_the_agent() -> None:
    with pytest.raises(InvalidArgumentError, match="runs in the node agent, not in this process"):
        _backends(["cuda-checkpoint"])
    with pytest.raises(InvalidArgumentError, match="moves whole processes: the node agent runs"):
        _backends([CudaCheckpointBackend()])


def test_only_whole_process_node_backends_make_a_process_register_with_the_agent() -> None:
    assert _whole_process(["cuda-checkpoint"]) and _whole_process(["simulated", "cuda-checkpoint"])
    assert not _whole_process(["simulated"])
    # An agent's own extra backend, which the registry does not know, moves no process.
    assert not _whole_process(["site-specific"])


def test_the_node_agent_refuses_a_backend_of_the_old_interface() -> None:
    class Old:
        name = "old"

        async def snapshot(self, job_id: str) -> None: ...

        async def restore(self, job_id: str) -> None: ...

        def health(self) -> None: ...

    with pytest.raises(SnapshotError, match="is not a snapshot backend: it needs a name, cap"):
        build_node_agent(None, "n", extra_backends=[Old()])  # type: ignore[arg-type,list-item]


def test_without_jax_the_jax_backend_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where JAX is not installed (``import jax`` fails), the backend's module still imports,
    its health says what to install, and the registry names the extra."""
    import sys

    monkeypatch.setitem(sys.modules, "jax", None)  # makes `import jax` raise ImportError
    from timeslice.snapshot.jax_backend import JaxBackend

    assert entry("jax").missing() == "jax is not installed: install timeslice[jax]"
    health = JaxBackend().health()
    assert not health.ok
    assert "needs JAX" in health.detail and "install timeslice[jax]" in health.detail
    assert "jax[tpu]" in health.detail
    with pytest.raises(SnapshotError, match=r"needs JAX .*install timeslice\[jax\]"):
        JaxBackend().register("params", {"w": 1.0})


def test_a_backend_that_claims_its_size_without_saying_it_gets_a_clear_error() -> None:
    """``KNOWS_SIZE`` promises ``registered_bytes`` (SizedSnapshotBackend); a backend that
    declares the one without the other is told so, not met with an AttributeError."""

    class Boasting(NoopBackend):
        name = "boasting"
        capabilities = frozenset({Capability.KNOWS_SIZE})

    with pytest.raises(SnapshotError, match=r"'boasting' declares 'knows-size'.*registered_bytes"):
        registered_bytes(Boasting())
    sized = SimulatedBackend()
    assert isinstance(sized, SizedSnapshotBackend)
    assert registered_bytes(sized) == sized.registered_bytes
    assert not isinstance(NoopBackend(), SizedSnapshotBackend)
    assert registered_bytes(NoopBackend()) is None
