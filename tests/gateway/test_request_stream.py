"""RequestStream: one request's replies, coalesced until the pipeline takes them."""

from __future__ import annotations

import asyncio

import pytest

from gateway.workers.stream import RequestStream
from shared.errors import ErrorCode, SluiceError
from shared.protocol import Finished, TokenDelta


def make_stream() -> RequestStream:
    return RequestStream("r1", worker=None)  # no reservation: the worker is never consulted


async def test_next_update_returns_tokens_pushed_before_it_without_waiting():
    stream = make_stream()
    stream._push(TokenDelta("r1", [1, 2], first_token_latency_ms=3.5))
    stream._push(TokenDelta("r1", [3]))
    update = await stream.next_update(timeout_s=0.0)
    assert update.token_ids == [1, 2, 3] and update.first_token_latency_ms == 3.5 and update.finished is None


async def test_next_update_wakes_when_a_reply_arrives_while_it_waits():
    stream = make_stream()
    waiting = asyncio.create_task(stream.next_update(timeout_s=30.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    stream._push(TokenDelta("r1", [7]))
    update = await asyncio.wait_for(waiting, 5.0)
    assert update.token_ids == [7]
    stream._finish(Finished("r1", "stop", 4, 0, 1))
    last = await stream.next_update(timeout_s=30.0)
    assert last.token_ids == [] and last.finished is not None and last.finished.finish_reason == "stop"
    assert stream.done


async def test_next_update_raises_worker_timeout_when_nothing_arrives():
    stream = make_stream()
    with pytest.raises(SluiceError) as raised:
        await stream.next_update(timeout_s=0.01)
    assert raised.value.code == ErrorCode.WORKER_TIMEOUT
    stream._push(TokenDelta("r1", [5]))  # a late reply is still delivered to the next wait
    assert (await stream.next_update(timeout_s=0.01)).token_ids == [5]


async def test_next_update_raises_the_workers_failure():
    stream = make_stream()
    waiting = asyncio.create_task(stream.next_update(timeout_s=30.0))
    await asyncio.sleep(0)
    stream._fail(SluiceError(ErrorCode.WORKER_FAILED, "connection lost"))
    with pytest.raises(SluiceError) as raised:
        await asyncio.wait_for(waiting, 5.0)
    assert raised.value.code == ErrorCode.WORKER_FAILED and stream.done


async def test_a_failure_that_arrives_with_tokens_is_raised_by_the_next_call_without_waiting():
    stream = make_stream()
    stream._push(TokenDelta("r1", [1, 2]))
    stream._fail(SluiceError(ErrorCode.WORKER_FAILED, "connection lost"))
    assert (await stream.next_update(timeout_s=0.0)).token_ids == [1, 2]
    with pytest.raises(SluiceError) as raised:
        await asyncio.wait_for(stream.next_update(timeout_s=30.0), 5.0)  # not after the 30 s stall timeout
    assert raised.value.code == ErrorCode.WORKER_FAILED


async def test_a_cancelled_wait_leaves_no_waiter_behind():
    stream = make_stream()
    waiting = asyncio.create_task(stream.next_update(timeout_s=30.0))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert stream._waiter is None
    stream._push(TokenDelta("r1", [9]))
    assert (await stream.next_update(timeout_s=0.0)).token_ids == [9]


async def test_one_timer_serves_waits_of_changing_length_and_stops_with_the_stream():
    """The wait timer is armed once and moved only nearer: a short wait after a long one times out at its own
    deadline; a long wait after a short one is not cut at the short one's; the stream's end cancels it."""
    loop = asyncio.get_running_loop()
    stream = make_stream()
    long_wait = asyncio.create_task(stream.next_update(timeout_s=60.0))
    await asyncio.sleep(0)
    stream._push(TokenDelta("r1", [1]))
    assert (await long_wait).token_ids == [1]
    assert stream._timer is not None and stream._timer.when() > loop.time() + 50  # still armed for the long one

    started = loop.time()
    with pytest.raises(SluiceError) as info:
        await stream.next_update(timeout_s=0.2)  # nearer than the armed timer: re-armed for it
    assert info.value.code is ErrorCode.WORKER_TIMEOUT
    assert 0.2 <= loop.time() - started < 5.0

    short_wait = asyncio.create_task(stream.next_update(timeout_s=0.1))
    await asyncio.sleep(0)
    stream._push(TokenDelta("r1", [2]))
    assert (await short_wait).token_ids == [2]  # the timer stays armed for 0.1 s from that wait
    started = loop.time()
    with pytest.raises(SluiceError):
        await stream.next_update(timeout_s=0.5)  # the 0.1 s timer fires first and re-arms for the rest
    assert 0.5 <= loop.time() - started < 5.0

    waiting = asyncio.create_task(stream.next_update(timeout_s=60.0))
    await asyncio.sleep(0)
    assert stream._timer is not None
    stream._finish(Finished("r1", "stop", 4, 0, 2))
    assert stream._timer is None  # the end stops the timer: no timer per ended stream left in the loop
    assert (await waiting).finished is not None
    aborted = make_stream()
    aborted_wait = asyncio.create_task(aborted.next_update(timeout_s=60.0))
    await asyncio.sleep(0)
    aborted.end()  # what WorkerClient.abort does
    assert aborted._timer is None
    aborted_wait.cancel()
    await asyncio.gather(aborted_wait, return_exceptions=True)
