"""Waiting on a condition, once for every test: poll until it holds or the time is up."""
from __future__ import annotations

import time
from typing import Callable


def wait_until(done: Callable[[], object], timeout: float, every: float = 0.02):
    """Polls `done()` every `every` s until it is true or `timeout` s have passed; returns its last value, which
    the caller asserts (naming what it waited for)."""
    deadline = time.monotonic() + timeout
    while True:
        value = done()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(every)
