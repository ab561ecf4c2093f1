"""The built-in workloads' declared options: what `timeslice job start` checks before anything
starts, and what `timeslice job options` prints."""

from __future__ import annotations

import importlib

import pytest
from timeslice.errors import InvalidArgumentError
from timeslice.jobs import parse_any_job_config
from timeslice.workloads.options import (
    BUILTIN_OPTIONS,
    GrpoToyOptions,
    SimulatedOptions,
    check_workload_options,
)
from timeslice.workloads.registry import BUILTIN


def test_every_builtin_workload_declares_its_options_and_parses_them_so() -> None:
    assert set(BUILTIN_OPTIONS) == set(BUILTIN)
    for name, target in BUILTIN.items():
        module, _, factory = target.partition(":")
        workload = getattr(importlib.import_module(module), factory)()
        assert workload.options_type is BUILTIN_OPTIONS[name], name
        for info in BUILTIN_OPTIONS[name].describe():
            assert info.doc and info.type, (name, info)


def test_a_mistyped_option_names_the_closest_one() -> None:
    with pytest.raises(ValueError, match=r"'reward_latency' \(did you mean 'reward_latency_s'\?\)"):
        check_workload_options("grpo-toy", {"reward_latency": 1.5})
    with pytest.raises(ValueError, match=r"unknown option\(s\) 'zzz'; allowed"):
        check_workload_options("simulated", {"zzz": 1})


@pytest.mark.parametrize(
    ("workload", "options", "said"),
    [
        ("grpo-toy", {"lr": "fast please"}, "option 'lr' must be float, not str"),
        ("grpo-toy", {"layers": 2.5}, "option 'layers' must be int"),
        ("grpo-toy", {"reward_latency_s": -1}, "'reward_latency_s' = -1.0 is invalid"),
        ("grpo-toy", {"heads": 3}, "divides d_model (64)"),
        ("simulated", {"sample_s": True}, "option 'sample_s' must be float, not bool"),
        ("simulated", {"train_s": -0.5}, "'train_s' = -0.5 is invalid"),
        ("hf-grpo", {"digits": 12}, "must be 10"),
        ("grpo-jax", {"hidden": 4}, "'hidden' = 4 is invalid"),
    ],
)
def test_bad_values_are_refused_naming_the_option(
    workload: str, options: dict[str, object], said: str
) -> None:
    with pytest.raises(ValueError) as err:
        check_workload_options(workload, options)
    assert said in str(err.value)


def test_good_values_parse_with_their_defaults() -> None:
    assert check_workload_options("grpo-toy", {"reward_latency_s": 2, "lr": 1e-3})
    sim = SimulatedOptions.parse({"state_bytes": 4e9, "snapshot_s": 0.1}).seconds_and_bytes()
    assert sim["restore_s"] == 0.1 and sim["sync_bytes"] == 4e9 and sim["reward_s"] == 1.5
    assert SimulatedOptions.parse({"restore_s": None}).restore_s is None
    # Your own workload's options are its process's to check.
    assert not check_workload_options("my_project.rl:make_workload", {"anything": 1})


def test_what_only_the_job_host_can_tell_is_left_to_it() -> None:
    """`job start` runs where the CLI runs, not where the job does: a CUDA device is the job
    process's to find."""
    assert GrpoToyOptions.parse({"device": "cuda"}, here=False).device == "cuda"
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available here"):
            GrpoToyOptions.parse({"device": "cuda"})


def test_job_start_refuses_bad_options_before_anything_starts() -> None:
    config = {"job_id": "j", "workload": "grpo-toy", "sampler_group": "g", "epochs": 1}
    with pytest.raises(InvalidArgumentError, match="did you mean 'reward_latency_s'"):
        parse_any_job_config({**config, "workload_options": {"reward_latencyy_s": 1}})
    with pytest.raises(InvalidArgumentError, match="workload_options: simulated"):
        parse_any_job_config(
            {**config, "workload": "simulated", "mode": "async", "trainer_group": "t",
             "workload_options": {"sync_s": -1}}
        )  # fmt: skip
