"""Activities of Timeslice: the ones a job process serves on its own task queue, and the
requester workflows' local activities. (The grant inbox and the snapshot activities, which
every client serves too, are the session's: ``timeslice.session.grants``,
``timeslice.session.snapshot_activities``.)"""
