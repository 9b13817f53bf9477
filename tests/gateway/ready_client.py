"""A real :class:`WorkerClient` that has said Hello, with no process behind it, for tests that pin the gateway's
routing and admission decisions (which worker, or none); its writer records the frames it would have sent. The real
connection is exercised by the gateway's end-to-end tests."""

from __future__ import annotations

from gateway.workers.client import WorkerClient
from shared.protocol import Capacity, Hello


class RecordingWriter:
    """Stands in for the connection's ``StreamWriter``: keeps every frame written."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def ready_client(name: str, prefill_tokens_per_s: float = 2000.0, max_num_seqs: int = 8) -> WorkerClient:
    """Return a worker client that is ready: Hello and Capacity set by hand (10,000 free KV blocks of 16 tokens)."""
    worker = WorkerClient(f"unix:/nonexistent/{name}", name)
    worker.hello = Hello(worker_id=name, model_id="m", backend="sim", device="sim", block_size_tokens=16,
                         num_kv_blocks=10_000, kv_capacity_tokens=160_000, max_num_seqs=max_num_seqs,
                         max_model_len_tokens=8192)
    worker.capacity = Capacity(free_kv_blocks=10_000, total_kv_blocks=10_000, used_kv_blocks=0, cached_kv_blocks=0,
                               num_running=0, num_waiting=0, prefill_tokens_per_s=prefill_tokens_per_s)
    worker._writer = RecordingWriter()  # type: ignore[assignment]
    return worker
