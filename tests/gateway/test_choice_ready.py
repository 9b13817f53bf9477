"""ChoiceRunner.ready, which the SSE writer trusts to coalesce: True only when the next event needs no wait.

A worker reply can make no event (a token held back as the start of a possible stop string, a character not
complete yet); ready() takes such a reply at once and answers False, so the writer sends what it holds instead of
holding it until the next token.
"""

from __future__ import annotations

from types import SimpleNamespace

from gateway.pipeline.choice import ChoiceRunner
from gateway.pipeline.choice_state import ChoiceState, FinishEvent, TextEvent
from gateway.workers.stream import RequestStream
from shared.errors import ErrorCode, SluiceError
from shared.protocol import Finished, SamplingParams, TokenDelta


def _runner_and_choice(tokenizer, stop_strings: list[str]) -> tuple[ChoiceRunner, ChoiceState]:
    prompt = tokenizer.encode_text_sync("Say hello.")
    pool = SimpleNamespace(record_success=lambda reservation: None, record_failure=lambda reservation: None)
    admission = SimpleNamespace(release=lambda ticket, completion_tokens=None: None)
    metrics = SimpleNamespace(inter_token_latency=SimpleNamespace(observe=lambda seconds: None))
    runner = ChoiceRunner(request_id="r", prompts=[prompt], max_tokens=[16], sampling=SamplingParams(),
                          stop_strings=stop_strings, tier="standard", admission=admission, pool=pool,
                          tokenizer=tokenizer, metrics=metrics, first_token_timeout_s=5.0, stall_timeout_s=5.0,
                          cache_key="", ignore_eos=False, upstream_prompts=None,
                          on_first_token=lambda now_s, worker_ttft_ms: None)
    choice = ChoiceState(0, 0, "r-0", len(prompt))
    choice.ticket = SimpleNamespace(reservation=None, decoding=False, decoded_tokens=0)
    runner.start(choice)
    choice.stream = RequestStream("r-0", worker=SimpleNamespace(abort=lambda request_id: None))
    return runner, choice


async def test_a_reply_held_back_as_a_possible_stop_string_is_taken_and_ready_says_false(tokenizer):
    runner, choice = _runner_and_choice(tokenizer, ["\n\n"])
    stream = choice.stream
    stream._push(TokenDelta("r-0", tokenizer.encode_text_sync("Hello")))
    assert runner.ready(choice)
    event = await runner.next_event(choice)
    assert isinstance(event, TextEvent) and event.text == "Hello"
    assert not runner.ready(choice)  # nothing came yet: the writer sends "Hello" now
    stream._push(TokenDelta("r-0", tokenizer.encode_text_sync("\n")))  # could start "\n\n": held back
    assert not runner.ready(choice)  # no event from it, and no wait on the next reply behind a True
    assert not stream.has_unread  # the reply was taken
    stream._push(TokenDelta("r-0", tokenizer.encode_text_sync(" world")))
    assert runner.ready(choice)
    event = await runner.next_event(choice)
    assert isinstance(event, TextEvent) and event.text == "\n world"
    stream._finish(Finished("r-0", "stop", 4, 0, 3))
    assert runner.ready(choice)
    assert isinstance(await runner.next_event(choice), FinishEvent)
    assert runner.ready(choice) and await runner.next_event(choice) is None


async def test_ready_is_false_while_a_failure_is_in(tokenizer):
    """A failure may be retried or resumed by next_event (a wait): ready() leaves it to next_event."""
    runner, choice = _runner_and_choice(tokenizer, [])
    choice.stream._fail(SluiceError(ErrorCode.WORKER_FAILED, "worker lost"))
    assert not runner.ready(choice)
    assert choice.stream.has_unread  # not taken: next_event handles it
