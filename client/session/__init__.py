"""The client's session machinery: the layer under the user API and the job runtime.

One job process's leases (``lease_session``: acquire, renew, release, withdraw, eviction
reports, departure, a group's status), the lease it hands out (``lease``), what it serves on the
job's task queue (the grant inbox ``grants``, the ``snapshot_activities``), starting a group's
workflow (``group_start``), and the embedded client's host of a session on an event-loop
thread of its own (``engine``). Both the user API (``timeslice.orchestrator``) and the job
runtime (``timeslice.activities.job_runtime``) build on it; it imports neither.
"""
