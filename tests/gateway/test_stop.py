"""Stop-string hold-back (BC14, BC16) on the matcher alone."""

from __future__ import annotations

import random

from gateway.pipeline.stop import StopStringMatcher


def _run(stops: list[str], pieces: list[str]) -> tuple[list[str], str | None]:
    matcher = StopStringMatcher(stops)
    out = [matcher.push(p) for p in pieces]
    if matcher.matched is None:
        out.append(matcher.flush())
    return out, matcher.matched


def test_bc14_stop_string_never_streamed_across_pieces():
    out, matched = _run(["DEFGHIJ"], [" D", "EF", "G", "HI", "J", "KL"])
    assert matched == "DEFGHIJ"
    assert "".join(out) == " "
    assert not any("D" in piece for piece in out)


def test_bc14_held_text_is_released_when_the_match_fails():
    out, matched = _run(["DEFGHIJ"], ["ABC", "DEF", "GX", "YZ"])
    assert matched is None
    assert out == ["ABC", "", "DEFGX", "YZ", ""]


def test_bc16_stop_inside_one_piece_cuts_it_and_everything_after():
    out, matched = _run(["7"], ["1 2 3 4 5 6 7 8 9 10"])
    assert matched == "7"
    assert "".join(out) == "1 2 3 4 5 6 "


def test_the_stop_string_that_ends_first_wins():
    out, matched = _run(["world", "lo w"], ["hel", "lo wor", "ld"])
    assert matched == "lo w"
    assert "".join(out) == "hel"


def test_random_splits_equal_the_unsplit_result():
    rng = random.Random(1)
    alphabet = "ab c\n"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        cut = [i for i in range(1, len(text)) if rng.random() < 0.4]
        pieces = [text[a:b] for a, b in zip([0, *cut], [*cut, len(text)])]
        expected = text
        ends = [(text.find(s) + len(s), text.find(s)) for s in stops if text.find(s) != -1]
        if ends:
            expected = text[:min(ends)[1]]
        out, _ = _run(stops, pieces)
        assert "".join(out) == expected, (text, stops, pieces)
