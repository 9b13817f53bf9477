"""What a pool of upstream engines can serve of a request, and what it is sent: the pipeline's checks and prompts
for ``[[pools]] backend = "openai"`` (:mod:`gateway.upstream`).

A field the pool's engine cannot take is a 400 naming it before the request is queued (:func:`check_servable`),
rather than an answer without it or the engine's own refusal, which names no field; each prompt goes as the chat
messages or the completion prompt, token ids as their text to an engine that takes only text
(:func:`upstream_prompts`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.pipeline import openai_api
from gateway.pipeline.openai_api import OpenAIRequest
from gateway.pipeline.tokenize import Tokenizer
from gateway.upstream.request_body import ENGINES_RESUMING_FROM_TOKEN_IDS, ENGINES_WITHOUT_VLLM_SAMPLING, \
    UpstreamPrompt
from shared.config import PoolConfig
from shared.errors import ErrorCode, SluiceError

if TYPE_CHECKING:
    from gateway.fleet.pools import PoolRuntime


def unservable_field(body: OpenAIRequest, pool: PoolConfig) -> str | None:
    """Return the field of the request that ``pool`` cannot serve, or None: ``logprobs`` on a pool of upstream
    engines (``gateway.upstream`` streams their text, not their log-probabilities); ``top_k`` or ``ignore_eos`` on an
    engine that refuses vLLM's sampling extensions (:data:`ENGINES_WITHOUT_VLLM_SAMPLING`)."""
    if pool.backend != "openai":
        return None
    if openai_api.logprobs_wanted(body)[0]:
        return "logprobs"
    if pool.engine in ENGINES_WITHOUT_VLLM_SAMPLING:
        if (body.top_k or 0) > 0:
            return "top_k"
        if body.ignore_eos:
            return "ignore_eos"
    return None


def check_servable(body: OpenAIRequest, runtime: PoolRuntime) -> None:
    """Raise 400 naming the field the request's pool cannot serve (:func:`unservable_field`), rather than answer
    without it or pass on the engine's own refusal, which names no field."""
    field = unservable_field(body, runtime.config)
    if field == "logprobs":
        raise SluiceError(ErrorCode.INVALID_VALUE, f"logprobs are not available from model '{body.model}': its pool "
                          f"'{runtime.name}' is an upstream engine, whose log-probabilities this gateway does not pass "
                          "through", param="logprobs")
    if field is not None:
        engine = runtime.config.engine
        which = (f"an upstream {engine} engine, which does not take it" if engine != "generic"
                 else "an upstream engine of unknown kind (engine = \"generic\"), which may not take it")
        raise SluiceError(ErrorCode.INVALID_VALUE, f"{field} is not available from model '{body.model}': its pool "
                          f"'{runtime.name}' is {which}", param=field)


def upstream_prompts(body: OpenAIRequest, engine: str, tokenizer: Tokenizer) -> list[UpstreamPrompt]:
    """Return what an upstream pool is sent per prompt: the chat messages, or each completion prompt; a prompt of
    token ids goes as its text to an engine that takes only text (not in
    :data:`~gateway.upstream.request_body.ENGINES_RESUMING_FROM_TOKEN_IDS`: ``transformers serve`` answers "prompt
    must be a string").

    Raises:
        SluiceError: 400 naming the prompt whose token ids no text spells (:func:`_prompt_text`).
    """
    if isinstance(body, openai_api.ChatCompletionRequest):
        return [UpstreamPrompt(messages=openai_api.chat_messages(body))]
    prompts = openai_api.completion_prompts(body)
    if engine in ENGINES_RESUMING_FROM_TOKEN_IDS:
        return [UpstreamPrompt(prompt=prompt) for prompt in prompts]
    return [UpstreamPrompt(prompt=prompt if isinstance(prompt, str) else
                           _prompt_text(prompt, tokenizer, "prompt" if len(prompts) == 1 else f"prompt[{i}]", engine))
            for i, prompt in enumerate(prompts)]


def _prompt_text(token_ids: list[int], tokenizer: Tokenizer, param: str, engine: str) -> str:
    """Return the text ``token_ids`` spell, special tokens included (``<|im_start|>`` stays in the prompt), for an
    engine that tokenizes it again.

    Raises:
        SluiceError: 400 naming ``param`` when the ids do not spell whole UTF-8 characters (a byte token cut from
            its character): no text stands for them, and the engine would read a replacement character instead.
    """
    raw = tokenizer.byte_level_bytes(token_ids) if tokenizer.byte_level else tokenizer.token_bytes(token_ids)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SluiceError(ErrorCode.INVALID_VALUE, f"this model's pool is an upstream {engine} engine, which takes a "
                          "prompt only as text, and these token ids do not decode to whole UTF-8 characters; send "
                          "the prompt as text", param=param) from None
    return tokenizer.backend.decode(token_ids, skip_special_tokens=False)
