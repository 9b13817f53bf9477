"""Output-length caps: the effective ``max_tokens`` of a request (DESIGN.md, step 4)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission.pressure import PressureMonitor
from shared.config import Config, effective_tiers
from shared.errors import ErrorCode, SluiceError


def effective_max_tokens(
    requested_tokens: int | None,
    prompt_tokens: int,
    max_model_len_tokens: int,
    max_tokens_cap: int,
    default_max_tokens: int,
    prompt_param: str = "messages",
) -> int:
    """Return min(request or default, cap, context − prompt), the output budget sent to the worker.

    A missing or null request gets ``default_max_tokens``, which is capped too.

    Args:
        requested_tokens: the client's ``max_tokens`` (already ≥ 1) or None.
        prompt_tokens: prompt length in tokens.
        max_model_len_tokens: the context length in tokens (prompt + output).
        max_tokens_cap: server-wide ceiling on output tokens.
        default_max_tokens: output budget when the client gives none.
        prompt_param: the request field named in a context error (``messages`` or ``prompt``).

    Raises:
        SluiceError: ``context_length_exceeded`` when the prompt leaves no room for one output token.
    """
    room_tokens = max_model_len_tokens - prompt_tokens
    if room_tokens < 1:
        raise SluiceError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {max_model_len_tokens} tokens, but the prompt has "
            f"{prompt_tokens} tokens, leaving no room for output. Shorten the messages or the prompt.",
            param=prompt_param,
        )
    wanted_tokens = default_max_tokens if requested_tokens is None else requested_tokens
    return max(1, min(wanted_tokens, max_tokens_cap, room_tokens))


@dataclass(frozen=True)
class CapDecision:
    """The effective output budget of a request and the limit that set it.

    Attributes:
        max_tokens: output tokens per choice to send to the worker (≥ 1).
        limited_by: ``request``, ``tier_default``, ``server_default``, ``tier_max``, ``server_cap``, ``pressure``
            or ``context``: when it is not ``request``/``tier_default``/``server_default`` the answer may end with ``finish_reason == "length"``
            earlier than the client asked.
    """

    max_tokens: int
    limited_by: str


class OutputCapper:
    """Cap output length per tier and pressure level (DESIGN.md step 4).

    effective ``max_tokens`` = min(request or default, tier max, server-wide ``gateway.max_tokens_cap``,
    the pressure level's cap for the tier, context − prompt). A missing or null request gets the default — the
    tier's ``default_max_tokens``, no more than the server-wide ``gateway.default_max_tokens`` — which is capped
    too; a request below 1 is a 400, never "unset".

    With ``admission.enabled = false`` (benchmark baseline) only the server-wide cap and the context hold, and the
    default is ``gateway.default_max_tokens``.

    Args:
        config: the whole config (tiers, gateway caps, context length, admission switch).
        pressure: the live pressure monitor, or None for no pressure caps.
    """

    def __init__(self, config: Config, pressure: PressureMonitor | None = None) -> None:
        self._config = config
        self._pressure = pressure
        self._tiers = {tier.name: tier for tier in effective_tiers(config)}
        self._reserved_kv_fraction_above = {
            tier.name: sum(t.reserved_kv_fraction for t in self._tiers.values() if t.priority > tier.priority)
            if config.admission.enabled else 0.0
            for tier in self._tiers.values()}

    def reserved_kv_fraction_above(self, tier: str) -> float:
        """Return the fraction of a pool's KV blocks that the tiers above ``tier`` reserve (their
        ``reserved_kv_fraction``, summed): admission never grants a request of ``tier`` more than the rest. 0.0
        with admission off (no reserved shares)."""
        return self._reserved_kv_fraction_above[tier]

    @property
    def pressure_monitor(self) -> PressureMonitor | None:
        """Return the pressure monitor whose level sets the pressure caps (shared with admission)."""
        return self._pressure

    def cap(
        self,
        tier: str,
        requested_tokens: int | None,
        prompt_tokens: int,
        param: str = "max_tokens",
        prompt_param: str = "messages",
        max_model_len_tokens: int | None = None,
    ) -> CapDecision:
        """Return the effective output budget of one request.

        Args:
            tier: the request's tier name (already resolved, see ``gateway.pipeline.classify``).
            requested_tokens: the client's ``max_tokens`` / ``max_completion_tokens``, or None when omitted/null.
            prompt_tokens: prompt length in tokens.
            param: the request field the value came from, named in a 400.
            prompt_param: the request field named in a context error (``messages`` or ``prompt``).
            max_model_len_tokens: the context length in tokens; None = ``model.max_model_len_tokens`` (the gateway
                passes the lower of that and what its workers announce).

        Raises:
            SluiceError: ``invalid_value`` (400) for a request below 1; ``context_length_exceeded`` (400) when the
                prompt leaves no room for one output token.
        """
        if requested_tokens is not None and requested_tokens < 1:
            raise SluiceError(
                ErrorCode.INVALID_VALUE,
                f"Invalid '{param}': integer below minimum value. Expected a value ≥ 1, got {requested_tokens}.",
                param=param,
            )
        gateway = self._config.gateway
        context_tokens = self._config.model.max_model_len_tokens if max_model_len_tokens is None else max_model_len_tokens
        room_tokens = context_tokens - prompt_tokens
        if room_tokens < 1:
            # Reuse the plain function's message for the context error.
            effective_max_tokens(
                requested_tokens, prompt_tokens, context_tokens, gateway.max_tokens_cap,
                gateway.default_max_tokens, prompt_param,
            )
        limits: list[tuple[int, str]] = []
        if not self._config.admission.enabled:
            wanted = gateway.default_max_tokens if requested_tokens is None else requested_tokens
            limits.append((wanted, "request" if requested_tokens is not None else "tier_default"))
        else:
            tier_config = self._tiers.get(tier)
            if tier_config is None:
                raise KeyError(f"unknown tier {tier!r}; tiers are {sorted(self._tiers)}")
            if requested_tokens is None:
                limits.append((tier_config.default_max_tokens, "tier_default"))
                limits.append((gateway.default_max_tokens, "server_default"))
            else:
                limits.append((requested_tokens, "request"))
            limits.append((tier_config.max_tokens, "tier_max"))
            pressure_cap = None if self._pressure is None else self._pressure.max_tokens_cap(tier)
            if pressure_cap is not None:
                limits.append((pressure_cap, "pressure"))
        limits.append((gateway.max_tokens_cap, "server_cap"))
        limits.append((room_tokens, "context"))
        tokens, limited_by = min(limits, key=lambda item: item[0])  # first of equals wins: the request's own
        return CapDecision(max_tokens=max(1, tokens), limited_by=limited_by)
