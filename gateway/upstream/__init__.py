"""Pools of OpenAI-compatible HTTP upstreams (vLLM, SGLang, llama.cpp, TGI, transformers serve, any other).

An upstream is one more worker of a pool (``[[pools]] backend = "openai"``): :class:`~gateway.upstream.client.
UpstreamClient` presents itself to the pool, admission and routing as a ``WorkerClient`` does, reads its capacity
from the engine's own ``/metrics`` (:mod:`gateway.upstream.engine_metrics`) and streams each request over HTTP
(:mod:`gateway.upstream.sse`), so tiers, caps, deadlines, early rejection, deferral and degrade routing apply to it
unchanged.
"""
