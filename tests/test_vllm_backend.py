"""vllm backend: argument checks and the sleep / wake-up sequence.

The sequence tests drive a stand-in engine that records calls (vLLM itself needs a GPU); the
`gpu` test runs a real vllm.LLM with dummy weights from a local config (no downloads).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from timeslice.snapshot import SnapshotError
from timeslice.snapshot.vllm_backend import VllmSleepBackend


class Engine:
    def __init__(self, enable_sleep_mode: bool = True) -> None:
        self.calls: list[tuple] = []
        model_config = type("MC", (), {"enable_sleep_mode": enable_sleep_mode})()
        vllm_config = type("VC", (), {"model_config": model_config})()
        self.llm_engine = type("E", (), {"vllm_config": vllm_config})()

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))


def test_level_one_offloads_and_wakes():
    engine = Engine()
    backend = VllmSleepBackend(engine)
    snap = asyncio.run(backend.snapshot("sampler"))
    wake = asyncio.run(backend.restore("sampler"))
    assert engine.calls == [("sleep", 1), ("wake_up", None)]
    assert (snap.backend, snap.mode, wake.mode) == ("vllm", "sleep-1", "wake-up")


def test_level_two_reprovisions_after_wake_up_by_tags():
    engine = Engine()
    loaded: list[object] = []
    backend = VllmSleepBackend(engine, level=2, wake_tags=["weights"], reprovision=loaded.append)
    asyncio.run(backend.snapshot("sampler"))
    asyncio.run(backend.restore("sampler"))
    assert engine.calls == [("sleep", 2), ("wake_up", ["weights"])]
    assert loaded == [engine]


def test_bad_arguments_are_clear():
    with pytest.raises(TypeError, match=r"no sleep\(\) / wake_up\(\)"):
        VllmSleepBackend(object())
    with pytest.raises(SnapshotError, match="without enable_sleep_mode=True"):
        VllmSleepBackend(Engine(enable_sleep_mode=False))
    with pytest.raises(ValueError, match="sleep level must be 1"):
        VllmSleepBackend(Engine(), level=3)
    with pytest.raises(ValueError, match="pass reprovision="):
        VllmSleepBackend(Engine(), level=2)


@pytest.mark.gpu
def test_real_vllm_sleep_frees_device_memory(tmp_path):
    vllm = pytest.importorskip("vllm")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = vllm.LLM(
        model=str(tmp_path),
        load_format="dummy",
        skip_tokenizer_init=True,
        enable_sleep_mode=True,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
    )
    backend = VllmSleepBackend(llm)
    snap = asyncio.run(backend.snapshot("sampler"))
    assert snap.bytes > 0
    wake = asyncio.run(backend.restore("sampler"))
    assert wake.bytes > 0
