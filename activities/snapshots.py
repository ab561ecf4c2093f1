"""The snapshot / restore activities live beside the engine (``timeslice.snapshot_activities``),
so that the client imports nothing of this package; this path is kept for existing imports."""

from timeslice.snapshot_activities import SnapshotActivities, StateMover

__all__ = ["SnapshotActivities", "StateMover"]
