"""The ``workflow.patched`` ids of the group workflow, in one place.

Each names a change to the commands ``GpuGroupWorkflow`` emits: groups that started before it
replay the way they ran (docs/upgrading.md; ``tests/test_replay.py`` replays stored histories
down both branches). An id, once released, is never renamed or reused.
"""

from __future__ import annotations

# workflow.patched id: groups that started before it replay with the old, unbounded wait.
BOUNDED_EVICTION_REPORT_WAIT = "bounded-eviction-report-wait"
# workflow.patched ids: a holder that never reported its eviction and whose processes are gone
# is forgotten; a failed-eviction report faults the job only from the lease answered `evict`.
FORGET_GONE_EVICTOR = "forget-gone-evictor"
FAULT_ONLY_ASKED_EVICTION = "fault-only-asked-eviction"
# workflow.patched id: a grant's delivery outcome is obeyed only when it presents the lease key.
AUTHENTICATED_GRANT_ANSWERS = "authenticated-grant-answers"
# workflow.patched id: a delivery activity that fails after its holder confirmed the grant by a
# renewal no longer ends the lease (groups that started before end it, as they did).
CONFIRMED_GRANT_OUTLIVES_DELIVERY = "confirmed-grant-outlives-delivery"
# workflow.patched id: a lease may be carried past waiters into its holder's next phase (the
# phase_aware grant policy); groups that started before it replay releasing as FIFO did.
PHASE_AWARE_GRANTS = "phase-aware-grants"
# workflow.patched id: one durable timer for the earliest of the group's deadlines (lease
# expiry, grant confirmation, waiter and park time-outs, an eviction report) instead of a timer
# started and cancelled by every wait; groups that started before it replay as they ran.
ONE_DEADLINE_TIMER = "one-deadline-timer"
# workflow.patched id: a switch between two jobs whose moves go through one device room on the
# node streams (the grant does not wait for the eviction, and the group's own eviction runs
# beside it) even when the group's memory holds only one of their states; groups that started
# before it replay waiting for the eviction, as they ran.
STREAMED_SWITCHES = "streamed-switches"
# workflow.patched id: a grant's delivery activity has grant_ack_timeout_s to run (not 30 s),
# and a delivery that ends without the process's keyed answer leaves its holder until the grant
# is grant_ack_timeout_s old (not that long after the delivery ended): a lost waiter holds the
# group grant_ack_timeout_s, not 45 s. Groups that started before it replay as they ran.
BOUNDED_GRANT_DELIVERY = "bounded-grant-delivery"
# workflow.patched id: a renewal the group handles before it has processed the lease's expiry
# renews it, however late its workflow task ran (nobody else can hold the group until the expiry
# is processed, and the holder's validity counts from before it sent the renewal); groups that
# started before it replay ending such a lease as expired, as they ran.
LATE_RENEWAL_RENEWS = "late-renewal-renews"
# workflow.patched id: while the holder works, the group restores the next waiter's state when
# the device's declared memory holds both (a staged restore), so that waiter's grant moves
# nothing; groups that started before it replay restoring at the grant, as they ran.
STAGED_RESTORES = "staged-restores"
# workflow.patched id: every id above holds without its own marker. A run asks this one first
# thing (in the workflow's __init__, before any handler runs) and, recorded, asks none of them:
# a patch first asked from an update handler, in the workflow task in which the main loop
# started a timer, recorded its marker after that timer, and the SDK (temporalio 1.35.0)
# replays the handler first, so every later task of the group failed with a nondeterminism
# error (tests/histories/known/gpu_group_flood_patch_after_timer.json). One marker a run also
# replaces one marker and version search attribute per patch. Groups that started before it
# ask each patch where they asked it, as they ran. A patch added after this one is asked in
# __init__ too, never first from a handler.
PATCHES_AT_START = "patches-at-start"
# workflow.patched id (asked in __init__, after PATCHES_AT_START): a holder that evicts its own
# state reports it at once, not with its next release, when the group knows a third job whose
# state it could stage: a report held back keeps that eviction under way in the group's eyes,
# and nothing is staged beside it. Groups that started before it replay as they ran.
EVICTION_REPORTS_FOR_STAGING = "eviction-reports-for-staging"
# workflow.patched id (asked in __init__): a holder's own eviction that begins while another
# eviction is still counted under way keeps that one on the books (unconfirmed_evictions) until
# its report comes or the group's snapshot activity confirms it, before another job's state is
# restored or staged beside it. Before, the second eviction took the first one's place, and a
# third job could be restored beside both: three jobs' states against memory declared for two.
# Groups that started before it replay as they ran.
UNCONFIRMED_EVICTIONS_KEPT = "unconfirmed-evictions-kept"
# workflow.patched id (asked in __init__): a node agent's queue is waited for as long as a move
# may take (snapshot_timeout_s, not grant_ack_timeout_s), and an agent that does not take a
# move faults the job instead of reading as "the job's processes are gone": an agent
# restarting, or busy, made the group forget a live job and restore the next beside it.
# Groups that started before it replay as they ran.
AGENT_QUEUES_WAITED_FOR = "agent-queues-waited-for"
