"""A request's items on their way back, from the engine thread to its HTTP response.

Each choice's ticket posts its chunks, its answer, an ApiError or None (its end) onto the
request's asyncio queue from the engine thread (`poster`). A streamed request reads them as they
come (`chunks`: each choice's under its index, an SSE comment while nothing comes, the rows
given up when the client leaves), written as `data:` lines (`chat_events`; responses.py writes
the Responses API's events); one that did not stream waits for every choice (`whole`: their
answers merged, or the first error, or nothing for a client that left). The app chooses how often
a quiet stream sends a comment and how often a waiting request looks for its client.
No torch here.
"""

from __future__ import annotations

import asyncio
import json

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from specgen.serve import answers, api
from specgen.serve.scheduler import Scheduler, Ticket


def error(exc: api.ApiError, headers: dict | None = None) -> JSONResponse:
    """An ApiError as the HTTP answer: OpenAI's error object under its status."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def poster(loop, queue: asyncio.Queue):
    """`post(choice)`: what a choice's ticket calls on the engine thread with each item."""

    def poster(choice: int):
        def post(item) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (choice, item))
            except RuntimeError:  # the server's loop has closed: nobody waits for this answer
                pass

        return post

    return poster


class _Inbox:
    """A request's queue, read with a time limit that never loses an item: one get stays
    pending across timeouts (asyncio.wait_for would cancel a get that had just been handed
    one)."""

    def __init__(self, queue: asyncio.Queue):
        self.queue, self.getter = queue, None

    async def get(self, timeout: float):
        """The next (choice, item), or None after `timeout` seconds without one."""
        self.getter = self.getter or asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({self.getter}, timeout=timeout)
        if not done:
            return None
        got, self.getter = self.getter.result(), None
        return got

    def close(self) -> None:
        if self.getter is not None:
            self.getter.cancel()


async def chunks(scheduler: Scheduler, rows: list[Ticket], queue: asyncio.Queue, keepalive: float):
    """A streamed request's chunks (each choice's under its index) and errors (ApiError), until
    every choice ended, KEEPALIVE after `keepalive` seconds without one; the choices' usage
    chunks become one, last. If the client goes away (the task is cancelled), the rows end
    before the next round."""
    left, usage, inbox = len(rows), [], _Inbox(queue)
    try:
        while left:
            got = await inbox.get(keepalive)
            if got is None:  # queued, or a long prefill: a comment keeps the client's read timeout at bay
                yield api.KEEPALIVE
                continue
            choice, item = got
            if item is None:
                left -= 1
                continue
            if isinstance(item, api.ApiError):
                yield item
                continue
            if len(rows) > 1 and not item["choices"]:
                usage.append((choice, item))
                continue
            for part in item["choices"]:
                part["index"] = choice
            yield item
        if usage:
            yield answers.merged_usage(
                [item for _, item in sorted(usage, key=lambda u: u[0])], rows[0].request.n
            )
    finally:
        inbox.close()
        if left:
            for ticket in rows:
                scheduler.cancel(ticket)


async def chat_events(chunks):
    """Chat and completions streams: `data: {chunk}` per chunk, `data: [DONE]` at the end."""
    async for item in chunks:
        if item is api.KEEPALIVE:
            yield ": keep-alive\n\n"
            continue
        body = item.body() if isinstance(item, api.ApiError) else item
        yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


async def closing(stream, chunks):
    """`stream`, and its chunks closed with it (a client that leaves cancels the rows)."""
    try:
        async for text in stream:
            yield text
    finally:
        await stream.aclose()
        await chunks.aclose()


async def whole(
    scheduler: Scheduler, rows: list[Ticket], queue: asyncio.Queue, http: Request, poll: float
) -> dict | Response:
    """A request that did not stream: wait for its choices' answers, giving up their rows if the
    client leaves (looked for every `poll` seconds); one answer (answers.merged), or a Response:
    the first choice's error, or 499."""
    replies: list = [None] * len(rows)
    left, inbox = len(rows), _Inbox(queue)
    try:
        while left:
            got = await inbox.get(poll)
            if got is None:
                if await http.is_disconnected():
                    for ticket in rows:
                        scheduler.cancel(ticket)
                    return Response(status_code=499)
                continue
            choice, item = got
            if item is None:
                left -= 1
            else:
                replies[choice] = item
    finally:
        inbox.close()
    failed = next((a for a in replies if a is None or isinstance(a, api.ApiError)), False)
    if isinstance(failed, api.ApiError):
        return error(failed)
    if failed is None:
        return error(api.ApiError(500, "the request ended without an answer", kind="server_error"))
    return answers.merged(rows[0].request, replies)
