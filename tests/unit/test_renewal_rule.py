"""What a holder may conclude once the server recorded its renewal signal
(``transport.renewals.counted_from_signal``; docs/architecture.md, "Local validity")."""

from __future__ import annotations

import pytest
from timeslice.transport.renewals import SIGNALS_WITHOUT_ANSWER_S, counted_from_signal

TTL = 1.0


def test_a_signal_recorded_while_valid_counts_the_lease_from_when_it_was_sent() -> None:
    # valid until 10.0; the signal went at 9.4 and the server said it recorded it at 9.6
    assert counted_from_signal(
        10.0, 9.4, 9.6, TTL, group_renews=True, answered=9.0
    ) == pytest.approx(10.4)


def test_a_signal_recorded_after_the_local_validity_ran_out_changes_nothing() -> None:
    # The group may have processed the expiry before it saw the signal.
    assert counted_from_signal(10.0, 9.4, 10.0, TTL, group_renews=True, answered=9.0) == 10.0
    assert counted_from_signal(10.0, 9.4, 10.3, TTL, group_renews=True, answered=9.0) == 10.0


def test_a_group_that_does_not_state_the_rule_is_trusted_only_by_its_answers() -> None:
    # An older group ends a lease whose renewal it handles after the expiry time.
    assert counted_from_signal(10.0, 9.4, 9.6, TTL, group_renews=False, answered=9.0) == 10.0


def test_validity_never_shrinks() -> None:
    # An earlier signal (or answer) may already have counted it further.
    assert counted_from_signal(10.9, 9.4, 9.6, TTL, group_renews=True, answered=9.0) == 10.9


def test_signals_count_only_for_a_while_after_the_group_last_answered() -> None:
    # Each step rests on the one before: a validity that ran past the group's expiry would be
    # carried on by signals alone; the group's answers are what ends it.
    long_ago = 9.6 - SIGNALS_WITHOUT_ANSWER_S - 0.1
    assert counted_from_signal(10.0, 9.4, 9.6, TTL, group_renews=True, answered=long_ago) == 10.0
    recently = 9.6 - SIGNALS_WITHOUT_ANSWER_S + 0.1
    assert counted_from_signal(
        10.0, 9.4, 9.6, TTL, group_renews=True, answered=recently
    ) == pytest.approx(10.4)
