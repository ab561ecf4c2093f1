"""The jax snapshot backend on the CPU: real JAX arrays, real optax steps.

On the CPU, JAX's ``device`` and ``pinned_host`` memory are the same RAM, so these tests show
that the arrays really move between memory spaces, are freed and come back bit-identical through
their holders; they say nothing about a TPU's bandwidth. Sharded arrays over two devices run in a
subprocess (tests/jax_sharded_probe.py), since the device count is fixed when JAX starts.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax", reason="the jax backend's tests need JAX: timeslice[jax]")
optax = pytest.importorskip("optax", reason="the jax backend's tests need optax: timeslice[jax]")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from timeslice.snapshot import SnapshotError  # noqa: E402
from timeslice.snapshot.base import SnapshotRequest, registered_bytes  # noqa: E402
from timeslice.snapshot.jax_backend import JaxBackend, JaxState  # noqa: E402

from tests.helpers import REPO  # noqa: E402

REQUEST = SnapshotRequest("job")


def make_params(seed: int = 0, width: int = 32) -> dict:
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "embed": jax.random.normal(k[0], (16, width)),
        "layers": [
            {
                "w": jax.random.normal(k[1], (width, width)) * 0.1,
                "b": jnp.zeros(width),
                "lora_A": jax.random.normal(k[2], (width, 4)) * 0.01,
                "lora_B": jnp.zeros((4, width)),
            }
        ],
        "head": jax.random.normal(k[3], (width, 16)) * 0.1,
    }


def loss_fn(params: dict, tokens: jax.Array) -> jax.Array:
    h = params["embed"][tokens]
    for layer in params["layers"]:
        h = h + jnp.tanh(h @ layer["w"] + layer["b"]) + h @ layer["lora_A"] @ layer["lora_B"]
    logits = h @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()


OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


@jax.jit
def train_step(params: dict, opt_state: tuple, tokens: jax.Array) -> tuple[dict, tuple]:
    grads = jax.grad(loss_fn)(params, tokens)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def tokens_for(step: int) -> jax.Array:
    return jax.random.randint(jax.random.key(1000 + step), (8, 6), 0, 16)


def registered(**options) -> tuple[JaxBackend, JaxState, JaxState]:
    backend = JaxBackend(**options)
    params = backend.register("policy", make_params())
    opt_state = backend.register("adam", OPTIMIZER.init(params.value))
    return backend, params, opt_state


def leaves(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree_util.tree_leaves(tree)]


def bit_identical(a, b) -> bool:
    xs, ys = leaves(a), leaves(b)
    return len(xs) == len(ys) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(xs, ys, strict=True)
    )


def device_bytes_alive() -> int:
    """Bytes of every live array in device memory (not a host memory kind)."""
    return sum(
        x.on_device_size_in_bytes() for x in jax.live_arrays() if x.sharding.memory_kind == "device"
    )


def test_round_trip_is_bit_identical_and_the_holder_gets_the_new_arrays() -> None:
    backend, params, opt_state = registered()
    for step in range(3):
        params.value, opt_state.value = train_step(params.value, opt_state.value, tokens_for(step))
    before = (leaves(params.value), leaves(opt_state.value))
    old = jax.tree_util.tree_leaves(params.value)
    expected = registered_bytes(backend)
    by_shape = sum(x.nbytes for x in jax.tree_util.tree_leaves((params.value, opt_state.value)))
    assert expected == by_shape > 0  # unsharded: the runtime's size is the arrays' own
    gc.collect()  # other tests' garbage must not be freed in between and count as ours
    gc.disable()
    try:
        alive = device_bytes_alive()
        report = asyncio.run(backend.snapshot(REQUEST))
        freed = alive - device_bytes_alive()
    finally:
        gc.enable()
    assert (report.backend, report.mode, report.bytes) == ("jax", "offload", expected)
    assert report.seconds > 0
    assert params.evicted and opt_state.evicted and backend.evicted
    assert all(x.is_deleted() for x in old), "the device buffers were not freed"
    assert freed == expected  # the device memory is gone ...
    host = [moved.host for _, moved in params._out_names]
    assert {h.sharding.memory_kind for h in host} == {"pinned_host"}  # ... and it is host memory
    assert registered_bytes(backend) == expected  # still known while out

    restored = asyncio.run(backend.restore(REQUEST))
    assert restored.bytes == expected and not backend.evicted
    new = jax.tree_util.tree_leaves(params.value)
    assert not any(n is o for n, o in zip(new, old, strict=True))
    assert not any(x.is_deleted() for x in new)
    assert {x.sharding.memory_kind for x in new} == {"device"}
    assert [x.sharding for x in new] == [x.sharding for x in old]
    assert all(h.is_deleted() for h in host), "the host copies outlived the restore"
    assert bit_identical(params.value, before[0]) and bit_identical(opt_state.value, before[1])


def test_training_through_the_holder_continues_exactly_as_an_uninterrupted_run() -> None:
    """A loop that reads its state from the holders trains on through ten switches to the very
    bytes of a loop never switched. Had a restore left a holder pointing at the deleted arrays,
    the next step would raise JAX's "Array has been deleted"."""
    steady_params = make_params()
    steady_opt = OPTIMIZER.init(steady_params)
    backend, params, opt_state = registered()
    for step in range(10):
        backend.snapshot_sync(REQUEST)
        backend.restore_sync(REQUEST)
        steady_params, steady_opt = train_step(steady_params, steady_opt, tokens_for(step))
        params.value, opt_state.value = train_step(params.value, opt_state.value, tokens_for(step))
    assert bit_identical(params.value, steady_params)
    assert bit_identical(opt_state.value, steady_opt)
    assert not bit_identical(params.value, make_params())  # it really trained


def test_deleted_buffers_are_never_read() -> None:
    backend, params, _ = registered()
    stale = params.value  # a reference the loop kept across a switch, against the advice
    backend.snapshot_sync(REQUEST)
    with pytest.raises(SnapshotError, match="'policy' is off the device"):
        _ = params.value
    with pytest.raises(SnapshotError, match="cannot set jax state 'policy'"):
        params.value = make_params()
    with pytest.raises(RuntimeError, match="deleted"):  # JAX refuses; freed memory is not read
        loss_fn(stale, tokens_for(0))
    backend.restore_sync(REQUEST)
    assert np.isfinite(float(loss_fn(params.value, tokens_for(0))))
    with pytest.raises(RuntimeError, match="deleted"):
        loss_fn(stale, tokens_for(0))


def test_a_holder_left_with_a_donated_array_is_refused_and_nothing_moves() -> None:
    backend, params, opt_state = registered()
    donated = jax.tree_util.tree_leaves(params.value)[0]
    full = registered_bytes(backend)
    donated.delete()  # what donate_argnums does to it
    assert registered_bytes(backend) == full - donated.nbytes  # counted, not a crash
    before = leaves(opt_state.value)
    with pytest.raises(SnapshotError, match=r"policy\.embed was deleted before the eviction"):
        backend.snapshot_sync(REQUEST)
    assert not backend.evicted
    assert bit_identical(opt_state.value, before)


def test_selective_snapshot_moves_only_the_lora_leaves() -> None:
    backend, params, opt_state = registered(include=["policy.*lora_*"])
    assert backend.selected_names() == ["policy.layers.0.lora_A", "policy.layers.0.lora_B"]
    layer = params.value["layers"][0]
    lora_bytes = layer["lora_A"].nbytes + layer["lora_B"].nbytes
    kept = {k: v for k, v in layer.items() if not k.startswith("lora")}
    lora_before = leaves([layer["lora_A"], layer["lora_B"]])
    assert registered_bytes(backend) == lora_bytes

    report = backend.snapshot_sync(REQUEST)
    assert report.bytes == lora_bytes
    assert layer["lora_A"].is_deleted() and not layer["w"].is_deleted()
    assert params.evicted and not opt_state.evicted  # nothing of adam's was selected
    opt_state.value = opt_state.value  # a state with nothing out stays usable

    backend.restore_sync(REQUEST)
    restored = params.value["layers"][0]
    assert all(restored[k] is v for k, v in kept.items())  # the untouched arrays stay as they were
    assert bit_identical([restored["lora_A"], restored["lora_B"]], lora_before)


def test_exclude_patterns_and_an_array_in_two_places_moves_once() -> None:
    backend = JaxBackend(exclude=["adam.*", "*.b"])
    shared = jnp.ones((64,))
    holder = backend.register("policy", {"a": shared, "b": jnp.zeros(3), "tied": shared})
    backend.register("adam", {"mu": jnp.zeros(5)})
    assert backend.selected_names() == ["policy.a", "policy.tied"]
    assert registered_bytes(backend) == shared.nbytes
    assert backend.snapshot_sync(REQUEST).bytes == shared.nbytes
    assert backend.restore_sync(REQUEST).bytes == shared.nbytes
    assert holder.value["a"] is holder.value["tied"]  # still one array, in both places


def test_an_array_a_pattern_left_out_but_also_chosen_elsewhere_comes_back_in_both_places():
    """Tied weights where a pattern chose one name and not the other (or another holder holds
    the same array unchosen): the array moves once, is deleted from the device, and every place
    that holds it reads it back after the restore, still one array."""
    backend = JaxBackend(exclude=["policy.head", "other.*"])
    w = jnp.arange(64.0)
    policy = backend.register("policy", {"embed": w, "head": w})
    other = backend.register("other", {"w": w})
    assert backend.selected_names() == ["policy.embed"]
    assert backend.snapshot_sync(REQUEST).bytes == w.nbytes
    assert backend.restore_sync(REQUEST).bytes == w.nbytes
    assert policy.value["embed"] is policy.value["head"] is other.value["w"]
    assert jnp.array_equal(policy.value["head"], jnp.arange(64.0))


@pytest.mark.parametrize("host_memory", ["numpy", "unpinned_host"])
def test_other_host_memories_round_trip_bit_identically(host_memory: str) -> None:
    backend, params, opt_state = registered(host_memory=host_memory)
    params.value, opt_state.value = train_step(params.value, opt_state.value, tokens_for(0))
    before = leaves((params.value, opt_state.value))
    backend.snapshot_sync(REQUEST)
    kinds = {type(m.host).__name__ if host_memory == "numpy" else m.host.sharding.memory_kind
             for _, m in params._out_names}  # fmt: skip
    assert kinds == {"ndarray" if host_memory == "numpy" else host_memory}
    backend.restore_sync(REQUEST)
    assert bit_identical((params.value, opt_state.value), before)


def test_a_failure_part_way_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, params, opt_state = registered(chunk_bytes=1)  # one array per chunk
    before = leaves((params.value, opt_state.value))
    calls = 0
    real = JaxBackend._to_host

    def failing(self, jax_module, arrays):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("host memory exhausted (injected)")
        return real(self, jax_module, arrays)

    monkeypatch.setattr(JaxBackend, "_to_host", failing)
    with pytest.raises(RuntimeError, match="injected"):
        backend.snapshot_sync(REQUEST)
    assert params.evicted  # two arrays went out; the holder says so instead of handing them out
    backend.restore_sync(REQUEST)
    assert bit_identical((params.value, opt_state.value), before)


def test_health_says_what_platform_and_memory_kinds_it_found() -> None:
    backend = JaxBackend()
    health = backend.health()
    assert not health.ok and "nothing registered" in health.detail
    assert "on cpu" in health.detail and "pinned_host" in health.detail
    backend.register("policy", make_params())
    health = backend.health()
    assert health.ok, health.detail
    assert "snapshots go to pinned_host" in health.detail and "resident" in health.detail
    backend.snapshot_sync(REQUEST)
    assert "evicted" in backend.health().detail
    assert "NumPy host buffers" in JaxBackend(host_memory="numpy").health().detail


def test_bad_arguments_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="host_memory must be one of"):
        JaxBackend(host_memory="hbm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes must be > 0"):
        JaxBackend(chunk_bytes=0)
    backend = JaxBackend()
    with pytest.raises(TypeError, match="expected a pytree with JAX arrays"):
        backend.register("x", [1, 2, 3])
    with pytest.raises(ValueError, match=r"no '\.'"):
        backend.register("a.b", jnp.ones(2))
    backend.register("x", jnp.ones(2))
    with pytest.raises(ValueError, match="already registered"):
        backend.register("x", jnp.ones(2))
    backend.snapshot_sync(REQUEST)
    with pytest.raises(SnapshotError, match="while the state is evicted"):
        backend.register("y", jnp.ones(2))
    with pytest.raises(SnapshotError, match="has memory kinds"):
        JaxBackend(host_memory="pinned_host")._host_kind(_FakeDevice())


class _FakeDevice:
    """A device of a platform with no host memory kinds (what ``auto`` falls back from)."""

    platform, id = "fake", 99

    def addressable_memories(self) -> list:
        return []


def test_a_platform_without_host_memory_kinds_falls_back_to_numpy() -> None:
    assert JaxBackend()._host_kind(_FakeDevice()) is None


def test_sharded_arrays_round_trip_on_two_devices() -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "jax_sharded_probe.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    assert result["bit_identical"] and result["same_shardings"]
    assert result["host_kinds"] == ["pinned_host"]
    # The replicated array is on both devices: its bytes count twice, as the runtime says.
    assert result["snapshot_bytes"] == result["restore_bytes"] == result["expected_bytes"]
