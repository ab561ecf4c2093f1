"""The client's event-loop thread is running when its constructor returns."""

from __future__ import annotations

import asyncio
import time

import pytest
from timeslice.session.engine import LoopThread


class _SlowToStart(asyncio.SelectorEventLoop):
    """A loop whose thread takes a while to get going, as on a loaded machine."""

    def run_forever(self) -> None:
        time.sleep(0.3)
        super().run_forever()


def test_the_loop_runs_once_constructed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before the fix the constructor returned as soon as the thread was started; a client's
    # connect() made at once then found the loop not running and raised ClientClosedError
    # (seen under load in a two-worker make test).
    monkeypatch.setattr(asyncio, "new_event_loop", _SlowToStart)
    thread = LoopThread("slow")
    try:
        assert thread.loop.is_running()
        assert thread.submit(_answer()).result(timeout=10) == 42
    finally:
        thread.stop()


async def _answer() -> int:
    return 42
