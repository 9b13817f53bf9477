"""FrameSplitter: the gateway's reader cuts a worker connection's bytes into frames, however the reads split them."""

from __future__ import annotations

import pytest

from shared.protocol import (FRAME_HEADER, Failed, Finished, FrameSplitter, ProtocolError, TokenDelta,
                             gateway_codec, worker_codec)

MESSAGES = [
    TokenDelta("r-1", [11, 12, 13], first_token_latency_ms=4.5),
    Failed("r-2", "worker_failed", "x" * 300),  # a body longer than most reads below
    TokenDelta("r-1", [14]),
    Finished("r-1", "length", 7, 0, 4),
]


def _stream() -> bytes:
    codec = worker_codec()  # the worker's side encodes what the gateway's decodes
    return b"".join(codec.encode(m) for m in MESSAGES)


def _feed_in_pieces(data: bytes, cuts: list[int]) -> tuple[list, FrameSplitter]:
    splitter = FrameSplitter(gateway_codec())
    received: list = []
    bounds = [0, *cuts, len(data)]
    for start, end in zip(bounds, bounds[1:]):
        splitter.feed(data[start:end], received.append)
    return received, splitter


def test_every_split_point_gives_the_same_frames_in_order():
    data = _stream()
    for cut in range(len(data) + 1):
        received, splitter = _feed_in_pieces(data, [cut])
        assert received == MESSAGES, cut
        assert not splitter.partial


def test_byte_by_byte_and_three_way_splits():
    data = _stream()
    received, _ = _feed_in_pieces(data, list(range(1, len(data))))
    assert received == MESSAGES
    for first in range(0, len(data), 7):
        for second in range(first, len(data), 11):
            assert _feed_in_pieces(data, [first, second])[0] == MESSAGES


def test_a_frame_cut_short_is_held_as_partial():
    data = _stream()
    received, splitter = _feed_in_pieces(data[:-3], [])
    assert received == MESSAGES[:-1]
    assert splitter.partial
    splitter.feed(data[-3:], received.append)
    assert received == MESSAGES and not splitter.partial


def test_oversized_frame_is_a_protocol_error():
    splitter = FrameSplitter(gateway_codec(), max_frame_bytes=64)
    with pytest.raises(ProtocolError, match="exceeds 64"):
        splitter.feed(FRAME_HEADER.pack(65) + b"\0" * 10, lambda m: None)


def test_malformed_frame_is_a_protocol_error_after_the_frames_before_it():
    good = worker_codec().encode(MESSAGES[0])
    bad = FRAME_HEADER.pack(3) + b"\xc1\xc1\xc1"  # 0xc1 is never valid msgpack
    received: list = []
    with pytest.raises(ProtocolError, match="malformed frame"):
        FrameSplitter(gateway_codec()).feed(good + bad, received.append)
    assert received == MESSAGES[:1]
