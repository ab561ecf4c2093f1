"""Job protocol v5: a phase's result says whether the process sent the order it was told to ask
for ahead, and says nothing where it had none."""

from __future__ import annotations

import json

from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice.protocol.rl_job import JOB_PROTOCOL_VERSION, EpochRecord, PhaseResult

FIELDS = {"epoch": 0, "phase": "train", "metrics": {}, "seconds": 1.0, "mono_start": 0.0,
          "mono_end": 1.0}  # fmt: skip


def encoded(value: PhaseResult | EpochRecord) -> dict:
    (payload,) = pydantic_data_converter.payload_converter.to_payloads([value])
    return json.loads(payload.data)


def test_a_result_without_a_prefetch_encodes_as_before_v5():
    """Readers of an older release refuse unknown fields (an EpochRecord's holds are results):
    a result with no answer must not carry the field, not even as null."""
    plain = PhaseResult(**FIELDS)
    assert plain.asked_ahead is None
    assert "asked_ahead" not in encoded(plain)
    assert "asked_ahead" not in plain.model_dump(mode="json")
    record = EpochRecord(epoch=0, reward_mean=None, holds=[plain])
    assert "asked_ahead" not in encoded(record)["holds"][0]


def test_the_answer_round_trips():
    for sent in (False, True):
        result = PhaseResult(**FIELDS, asked_ahead=sent)
        assert encoded(result)["asked_ahead"] is sent
        assert PhaseResult.model_validate(encoded(result)).asked_ahead is sent
    assert JOB_PROTOCOL_VERSION == 5
