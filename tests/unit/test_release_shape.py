"""The two release messages share one shape (``protocol/group.py``'s ``_LeaseEnd``) and still
encode exactly as they did: the same keys, defaults and order, on every path a payload takes."""

from __future__ import annotations

import json

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice.protocol.group import (
    LeaseEnd,
    LeaseReturn,
    NextPhase,
    ReleaseRequest,
    SnapshotReport,
)

KEY = "k" * 16
REPORT = SnapshotReport(job_id="j", backend="torch", mode="offload", bytes=1024, seconds=0.5)
REPORT_DICT = {"job_id": "j", "backend": "torch", "mode": "offload", "bytes": 1024, "seconds": 0.5}


def _wire(value: object) -> bytes:
    (payload,) = pydantic_data_converter.payload_converter.to_payloads([value])
    return payload.data


CASES = [
    pytest.param(
        ReleaseRequest(request_id="r", token=1, key=KEY),
        {"request_id": "r", "token": 1, "key": KEY, "evicted": [], "restored": []},
        id="signal-plain",
    ),
    pytest.param(
        ReleaseRequest(request_id="r", token=7, key=KEY, evicted=[REPORT], restored=[REPORT]),
        {
            "request_id": "r",
            "token": 7,
            "key": KEY,
            "evicted": [REPORT_DICT],
            "restored": [REPORT_DICT],
        },
        id="signal-with-reports",
    ),
    pytest.param(
        LeaseReturn(request_id="r", token=1, key=KEY),
        {
            "request_id": "r",
            "token": 1,
            "key": KEY,
            "restored": [],
            "evicted": [],
            "keep_if_uncontended": False,
            "evicts_itself": False,
        },
        id="update-plain",
    ),
    pytest.param(
        LeaseReturn(
            request_id="r",
            token=2,
            key=KEY,
            restored=[REPORT],
            evicted=[REPORT],
            keep_if_uncontended=True,
            carry_into=NextPhase(name="sample", expected_s=0.25),
            evicts_itself=True,
        ),
        {
            "request_id": "r",
            "token": 2,
            "key": KEY,
            "restored": [REPORT_DICT],
            "evicted": [REPORT_DICT],
            "keep_if_uncontended": True,
            "carry_into": {"name": "sample", "expected_s": 0.25},
            "evicts_itself": True,
        },
        id="update-carried",
    ),
]


@pytest.mark.parametrize(("message", "expected"), CASES)
def test_release_messages_encode_as_before(message: object, expected: dict) -> None:
    dumped = message.model_dump(mode="json")  # type: ignore[attr-defined]
    assert dumped == expected
    # Key order too: the payload's bytes are what a recorded history holds.
    assert list(dumped) == list(expected)
    assert _wire(message) == json.dumps(expected, separators=(",", ":")).encode()
    assert type(message).model_validate_json(_wire(message)) == message  # type: ignore[attr-defined]


def test_the_shared_fields_are_declared_once() -> None:
    assert issubclass(ReleaseRequest, LeaseEnd) and issubclass(LeaseReturn, LeaseEnd)
    assert list(LeaseEnd.model_fields) == ["request_id", "token", "key"]
    for name in ("restored", "evicted"):
        assert repr(ReleaseRequest.model_fields[name]) == repr(LeaseReturn.model_fields[name])
