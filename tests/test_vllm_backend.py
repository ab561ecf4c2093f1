"""vllm backend: argument checks, the sleep / wake-up sequence and vLLM's call shapes.

The sequence tests drive a stand-in engine that records calls (vLLM itself needs a GPU); the
call-shape test reads the installed vLLM's signatures where vLLM is installed; the `gpu` test
runs a real vllm.LLM with dummy weights from a local config (no downloads).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tomllib
from pathlib import Path

import pytest
from timeslice.snapshot import SnapshotError
from timeslice.snapshot.base import SnapshotRequest
from timeslice.snapshot.gpu_env import package_version
from timeslice.snapshot.vllm_backend import (
    SLEEP_KEYWORDS,
    VLLM_REQUIREMENT,
    VllmSleepBackend,
    missing_keywords,
    vllm_in_range,
)

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


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


class OldEngine(Engine):
    """An engine from before wake_up took tags (vLLM < 0.8.3)."""

    def wake_up(self) -> None:  # type: ignore[override]
        self.calls.append(("wake_up", None))


def test_level_one_offloads_and_wakes():
    engine = Engine()
    backend = VllmSleepBackend(engine)
    snap = asyncio.run(backend.snapshot(SnapshotRequest("sampler")))
    wake = asyncio.run(backend.restore(SnapshotRequest("sampler")))
    assert engine.calls == [("sleep", 1), ("wake_up", None)]
    assert (snap.backend, snap.mode, wake.mode) == ("vllm", "sleep-1", "wake-up")


def test_level_two_wakes_weights_reprovisions_then_wakes_the_kv_cache():
    engine = Engine()

    def reprovision(llm: Engine) -> None:
        llm.calls.append(("reprovision", llm is engine))

    backend = VllmSleepBackend(engine, level=2, wake_tags=["weights"], reprovision=reprovision)
    asyncio.run(backend.snapshot(SnapshotRequest("sampler")))
    asyncio.run(backend.restore(SnapshotRequest("sampler")))
    assert engine.calls == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("reprovision", True),
        ("wake_up", ["kv_cache"]),
    ]


def test_a_staged_wake_up_ends_with_every_tag_awake():
    engine = Engine()
    backend = VllmSleepBackend(engine, wake_tags=["kv_cache", "weights"])
    asyncio.run(backend.snapshot(SnapshotRequest("sampler")))
    asyncio.run(backend.restore(SnapshotRequest("sampler")))
    assert engine.calls == [("sleep", 1), ("wake_up", ["kv_cache", "weights"])]


def test_bad_arguments_are_clear():
    with pytest.raises(TypeError, match=r"no sleep\(\) / wake_up\(\)"):
        VllmSleepBackend(object())
    with pytest.raises(SnapshotError, match="without enable_sleep_mode=True"):
        VllmSleepBackend(Engine(enable_sleep_mode=False))
    with pytest.raises(ValueError, match="sleep level must be 1"):
        VllmSleepBackend(Engine(), level=3)
    with pytest.raises(ValueError, match="pass reprovision="):
        VllmSleepBackend(Engine(), level=2)
    with pytest.raises(ValueError, match=r"\['scheduling'\] are not vLLM memory tags"):
        VllmSleepBackend(Engine(), wake_tags=["weights", "scheduling"])


def test_an_engine_without_the_keywords_the_backend_passes_is_refused():
    with pytest.raises(TypeError, match=r"OldEngine.wake_up\(\) takes no \['tags'\] argument"):
        VllmSleepBackend(OldEngine())
    assert missing_keywords(Engine().sleep, ("level",)) == []
    assert missing_keywords(OldEngine().wake_up, ("tags",)) == ["tags"]
    assert missing_keywords(lambda **kwargs: None, ("tags",)) == []


def test_health_says_what_it_drives_and_survives_a_failing_engine():
    class Broken(Engine):
        def is_sleeping(self) -> bool:
            raise RuntimeError("engine core died")

    health = VllmSleepBackend(Broken()).health()
    assert health.ok and health.detail.startswith("sleep level 1, sleep state unknown")
    assert "RuntimeError: engine core died" in health.detail
    installed = package_version("vllm")
    if installed is None:
        assert "vLLM not installed, driving a Broken" in health.detail
    else:
        assert f"vLLM {installed}" in health.detail


def test_extras_pin_the_checked_ranges():
    from timeslice.snapshot.gpu_env import CUDA_EXTRAS

    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [VLLM_REQUIREMENT] == ["vllm>=0.8.3,<0.34"]
    assert vllm_in_range("0.8.3") and vllm_in_range("0.33.1rc1") and vllm_in_range("0.10.0")
    assert not vllm_in_range("0.8.2") and not vllm_in_range("0.34.0")
    assert extras["cuda"] == [CUDA_EXTRAS["cuda"]]
    assert extras["cuda13"] == [CUDA_EXTRAS["cuda13"]]


def test_installed_vllm_takes_the_calls_this_backend_makes():
    """Fails when an installed vLLM in the pinned range drifts from the backend's calls."""
    vllm = pytest.importorskip(
        "vllm",
        reason="vLLM is not installed here (a GPU build; tests/gpu/run.sh installs it where it "
        "can): the expected call shapes are checked wherever it is",
    )
    assert vllm_in_range(vllm.__version__), f"{vllm.__version__} is outside {VLLM_REQUIREMENT}"
    for method, names in SLEEP_KEYWORDS.items():
        assert missing_keywords(getattr(vllm.LLM, method), names) == [], f"LLM.{method}"
    assert "enable_sleep_mode" in {f.name for f in dataclasses.fields(vllm.EngineArgs)}


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
    # Staged: weights first, then the KV cache, as for a weight update; the engine must then
    # generate, which it cannot with a tag still asleep.
    backend = VllmSleepBackend(llm, wake_tags=["weights"])
    print(f"vllm health: {backend.health().detail}")
    snap = asyncio.run(backend.snapshot(SnapshotRequest("sampler")))
    assert snap.bytes > 0
    wake = asyncio.run(backend.restore(SnapshotRequest("sampler")))
    assert wake.bytes > 0
    print(
        f"vllm sleep level 1: released {snap.bytes / 2**30:.2f} GiB in {snap.seconds:.2f} s; "
        f"staged wake-up took back {wake.bytes / 2**30:.2f} GiB in {wake.seconds:.2f} s"
    )
    params = vllm.SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4
