"""OpenAI request schemas as msgspec Structs, and their validation into :class:`SluiceError` with ``param``.

Policy (deliberate, documented in the README):

- Unknown fields are accepted and ignored, as vLLM does (SDKs send extra keys; OpenAI itself answers 400).
- Known fields with a wrong type or value are rejected with 400 and the field path in ``param``
  (``messages[0].content``, ``max_tokens`` …).
- Features Sluice does not implement are rejected with a clear 400 rather than silently ignored when ignoring them
  would change the answer: non-zero ``presence_penalty``/``frequency_penalty``, ``tools``, ``response_format``
  other than text, ``echo``, ``suffix``, ``best_of`` ≠ ``n``, tool calls in the history (``messages[i].tool_calls``),
  and vLLM's sampling and template extensions (:data:`VLLM_EXTENSIONS`: ``min_tokens``, ``repetition_penalty``,
  ``guided_json`` …) set to anything but their neutral value; vLLM's ``top_k`` and ``ignore_eos`` are served.
- ``logprobs``: chat ``logprobs: true`` with ``top_logprobs`` 0–20 (``top_logprobs`` > 0 needs ``logprobs: true``);
  completions ``logprobs`` 0–5 (OpenAI's limits).
- ``max_tokens`` / ``max_completion_tokens``: null or omitted means the default; 0, negative or fractional is 400.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

from shared.errors import ErrorCode, SluiceError

MAX_SEED = 2**63 - 1
MIN_SEED = -(2**63)

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
MAX_TOP_K = 2**31 - 1  # past any vocabulary (a top_k at least the vocabulary keeps every token), within msgpack's ints
TopK = Annotated[int, msgspec.Meta(ge=-1, le=MAX_TOP_K)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
Seed = Annotated[int, msgspec.Meta(ge=MIN_SEED, le=MAX_SEED)]
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
ChatTopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_CHAT_TOP_LOGPROBS)]
CompletionLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)]


class _Schema(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    pass


class ContentPart(_Schema, kw_only=True):
    """One part of a message's content list: ``{"type": "text", "text": ...}``, or in an assistant message
    ``{"type": "refusal", "refusal": ...}`` (what the model said when it declined, taken as its text)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(_Schema, kw_only=True):
    """One chat message. ``content`` may be null only for an assistant message; a ``tool`` message names the call
    it answers (``tool_call_id``, as OpenAI requires)."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # read for its type only: chat templates take role and content
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = None  # rejected when non-empty (check_unsupported)
    function_call: Any = None
    audio: Any = None  # an earlier assistant turn given as audio: rejected (message_text)


class StreamOptions(_Schema, kw_only=True):
    include_usage: bool = False


class ResponseFormat(_Schema, kw_only=True):
    type: str = "text"


class _SamplingFields(_Schema, kw_only=True):
    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    n: PositiveInt | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions Sluice does not serve: read only to refuse a non-neutral value (VLLM_EXTENSIONS)
    min_tokens: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    stop_token_ids: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    prompt_logprobs: Any = None
    use_beam_search: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/chat/completions`` (the fields Sluice reads)."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: ChatTopLogprobs | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    reasoning_effort: str | None = None
    # vLLM's chat template extensions (VLLM_EXTENSIONS)
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/completions`` (the fields Sluice reads).

    ``prompt``: a string, a list of strings, a list of token ids or a list of token id lists (checked by
    :func:`completion_prompts`; msgspec cannot express that union of arrays).
    """

    prompt: str | list[Any]
    logprobs: CompletionLogprobs | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


OpenAIRequest = ChatCompletionRequest | CompletionRequest  # a parsed body of either endpoint


_PATH_RE = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING_RE = re.compile(r"Object missing required field `(?P<field>[^`]+)`")


def _param_from_validation(message: str) -> str | None:
    """Turn msgspec's ``... - at `$.messages[0].content``` into ``messages[0].content``."""
    path = ""
    match = _PATH_RE.search(message)
    if match:
        path = match.group("path").lstrip(".")
    missing = _MISSING_RE.search(message)
    if missing:
        field = missing.group("field")
        path = f"{path}.{field}" if path else field
    return path or None


def decode_json(body: bytes) -> Any:
    """Decode a JSON request body into Python values.

    Raises:
        SluiceError: ``invalid_json``: not JSON, or nested deeper than the decoder's recursion limit (about 1000
            levels: msgspec raises ``RecursionError``, which would otherwise surface as a 500).
    """
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise SluiceError(ErrorCode.INVALID_JSON, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep() from None


def _too_deep() -> SluiceError:
    return SluiceError(ErrorCode.INVALID_JSON, "the request body is nested too deeply to decode")


def decode_body(body: bytes, schema: type[msgspec.Struct]) -> Any:
    """Decode a JSON request body straight into ``schema``.

    Raises:
        SluiceError: ``invalid_json`` (not JSON, or nested too deeply), ``invalid_type``/``invalid_value`` (wrong
            shape; ``param`` names the field), ``missing_required_parameter``.
    """
    try:
        return msgspec.json.decode(body, type=schema)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.ValidationError as exc:
        _raise_if_not_json(body)  # typed decoding stops at the first bad field, maybe before a syntax error
        text = str(exc)
        param = _param_from_validation(text)
        if text.startswith("Object missing required field"):
            code = ErrorCode.MISSING_FIELD
        elif text.startswith("Expected `") and " - at " not in text and param is None:
            code = ErrorCode.INVALID_TYPE
            text = f"the request body must be a JSON object ({text})"
        elif text.startswith("Expected `") and "`, got `" in text:
            code = ErrorCode.INVALID_TYPE
        else:
            code = ErrorCode.INVALID_VALUE
        raise SluiceError(code, f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        if not body.strip():
            raise SluiceError(ErrorCode.INVALID_JSON, "the request body is empty: send a JSON object") from None
        raise SluiceError(ErrorCode.INVALID_JSON, f"the request body is not valid JSON: {exc}") from None


def _raise_if_not_json(body: bytes) -> None:
    decode_json(body)


def _invalid(message: str, param: str) -> SluiceError:
    return SluiceError(ErrorCode.INVALID_VALUE, message, param=param)


def message_text(message: ChatMessage, index: int) -> str:
    """Return the text of a chat message; content parts are joined with newlines (as vLLM does).

    Raises:
        SluiceError: missing content on a non-assistant message, a tool message without ``tool_call_id``, an
            assistant turn given as ``audio`` (it would reach the model empty), or a content part that is not text
            (a ``refusal`` part counts as text in an assistant message).
    """
    if message.role == "tool" and not message.tool_call_id:
        raise SluiceError(ErrorCode.MISSING_FIELD, f"messages[{index}].tool_call_id is required for role 'tool'",
                          param=f"messages[{index}].tool_call_id")
    if message.audio is not None:
        raise _invalid("an assistant turn given as audio is not supported (this model reads text only, so the turn "
                       "would reach it empty); send its transcript as content", f"messages[{index}].audio")
    content = message.content
    if content is None:
        if message.role == "assistant":
            return ""
        raise SluiceError(ErrorCode.MISSING_FIELD, f"messages[{index}].content is required for role "
                          f"{message.role!r}", param=f"messages[{index}].content")
    if isinstance(content, str):
        return content
    texts = []
    for part_index, part in enumerate(content):
        param = f"messages[{index}].content[{part_index}]"
        if part.type == "refusal" and message.role == "assistant":
            if part.refusal is None:
                raise SluiceError(ErrorCode.MISSING_FIELD, "a refusal content part needs 'refusal'",
                                  param + ".refusal")
            texts.append(part.refusal)
            continue
        if part.type != "text":
            raise _invalid(f"content part type {part.type!r} is not supported (only 'text', and 'refusal' in an "
                           "assistant message)", param + ".type")
        if part.text is None:
            raise SluiceError(ErrorCode.MISSING_FIELD, "a text content part needs 'text'", param + ".text")
        texts.append(part.text)
    return "\n".join(texts)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """Return the messages as ``[{"role", "content"}]`` dicts ready for the chat template; a ``developer`` message
    (OpenAI's newer name for the system message) becomes ``system``, the role chat templates know.

    Raises:
        SluiceError: see :func:`message_text`.
    """
    return [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m, i)}
            for i, m in enumerate(request.messages)]


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """Return the prompts of a completions request: each a string or a list of token ids.

    Raises:
        SluiceError: an empty prompt list, mixed element types, or a non-integer token id (``param`` "prompt").
    """
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise _invalid("prompt must not be an empty list", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        for i, ids in enumerate(prompt):
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise _invalid(f"prompt[{i}] must be a non-empty list of token ids", f"prompt[{i}]")
        return [list(p) for p in prompt]
    raise SluiceError(ErrorCode.INVALID_TYPE, "prompt must be a string, a list of strings, a list of token ids "
                      "or a list of token id lists", param="prompt")


def stop_strings(stop: str | list[str] | None, max_stop_sequences: int) -> list[str]:
    """Return the non-empty stop strings of a request.

    Raises:
        SluiceError: more than ``max_stop_sequences`` strings (``param`` "stop").
    """
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if len(items) > max_stop_sequences:
        raise _invalid(f"at most {max_stop_sequences} stop sequences are allowed, got {len(items)}", "stop")
    return [s for s in items if s]


# vLLM's request extensions that change the answer, each with the values that leave it unchanged (its default and
# the like): any other value is refused, naming the field (vLLM docs, "Extra parameters" of the OpenAI-compatible
# server). Chat-only names are ignored on /v1/completions, whose Struct lacks them.
VLLM_EXTENSIONS: dict[str, tuple[object, ...]] = {
    "min_tokens": (None, 0), "min_p": (None, 0), "repetition_penalty": (None, 1), "stop_token_ids": (None, []),
    "bad_words": (None, []), "allowed_token_ids": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "prompt_logprobs": (None,), "use_beam_search": (None, False),
    "truncate_prompt_tokens": (None,), "logits_processors": (None, []),
    "continue_final_message": (None, False), "add_generation_prompt": (None, True), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None,),
}


def _is_neutral(value: object, neutral: tuple[object, ...]) -> bool:
    # bool is an int: True must not pass for 1 (repetition_penalty) nor False for 0 (min_tokens)
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


@functools.cache
def _vllm_extension_fields(request_type: type) -> tuple[tuple[str, ...], Callable[[object], tuple[object, ...]]]:
    """The :data:`VLLM_EXTENSIONS` fields of a request Struct and a getter of all their values at once."""
    names = tuple(name for name in VLLM_EXTENSIONS if name in request_type.__struct_fields__)
    getter = operator.attrgetter(*names)
    return names, (getter if len(names) > 1 else lambda request: (getter(request),))


def check_unsupported(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Reject features whose silent omission would change the answer.

    Raises:
        SluiceError: 400 naming the field.
    """
    if request.stream_options is not None and not request.stream:  # OpenAI's and vLLM's 400
        raise _invalid("stream_options is only allowed when stream is true", "stream_options")
    names, read_all = _vllm_extension_fields(type(request))
    if any(value is not None for value in read_all(request)):  # the common case, all absent: one C call
        for name in names:
            value, neutral = getattr(request, name), VLLM_EXTENSIONS[name]
            if value is not None and not _is_neutral(value, neutral):
                raise _invalid(f"{name} is not supported by this server (a vLLM extension; only "
                               f"{' or '.join(msgspec.json.encode(n).decode() for n in neutral)})", name)
    if request.response_format is not None and request.response_format.type != "text":
        raise _invalid("only response_format {'type': 'text'} is supported", "response_format.type")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value not in (None, 0, 0.0):
            raise _invalid(f"{name} is not supported by this server (only 0)", name)
    if request.logit_bias:
        raise _invalid("logit_bias is not supported by this server (only {} or null)", "logit_bias")
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs and not request.logprobs:
            raise _invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        if request.tools:
            raise _invalid("tools (function calling) are not supported by this server", "tools")
        if request.tool_choice not in (None, "none"):
            raise _invalid("tool_choice is not supported by this server (no tools; only \"none\")", "tool_choice")
        if request.functions:
            raise _invalid("functions (function calling) are not supported by this server", "functions")
        if request.function_call not in (None, "none"):
            raise _invalid("function_call is not supported by this server (only \"none\")", "function_call")
        for i, message in enumerate(request.messages):
            if message.role == "tool" and message.tool_call_id is not None:  # without one: 400 naming it (BC23)
                # a tool's result answers a tool call, which this server never makes
                raise _invalid("tool messages are not supported by this server (no tools)", f"messages[{i}].role")
            if message.tool_calls or message.function_call is not None:
                field = "tool_calls" if message.tool_calls else "function_call"
                raise _invalid("tool calls in the conversation are not supported by this server (no tools)",
                               f"messages[{i}].{field}")
        if request.modalities is not None and set(request.modalities) - {"text"}:
            raise _invalid("only the text modality is supported by this server", "modalities")
        if request.audio is not None:
            raise _invalid("audio output is not supported by this server", "audio")
        if request.reasoning_effort is not None:
            raise _invalid("reasoning_effort is not supported by this model", "reasoning_effort")
    else:
        if request.echo:
            raise _invalid("echo is not supported by this server", "echo")
        if request.suffix:
            raise _invalid("suffix is not supported by this server", "suffix")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise _invalid("best_of must equal n (server-side best-of is not supported)", "best_of")


def logprobs_wanted(request: ChatCompletionRequest | CompletionRequest) -> tuple[bool, int]:
    """Return (whether the answer carries log-probabilities, how many alternatives per position)."""
    if isinstance(request, ChatCompletionRequest):
        return bool(request.logprobs), (request.top_logprobs or 0) if request.logprobs else 0
    return request.logprobs is not None, request.logprobs or 0


def requested_max_tokens(request: ChatCompletionRequest | CompletionRequest) -> int | None:
    """Return the client's output cap: ``max_completion_tokens`` wins over ``max_tokens``; None when neither."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens
