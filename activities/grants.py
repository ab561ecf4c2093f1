"""The grant inbox lives beside the engine (``timeslice.grants``), so that the client imports
nothing of this package; this path is kept for existing imports."""

from timeslice.grants import (
    CLOCK_SKEW_S,
    DELIVERY_MARGIN_S,
    LATE_GRANT_S,
    Delivery,
    Grant,
    GrantInbox,
    grant_from_update,
    local_time_of,
    validity_if_fresh,
    with_ask_bound,
)

__all__ = [
    "CLOCK_SKEW_S",
    "DELIVERY_MARGIN_S",
    "LATE_GRANT_S",
    "Delivery",
    "Grant",
    "GrantInbox",
    "grant_from_update",
    "local_time_of",
    "validity_if_fresh",
    "with_ask_bound",
]
