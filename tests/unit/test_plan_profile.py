"""Profiles: hand-written files (and the errors bad ones get), and profiles built from records."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from timeslice.errors import InvalidArgumentError
from timeslice.plan.collect import RLJobRun, client_profile, measured_overheads, rl_job_profile
from timeslice.plan.profile import (
    JobProfile,
    Seconds,
    dump_profile,
    load_overheads,
    load_profile,
    load_profiles,
    profile_schema,
)
from timeslice.protocol.group import LeaseOutcome, LeaseRecord, SnapshotReport
from timeslice.protocol.rl_job import (
    DescribeResult,
    PhaseResult,
    PrepareResult,
    RLJobConfig,
)

GOOD = """\
job_id: grpo-7b
epochs: 200
max_slowdown: 1.3
phases:
  - {name: sample, gpu: true, pool: sampler, seconds: 40}
  - {name: rewards, gpu: false, seconds: 55}
  - {name: train, gpu: true, pool: trainer, seconds: {mean: 20, p90: 24}}
states:
  - {name: sampler, pool: sampler, bytes: 16e9, snapshot_s: 0.7, restore_s: 0.6}
  - {name: trainer, pool: trainer, bytes: 48e9}
"""


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_hand_written_yaml_profile(tmp_path: Path) -> None:
    p = load_profile(write(tmp_path, GOOD))
    assert p.job_id == "grpo-7b" and p.kind == "rl-job" and p.max_slowdown == 1.3
    assert [ph.seconds.mean for ph in p.phases] == [40, 55, 20]
    assert p.states[0].bytes == 16_000_000_000 and p.states[1].snapshot_s is None
    assert p.duty == pytest.approx(60 / 115)
    # Written back (JSON and YAML) and read again: the same profile.
    for name in ("again.json", "again.yaml"):
        dump_profile(p, tmp_path / name)
        assert load_profile(tmp_path / name) == p


def test_a_file_may_hold_several_profiles(tmp_path: Path) -> None:
    other = GOOD.replace("grpo-7b", "other").replace("\n", "\n  ").rstrip()
    text = "- " + GOOD.replace("\n", "\n  ").rstrip() + "\n- " + other + "\n"
    assert [p.job_id for p in load_profiles(write(tmp_path, text))] == ["grpo-7b", "other"]


@pytest.mark.parametrize(
    ("text", "messages"),
    [
        (
            GOOD.replace("pool: sampler, seconds: 40", "seconds: 40"),
            ["phases.0: GPU phase 'sample' needs a pool (sampler or trainer)"],
        ),
        (GOOD.replace("epochs: 200\n", ""), ["epochs: Field required"]),
        (GOOD.replace("seconds: 55", "seconds: -1"), ["phases.1.seconds.mean", "greater than"]),
        (
            GOOD.replace("{mean: 20, p90: 24}", "{mean: 20, min: 30}"),
            ["phases.2.seconds", "mean 20.0 lies outside min..max (30.0..None)"],
        ),
        (GOOD.replace("epochs: 200", "epochs: 200\ncolour: red"), ["colour: Extra inputs"]),
        (
            GOOD.replace("pool: trainer, seconds: {mean", "seconds: {mean")
            .replace("gpu: true, seconds: {mean", "gpu: false, seconds: {mean")
            .replace("pool: sampler, seconds: 40", "seconds: 40")
            .replace("gpu: true, seconds: 40", "gpu: false, seconds: 40"),
            ["no GPU phase"],
        ),
        (GOOD.replace("name: train", "name: sample"), ["phase names repeat: ['sample']"]),
        (GOOD.replace("pool: sampler, bytes", "pool: gpu0, bytes"), ["states.0.pool"]),
        (GOOD.replace("max_slowdown: 1.3", "max_slowdown: 0.5"), ["max_slowdown"]),
        ("job_id: [unclosed\n", ["not valid YAML (line 2, column 1)"]),
        ("- 1\n- 2\n", ["(profile 1): a profile is a mapping"]),
    ],
)
def test_bad_profiles_name_the_file_the_field_and_the_fix(
    tmp_path: Path, text: str, messages: list[str]
) -> None:
    path = write(tmp_path, text, "bad.yaml")
    with pytest.raises(InvalidArgumentError) as caught:
        load_profiles(path)
    message = str(caught.value)
    assert message.startswith(str(path))
    for expected in messages:
        assert expected in message


def test_bad_json_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"not valid JSON \(line 1, column 2"):
        load_profile(write(tmp_path, "{oops", "p.json"))
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        load_profile(tmp_path / "absent.yaml")
    with pytest.raises(InvalidArgumentError, match="grant_s"):
        load_overheads(write(tmp_path, "grant_s: -1\n", "ov.yaml"))


def test_schema_is_the_models() -> None:
    schema = profile_schema()
    assert set(schema["required"]) == {"job_id", "epochs", "phases"}
    assert "PhaseProfile" in schema["$defs"] and "StateProfile" in schema["$defs"]


def test_seconds_summary() -> None:
    s = Seconds.of([1.0, 2.0, 3.0, 4.0, 10.0])
    assert (s.mean, s.min, s.p50, s.max, s.samples) == (4.0, 1.0, 3.0, 10.0, 5)
    assert s.p90 == pytest.approx(4.0 + 0.6 * 6.0)


# ---------------------------------------------------------------- from records


def phase(epoch: int, name: str, start: float, seconds: float, **kw: object) -> PhaseResult:
    return PhaseResult(
        epoch=epoch,
        phase=name,  # type: ignore[arg-type]
        metrics={},
        seconds=seconds,
        mono_start=start,
        mono_end=start + seconds,
        **kw,  # type: ignore[arg-type]
    )


def report(seconds: float, nbytes: int = 1000) -> SnapshotReport:
    return SnapshotReport(
        job_id="j", backend="simulated", mode="simulated", bytes=nbytes, seconds=seconds
    )


def test_rl_profile_from_records() -> None:
    cfg = RLJobConfig(
        job_id="j", workload="simulated", sampler_group="g", epochs=10, checkpoint_every=5
    )
    phases = []
    t = 0.0
    for e in range(3):
        # sample (asked 0.03 s before its grant, on a free group), rewards 40 ms later,
        # train (kept: nobody waited), next sample 80 ms after train.
        restored = [report(0.2), report(0.3)] if e == 1 else []
        phases.append(
            phase(
                e,
                "sample",
                t,
                1.0,
                group_id="g",
                asked_mono=t - 0.05,
                granted_mono=t - 0.02,
                restored=restored,
            )
        )
        phases.append(phase(e, "rewards", t + 1.04, 2.0))
        phases.append(
            phase(
                e,
                "train",
                t + 3.1,
                0.5 + 0.1 * e,
                group_id="g",
                asked_mono=t + 3.04,
                granted_mono=t + 3.07,
                kept=True,
            )
        )
        t += 3.6 + 0.1 * e + 0.08
    run = RLJobRun(
        workflow_id="rl-job-j",
        config=cfg,
        phases=phases,
        checkpoint_s=[0.4],
        describe=DescribeResult(
            workload="simulated",
            sampler_backends=["sampler"],
            trainer_backends=["trainer"],
            epochs_done=0,
        ),
        prepare=PrepareResult(
            epochs_done=0, state_bytes=2000, backend_bytes={"sampler": 1000, "trainer": 1000}
        ),
        runs=1,
    )
    p = rl_job_profile(run, read_at=datetime(2026, 1, 1, tzinfo=UTC))
    assert [(x.name, x.gpu, x.pool, x.seconds.samples) for x in p.phases] == [
        ("sample", True, "sampler", 3),
        ("rewards", False, None, 3),
        ("train", True, "trainer", 3),
    ]
    assert p.phases[2].seconds.mean == pytest.approx(0.6)
    assert p.epochs == 10 and p.checkpoint_every == 5 and p.checkpoint_s is not None
    # One group serves both phases: both states are restored before a phase, in name order.
    states = {s.name: (s.pool, s.bytes, s.restore_s) for s in p.states}
    assert states == {"sampler": ("sampler", 1000, 0.2), "trainer": ("trainer", 1000, 0.3)}
    ov = p.source.overheads  # type: ignore[union-attr]
    assert ov is not None
    assert ov.hop_s == pytest.approx(0.04)
    assert ov.carry_s == pytest.approx(0.08)
    # The sample that restored its state after another job held the group is left out.
    assert ov.request_s + ov.grant_s == pytest.approx(0.03)


def test_rl_profile_needs_a_whole_epoch() -> None:
    cfg = RLJobConfig(job_id="j", workload="simulated", sampler_group="g", epochs=3)
    run = RLJobRun(
        workflow_id="rl-job-j", config=cfg, phases=[phase(0, "sample", 0, 1, group_id="g")]
    )
    with pytest.raises(Exception, match="no completed rewards / train phase yet"):
        rl_job_profile(run)
    with pytest.raises(Exception, match="no completed phase"):
        rl_job_profile(RLJobRun(workflow_id="rl-job-j", config=cfg))


def test_measured_overheads_need_measurements() -> None:
    assert measured_overheads([]) is None


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def lease(job: str, start: float, end: float, token: int) -> LeaseRecord:
    return LeaseRecord(
        job_id=job,
        token=token,
        start=T0 + timedelta(seconds=start),
        end=T0 + timedelta(seconds=end),
        outcome=LeaseOutcome.RELEASED,
    )


def test_client_profile_from_leases() -> None:
    records = [
        lease("c", 0, 1, 1),
        lease("c", 3.1, 4.1, 2),  # gap 2.1, nobody else: work = 2.1 - 2 round trips (0.06)
        lease("other", 4.2, 9, 3),
        lease("c", 9.1, 10.1, 4),  # this gap held a wait for "other": left out
    ]
    p = client_profile("c", "g", records)
    assert p.kind == "client" and p.epochs == 3
    hold, work = p.phases
    assert hold.seconds.mean == pytest.approx(1.0) and hold.seconds.samples == 3
    assert work.seconds.samples == 1 and work.seconds.mean == pytest.approx(2.1 - 0.06)
    with pytest.raises(LookupError, match="holds no lease"):
        client_profile("nobody", "g", records)


def test_profile_model_round_trip_is_lossless() -> None:
    p = JobProfile.model_validate(
        {
            "job_id": "x",
            "kind": "client",
            "epochs": 2,
            "phases": [{"name": "hold", "gpu": True, "pool": "sampler", "seconds": 1}],
        }
    )
    assert JobProfile.model_validate(p.model_dump(mode="json")) == p


def test_the_async_profile_in_docs_plan_md_loads_as_written(tmp_path: Path) -> None:
    """docs/plan.md's async example, verbatim: YAML reads ``4e9`` (no decimal point) as a
    string, which a byte count in ``weight_sync`` takes as a state's ``bytes`` does."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "plan.md").read_text()
    block = next(
        b.split("```", 1)[0] for b in doc.split("```yaml\n")[1:] if "job_id: grpo-async" in b
    )
    p = load_profile(write(tmp_path, block))
    assert p.mode == "async" and p.weight_sync is not None
    assert p.weight_sync.publish_bytes == 4_000_000_000
