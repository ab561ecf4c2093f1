"""The torch snapshot backend on CPU tensors: real torch, real training steps."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest

torch = pytest.importorskip("torch")

from timeslice.snapshot import SnapshotError  # noqa: E402
from timeslice.snapshot.base import SnapshotRequest  # noqa: E402
from timeslice.snapshot.host_arena import page_offsets  # noqa: E402
from timeslice.snapshot.torch_backend import TorchBackend  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class TinyPolicy(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, width)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)
        )
        self.lora_A = torch.nn.Parameter(torch.randn(width, 4) * 0.01)
        self.lora_B = torch.nn.Parameter(torch.zeros(4, width))
        self.head = torch.nn.Linear(width, 32, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = self.body(h) + h @ self.lora_A @ self.lora_B
        return self.head(h)


def train_steps(model: TinyPolicy, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 32, (8, 6), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def make(seed: int = 0) -> tuple[TinyPolicy, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyPolicy()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def state_of(model: TinyPolicy, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def test_snapshot_frees_and_restore_is_bit_identical_in_place():
    model, opt = make()
    train_steps(model, opt, 5, seed=1)
    backend = TorchBackend()
    backend.register_module("policy", model)
    backend.register_optimizer("adam", opt)
    before = state_of(model, opt)
    param_ids = [id(p) for p in model.parameters()]
    moment_ids = [id(s["exp_avg"]) for s in opt.state.values()]
    expected = backend.registered_bytes

    report = asyncio.run(backend.snapshot(SnapshotRequest("job")))
    assert report.bytes == expected and report.mode == "offload" and report.backend == "torch"
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(s["exp_avg"].untyped_storage().nbytes() == 0 for s in opt.state.values())

    restored = asyncio.run(backend.restore(SnapshotRequest("job")))
    assert restored.bytes == expected
    assert [id(p) for p in model.parameters()] == param_ids
    assert [id(s["exp_avg"]) for s in opt.state.values()] == moment_ids
    assert model.head.weight is model.embed.weight
    after = state_of(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_training_continues_exactly_as_an_uninterrupted_run():
    steady, steady_opt = make()
    sliced, sliced_opt = make()
    train_steps(steady, steady_opt, 3, seed=7)
    train_steps(sliced, sliced_opt, 3, seed=7)
    backend = TorchBackend()
    backend.register_module("policy", sliced)
    backend.register_optimizer("adam", sliced_opt)
    for step in range(10):
        backend.snapshot_sync(SnapshotRequest("job"))
        backend.restore_sync(SnapshotRequest("job"))
        train_steps(steady, steady_opt, 1, seed=100 + step)
        train_steps(sliced, sliced_opt, 1, seed=100 + step)
    for a, b in zip(state_of(steady, steady_opt), state_of(sliced, sliced_opt), strict=True):
        assert torch.equal(a, b)


def test_tied_weights_move_once():
    model, _ = make()
    backend = TorchBackend()
    backend.register_module("policy", model)
    distinct = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    assert backend.registered_bytes == sum(distinct.values())


def test_selective_snapshot_moves_only_named_tensors():
    model, _ = make()
    backend = TorchBackend(include=["policy.lora_*"])
    backend.register_module("policy", model)
    lora_bytes = sum(t.numel() * t.element_size() for t in (model.lora_A, model.lora_B))
    body_before = model.body[0].weight.detach().clone()
    lora_before = model.lora_A.detach().clone()
    report = backend.snapshot_sync(SnapshotRequest("job"))
    assert sorted(backend.selected_names()) == ["policy.lora_A", "policy.lora_B"]
    assert report.bytes == lora_bytes
    assert model.lora_A.untyped_storage().nbytes() == 0
    assert model.body[0].weight.untyped_storage().nbytes() > 0
    assert torch.equal(model.body[0].weight, body_before)
    backend.restore_sync(SnapshotRequest("job"))
    assert torch.equal(model.lora_A, lora_before)


def test_exclude_pattern():
    model, _ = make()
    backend = TorchBackend(exclude=["*.lora_*", "policy.body.*"])
    backend.register_module("policy", model)
    # named_parameters() names a tied weight once: the storage moves under its first name.
    assert backend.selected_names() == ["policy.embed.weight"]


def test_discard_mode_releases_memory_without_copying():
    # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB), so the storage is its own
    # mapping and freeing it returns it to the OS, whatever earlier tests allocated and freed
    # (a freed 16 MiB mapping raises the threshold, and the next 16 MiB comes from the heap).
    size = 64 * 1024 * 1024
    big = torch.ones(size // 4)
    backend = TorchBackend(mode="discard")
    backend.register_tensor("weights", big)
    gc.collect()
    before = rss_bytes()
    report = backend.snapshot_sync(SnapshotRequest("job"))
    freed = before - rss_bytes()
    assert report.mode == "discard" and report.bytes == size
    assert freed >= 0.9 * size, f"only {freed} bytes of RSS were released"
    backend.restore_sync(SnapshotRequest("job"))
    assert big.shape == (size // 4,) and big.untyped_storage().nbytes() == size


def test_hundred_cycles_leak_no_memory():
    weights = [torch.randn(256 * 1024) for _ in range(8)]  # 8 MiB
    backend = TorchBackend()
    for i, w in enumerate(weights):
        backend.register_tensor(f"w{i}", w)
    reference = [w.clone() for w in weights]
    for _ in range(5):  # warm-up: the host pool is allocated once
        backend.snapshot_sync(SnapshotRequest("job"))
        backend.restore_sync(SnapshotRequest("job"))
    gc.collect()
    baseline = rss_bytes()
    for _ in range(100):
        backend.snapshot_sync(SnapshotRequest("job"))
        backend.restore_sync(SnapshotRequest("job"))
    gc.collect()
    growth = (rss_bytes() - baseline) / baseline
    assert growth < 0.05, f"RSS grew by {growth:.1%} over 100 cycles"
    assert all(torch.equal(a, b) for a, b in zip(weights, reference, strict=True))


def test_registration_errors():
    backend = TorchBackend()
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        backend.register_tensor("x", [1, 2, 3])
    with pytest.raises(ValueError, match="mode must be"):
        TorchBackend(mode="swap")
    backend.register_tensor("x", torch.ones(4))
    backend.snapshot_sync(SnapshotRequest("job"))
    with pytest.raises(SnapshotError, match="while the state is evicted"):
        backend.register_tensor("y", torch.ones(4))


# ---------------------------------------------------------------- host buffers ahead of a switch


def test_arena_blocks_start_on_pages_and_add_up_to_the_state():
    assert page_offsets([1, 4096, 0, 5000]) == ([0, 4096, 8192, 8192], 16384)
    assert page_offsets([]) == ([], 0)
    with pytest.raises(ValueError, match=">= 0"):
        page_offsets([-1])


def _kept_state(backend: TorchBackend, mib: int) -> list[torch.Tensor]:
    weights = [torch.randn(mib * 1024 * 1024 // 4 // 4) for _ in range(4)]
    for i, w in enumerate(weights):
        backend.register_tensor(f"w{i}", w)
    return weights


def test_reserved_buffers_are_made_once_and_grow_memory_by_the_state_alone():
    backend = TorchBackend(keep_host_buffers="all")
    weights = _kept_state(backend, 64)
    reference = [w.clone() for w in weights]
    state = backend.registered_bytes
    gc.collect()
    before = rss_bytes()
    times = backend.reserve_host_buffers(background=False)
    grown = rss_bytes() - before
    assert times is not None and times.bytes == page_offsets([state // 4] * 4)[1]
    assert not times.pinned  # CPU state: nothing to pin
    # Faulted in ahead (not lazily at the first switch), and no more than the state itself.
    assert 0.95 * state <= grown <= state + 4 * 1024 * 1024, (grown, state)
    arena = backend.arena_times
    for _ in range(3):
        backend.snapshot_sync(SnapshotRequest("job"))
        backend.restore_sync(SnapshotRequest("job"))
    assert backend.arena_times is arena  # no switch made buffers of its own
    assert all(torch.equal(a, b) for a, b in zip(weights, reference, strict=True))


def test_first_snapshot_waits_for_a_reservation_under_way():
    backend = TorchBackend(keep_host_buffers="all")
    weights = _kept_state(backend, 16)
    reference = [w.clone() for w in weights]
    assert backend.reserve_host_buffers() is None  # in the background
    backend.snapshot_sync(SnapshotRequest("job"))
    # Either the reservation or the snapshot made the one arena; never both.
    made = backend.arena_times
    assert made is not None and made.bytes >= backend.registered_bytes
    backend.restore_sync(SnapshotRequest("job"))
    assert backend.reserve_host_buffers(background=False) is None  # nothing left to prepare
    assert backend.arena_times is made
    assert all(torch.equal(a, b) for a, b in zip(weights, reference, strict=True))


def test_a_reservation_that_would_not_fit_is_left_to_the_first_switch(monkeypatch, caplog):
    import timeslice.snapshot.torch_backend as torch_backend

    backend = TorchBackend(keep_host_buffers="all")
    weights = _kept_state(backend, 4)
    reference = [w.clone() for w in weights]
    monkeypatch.setattr(torch_backend, "available_host_bytes", lambda: 1024 * 1024)
    with caplog.at_level("WARNING", logger="timeslice.snapshot.torch"):
        assert backend.reserve_host_buffers(background=False) is None
    assert "not reserving" in caplog.text and backend.arena_times is None
    backend.snapshot_sync(SnapshotRequest("job"))  # the switch makes them: it needs them
    assert backend.arena_times is not None
    backend.restore_sync(SnapshotRequest("job"))
    assert all(torch.equal(a, b) for a, b in zip(weights, reference, strict=True))


def test_cpu_state_keeps_no_buffer_by_default():
    backend = TorchBackend()
    _kept_state(backend, 4)
    assert backend.reserve_host_buffers(background=False) is None  # CPU state: nothing kept
    backend.snapshot_sync(SnapshotRequest("job"))
    backend.restore_sync(SnapshotRequest("job"))
    assert backend.arena_times is None
    with pytest.raises(ValueError, match="keep_host_buffers"):
        TorchBackend(keep_host_buffers="gpu")  # type: ignore[arg-type]


def test_a_registration_after_the_reservation_gets_one_arena_for_the_whole_state():
    backend = TorchBackend(keep_host_buffers="all")
    weights = _kept_state(backend, 4)
    first = backend.reserve_host_buffers(background=False)
    extra = torch.randn(1000)
    backend.register_tensor("extra", extra)
    weights.append(extra)
    reference = [w.clone() for w in weights]
    backend.snapshot_sync(SnapshotRequest("job"))
    made = backend.arena_times
    assert made is not None and made is not first
    assert made.bytes == page_offsets([w.untyped_storage().nbytes() for w in reference])[1]
    backend.restore_sync(SnapshotRequest("job"))
    assert all(torch.equal(a, b) for a, b in zip(weights, reference, strict=True))


def test_a_restore_streams_behind_another_jobs_eviction_within_the_room(tmp_path):
    """Two jobs' tensors, room for one: the restore grows each chunk only once the eviction
    has given its room back, the room never holds more than declared, and every byte comes back
    bit-identical."""
    from timeslice.snapshot.device_room import DeviceRooms

    def state(seed: int) -> tuple[TorchBackend, list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(64 * 1024, generator=gen) for _ in range(8)]  # 256 KiB each
        backend = TorchBackend(chunk_bytes=256 * 1024)
        for i, t in enumerate(tensors):
            backend.register_tensor(f"t{i}", t)
        return backend, tensors

    room = DeviceRooms(tmp_path).room("g")
    (out, out_tensors), (back, back_tensors) = state(1), state(2)
    expected = [t.clone() for t in back_tensors]
    back.snapshot_sync(SnapshotRequest("b"))  # out earlier, through no room
    room.set_capacity(out.registered_bytes)  # one job's state
    out.hold_in(room)

    async def swap() -> None:
        await asyncio.gather(
            back.restore(SnapshotRequest("b", "g", room=room)),
            out.snapshot(SnapshotRequest("a", "g", room=room)),
        )

    asyncio.run(asyncio.wait_for(swap(), timeout=60))
    status = room.status()
    assert status.peak <= out.registered_bytes and status.used == back.registered_bytes
    assert all(t.untyped_storage().nbytes() == 0 for t in out_tensors)
    assert all(torch.equal(t, e) for t, e in zip(back_tensors, expected, strict=True))


def test_state_on_the_cpu_says_it_lives_in_host_memory_and_device_state_does_not():
    """The job process tells its groups a switch of CPU state frees no device memory
    (``snapshot.base.on_host``); a tensor on any other device (here ``meta``, which every
    build has) is device state, and a backend with nothing registered says nothing."""
    from timeslice.snapshot.base import on_host

    model, _ = make()
    cpu = TorchBackend()
    cpu.register_module("policy", model)
    assert cpu.resides_on_host() and on_host(cpu)
    asyncio.run(cpu.snapshot(SnapshotRequest("j")))  # evicted: its host copy, still on host
    assert cpu.evicted and on_host(cpu)
    asyncio.run(cpu.restore(SnapshotRequest("j")))
    mixed = TorchBackend()
    mixed.register_module("policy", model)
    mixed.register_tensor("kv", torch.empty(4, 4, device="meta"))
    assert not on_host(mixed)
    assert not on_host(TorchBackend())


def test_a_restore_that_fails_part_way_gives_its_room_back_and_stays_evicted(tmp_path, monkeypatch):
    """Growing a storage fails part-way through a chunk (out of device memory, say): the chunk
    shrinks back, its room is given back, and the state stays evicted with its bytes in their
    host buffers, so the next eviction moves nothing wrong and the next restore brings every
    byte back."""
    import timeslice.snapshot.torch_backend as torch_backend
    from timeslice.snapshot.device_room import DeviceRooms

    tensors = [torch.randn(256) for _ in range(4)]  # 1 KiB each: one 4-KiB chunk
    expected = [t.clone() for t in tensors]
    backend = TorchBackend(chunk_bytes=4096, keep_host_buffers="all")
    for i, t in enumerate(tensors):
        backend.register_tensor(f"t{i}", t)
    room = DeviceRooms(tmp_path).room("g")
    room.set_capacity(4096)
    backend.hold_in(room)
    backend.snapshot_sync(SnapshotRequest("a", "g", room=room))
    assert room.status().used == 0

    grown = 0
    advise = torch_backend.advise_huge_pages

    def third_fails(address: int, nbytes: int) -> None:
        nonlocal grown
        grown += 1
        if grown == 3:
            raise RuntimeError("out of memory (injected)")
        advise(address, nbytes)

    monkeypatch.setattr(torch_backend, "advise_huge_pages", third_fails)
    with pytest.raises(RuntimeError, match="injected"):
        backend.restore_sync(SnapshotRequest("a", "g", room=room))
    assert room.status().used == 0  # the chunk's room went back
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    assert backend.evicted
    # Nothing on the device to move out; then the restore succeeds with every byte.
    assert backend.snapshot_sync(SnapshotRequest("a", "g", room=room)).bytes == 0
    monkeypatch.setattr(torch_backend, "advise_huge_pages", advise)
    backend.restore_sync(SnapshotRequest("a", "g", room=room))
    assert room.status().used == 4096
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))


def test_discard_mode_restores_zeros():
    tensor = torch.full((1024,), 7.0)
    backend = TorchBackend(mode="discard")
    backend.register_tensor("cache", tensor)
    backend.snapshot_sync(SnapshotRequest("job"))
    backend.restore_sync(SnapshotRequest("job"))
    assert torch.count_nonzero(tensor) == 0
