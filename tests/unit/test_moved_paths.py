"""Import paths that moved before 1.0, and where they went.

The aliases that kept older paths importing are gone (CHANGELOG.md, Unreleased): each older
path now fails to import, its new path holds what it held, and CHANGELOG.md and
docs/upgrading.md name both, so a user whose import broke finds where it went."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# older path -> (new path, a name it holds)
MOVED: dict[str, tuple[str, str]] = {
    "timeslice.connection": ("timeslice.transport.connection", "connect_config"),
    "timeslice.updates": ("timeslice.transport.updates", "send_update"),
    "timeslice.telemetry": ("timeslice.transport.telemetry", "tracer"),
    "timeslice.codec": ("timeslice.transport.codec", "PayloadEncryptionCodec"),
    "timeslice.activities.grants": ("timeslice.session.grants", "GrantInbox"),
    "timeslice.activities.snapshots": (
        "timeslice.session.snapshot_activities",
        "SnapshotActivities",
    ),
    "timeslice.engine": ("timeslice.session.engine", "Engine"),
    "timeslice.lease_session": ("timeslice.session.lease_session", "LeaseSession"),
    "timeslice.lease": ("timeslice.session.lease", "Lease"),
    "timeslice.grants": ("timeslice.session.grants", "GrantInbox"),
    "timeslice.group_start": ("timeslice.session.group_start", "start_group"),
    "timeslice.snapshot_activities": (
        "timeslice.session.snapshot_activities",
        "SnapshotActivities",
    ),
}


@pytest.mark.parametrize("older", sorted(MOVED))
def test_the_new_path_holds_what_the_older_one_did(older: str) -> None:
    new, name = MOVED[older]
    assert hasattr(importlib.import_module(new), name), f"{new} has no {name}"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(older)


@pytest.mark.parametrize("doc", ["CHANGELOG.md", "docs/upgrading.md"])
def test_the_docs_say_where_each_path_went(doc: str) -> None:
    text = (REPO / doc).read_text()
    if doc == "CHANGELOG.md":
        text = text.split("\n## ", 2)[1]  # the Unreleased section
    missing = [
        f"{older} -> {new}"
        for older, (new, _) in MOVED.items()
        if f"`{older}`" not in text or f"`{new}`" not in text
    ]
    assert not missing, f"{doc} does not say where these went: {missing}"


def test_the_root_package_still_exports_the_lease() -> None:
    """``timeslice.Lease`` is the user's path to the lease, wherever its module sits."""
    from timeslice import Lease
    from timeslice.session.lease import Lease as Moved

    assert Lease is Moved
