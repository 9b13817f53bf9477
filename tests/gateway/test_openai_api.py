"""Request validation: msgspec schemas → 400 with the field in ``param`` (BC19, BC22, BC23)."""

from __future__ import annotations

import pytest

from gateway.pipeline import openai_api
from gateway.pipeline.openai_api import ChatCompletionRequest, CompletionRequest, decode_body
from shared.errors import ErrorCode, SluiceError


def _chat_error(body: bytes) -> SluiceError:
    with pytest.raises(SluiceError) as info:
        request = decode_body(body, ChatCompletionRequest)
        openai_api.check_unsupported(request)
        openai_api.chat_messages(request)
    return info.value


@pytest.mark.parametrize("raw", [b'{"model": "m", "messages": [], x}', b'', b'{"model": "m"',
                                 b'{"model": "m", "prompt": "hi",}', b'\xff\xfe'])
def test_bc22_invalid_json_is_invalid_json(raw):
    error = _chat_error(raw)
    assert error.code is ErrorCode.INVALID_JSON and error.status == 400


@pytest.mark.parametrize("raw", [b"", b" \n"])
def test_bc22_an_empty_body_says_it_is_empty(raw):
    error = _chat_error(raw)
    assert error.code is ErrorCode.INVALID_JSON and "the request body is empty" in error.message


@pytest.mark.parametrize("raw", [b'"just a string"', b'[]', b'null', b'42'])
def test_bc22_non_object_body_is_400(raw):
    error = _chat_error(raw)
    assert error.status == 400 and error.code is ErrorCode.INVALID_TYPE


@pytest.mark.parametrize("body, param", [
    (b'{"model": "m", "messages": []}', "messages"),
    (b'{"model": "m"}', "messages"),
    (b'{"model": "m", "messages": [{"role": "user"}]}', "messages[0].content"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 123}]}', "messages[0].content"),
    (b'{"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}',
     "messages[1].tool_call_id"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}', "temperature"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}', "top_p"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     "messages[0].content[0].type"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}', "top_logprobs"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}',
     "top_logprobs"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}', "logprobs"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}',
     "presence_penalty"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 99999999999999999999999}', "seed"),
    # README trial 14: a top_k past msgpack's ints was a 500 (the Generate frame could not be encoded)
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 18446744073709551616}', "top_k"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": -2}', "top_k"),
    # README trial 14: a wrong-typed name was accepted, and an assistant turn given as audio reached the model empty
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi", "name": 1}]}', "messages[0].name"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null,'
     b' "audio": {"id": "audio_abc"}}]}', "messages[1].audio"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}',
     "messages[0].content[0].type"),
    (b'{"model": "m", "messages": [{"role": "assistant", "content": [{"type": "refusal"}]}]}',
     "messages[0].content[0].refusal"),
])
def test_bc23_bad_fields_are_400_naming_the_field(body, param):
    error = _chat_error(body)
    assert error.status == 400
    assert error.param == param
    if param == "messages":
        assert "messages" in error.message


_HI = '"model": "m", "messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("extra, param", [
    ('"logit_bias": {"100": 100}', "logit_bias"),
    ('"logit_bias": "x"', "logit_bias"),
    ('"functions": [{"name": "f", "parameters": {}}]', "functions"),
    ('"function_call": "auto"', "function_call"),
    ('"tool_choice": "required"', "tool_choice"),
    ('"tool_choice": {"type": "function", "function": {"name": "f"}}', "tool_choice"),
    ('"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}', "modalities"),
    ('"audio": {"voice": "alloy", "format": "wav"}', "audio"),
    ('"reasoning_effort": "high"', "reasoning_effort"),
    ('"stream_options": {"include_usage": true}', "stream_options"),  # without stream: OpenAI's and vLLM's 400
    # a tool's result with no tool call before it (this server makes none)
    ('"messages": [{"role": "user", "content": "weather?"}, {"role": "tool", "tool_call_id": "c1", '
     '"content": "sunny"}]', "messages[1].role"),
    # vLLM's extensions that change the answer (it applies them; Sluice does not)
    ('"min_tokens": 30', "min_tokens"),
    ('"repetition_penalty": 2.0', "repetition_penalty"),
    ('"repetition_penalty": true', "repetition_penalty"),
    ('"stop_token_ids": [2]', "stop_token_ids"),
    ('"guided_choice": ["yes", "no"]', "guided_choice"),
    ('"guided_json": {"type": "object"}', "guided_json"),
    ('"structured_outputs": {"regex": "a+"}', "structured_outputs"),
    ('"include_stop_str_in_output": true', "include_stop_str_in_output"),
    ('"skip_special_tokens": false', "skip_special_tokens"),
    ('"continue_final_message": true', "continue_final_message"),
    ('"add_generation_prompt": false', "add_generation_prompt"),
    ('"chat_template": "{{ messages }}"', "chat_template"),
    ('"chat_template_kwargs": {"enable_thinking": false}', "chat_template_kwargs"),
    ('"prompt_logprobs": 1', "prompt_logprobs"),
    ('"use_beam_search": true', "use_beam_search"),
    # an earlier tool call in the history: its name and arguments have no place in this server's prompt
    ('"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": '
     '[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, '
     '{"role": "tool", "tool_call_id": "c1", "content": "42"}]', "messages[1].tool_calls"),
    ('"messages": [{"role": "assistant", "content": null, "function_call": {"name": "f", "arguments": "{}"}}]',
     "messages[0].function_call"),
])
def test_fields_that_would_change_the_answer_are_400_not_ignored(extra, param):
    error = _chat_error(("{" + _HI + ", " + extra + "}").encode())
    assert error.status == 400 and error.param == param, error


@pytest.mark.parametrize("extra", ['"logit_bias": {}', '"logit_bias": null', '"tool_choice": "none"',
                                   '"function_call": "none"', '"modalities": ["text"]', '"tools": []',
                                   '"min_tokens": 0', '"repetition_penalty": 1.0', '"stop_token_ids": []',
                                   '"skip_special_tokens": true', '"add_generation_prompt": true',
                                   '"include_stop_str_in_output": false', '"guided_json": null',
                                   '"chat_template_kwargs": {}', '"unknown_vendor_field": {"x": 1}',
                                   '"messages": [{"role": "assistant", "content": "a", "tool_calls": []}]',
                                   '"stream": true, "stream_options": {"include_usage": true}',
                                   '"stream_options": null'])
def test_harmless_spellings_of_those_fields_are_accepted(extra):
    request = decode_body(("{" + _HI + ", " + extra + "}").encode(), ChatCompletionRequest)
    openai_api.check_unsupported(request)


@pytest.mark.parametrize("extra, param", [('"logprobs": -1', "logprobs"), ('"logprobs": 6', "logprobs"),
                                          ('"logit_bias": {"50256": -100}', "logit_bias"),
                                          ('"response_format": {"type": "json_object"}', "response_format.type"),
                                          ('"min_tokens": 5', "min_tokens"),
                                          ('"guided_regex": "[0-9]+"', "guided_regex")])
def test_completions_fields_that_would_change_the_answer_are_400(extra, param):
    with pytest.raises(SluiceError) as info:
        request = decode_body(('{"model": "m", "prompt": "hi", ' + extra + "}").encode(), CompletionRequest)
        openai_api.check_unsupported(request)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("schema", [ChatCompletionRequest, CompletionRequest, None])
def test_json_nested_past_the_decoders_limit_is_invalid_json_not_a_500(schema):
    deep = b"[" * 5000 + b"]" * 5000
    body = b'{"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "x": ' + deep + b"}"
    with pytest.raises(SluiceError) as info:
        openai_api.decode_json(body) if schema is None else decode_body(body, schema)
    assert info.value.code is ErrorCode.INVALID_JSON and info.value.status == 400
    assert "nested too deeply" in info.value.message
    assert openai_api.decode_json(b'{"x": ' + b"[" * 100 + b"]" * 100 + b"}")  # ordinary nesting still decodes


@pytest.mark.parametrize("value", [b"0", b"-5", b"1.5", b'"10"', b"-1"])
def test_bc19_max_tokens_zero_negative_fractional_string_is_400(value):
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + value + b"}"
    error = _chat_error(body)
    assert error.status == 400 and error.param == "max_tokens"


def test_bc18_null_max_tokens_means_default():
    body = b'{"model": "m", "messages": [{"role": "user", "content": "t"}], "max_tokens": null,' \
           b' "max_completion_tokens": null}'
    assert openai_api.requested_max_tokens(decode_body(body, ChatCompletionRequest)) is None


def test_max_completion_tokens_wins_over_max_tokens():
    body = b'{"model": "m", "messages": [{"role": "user", "content": "t"}], "max_tokens": 9,' \
           b' "max_completion_tokens": 5}'
    assert openai_api.requested_max_tokens(decode_body(body, ChatCompletionRequest)) == 5


def test_unknown_fields_are_ignored_and_content_parts_joined():
    body = (b'{"model": "m", "totally_unknown_field": [1, 2], "messages": [{"role": "developer", "name": "x",'
            b' "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},'
            b' {"role": "assistant", "content": null}]}')
    request = decode_body(body, ChatCompletionRequest)
    assert openai_api.chat_messages(request) == [{"role": "system", "content": "a\nb"},
                                                 {"role": "assistant", "content": ""}]


def test_an_assistant_refusal_part_is_its_text():
    """OpenAI lets an earlier assistant turn hold a refusal part; it reaches the model as that turn's text (README
    trial 14: it was a 400)."""
    body = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content":'
            b' [{"type": "refusal", "refusal": "I cannot help with that."}]}, {"role": "user", "content": "ok"}]}')
    messages = openai_api.chat_messages(decode_body(body, ChatCompletionRequest))
    assert messages[1] == {"role": "assistant", "content": "I cannot help with that."}


@pytest.mark.parametrize("prompt, expected", [
    ('"hi"', ["hi"]), ('["a", "b"]', ["a", "b"]), ("[1, 2, 3]", [[1, 2, 3]]), ("[[1], [2, 3]]", [[1], [2, 3]]),
])
def test_completion_prompt_forms(prompt, expected):
    request = decode_body(b'{"model": "m", "prompt": ' + prompt.encode() + b"}", CompletionRequest)
    assert openai_api.completion_prompts(request) == expected


@pytest.mark.parametrize("prompt, param", [("[]", "prompt"), ('[1, "a"]', "prompt"), ("[[1], []]", "prompt[1]"),
                                          ("[true]", "prompt")])
def test_bad_completion_prompts_are_400(prompt, param):
    request = decode_body(b'{"model": "m", "prompt": ' + prompt.encode() + b"}", CompletionRequest)
    with pytest.raises(SluiceError) as info:
        openai_api.completion_prompts(request)
    assert info.value.status == 400 and info.value.param == param


def test_stop_strings_limit_and_empty_strings():
    assert openai_api.stop_strings("x", 4) == ["x"]
    assert openai_api.stop_strings(["", "a"], 4) == ["a"]
    with pytest.raises(SluiceError) as info:
        openai_api.stop_strings(["a"] * 5, 4)
    assert info.value.param == "stop"


def test_a_batch_input_line_nested_past_the_decoders_limit_names_the_line():
    from gateway.jobs.batches import parse_input_lines

    good = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}'
    deep = b'{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"x": ' + \
        b"[" * 5000 + b"]" * 5000 + b"}}"
    with pytest.raises(SluiceError) as info:
        parse_input_lines(good + b"\n" + deep + b"\n", max_lines=10)
    assert info.value.status == 400 and info.value.param == "file"
    assert "line 2" in info.value.message and "nested too deeply" in info.value.message


def test_every_vllm_extension_refused_is_a_field_the_schemas_decode():
    """``VLLM_EXTENSIONS`` names the fields ``check_unsupported`` reads; one the Structs lack would never be read
    (msgspec drops unknown keys) and so never refused."""
    fields = set(ChatCompletionRequest.__struct_fields__) | set(CompletionRequest.__struct_fields__)
    assert set(openai_api.VLLM_EXTENSIONS) <= fields


def test_a_developer_message_reaches_the_chat_template_as_the_system_message():
    """OpenAI's ``developer`` role replaces ``system``; a template that knows only ``system`` would otherwise add
    its default system prompt and a ``developer`` turn the model never saw (README trial 8)."""
    request = decode_body(b'{"model": "m", "messages": [{"role": "developer", "content": "Be terse."}, '
                          b'{"role": "user", "content": "hi"}]}', ChatCompletionRequest)
    openai_api.check_unsupported(request)
    assert openai_api.chat_messages(request) == [{"role": "system", "content": "Be terse."},
                                                 {"role": "user", "content": "hi"}]
