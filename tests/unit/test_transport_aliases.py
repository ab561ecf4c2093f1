"""The plumbing moved to ``timeslice.transport``; the older paths still import, as the very same
modules (not copies), so classes, module state and patches agree whichever path a user took."""

from __future__ import annotations

import importlib

import pytest

MOVED = ("connection", "updates", "telemetry", "codec")


@pytest.mark.parametrize("name", MOVED)
def test_the_older_path_is_the_same_module(name: str) -> None:
    older = importlib.import_module(f"timeslice.{name}")
    moved = importlib.import_module(f"timeslice.transport.{name}")
    assert older is moved
    assert moved.__name__ == f"timeslice.transport.{name}"
    assert getattr(importlib.import_module("timeslice"), name) is moved


def test_a_class_through_either_path_is_one_class() -> None:
    from timeslice.codec import PayloadEncryptionCodec as Older
    from timeslice.transport.codec import PayloadEncryptionCodec

    assert Older is PayloadEncryptionCodec
    from timeslice.connection import connect_config as older_connect_config
    from timeslice.transport.connection import connect_config

    assert older_connect_config is connect_config
