"""Activities of Timeslice: the ones a job process serves on its own task queue, and the
requester workflows' local activities. (The grant inbox and the snapshot activities, which
every client serves too, live beside the engine: ``timeslice.grants``,
``timeslice.snapshot_activities``.)"""

from timeslice.grants import GrantInbox
from timeslice.snapshot_activities import SnapshotActivities

__all__ = ["GrantInbox", "SnapshotActivities"]
