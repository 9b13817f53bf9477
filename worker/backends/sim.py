"""The sim backend: a roofline SIMULATOR of a GPU worker, for load beyond what a CPU can run.

Same scheduler, same KV pool metadata, same protocol as the real worker; only the model step is replaced by a
timed wait from a roofline model (DESIGN.md, sim backend) and tokens are deterministic pseudo-random ids from the
real tokenizer's vocabulary. It announces itself as ``backend = "sim"`` and device ``sim:<gpu>`` in ``Hello``, so
every metric label and log line that names the backend says it is a simulator. Never use it in tests of the model.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.config import Config, SimConfig, resolve_model_path
from worker.sampling import TokenLogprobs
from worker.scheduler import SchedulerOutput

GIB = 1024**3


@dataclass(frozen=True)
class SimModelSpec:
    """The parts of a model spec the worker needs, for the simulated model."""

    vocab_size: int
    eos_token_ids: list[int]
    max_position_embeddings: int


def step_time_s(sim: SimConfig, num_prefill_tokens: int, kv_tokens_read: int) -> float:
    """Return the simulated duration of one engine step in seconds.

    Args:
        sim: the roofline parameters.
        num_prefill_tokens: prompt tokens computed this step (compute-bound: 2 × params FLOPs each).
        kv_tokens_read: cached tokens whose K/V the step's attention reads (memory-bound).

    The weights are read once per step whatever the batch (decode is memory-bound; Williams et al., "Roofline",
    CACM 2009); prefill FLOPs are added, not overlapped, which makes mixed steps slightly pessimistic.
    """
    bandwidth_bytes_s = sim.hbm_bandwidth_gb_s * 1e9 * sim.hbm_efficiency
    weight_bytes = sim.model_params_b * 1e9 * sim.weight_bytes_per_param
    memory_s = (weight_bytes + kv_tokens_read * sim.kv_bytes_per_token) / bandwidth_bytes_s
    compute_s = 2.0 * sim.model_params_b * 1e9 * num_prefill_tokens / (sim.usable_tflops * 1e12)
    return (memory_s + compute_s + sim.step_overhead_ms / 1000.0) * sim.time_scale


def sim_token(seed: int, position: int, vocab: list[int]) -> int:
    """Return a deterministic pseudo-random token id for (seed, output position) from ``vocab``."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return vocab[int.from_bytes(digest, "little") % len(vocab)]


class SimRunner:
    """Stand-in for :class:`worker.model_runner.ModelRunner` that sleeps for the roofline step time.

    The simulated GPU runs one step after another; this process's own host work between two steps (scheduling,
    the KV manager, sampling bookkeeping, socket I/O: real CPU time on this machine, not simulated) overlaps the
    previous step on the simulated GPU, up to that step's duration, as vLLM v1's async scheduling overlaps the
    scheduler with the GPU (the roofline's ``step_overhead_ms`` already stands for a real host's share). Without
    that, a slow test machine would add its Python time to every simulated step and the simulated H200 would be as
    slow as the CPU driving it. Host work longer than the previous step (the engine was idle, or the host is the
    bottleneck) is hidden only up to the previous step's duration; after a gap of over two steps the engine was idle
    and nothing is hidden.

    Attributes:
        num_steps: steps run.
        simulated_busy_s: the roofline time of those steps, seconds (time-scaled).
        host_overlap_s: host time hidden under the previous simulated step, seconds.
    """

    def __init__(self, sim: SimConfig, vocab: list[int]) -> None:
        self.sim = sim
        self.vocab = vocab
        self.num_steps = 0
        self.simulated_busy_s = 0.0
        self.host_overlap_s = 0.0
        self._gpu_end_s = -math.inf  # time.monotonic() when the simulated GPU finishes its last step
        self._last_duration_s = 0.0
        self.step_logprobs: dict[str, TokenLogprobs] = {}

    def run(self, out: SchedulerOutput, should_stop: Callable[[], bool] | None = None) -> dict[str, int]:
        """Wait the simulated step time of ``out``; return each sampling sequence's deterministic pseudo-random
        token (``should_stop`` is not asked: a simulated step is one wait).

        The simulator's token is certain, so a sequence that asks for log-probabilities gets 0.0 for it and that
        token as its only alternative (:attr:`step_logprobs`).
        """
        num_prefill = 0
        kv_tokens = 0
        for item in out.scheduled:
            kv_tokens += item.seq.num_computed_tokens + item.num_new_tokens
            if not (item.num_new_tokens == 1 and item.seq.output_token_ids):
                num_prefill += item.num_new_tokens
        duration_s = step_time_s(self.sim, num_prefill, kv_tokens)
        now_s = time.monotonic()
        # busy: the host prepared this step while the simulated GPU ran the previous one, so the step starts when
        # that one ended or when the host was ready, whichever is later; a gap of over two steps was idle time
        busy = now_s - self._gpu_end_s < 2 * self._last_duration_s
        start_s = max(self._gpu_end_s, now_s - self._last_duration_s) if busy else now_s
        end_s = start_s + duration_s
        if end_s > now_s:
            time.sleep(end_s - now_s)
        self.host_overlap_s += now_s - start_s
        self._gpu_end_s = end_s
        self._last_duration_s = duration_s
        self.num_steps += 1
        self.simulated_busy_s += duration_s
        sampled = {
            item.seq.request_id: sim_token(item.seq.seed, len(item.seq.output_token_ids), self.vocab)
            for item in out.scheduled
            if item.sample
        }
        self.step_logprobs = {
            item.seq.request_id: TokenLogprobs(0.0, [sampled[item.seq.request_id]][:item.seq.sampling.top_logprobs],
                                               [0.0][:item.seq.sampling.top_logprobs])
            for item in out.scheduled
            if item.sample and item.seq.sampling.logprobs
        }
        return sampled


def tokenizer_facts(path: str) -> tuple[int, list[int], list[int]]:
    """Return ``(vocab_size, special_token_ids, eos_token_ids)`` of the tokenizer at ``path`` (a GGUF file or an HF
    folder), loaded with transformers.

    The answer is cached as JSON under ``$XDG_CACHE_HOME/sluice/sim`` (default ``~/.cache``), keyed by the path, size
    and mtime of the model file, so a simulated worker's cold start after the first is Python start-up, not a
    tokenizer load from the GGUF (seconds). A cache that cannot be read or written is ignored.
    """
    import json
    import os

    from shared.model_files import cache_root, load_tokenizer

    target = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    try:
        st = os.stat(target)
        key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
        cache_dir = os.path.join(cache_root(), "sim")
        cache_path = os.path.join(cache_dir, f"{key}.json")
    except OSError:
        cache_path = ""
    if cache_path:
        try:
            with open(cache_path) as f:
                facts = json.load(f)
            return int(facts["vocab_size"]), list(facts["special_ids"]), list(facts["eos_ids"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    tokenizer = load_tokenizer(path)
    vocab_size = len(tokenizer)
    special_ids = sorted(set(tokenizer.all_special_ids))
    eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if cache_path:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            tmp_path = f"{cache_path}.{os.getpid()}.tmp"
            with open(tmp_path, "w") as f:
                json.dump({"path": path, "vocab_size": vocab_size, "special_ids": special_ids, "eos_ids": eos_ids}, f)
            os.replace(tmp_path, cache_path)
        except OSError:
            pass
    return vocab_size, special_ids, eos_ids


def build_sim_runner(config: Config):
    """Build the simulator from config: ``(runner, spec, num_kv_blocks, device_name, attention_name)``.

    The vocabulary is the real tokenizer's (the served model's), without its special tokens, so the gateway
    detokenizes the simulated output like real output (see :func:`tokenizer_facts`).
    """
    path = resolve_model_path(config.model)
    vocab_size, special_ids, eos = tokenizer_facts(path)
    special = set(special_ids)
    vocab = [i for i in range(vocab_size) if i not in special]
    sim = config.sim
    bytes_per_block = sim.kv_bytes_per_token * config.worker.block_size_tokens
    num_blocks = int(sim.kv_cache_gib * GIB // bytes_per_block)
    spec = SimModelSpec(vocab_size=vocab_size, eos_token_ids=eos,
                        max_position_embeddings=sim.max_model_len_tokens)
    return SimRunner(sim, vocab), spec, num_blocks, "sim:roofline", "sim"
