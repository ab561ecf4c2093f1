"""An optional payload codec: AES-256-GCM over every payload a Timeslice process sends.

Set ``TIMESLICE_PAYLOAD_KEY`` (base64 of 32 random bytes; a comma-separated list to rotate) for
every process — CLI, control worker, node agents, job processes, client library — and
:func:`timeslice.transport.connection.connect` encrypts with the first key and decrypts with any
of them.
What it hides and what it does not: docs/security.md. Needs ``pip install 'timeslice[crypto]'``.

A new key::

    python -m timeslice.transport.codec    # or: openssl rand -base64 32
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec
from timeslice.errors import InvalidArgumentError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

logger = logging.getLogger("timeslice.codec")

KEY_ENV = "TIMESLICE_PAYLOAD_KEY"
# The names Temporal's own encryption samples use, so a codec server written for them (or the
# Web UI's "encoded" view) recognises these payloads.
ENCODING = b"binary/encrypted"
KEY_ID_METADATA = "encryption-key-id"
# What a payload this process cannot decrypt is handed on as (see PayloadEncryptionCodec.decode).
UNDECRYPTABLE = b"binary/undecryptable"
KEY_BYTES = 32
_NONCE_BYTES = 12  # GCM's standard nonce; random per payload
_GENERATE = "python -m timeslice.transport.codec (or: openssl rand -base64 32)"


class PayloadKeyError(InvalidArgumentError):
    """TIMESLICE_PAYLOAD_KEY is malformed, or set where the crypto library is missing."""


def new_key() -> str:
    """A fresh key, as TIMESLICE_PAYLOAD_KEY takes it."""
    return base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()


def key_id(key: bytes) -> str:
    """A short public name for a key: which key a payload needs, without revealing the key."""
    return hashlib.sha256(b"timeslice-payload-key:" + key).hexdigest()[:16]


def parse_keys(value: str) -> list[bytes]:
    """The keys of a TIMESLICE_PAYLOAD_KEY value, in order; PayloadKeyError saying what is wrong
    (never echoing key material, which would end up in logs)."""
    entries = [entry.strip() for entry in value.split(",")]
    if not any(entries):
        raise PayloadKeyError(
            f"{KEY_ENV} is set but empty: give it a key (make one with {_GENERATE}), "
            "or unset it to send payloads unencrypted"
        )
    keys: list[bytes] = []
    for number, entry in enumerate(entries, start=1):
        where = f"{KEY_ENV} key {number} of {len(entries)}"
        if not entry:
            raise PayloadKeyError(f"{where} is empty (a stray comma?)")
        try:
            # Standard or URL-safe alphabet, padding required: a truncated copy-paste fails here.
            key = base64.b64decode(entry.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raise PayloadKeyError(
                f"{where} is not base64 ({len(entry)} characters); make one with {_GENERATE}"
            ) from None
        if len(key) != KEY_BYTES:
            raise PayloadKeyError(
                f"{where} is {len(key)} bytes; AES-256 needs {KEY_BYTES} "
                f"(44 base64 characters); make one with {_GENERATE}"
            )
        if key not in keys:
            keys.append(key)
    return keys


def _aesgcm(key: bytes) -> AESGCM:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise PayloadKeyError(
            f"{KEY_ENV} is set, but the `cryptography` library that encrypts payloads is not "
            "installed: pip install 'timeslice[crypto]' (or unset the variable)"
        ) from None
    return AESGCM(key)


class PayloadEncryptionCodec(PayloadCodec):
    """AES-256-GCM: encrypts each whole payload (its metadata too: the encoding and pydantic's
    type names) with the first key; decrypts with whichever key the payload names.

    The ciphertext is ``nonce || AES-GCM(serialized payload)``; the tag authenticates it, so a
    payload altered or forged without the key never decrypts."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise PayloadKeyError("PayloadEncryptionCodec needs at least one key")
        for key in keys:
            if len(key) != KEY_BYTES:
                raise PayloadKeyError(f"a payload key is {KEY_BYTES} bytes, not {len(key)}")
        self._encrypt_id = key_id(keys[0])
        self._ciphers = {key_id(key): _aesgcm(key) for key in keys}

    @classmethod
    def from_env(cls) -> PayloadEncryptionCodec | None:
        """The codec TIMESLICE_PAYLOAD_KEY configures, or None where it is unset."""
        value = os.environ.get(KEY_ENV)
        if value is None:
            return None
        return cls(parse_keys(value))

    @property
    def key_ids(self) -> list[str]:
        """The keys' public ids, the encrypting one first."""
        return list(self._ciphers)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        cipher = self._ciphers[self._encrypt_id]
        encoded = []
        for payload in payloads:
            nonce = secrets.token_bytes(_NONCE_BYTES)
            sealed = cipher.encrypt(nonce, payload.SerializeToString(), None)
            encoded.append(
                Payload(
                    metadata={"encoding": ENCODING, KEY_ID_METADATA: self._encrypt_id.encode()},
                    data=nonce + sealed,
                )
            )
        return encoded

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Decrypt what is ours; pass anything else through.

        A payload marked encrypted that cannot be opened (a key this process lacks, or altered
        bytes) becomes an ``binary/undecryptable`` payload rather than an exception: in a
        worker an exception here fails the whole workflow task, and since the message stays
        in the history every retry fails again — one forged signal would wedge a group. As it
        is, the SDK refuses that one message (a signal is dropped, an update rejected, an
        activity or a client call fails: "Unknown payload encoding binary/undecryptable"), and
        this logs why. Unencrypted payloads pass, so processes without a key, and the
        ``temporal`` CLI, still interoperate (docs/security.md says what that leaves open).
        """
        decoded = []
        for payload in payloads:
            if payload.metadata.get("encoding") != ENCODING:
                decoded.append(payload)
                continue
            decoded.append(self._open(payload))
        return decoded

    def _open(self, payload: Payload) -> Payload:
        wanted = payload.metadata.get(KEY_ID_METADATA, b"").decode(errors="replace")[:64]
        cipher = self._ciphers.get(wanted)
        if cipher is None:
            reason = (
                f"it was encrypted with key id {wanted!r}, which is not among {KEY_ENV}'s "
                f"keys ({', '.join(self._ciphers)})"
            )
        elif len(payload.data) <= _NONCE_BYTES:
            reason = "it is too short to be an encrypted payload"
        else:
            from cryptography.exceptions import InvalidTag

            data = payload.data
            try:
                plain = cipher.decrypt(data[:_NONCE_BYTES], data[_NONCE_BYTES:], None)
                inner = Payload()
                inner.ParseFromString(plain)
                return inner
            except InvalidTag:
                reason = f"it does not authenticate under key id {wanted!r} (altered or forged)"
            except Exception as err:  # a decrypted body that is not a payload: not ours
                reason = f"its decrypted body is not a payload ({type(err).__name__})"
        logger.warning("cannot decrypt a payload: %s; it is refused, not decoded", reason)
        return Payload(
            metadata={"encoding": UNDECRYPTABLE, KEY_ID_METADATA: wanted.encode()},
            data=b"",
        )


if __name__ == "__main__":
    print(new_key())
