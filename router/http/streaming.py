"""Async plumbing for the HTTP layer: merging the streams of a batch of prompts, and running
work only for as long as the client stays connected."""

from __future__ import annotations

import asyncio
from contextlib import aclosing, suppress
from typing import AsyncGenerator, Awaitable, TypeVar

from starlette.requests import Request

from router.call import Delta

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def merge(
    streams: list[AsyncGenerator[Delta, None]],
) -> AsyncGenerator[tuple[int, Delta], None]:
    """(stream index, delta) from every stream as they come. The first error ends the merge;
    closing the merge closes every stream (which cancels their worker calls)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for delta in only:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[Delta, None]) -> None:
        try:
            async with aclosing(stream):
                async for delta in stream:
                    await queue.put((i, delta, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put((i, None, exc))
        else:
            await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, got, exc = await queue.get()
            if exc is not None:
                raise exc
            if got is None:
                remaining -= 1
            else:
                yield i, got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelling it (and raising ClientGone) if the client goes away first.
    Call only after the request body has been read."""
    main = asyncio.ensure_future(work)
    watch = asyncio.create_task(_disconnected(request))
    try:
        done, _ = await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
        if main in done:
            return main.result()
        main.cancel()
        with suppress(asyncio.CancelledError, Exception):
            await main
        raise ClientGone()
    finally:
        watch.cancel()
        with suppress(asyncio.CancelledError):
            await watch
        if not main.done():
            main.cancel()
