"""Long-lived connections that must come back by themselves (a worker's etcd registration,
the router's etcd watch, its KV-event subscriptions): one loop with capped exponential
backoff, so every reconnect in the system behaves (and logs) the same way."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, NoReturn


class Backoff:
    """Delays of first_s, first_s * 2, ... capped at max_s; `reset` after a success."""

    def __init__(self, first_s: float = 0.2, max_s: float = 2.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.delay_s = first_s

    def reset(self) -> None:
        self.delay_s = self.first_s

    async def sleep(self) -> None:
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, self.max_s)


async def reconnect_forever(
    session: Callable[[], Awaitable[None]],
    what: str,
    log: logging.Logger,
    level: int = logging.WARNING,
    after_failure: Callable[[], Awaitable[None]] | None = None,
    backoff: Backoff | None = None,
) -> NoReturn:
    """Run `session()` again and again until cancelled. A session that returns is restarted
    at once (the backoff resets); one that raises is logged as "`what` failed", then
    `after_failure()` runs (drop the broken connection) and the next session starts after the
    backoff. Cancellation always propagates."""
    backoff = backoff or Backoff()
    while True:
        try:
            await session()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.log(level, "%s failed (%r); retrying in %.1fs", what, exc, backoff.delay_s)
            if after_failure is not None:
                await after_failure()
            await backoff.sleep()
        else:
            backoff.reset()
