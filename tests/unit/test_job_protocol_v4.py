"""Job protocol v4: the carry a train asks for travels only where both sides speak v4."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice.protocol.group import LeaseReturn, NextPhase
from timeslice.protocol.rl_job import JOB_PROTOCOL_VERSION, PhaseInput, PhaseResult


def encoded(value: PhaseInput) -> dict:
    (payload,) = pydantic_data_converter.payload_converter.to_payloads([value])
    return json.loads(payload.data)


def test_a_phase_input_without_a_carry_encodes_as_before_v4():
    """A run that speaks v3 sends what it always did: a v3 job process refuses unknown
    fields, so the new one must not appear at all, not even as null."""
    plain = PhaseInput(job_id="j", epoch=0, phase="train", release="if_contended")
    assert "carry_into" not in encoded(plain)
    assert "carry_into" not in plain.model_dump(mode="json")


def test_a_carry_round_trips_and_is_checked():
    carry = NextPhase(name="sample", expected_s=0.25)
    inp = PhaseInput(job_id="j", epoch=3, phase="train", release="if_contended", carry_into=carry)
    assert encoded(inp)["carry_into"] == {"name": "sample", "expected_s": 0.25}
    assert PhaseInput.model_validate(encoded(inp)).carry_into == carry
    with pytest.raises(ValidationError):
        NextPhase(name="sample", expected_s=float("nan"))
    assert JOB_PROTOCOL_VERSION >= 4


def test_a_phase_result_keeps_the_groups_answer_within_its_bound():
    fields = {"epoch": 0, "phase": "train", "metrics": {}, "seconds": 1.0, "mono_start": 0.0,
              "mono_end": 1.0}  # fmt: skip
    assert PhaseResult(**fields).carry == ""
    assert PhaseResult(**fields, carry="carrying into sample").carry == "carrying into sample"
    with pytest.raises(ValidationError):
        PhaseResult(**fields, carry="x" * 121)


def test_a_release_without_a_next_phase_encodes_as_before_the_grant_policy():
    """An embedded client's plain release reaches a group of an older release, whose models
    refuse unknown fields: the new field is left out when there is no next phase."""
    plain = LeaseReturn(request_id="r", token=1, key="k" * 16)
    (payload,) = pydantic_data_converter.payload_converter.to_payloads([plain])
    assert "carry_into" not in json.loads(payload.data)
    carried = plain.model_copy(update={"carry_into": NextPhase(name="train", expected_s=1.0)})
    (payload,) = pydantic_data_converter.payload_converter.to_payloads([carried])
    assert LeaseReturn.model_validate_json(payload.data).carry_into == carried.carry_into
