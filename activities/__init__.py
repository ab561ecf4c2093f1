"""Activities of Timeslice: the ones a job process serves on its own task queue."""

from timeslice.activities.grants import GrantInbox
from timeslice.activities.snapshots import SnapshotActivities

__all__ = ["GrantInbox", "SnapshotActivities"]
