"""The optional payload codec (timeslice.transport.codec): AES-256-GCM, key rotation, clear key
errors, and end to end: a real control worker and client encrypting every payload of a group."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.message import Message
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.api.failure.v1 import Failure
from temporalio.client import Client
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError
from timeslice import TimeSliceOrchestratorClient
from timeslice.cli.services import start_service, stop_service
from timeslice.protocol.group import AcquireRequest, GroupSignal, group_workflow_id
from timeslice.transport.codec import (
    ENCODING,
    KEY_ENV,
    KEY_ID_METADATA,
    UNDECRYPTABLE,
    PayloadEncryptionCodec,
    PayloadKeyError,
    key_id,
    new_key,
    parse_keys,
)
from timeslice.transport.connection import connect, connect_config, data_converter

from tests.helpers import new_namespace, wait_for


def _codec(*keys: str) -> PayloadEncryptionCodec:
    return PayloadEncryptionCodec(parse_keys(",".join(keys)))


def _request(job_id: str = "job-secret-7") -> AcquireRequest:
    return AcquireRequest(
        request_id=f"{job_id}:1", job_id=job_id, reply_task_queue="q", key_hash="ab" * 32
    )


def _encoded(codec: PayloadEncryptionCodec, value: object) -> Payload:
    payloads = data_converter().payload_converter.to_payloads([value])
    (sealed,) = asyncio.run(codec.encode(payloads))
    return sealed


# ------------------------------------------------------------------ unit: the codec alone


def test_round_trip_hides_the_payload_and_its_type(monkeypatch):
    monkeypatch.setenv(KEY_ENV, new_key())
    converter = data_converter()
    request = _request()
    (sealed,) = asyncio.run(converter.encode([request]))
    assert sealed.metadata["encoding"] == ENCODING
    assert set(sealed.metadata) == {"encoding", KEY_ID_METADATA}  # no inner encoding or type
    assert b"job-secret-7" not in sealed.data and b"json" not in sealed.data
    (back,) = asyncio.run(converter.decode([sealed], [AcquireRequest]))
    assert back == request
    # Fresh nonce each time: the same value never encrypts to the same bytes.
    (again,) = asyncio.run(converter.encode([request]))
    assert again.data != sealed.data


def test_unset_key_means_plain_pydantic_payloads(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    converter = data_converter()
    assert converter.payload_codec is None
    (plain,) = asyncio.run(converter.encode([_request()]))
    assert b"job-secret-7" in plain.data


def test_wrong_key_or_altered_bytes_are_refused_not_raised():
    keyed = _codec(new_key())
    sealed = _encoded(keyed, _request())
    # Another key: the payload names a key id this codec does not have.
    (refused,) = asyncio.run(_codec(new_key()).decode([sealed]))
    assert refused.metadata["encoding"] == UNDECRYPTABLE and refused.data == b""
    # The right key, one bit flipped: the tag does not authenticate.
    tampered = Payload()
    tampered.CopyFrom(sealed)
    tampered.data = sealed.data[:20] + bytes([sealed.data[20] ^ 1]) + sealed.data[21:]
    (refused,) = asyncio.run(keyed.decode([tampered]))
    assert refused.metadata["encoding"] == UNDECRYPTABLE and refused.data == b""
    # What the SDK then says where the value is needed.
    with pytest.raises(KeyError, match="binary/undecryptable"):
        data_converter().payload_converter.from_payloads([refused], [AcquireRequest])


def test_unencrypted_payloads_pass_through():
    codec = _codec(new_key())
    plain = data_converter().payload_converter.to_payloads([_request()])
    assert asyncio.run(codec.decode(plain)) == plain


def test_rotation_decodes_with_any_key_and_encodes_with_the_first():
    old, new = new_key(), new_key()
    before = _codec(old)
    during = _codec(new, old)  # step 2 of docs/security.md's rotation: the new key first
    old_payload = _encoded(before, _request())
    (opened,) = asyncio.run(during.decode([old_payload]))
    assert b"job-secret-7" in opened.data
    new_payload = _encoded(during, _request())
    assert new_payload.metadata[KEY_ID_METADATA] == key_id(base64.b64decode(new)).encode()
    assert during.key_ids == [key_id(base64.b64decode(k)) for k in (new, old)]
    # A process still on the old key alone cannot read it (so rotate in the documented order).
    (refused,) = asyncio.run(before.decode([new_payload]))
    assert refused.metadata["encoding"] == UNDECRYPTABLE


def test_failure_messages_are_encrypted_too(monkeypatch):
    monkeypatch.setenv(KEY_ENV, new_key())
    converter = data_converter()
    try:
        raise ApplicationError("job job-secret-7 failed", type="Boom")
    except ApplicationError as err:
        raised = err
    failure = Failure()
    asyncio.run(converter.encode_failure(raised, failure))
    assert "job-secret-7" not in failure.message and "job-secret-7" not in failure.stack_trace
    assert failure.encoded_attributes.metadata["encoding"] == ENCODING
    assert failure.application_failure_info.type == "Boom"  # types stay readable
    error = asyncio.run(converter.decode_failure(failure))
    assert isinstance(error, ApplicationError) and error.message == "job job-secret-7 failed"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "set but empty"),
        ("  ", "set but empty"),
        ("not base64!", "key 1 of 1 is not base64"),
        (base64.b64encode(b"k" * 16).decode(), "key 1 of 1 is 16 bytes; AES-256 needs 32"),
        (base64.b64encode(b"k" * 32).decode()[:-2], "not base64"),
        (f"{base64.b64encode(b'k' * 32).decode()},", "key 2 of 2 is empty"),
    ],
)
def test_malformed_key_is_a_clear_error_before_connecting(monkeypatch, value, message):
    monkeypatch.setenv(KEY_ENV, value)
    with pytest.raises(PayloadKeyError, match=message) as caught:
        data_converter()
    assert KEY_ENV in str(caught.value)
    if len(value) > 20:
        assert value[:8] not in str(caught.value), "key material is never echoed"
    # The one place every process connects through fails the same way, before any RPC.
    with pytest.raises(PayloadKeyError, match=message):
        asyncio.run(connect(connect_config("127.0.0.1:1")))


def test_url_safe_keys_are_accepted():
    key = base64.urlsafe_b64encode(b"\xfb\xff" * 16).decode()
    assert "-" in key or "_" in key
    assert parse_keys(key) == [b"\xfb\xff" * 16]


def test_missing_library_says_what_to_install(monkeypatch):
    # As if the crypto extra were not installed: the import inside the codec fails.
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    monkeypatch.setenv(KEY_ENV, new_key())
    with pytest.raises(PayloadKeyError, match=r"pip install 'timeslice\[crypto\]'"):
        data_converter()


def test_new_key_command_prints_a_usable_key():
    out = subprocess.run(
        [sys.executable, "-m", "timeslice.transport.codec"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert len(parse_keys(out.strip())) == 1


# ------------------------------------------------------------------ end to end


def _payloads(message: Message) -> Iterator[Payload]:
    """Every payload in a history event, except search attributes and headers, which no codec
    touches (docs/security.md)."""
    if isinstance(message, Payload):
        yield message
        return
    for field, value in message.ListFields():
        if field.name in ("search_attributes", "header"):
            continue
        if field.message_type is None:
            continue
        if field.is_repeated:
            items = value.values() if field.message_type.GetOptions().map_entry else value
            for item in items:
                if isinstance(item, Message):
                    yield from _payloads(item)
        else:
            yield from _payloads(value)


@pytest.fixture
def encrypted_namespace(server, monkeypatch, tmp_path) -> Iterator[tuple[str, str, Path]]:
    """A fresh namespace on the session's server, served by a control worker that encrypts
    (the session's own worker, in the default namespace, stays unencrypted)."""
    namespace = new_namespace(server.address, "encrypted")
    key = new_key()
    monkeypatch.setenv(KEY_ENV, key)  # for the worker below and this test's clients
    log = Path(tmp_path) / "worker.log"
    worker = start_service(
        ["worker", "--address", server.address, "--namespace", namespace],
        "control worker on task queue",
        log,
    )
    try:
        yield namespace, key, log
    finally:
        stop_service(worker)


def test_group_history_is_encrypted_end_to_end(server, encrypted_namespace, group):
    namespace, key, worker_log = encrypted_namespace
    job = f"secret-job-{uuid.uuid4().hex[:6]}"
    client = TimeSliceOrchestratorClient(target=server.address, namespace=namespace, job_id=job)
    try:
        client.release(client.acquire(group, timeout=120))
        assert client.group_status(group).stats.leases == 1  # a query through the codec
    finally:
        client.close()

    async def inspect() -> None:
        # A caller with namespace access but no key: a plain client, no codec.
        raw = await Client.connect(server.address, namespace=namespace)
        handle = raw.get_workflow_handle(group_workflow_id(group))
        history = await handle.fetch_history()
        found = []
        for event in history.events:
            marker = event.marker_recorded_event_attributes
            if event.HasField("marker_recorded_event_attributes") and marker.marker_name == (
                "core_patch"
            ):
                # A workflow.patched marker (reached on some runs only, e.g. a delivery that
                # raced a renewal): the SDK's core writes its patch id as plain JSON, past any
                # codec. It names the patch and nothing of the job.
                for payload in _payloads(marker):
                    assert job.encode() not in payload.data and b"key" not in payload.data
                continue
            found.extend(_payloads(event))
        assert len(found) >= 4, "start input, acquire and release arguments and results"
        for payload in found:
            assert payload.metadata["encoding"] == ENCODING, payload.metadata
            assert (
                job.encode() not in payload.data
                and job.encode() not in str(payload.metadata).encode()
            )
        with pytest.raises(Exception, match="binary/encrypted"):
            await handle.query("status")  # the answer comes back encrypted

        # With the key, the same history decodes: the job's own request is in it.
        opened = await PayloadEncryptionCodec(parse_keys(key)).decode(found)
        assert all(p.metadata["encoding"] != UNDECRYPTABLE for p in opened)
        assert any(job.encode() in p.data for p in opened)
        # ... and so is the lease key itself (the release presents it): what a reader of an
        # unencrypted history could lift, and what the codec hides (docs/security.md).
        assert any(b'"key":' in p.data for p in opened)

        # A forged "encrypted" signal (no key behind it) is refused, and never fails the
        # group's workflow task: the group still grants.
        forged = Payload(
            metadata={"encoding": ENCODING, KEY_ID_METADATA: b"0123456789abcdef"},
            data=b"\x00" * 64,
        )
        await handle.signal(GroupSignal.RELEASE, RawValue(forged))

    asyncio.run(inspect())
    wait_for(
        lambda: "cannot decrypt a payload" in worker_log.read_text(),
        what="the worker to refuse the forged payload",
    )
    again = TimeSliceOrchestratorClient(target=server.address, namespace=namespace, job_id=job)
    try:
        again.release(again.acquire(group, timeout=120))
    finally:
        again.close()

    async def no_task_failed() -> None:
        raw = await Client.connect(server.address, namespace=namespace)
        history = await raw.get_workflow_handle(group_workflow_id(group)).fetch_history()
        kinds = [event.event_type for event in history.events]
        assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED in kinds
        assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in kinds

    asyncio.run(no_task_failed())
