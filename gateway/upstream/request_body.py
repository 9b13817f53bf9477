"""What an upstream is sent for one choice: the OpenAI request body built from the client's prompt and Sluice's
decisions (capped ``max_tokens``, sampling, seed per choice).

The gateway has already validated the request, tokenized it for admission and capped its output; the upstream gets
the messages (it applies its own chat template, the same one when ``tokenizer`` names the served model's files) or
the completion prompt, always as a stream with usage, one choice per request (``n`` > 1 is n requests, as on our
workers). Stop strings are not sent: the gateway matches them and closes the upstream request at the match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.protocol import Generate


# Engines whose OpenAI endpoints refuse the vLLM sampling extensions forwarded below (``top_k``, ``ignore_eos``), or
# may: ``transformers serve`` answers 422 "Unexpected fields in the request", and a ``generic`` engine is one Sluice
# knows nothing about. The gateway refuses these fields for such a pool with a 400 naming the field. vLLM, SGLang
# and llama.cpp's server take both; TGI is sent them as asked.
ENGINES_WITHOUT_VLLM_SAMPLING = frozenset({"transformers", "generic"})
# Engines whose ``/v1/completions`` takes the prompt as token ids (vLLM, SGLang: ``prompt: list[int]``; llama.cpp
# server: "prompt" may be an array of tokens). The others are sent a prompt of token ids as its text.
ENGINES_RESUMING_FROM_TOKEN_IDS = frozenset({"vllm", "sglang", "llama.cpp"})


@dataclass(frozen=True)
class UpstreamPrompt:
    """One prompt as the client sent it, for an upstream to read instead of token ids.

    Attributes:
        messages: chat messages (``[{"role", "content"}]``) for ``/v1/chat/completions``; None for a completion.
        prompt: the completion prompt (a string or token ids) for ``/v1/completions``; None for a chat.
    """

    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None

    @property
    def path(self) -> str:
        """The upstream endpoint: ``/v1/chat/completions`` or ``/v1/completions``."""
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"


def upstream_body(prompt: UpstreamPrompt, message: Generate, model: str) -> dict[str, Any]:
    """Return the JSON body for one choice of ``message`` on an upstream serving ``model``.

    Args:
        prompt: the client's messages or prompt.
        message: the choice as a worker would get it (max_tokens after caps, sampling with the choice's seed).
        model: the model name the upstream serves.
    """
    sampling = message.sampling
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": message.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if prompt.messages is not None:
        body["messages"] = prompt.messages
    else:
        body["prompt"] = prompt.prompt
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if message.ignore_eos:
        body["ignore_eos"] = True
    return body
