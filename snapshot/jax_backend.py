"""The ``jax`` backend: move registered pytrees' arrays to host memory and back (TPU, GPU, CPU).

JAX arrays are immutable: a training step returns new arrays rather than changing the old ones,
and a snapshot that frees device memory must delete the arrays themselves. So the unit of
registration is a *holder* (:class:`JaxState`), not an array: the loop reads its state from
``holder.value`` at the start of each step and puts the step's result back into it, and the
backend swaps the holder's contents at every move::

    state = JaxBackend(include=["policy.*lora*"])  # or everything registered
    params = state.register("policy", params)  # a JaxState holder
    opt_state = state.register("adam", optimizer.init(params.value))
    for batch in batches:
        params.value, opt_state.value = train_step(params.value, opt_state.value, batch)

Snapshot copies every selected array to host memory with the same sharding
(``jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))``; ``unpinned_host`` where a
platform has only that, a NumPy copy where it has neither), waits for the copies, then
``x.delete()`` frees the device buffer. Restore puts the host copies back with the arrays'
original shardings and hands the new arrays to the holders. While a holder's arrays are out,
``holder.value`` raises :class:`SnapshotError` instead of handing out deleted buffers; an old
reference the loop kept raises JAX's own "Array has been deleted" if used, never reads freed
memory. Work goes in chunks, deleting as it goes, so where device and host memory are the same
RAM (the CPU) the peak is one chunk over the state, not a second copy.

This module imports JAX only when it is used: without JAX installed it still imports, and
``health()`` says what to install.
"""

from __future__ import annotations

import fnmatch
import importlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import (
    BlockingBackend,
    Capability,
    Health,
    SnapshotError,
    SnapshotRequest,
    move_report,
)

if TYPE_CHECKING:
    import jax

HostMemory = Literal["auto", "pinned_host", "unpinned_host", "numpy"]
HOST_MEMORIES: tuple[str, ...] = ("auto", "pinned_host", "unpinned_host", "numpy")
INSTALL_HINT = (
    "install timeslice[jax] (JAX's CPU wheels), or on a TPU VM pip install 'jax[tpu]' "
    "beside timeslice"
)


def _jax() -> Any:
    """The ``jax`` module, or SnapshotError saying what to install."""
    try:
        return importlib.import_module("jax")
    except ImportError as err:
        raise SnapshotError(f"the jax snapshot backend needs JAX ({err}): {INSTALL_HINT}") from err


def path_name(name: str, path: tuple[Any, ...]) -> str:
    """``policy.layers.0.w`` for the leaf at ``path`` in the pytree registered as ``name``:
    dict keys, sequence indices and attribute names joined by dots (shell patterns then need no
    escaping of JAX's ``['key']`` brackets)."""
    parts = [name]
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


@dataclass
class _Moved:
    """One array's place while it is off the device: its host copy and where it came from."""

    host: Any  # a jax.Array in a host memory kind, or a numpy.ndarray
    sharding: Any  # the original sharding, device memory kind
    nbytes: int  # device bytes it occupied (every shard, replicas included)


class JaxState:
    """A registered pytree: where the training loop keeps its arrays and finds them again.

    Read ``value`` at the start of each step and assign the step's result back to it. While the
    backend has the arrays out (a snapshot), both raise :class:`SnapshotError`; after a
    restore, ``value`` is the restored arrays (new objects: JAX arrays are immutable)."""

    def __init__(self, backend: JaxBackend, name: str, tree: Any) -> None:
        self._backend = backend
        self.name = name
        self._tree = tree
        # While evicted: the tree's structure and its leaves, the moved ones as _Moved, and
        # the moved leaves' names.
        self._out: tuple[Any, list[Any]] | None = None
        self._out_names: list[tuple[str, _Moved]] = []

    @property
    def evicted(self) -> bool:
        return self._out is not None

    @property
    def value(self) -> Any:
        with self._backend._lock:
            if self._out is not None:
                raise SnapshotError(
                    f"jax state {self.name!r} is off the device (evicted to host memory); "
                    "it comes back before the job's next grant: use it only while holding the group"
                )
            return self._tree

    @value.setter
    def value(self, tree: Any) -> None:
        with self._backend._lock:
            if self._out is not None:
                raise SnapshotError(
                    f"cannot set jax state {self.name!r} while it is off the device "
                    "(evicted to host memory): restore it first"
                )
            self._tree = tree

    def __repr__(self) -> str:
        return f"JaxState({self.name!r}, {'evicted' if self.evicted else 'resident'})"


class JaxBackend(BlockingBackend):
    """Snapshot / restore registered JAX pytrees (parameters, optimizer state, anything).

    ``include`` / ``exclude`` are shell-style patterns over the leaves' dotted path names
    (``"policy.layers.*.lora_*"``); with neither, every array registered moves. Leaves that are
    not JAX arrays (Python numbers, NumPy arrays, ``None``) are host data already and stay.
    ``host_memory``: where the copies go; ``"auto"`` takes ``pinned_host`` where the device
    has it, then ``unpinned_host``, else a NumPy copy.
    """

    name = "jax"
    capabilities = frozenset({Capability.KNOWS_SIZE})

    def __init__(
        self,
        *,
        include: Iterable[str] | None = None,
        exclude: Iterable[str] | None = None,
        host_memory: HostMemory = "auto",
        chunk_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        if host_memory not in HOST_MEMORIES:
            raise ValueError(
                f"host_memory must be one of {list(HOST_MEMORIES)}, not {host_memory!r}"
            )
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, not {chunk_bytes}")
        self.include = list(include or [])
        self.exclude = list(exclude or [])
        self.host_memory: HostMemory = host_memory
        self.chunk_bytes = chunk_bytes
        self._states: dict[str, JaxState] = {}
        self._lock = threading.RLock()
        self._kinds: dict[int, tuple[str, ...]] = {}  # device id -> its memory kinds

    # ------------------------------------------------------------ registration

    def register(self, name: str, tree: Any) -> JaxState:
        """Register the pytree ``tree`` as ``name``.

        Args:
            name: A name without dots: the leaves are named ``name.<their path>``.
            tree: A pytree holding JAX arrays (other leaves stay where they are).

        Returns:
            The holder the training loop reads its arrays from, and puts new ones in, from now.

        Raises:
            ValueError: An empty or dotted name, or one registered already.
            TypeError: ``tree`` holds no JAX array.
            SnapshotError: The state is evicted now.
        """
        jax = _jax()
        if not name or "." in name:
            raise ValueError(f"a jax state's name must be non-empty and have no '.', not {name!r}")
        leaves = jax.tree_util.tree_leaves(tree)
        if not any(isinstance(leaf, jax.Array) for leaf in leaves):
            raise TypeError(f"{name}: expected a pytree with JAX arrays, got {type(tree).__name__}")
        with self._lock:
            if name in self._states:
                raise ValueError(f"jax state {name!r} is already registered")
            if self.evicted:
                raise SnapshotError("cannot register jax state while the state is evicted")
            state = JaxState(self, name, tree)
            self._states[name] = state
            return state

    def states(self) -> dict[str, JaxState]:
        """The registered holders.

        Returns:
            Holders by name, in registration order (a copy of the table).
        """
        return dict(self._states)

    def selected_names(self) -> list[str]:
        """The dotted names of the arrays a snapshot moves (of resident and evicted states).

        Returns:
            Names, in registration order.
        """
        return [n for n, _ in self._selected_leaves()]

    def _selected(self, name: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)

    def _selected_leaves(self) -> Iterator[tuple[str, Any]]:
        """(name, array or _Moved) for every selected leaf, in registration order."""
        if not self._states:
            return
        jax = _jax()
        for state in self._states.values():
            if state._out is not None:
                yield from state._out_names
                continue
            for path, leaf in jax.tree_util.tree_flatten_with_path(state._tree)[0]:
                name = path_name(state.name, path)
                if isinstance(leaf, jax.Array) and self._selected(name):
                    yield name, leaf

    @property
    def evicted(self) -> bool:
        """Whether any registered state is out now."""
        return any(s.evicted for s in self._states.values())

    @property
    def registered_bytes(self) -> int:
        """Device bytes one snapshot moves: the selected distinct arrays, every shard and
        replica counted, as the runtime reports them (measured, not computed from shapes)."""
        with self._lock:
            total, seen = 0, set()
            for _, leaf in self._selected_leaves():
                if id(leaf) in seen:
                    continue
                seen.add(id(leaf))
                if isinstance(leaf, _Moved):
                    total += leaf.nbytes
                elif not leaf.is_deleted():  # a donated one: the snapshot will say so
                    total += _device_bytes(leaf)
            return total

    # ------------------------------------------------------------ health

    def health(self) -> Health:
        """Whether JAX runs here and something is registered: the platform, its memory kinds,
        where snapshots go, and what is registered.

        Returns:
            Ok with those; not ok when JAX is missing, finds no device, or nothing is selected.
        """
        try:
            jax = _jax()
        except SnapshotError as err:
            return Health(self.name, False, str(err))
        try:
            devices = jax.local_devices()
        except RuntimeError as err:  # no backend could initialise (a broken plugin)
            return Health(self.name, False, f"jax {jax.__version__} found no devices: {err}")
        platform = devices[0].platform
        kinds = self._memory_kinds(devices[0])
        found = (
            f"jax {jax.__version__} on {platform} ({len(devices)} local device"
            f"{'s' if len(devices) != 1 else ''}), memory kinds {', '.join(kinds) or 'none'}; "
            f"snapshots go to {self._host_kind(devices[0]) or 'NumPy host buffers'}"
        )
        with self._lock:
            arrays = list(self._selected_leaves())
            if not arrays:
                return Health(self.name, False, f"{found}; nothing registered (or selected)")
            state = "evicted" if self.evicted else "resident"
            return Health(
                self.name,
                True,
                f"{found}; {len(self._states)} pytrees, {len(arrays)} arrays, "
                f"{self.registered_bytes} bytes, {state}",
            )

    def _memory_kinds(self, device: Any) -> tuple[str, ...]:
        found = self._kinds.get(device.id)
        if found is None:
            try:
                found = tuple(m.kind for m in device.addressable_memories())
            except (AttributeError, NotImplementedError, RuntimeError):  # a platform without them
                found = ()
            self._kinds[device.id] = found
        return found

    def _host_kind(self, device: Any) -> str | None:
        """The memory kind snapshots copy to on ``device``'s platform; None: a NumPy copy."""
        kinds = self._memory_kinds(device)
        if self.host_memory == "numpy":
            return None
        if self.host_memory != "auto":
            if self.host_memory not in kinds:
                raise SnapshotError(
                    f"host_memory={self.host_memory!r}, but {device.platform} device {device.id} "
                    f"has memory kinds {list(kinds)}; use 'auto'"
                )
            return self.host_memory
        for kind in ("pinned_host", "unpinned_host"):
            if kind in kinds:
                return kind
        return None

    # ------------------------------------------------------------ snapshot / restore

    def snapshot_sync(self, request: SnapshotRequest) -> SnapshotReport:
        """Copy each selected array to host memory and delete it from the device, chunk by chunk;
        each holder then reads as evicted.

        Args:
            request: The job; only its id is reported.

        Returns:
            Mode ``offload``: the device bytes the copies freed.

        Raises:
            SnapshotError: An array was deleted before the eviction (donated to a jitted call):
                assign each step's new arrays to the holder's ``value``.
        """
        started = time.perf_counter()
        jax = _jax()
        moved = 0
        with self._lock:
            plans: list[tuple[JaxState, Any, list[Any], list[tuple[int, str]]]] = []
            distinct: dict[int, Any] = {}  # id -> array: an array in two places moves once
            for state in self._states.values():
                if state._out is not None:
                    continue
                flat, treedef = jax.tree_util.tree_flatten_with_path(state._tree)
                leaves = [leaf for _, leaf in flat]
                # Every array leaf, chosen or not: one left out by a pattern may be the same
                # array as a chosen one (tied weights), and is deleted with it.
                arrays = []
                for i, (path, leaf) in enumerate(flat):
                    name = path_name(state.name, path)
                    if not isinstance(leaf, jax.Array):
                        continue
                    arrays.append((i, name))
                    if not self._selected(name):
                        continue
                    if leaf.is_deleted():
                        raise SnapshotError(
                            f"{name} was deleted before the eviction (donated to a jitted call, "
                            f"or deleted by hand): assign the arrays each step returns to "
                            f"{state.name}.value, so the holder never keeps a spent one"
                        )
                    distinct.setdefault(id(leaf), leaf)
                if arrays:
                    plans.append((state, treedef, leaves, arrays))
            homes: dict[int, _Moved] = {}
            try:
                for chunk in self._chunks(list(distinct.values())):
                    copies = self._to_host(jax, chunk)
                    for array, (host, nbytes) in zip(chunk, copies, strict=True):
                        homes[id(array)] = _Moved(host, array.sharding, _device_bytes(array))
                        moved += nbytes
                        array.delete()
            finally:
                # Even after a failure part-way, each holder says where its arrays are: what
                # moved is on the host (a restore brings it back), the rest stays resident.
                for state, treedef, leaves, arrays in plans:
                    gone = [(i, name) for i, name in arrays if id(leaves[i]) in homes]
                    if not gone:
                        continue
                    for i, _ in gone:
                        leaves[i] = homes[id(leaves[i])]
                    state._out = (treedef, leaves)
                    state._out_names = [(name, leaves[i]) for i, name in gone]
                    state._tree = None
        return move_report(self.name, request.job_id, "offload", moved, started)

    def restore_sync(self, request: SnapshotRequest) -> SnapshotReport:
        """Put each host copy back on its device, with its own sharding; after a failure part-way
        a second call brings the rest.

        Args:
            request: The job; only its id is reported.

        Returns:
            Mode ``offload``: the device bytes restored.
        """
        started = time.perf_counter()
        jax = _jax()
        moved = 0
        with self._lock:
            out = [s for s in self._states.values() if s._out is not None]
            distinct: dict[int, _Moved] = {}
            for state in out:
                assert state._out is not None
                for leaf in state._out[1]:
                    if isinstance(leaf, _Moved):
                        distinct.setdefault(id(leaf), leaf)
            back: dict[int, Any] = {}
            try:
                for chunk in self._chunks(list(distinct.values())):
                    arrays = jax.device_put([m.host for m in chunk], [m.sharding for m in chunk])
                    jax.block_until_ready(arrays)
                    for m, array in zip(chunk, arrays, strict=True):
                        back[id(m)] = array
                        moved += _device_bytes(array)
                        if isinstance(m.host, jax.Array):
                            m.host.delete()  # the host copy's memory goes back now, not at GC
                        m.host = None
            finally:
                # After a failure part-way, a holder with any array still out stays out (its
                # restored arrays kept), so a second restore brings the rest.
                for state in out:
                    assert state._out is not None
                    treedef, leaves = state._out
                    leaves = [back.get(id(x), x) if isinstance(x, _Moved) else x for x in leaves]
                    if any(isinstance(x, _Moved) for x in leaves):
                        state._out = (treedef, leaves)
                        state._out_names = [
                            (n, m) for n, m in state._out_names if id(m) not in back
                        ]
                        continue
                    state._tree = jax.tree_util.tree_unflatten(treedef, leaves)
                    state._out, state._out_names = None, []
        return move_report(self.name, request.job_id, "offload", moved, started)

    def _to_host(self, jax: Any, arrays: list[Any]) -> list[tuple[Any, int]]:
        """Copy ``arrays`` to host memory, all at once: (host copy, bytes it holds) each."""
        by_kind: dict[str | None, list[int]] = {}
        for i, array in enumerate(arrays):
            device = next(iter(array.sharding.device_set))
            by_kind.setdefault(self._host_kind(device), []).append(i)
        out: list[tuple[Any, int]] = [(None, 0)] * len(arrays)
        for kind, indices in by_kind.items():
            if kind is None:
                import numpy as np

                for i in indices:
                    host = np.array(arrays[i], copy=True)  # its own memory: the array is deleted
                    out[i] = (host, host.nbytes)
                continue
            chunk = [arrays[i] for i in indices]
            copies = jax.device_put(chunk, [a.sharding.with_memory_kind(kind) for a in chunk])
            jax.block_until_ready(copies)
            for i, host in zip(indices, copies, strict=True):
                out[i] = (host, _device_bytes(host))
        return out

    def _chunks(self, items: list[Any]) -> Iterator[list[Any]]:
        chunk: list[Any] = []
        size = 0
        for item in items:
            chunk.append(item)
            size += item.nbytes if isinstance(item, _Moved) else _device_bytes(item)
            if size >= self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk


def _device_bytes(array: jax.Array) -> int:
    """Bytes ``array`` occupies in its memory space: every shard and replica, as the runtime
    reports it."""
    try:
        return int(array.on_device_size_in_bytes())
    except (AttributeError, NotImplementedError):  # older JAX, or a platform without it
        return sum(int(s.data.nbytes) for s in array.addressable_shards)
