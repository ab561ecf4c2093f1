"""Run by tests/test_jax_backend.py with XLA_FLAGS=--xla_force_host_platform_device_count=2:
sharded and replicated arrays through the jax backend on two CPU devices. Prints one JSON line.

In its own process because JAX fixes its device count when it starts, and other tests in the
same pytest worker must keep one device.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from timeslice.snapshot.base import SnapshotRequest
from timeslice.snapshot.jax_backend import JaxBackend


def main() -> None:
    mesh = jax.make_mesh((2,), ("x",))
    split = NamedSharding(mesh, P("x"))
    replicated = NamedSharding(mesh, P())
    tree = {
        "w": jax.device_put(jnp.arange(64.0).reshape(8, 8), split),
        "b": jax.device_put(jnp.arange(8, dtype=jnp.int32), replicated),
        "h": jax.device_put(
            jax.random.normal(jax.random.key(0), (4, 6)), NamedSharding(mesh, P(None, "x"))
        ),
    }
    before = {k: np.array(v) for k, v in tree.items()}
    shardings = {k: v.sharding for k, v in tree.items()}
    # Every shard on each device, replicas included: 256 + 2 * 32 + 96 bytes.
    expected = sum(int(s.data.nbytes) for v in tree.values() for s in v.addressable_shards)
    backend = JaxBackend()
    holder = backend.register("params", tree)
    snap = backend.snapshot_sync(SnapshotRequest("job"))
    host_kinds = sorted({m.host.sharding.memory_kind for _, m in holder._out_names})
    assert all(v.is_deleted() for v in tree.values())
    rest = backend.restore_sync(SnapshotRequest("job"))
    after = holder.value
    print(
        json.dumps(
            {
                "devices": len(jax.devices()),
                "bit_identical": all(
                    np.array(after[k]).tobytes() == before[k].tobytes() for k in before
                ),
                "same_shardings": all(after[k].sharding == shardings[k] for k in before),
                "host_kinds": host_kinds,
                "expected_bytes": expected,
                "snapshot_bytes": snap.bytes,
                "restore_bytes": rest.bytes,
            }
        )
    )


if __name__ == "__main__":
    main()
