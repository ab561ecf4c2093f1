"""What a workflow accepts as a message, and what it refuses with a reason (tests/test_fuzz.py
sends the same through a real server)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice.protocol.group import (
    MAX_QUEUE_BYTES,
    MAX_REQUEST_BYTES,
    MAX_WAITERS,
    AcquireRequest,
    GroupConfig,
    GroupInput,
    GroupState,
    GroupStats,
    MalformedMessage,
    QueueTarget,
    RenewRequest,
    SnapshotJobInput,
    SnapshotTarget,
    Undecodable,
    encoded_size,
    lease_key_hash,
    parse_message,
)
from timeslice.protocol.rl_job import (
    BUILTIN_WORKLOADS,
    MAX_OPTIONS_BYTES,
    DescribeResult,
    RLJobConfig,
    check_workload,
)
from timeslice.workers.control import TolerantPayloadConverter, control_data_converter
from timeslice.workflows.group_book import GroupBook
from timeslice.workloads.registry import BUILTIN

T0 = datetime(2026, 1, 12, tzinfo=UTC)
KEY = "k" * 16


def renew(**changes: object) -> dict[str, object]:
    return {"request_id": "r1", "token": 1, "key": KEY, **changes}


def request(n: int, **changes: object) -> AcquireRequest:
    fields: dict[str, object] = {
        "request_id": f"r{n}",
        "job_id": "j",
        "reply_task_queue": "q",
        "key_hash": lease_key_hash(KEY),
    }
    fields.update(changes)
    return AcquireRequest.model_validate(fields)


def test_parse_message_takes_exactly_one_valid_argument():
    assert parse_message(RenewRequest, (renew(),), "renew").token == 1
    model = RenewRequest.model_validate(renew())
    assert parse_message(RenewRequest, (model,), "renew") is model
    with pytest.raises(MalformedMessage, match=r"renew takes one argument \(RenewRequest"):
        parse_message(RenewRequest, (), "renew")
    with pytest.raises(MalformedMessage, match="not 2"):
        parse_message(RenewRequest, (renew(), renew()), "renew")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (None, "input: Input should be a valid dictionary"),
        ("renew", "input: Input should be a valid dictionary"),
        (renew(token=-1), "token: Input should be greater than or equal to 0"),
        (renew(token=math.nan), "token: Input should be a finite number"),
        (renew(token=2**64), "token: Input should be less than or equal to"),
        (renew(key="short"), "key: String should have at least 16 characters"),
        (renew(request_id="x" * 201), "request_id: String should have at most 200 characters"),
        (renew(extra=1), "extra: Extra inputs are not permitted"),
        ({"token": 1, "key": KEY}, "request_id: Field required"),
    ],
)
def test_parse_message_says_what_is_wrong(value, problem):
    with pytest.raises(MalformedMessage) as info:
        parse_message(RenewRequest, (value,), "the renew update")
    assert str(info.value).startswith("the renew update: invalid RenewRequest: ")
    assert problem in str(info.value)
    assert "x" * 201 not in str(info.value)  # the message names the rule, not the input


def test_undecodable_payload_is_refused_with_its_reason():
    bad = Undecodable(encoding="json/plain", error="input: Invalid JSON: EOF")
    with pytest.raises(MalformedMessage, match=r"could not be decoded \(json/plain\): input: Inv"):
        parse_message(RenewRequest, (bad,), "renew")


def test_tolerant_converter_hands_undecodable_payloads_over():
    converter = TolerantPayloadConverter()
    good = Payload(metadata={"encoding": b"json/plain"}, data=b'{"a": 1}')
    payloads = [
        good,
        Payload(metadata={"encoding": b"json/plain"}, data=b"{"),
        Payload(metadata={"encoding": b"json/plain"}, data=b"[" * 500 + b"]" * 500),
        Payload(metadata={"encoding": b"no/such"}, data=b"{}"),
    ]
    values = converter.from_payloads(payloads, None)
    assert values[0] == {"a": 1}
    assert [type(v) for v in values[1:]] == [Undecodable] * 3
    assert "EOF while parsing" in values[1].error
    assert "recursion limit" in values[2].error
    assert values[3].encoding == "no/such"
    # A typed decode is left as it was: it raises.
    with pytest.raises(ValidationError):
        converter.from_payloads([payloads[1]], [dict])
    [raw] = converter.from_payloads([payloads[1]], [RawValue])
    assert isinstance(raw, RawValue)


def test_control_worker_converter_keeps_the_codec_and_failure_converter():
    converter = control_data_converter(pydantic_data_converter)
    assert converter.payload_converter_class is TolerantPayloadConverter
    assert converter.payload_codec is pydantic_data_converter.payload_codec
    assert converter.failure_converter_class is pydantic_data_converter.failure_converter_class


@pytest.mark.parametrize(
    ("task_queue", "problem"),
    [
        ("/_sys/q", "reserved by Temporal"),
        ("   ", "printable, not blank"),
        ("a\x00b", "printable, not blank"),
        ("", "at least 1 character"),
        ("q" * 301, "at most 300 characters"),
    ],
)
def test_task_queues_temporal_would_refuse_are_refused(task_queue, problem):
    with pytest.raises(ValidationError, match=problem):
        request(1, reply_task_queue=task_queue)
    with pytest.raises(ValidationError, match=problem):
        QueueTarget(task_queue=task_queue, backends=["noop"])


@pytest.mark.parametrize(
    ("created_at", "problem"),
    [
        ("2026-01-12T00:00:00", "must carry its timezone"),
        ("9999-12-31T23:59:59Z", "must lie in 2000-2999"),
        ("0001-01-01T00:00:00Z", "must lie in 2000-2999"),
    ],
)
def test_carried_times_are_aware_and_near(created_at, problem):
    with pytest.raises(ValidationError, match=problem):
        GroupInput.model_validate(
            {"config": {"group_id": "g"}, "state": {"stats": {"created_at": created_at}}}
        )
    other_zone = datetime(2026, 1, 12, tzinfo=timezone(timedelta(hours=5)))
    assert GroupStats(created_at=other_zone).created_at == other_zone


def test_group_config_numbers_are_bounded():
    for bad in ({"aging_s": math.inf}, {"memory_bytes": 2**80}, {"grant_ack_timeout_s": math.nan}):
        with pytest.raises(ValidationError):
            GroupConfig.model_validate({"group_id": "g", **bad})


def test_snapshot_job_ids_are_checked():
    target = SnapshotTarget(queues=[QueueTarget(task_queue="q", backends=["noop"])])
    with pytest.raises(ValidationError, match="invalid job id"):
        SnapshotJobInput(job_id="j" * 101, action="snapshot", target=target)


def book() -> GroupBook:
    return GroupBook(GroupConfig(group_id="g"), GroupState(stats=GroupStats(created_at=T0)))


def test_queue_refuses_requests_past_its_count():
    b = book()
    for n in range(MAX_WAITERS):
        assert b.refusal(request(n)) is None
        b.enqueue(request(n), T0)
    assert "queue is full (1000 waiters)" in (b.refusal(request(MAX_WAITERS)) or "")
    assert b.refusal(request(0)) is None  # a request the group knows is never refused


def _target(queues: int) -> SnapshotTarget:
    return SnapshotTarget(
        queues=[
            QueueTarget(task_queue=f"q{i}-" + "q" * 250, backends=["b" * 100] * 16)
            for i in range(queues)
        ]
    )


def test_a_request_past_its_bytes_is_refused():
    """Bytes as the data converter encodes them (UTF-8: this emoji takes four), not characters."""
    b = book()
    assert encoded_size(request(0, snapshot=_target(64))) > MAX_REQUEST_BYTES
    assert "more than a group carries for one request" in (
        b.refusal(request(0, snapshot=_target(64))) or ""
    )
    escaped = SnapshotTarget(
        queues=[
            QueueTarget(task_queue=f"q{i}", backends=["\U0001f600" * 100] * 16) for i in range(12)
        ]
    )
    assert len(request(0, snapshot=escaped).model_dump_json()) < MAX_REQUEST_BYTES
    assert b.refusal(request(0, snapshot=escaped)) is not None


def test_queue_refuses_requests_past_its_bytes():
    b = book()
    big = _target(24)
    size = encoded_size(request(0, snapshot=big))
    fits = MAX_QUEUE_BYTES // size
    for n in range(fits):
        assert b.refusal(request(n, snapshot=big)) is None
        b.enqueue(request(n, snapshot=big), T0)
    assert f"{MAX_QUEUE_BYTES} bytes of requests" in (b.refusal(request(fits, snapshot=big)) or "")
    assert b.refusal(request(fits)) is None  # a small one still fits


@pytest.mark.parametrize("name", [*BUILTIN_WORKLOADS, "my_project.rl:make", "pkg:factory"])
def test_known_workload_names(name):
    assert check_workload(name) == name


@pytest.mark.parametrize(
    "name", ["nosuch", "grpo_toy", "GRPO-TOY", "mod:", ":attr", "a b:c", "m:a.b"]
)
def test_unknown_workload_names_are_refused(name):
    with pytest.raises(ValueError, match=f"unknown workload {name!r}: use a built-in"):
        check_workload(name)


def test_builtin_workload_names_match_the_registry():
    assert set(BUILTIN_WORKLOADS) == set(BUILTIN)


def config(**changes: object) -> dict[str, object]:
    return {"job_id": "j", "workload": "simulated", "sampler_group": "g", "epochs": 1, **changes}


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"lr": math.nan}, "must be finite numbers"),
        ({"lr": math.inf}, "must be finite numbers"),
        ({"deep": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}, "nest deeper than 16 levels"),
        ({"big": "x" * MAX_OPTIONS_BYTES}, f"at most {MAX_OPTIONS_BYTES}"),
        ({"obj": object()}, "must be JSON values"),
    ],
)
def test_workload_options_are_bounded(options, problem):
    with pytest.raises(ValidationError, match=problem):
        RLJobConfig.model_validate(config(workload_options=options))


def test_plain_workload_options_pass():
    options = {"lr": 0.003, "sampler": "vllm", "nested": {"list": [1, 2.5, None, True]}}
    assert RLJobConfig.model_validate(config(workload_options=options)).workload_options == options


def test_describe_result_tolerates_the_fields_older_job_processes_sent():
    """`pid` and `ready` were sent by job processes before they were dropped (nothing read
    them); an answer carrying them, as running jobs' histories do, still parses."""
    older = {
        "workload": "simulated",
        "sampler_backends": ["sampler"],
        "trainer_backends": ["trainer"],
        "pid": 4242,
        "ready": True,
        "epochs_done": 3,
        "protocol": 3,
    }
    parsed = DescribeResult.model_validate(older)
    assert parsed.epochs_done == 3 and parsed.protocol == 3
    assert "pid" not in parsed.model_dump() and "ready" not in parsed.model_dump()
    with pytest.raises(ValidationError):  # what it needs is still checked
        DescribeResult.model_validate({k: v for k, v in older.items() if k != "workload"})
    with pytest.raises(ValidationError, match="nonsense"):  # and any other field refused
        DescribeResult.model_validate({**older, "nonsense": True})
