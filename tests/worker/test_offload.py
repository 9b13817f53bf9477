"""Offload tiers (host RAM, disk, Redis), the chain between them and the pool, and the reload/swap cost model.

Block data moves through the real :class:`KVBlockIO` over a small KV tensor; Redis is the real server at
127.0.0.1:6379 (``make redis`` starts it), each test in its own key namespace.
"""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch
from structlog.testing import capture_logs

from shared.config import KVConfig
from worker.kv_cache.offload.base import OffloadedBlock
from worker.kv_cache.offload.chain import OffloadChain, build_offload_chain
from worker.kv_cache.offload.cost import CostModel
from worker.kv_cache.offload.disk import DiskTier
from worker.kv_cache.offload.host import HostTier
from worker.kv_cache.offload.redis_tier import RedisTier, redis_key_prefix
from worker.kv_cache.stats import KVStats
from worker.model_runner import KVBlockIO
from tests.support.server import free_port

REDIS_URL = "redis://127.0.0.1:6379/0"
NUM_LAYERS, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM = 2, 8, 2, 4, 8
BLOCK_BYTES = NUM_LAYERS * 2 * NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM * 4


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def block(block_hash: int, fill: int = 0, expires_at_s: float = float("inf")) -> OffloadedBlock:
    data = torch.full((BLOCK_BYTES,), fill % 256, dtype=torch.uint8)
    return OffloadedBlock(block_hash, block_hash - 1, tuple(range(block_hash, block_hash + BLOCK_SIZE)), data,
                          expires_at_s)


def closed_port() -> int:
    return free_port()  # nothing listens there


@pytest.fixture
def redis_client():
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379 (run `make redis`)")
    yield client
    client.close()


@pytest.fixture
def model_id(redis_client):
    model_id = f"test-{uuid.uuid4().hex[:8]}"
    yield model_id
    for key in redis_client.scan_iter(match=redis_key_prefix(model_id, "float32") + "*"):
        redis_client.delete(key)


# ---------------------------------------------------------------- KVBlockIO


def test_block_io_round_trips_one_block_slice_of_the_pool():
    kv = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    io = KVBlockIO(kv)
    assert io.block_bytes == BLOCK_BYTES
    data = io.read_block(3).clone()
    io.write_block(5, data)
    assert torch.equal(kv[:, :, 5], kv[:, :, 3])
    assert not torch.equal(kv[:, :, 4], kv[:, :, 3])
    with pytest.raises(ValueError, match="bytes"):
        io.write_block(1, data[:-4])


def test_block_io_copies_the_leading_rows_of_a_block_in_every_layer_and_nothing_else():
    kv = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    before = kv.clone()
    io = KVBlockIO(kv)
    io.copy_block_prefix(3, 5, 2)
    assert torch.equal(kv[:, :, 5, :, :2], before[:, :, 3, :, :2])
    assert torch.equal(kv[:, :, 5, :, 2:], before[:, :, 5, :, 2:])
    kv[:, :, 5, :, :2] = before[:, :, 5, :, :2]
    assert torch.equal(kv, before)
    for bad in (0, BLOCK_SIZE + 1):
        with pytest.raises(ValueError, match="num_tokens"):
            io.copy_block_prefix(3, 5, bad)


# ---------------------------------------------------------------- bounds and demotion


def test_host_tier_never_exceeds_its_size_and_demotes_lru_to_disk(tmp_path):
    stats = KVStats()
    disk = DiskTier(3 * BLOCK_BYTES, str(tmp_path), stats=stats)
    host = HostTier(2 * BLOCK_BYTES + 100, BLOCK_BYTES, stats=stats, lower=disk)
    assert host.capacity_bytes == 2 * BLOCK_BYTES  # whole blocks only
    for i in range(1, 8):
        assert host.put(block(10 * i, fill=i))
        assert host.used_bytes <= host.capacity_bytes and disk.used_bytes <= disk.capacity_bytes
    assert [host.contains(10 * i) for i in range(1, 8)] == [False] * 5 + [True] * 2
    assert [disk.contains(10 * i) for i in range(1, 8)] == [False, False, True, True, True, False, False]
    assert disk.flush(timeout_s=10)
    files = os.listdir(disk.folder)
    assert len(files) == 3  # one batch of one block per host eviction
    assert sum(os.path.getsize(os.path.join(disk.folder, f)) for f in files) < 3 * BLOCK_BYTES + 3 * 200
    got = disk.get(40)
    assert got.token_ids == tuple(range(40, 44)) and got.parent_hash == 39
    assert torch.equal(got.data, torch.full((BLOCK_BYTES,), 4, dtype=torch.uint8))
    assert stats.get("offload_evicted_blocks", tier="host") == 5
    assert stats.get("offload_evicted_blocks", tier="disk") == 2
    disk.close()
    assert not os.path.exists(disk.folder)


def test_recently_used_blocks_stay_and_expired_blocks_are_never_served(tmp_path):
    clock = FakeClock()
    host = HostTier(2 * BLOCK_BYTES, BLOCK_BYTES, clock=clock)
    host.put(block(1))
    host.put(block(2, expires_at_s=110.0))
    host.get(1)  # 1 is now the most recent: 2 goes first
    host.put(block(3))
    assert (host.contains(1), host.contains(2), host.contains(3)) == (True, False, True)
    host.put(block(4, expires_at_s=105.0))  # evicts 1 (LRU)
    clock.now_s = 106.0
    assert host.get(4) is None and host.contains(3)
    assert not host.put(block(5, expires_at_s=106.0))  # already expired: not stored
    assert host.used_bytes == BLOCK_BYTES


def test_disk_tier_rejects_a_corrupted_file(tmp_path):
    disk = DiskTier(4 * BLOCK_BYTES, str(tmp_path))
    disk.put(block(7, fill=9))
    assert disk.flush(timeout_s=10)
    (name,) = os.listdir(disk.folder)
    path = os.path.join(disk.folder, name)
    with open(path, "r+b") as f:
        f.truncate(100)
    assert disk.get(7) is None and not disk.contains(7) and disk.used_bytes == 0


class BlockedWriter:
    """Holds a disk tier's writer thread before each batch until :meth:`release` (a write in progress)."""

    def __init__(self, disk: DiskTier) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        write = disk._write

        def held_write(batch, data):
            self.entered.set()
            self.gate.wait(10)
            return write(batch, data)

        disk._write = held_write

    def release(self) -> None:
        self.gate.set()


def test_disk_tier_writes_one_file_per_batch_and_removes_it_with_its_last_block(tmp_path):
    disk = DiskTier(8 * BLOCK_BYTES, str(tmp_path))
    assert disk.put_many([block(10 * i, fill=i) for i in range(1, 4)]) == [True] * 3
    assert disk.flush(timeout_s=10)
    assert len(os.listdir(disk.folder)) == 1
    for i in range(1, 4):
        got = disk.get(10 * i)
        assert got.token_ids == tuple(range(10 * i, 10 * i + BLOCK_SIZE)) and got.parent_hash == 10 * i - 1
        assert torch.equal(got.data, torch.full((BLOCK_BYTES,), i, dtype=torch.uint8))
    disk.discard(10)
    disk.discard(20)
    assert len(os.listdir(disk.folder)) == 1 and disk.get(30) is not None  # one row still lives in the file
    disk.discard(30)
    assert os.listdir(disk.folder) == [] and disk.used_bytes == 0
    disk.close()


def test_disk_tier_removes_the_folders_of_dead_workers_beside_its_own_and_nothing_else(tmp_path):
    """User trial: a worker killed with SIGKILL left its ``sluice-kv-<pid>-*`` folder (75 MB) for ever."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid is no running process (until reused, which takes a pid space's worth of forks)
    dead = tmp_path / f"sluice-kv-{child.pid}-k3_x9a0q"
    (dead / "sub").mkdir(parents=True)
    (dead / "00000001.kv").write_bytes(b"x" * 1000)
    (dead / "sub" / "00000002.kv").write_bytes(b"y" * 24)
    kept = [tmp_path / f"sluice-kv-{os.getpid()}-k3_x9a0q",  # a running worker's: this process
            tmp_path / f"sluice-kv-{child.pid}-short",  # not mkdtemp's 8 characters
            tmp_path / f"sluice-kv-{child.pid}-k3_x9a0q.bak",
            tmp_path / f"other-kv-{child.pid}-k3_x9a0q"]
    for path in kept:
        path.mkdir()
    not_a_folder = tmp_path / f"sluice-kv-{child.pid}-abcdefgh"
    not_a_folder.write_bytes(b"z")
    with capture_logs() as logs:
        disk = DiskTier(8 * BLOCK_BYTES, str(tmp_path))
    assert not dead.exists()
    assert all(path.is_dir() for path in kept) and not_a_folder.is_file() and os.path.isdir(disk.folder)
    removed = [entry for entry in logs if entry["event"] == "kv_disk_dead_worker_folder_removed"]
    assert removed == [{"event": "kv_disk_dead_worker_folder_removed", "log_level": "info", "path": str(dead),
                        "pid": child.pid, "size_bytes": 1024}]
    disk.close()
    assert not os.path.exists(disk.folder)


def test_disk_block_is_readable_while_written_and_never_half_written_under_its_name(tmp_path):
    disk = DiskTier(8 * BLOCK_BYTES, str(tmp_path))
    writer = BlockedWriter(disk)
    source = block(5, fill=7)
    assert disk.put(source)
    source.data.fill_(0)  # the caller reuses its buffer at once: the tier copied it
    assert writer.entered.wait(10)
    assert not [name for name in os.listdir(disk.folder) if name.endswith(".kv")]  # not renamed into place yet
    got = disk.get(5)  # served from the queued copy
    assert torch.equal(got.data, torch.full((BLOCK_BYTES,), 7, dtype=torch.uint8))
    writer.release()
    assert disk.flush(timeout_s=10)
    assert [name.endswith(".kv") for name in os.listdir(disk.folder)] == [True]
    got = disk.get(5)  # now read back from the file
    assert torch.equal(got.data, torch.full((BLOCK_BYTES,), 7, dtype=torch.uint8)) and got.token_ids == source.token_ids
    disk.close()


def test_disk_tier_drops_a_batch_rather_than_wait_when_the_write_queue_is_full(tmp_path):
    stats = KVStats()
    disk = DiskTier(8 * BLOCK_BYTES, str(tmp_path), stats=stats, max_pending_bytes=2 * BLOCK_BYTES)
    writer = BlockedWriter(disk)
    assert disk.put_many([block(1, fill=1), block(2, fill=2)]) == [True, True]
    assert writer.entered.wait(10)
    assert disk.put_many([block(3, fill=3)]) == [False]  # queue full: dropped, the caller is not held
    assert not disk.contains(3) and stats.get("offload_dropped_blocks", tier="disk") == 1
    assert disk.used_bytes == 2 * BLOCK_BYTES
    writer.release()
    assert disk.flush(timeout_s=10)
    assert disk.put(block(3, fill=3))  # room in the queue again
    assert [torch.equal(disk.get(i).data, torch.full((BLOCK_BYTES,), i, dtype=torch.uint8)) for i in (1, 2, 3)] == \
        [True] * 3
    disk.close()


def test_disk_block_discarded_before_its_write_leaves_no_file(tmp_path):
    disk = DiskTier(8 * BLOCK_BYTES, str(tmp_path))
    writer = BlockedWriter(disk)
    disk.put(block(1))
    disk.put(block(2))  # queued behind the held write of block 1
    assert writer.entered.wait(10)
    disk.discard(1)  # its write is in progress: removed once done
    disk.discard(2)  # not started: skipped
    writer.release()
    assert disk.flush(timeout_s=10)
    assert os.listdir(disk.folder) == [] and disk.used_bytes == 0 and disk.num_blocks == 0
    disk.close()


def test_block_io_reads_a_batch_of_blocks_as_the_single_block_reads_do():
    kv = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    io = KVBlockIO(kv)
    rows = io.read_blocks([5, 1, 6])
    assert rows.shape == (3, BLOCK_BYTES) and rows.dtype == torch.uint8
    for row, block_id in enumerate([5, 1, 6]):
        assert torch.equal(rows[row], io.read_block(block_id))
    assert io.read_blocks([]).shape == (0, BLOCK_BYTES)


def test_chain_demotes_a_batch_through_host_and_disk_and_reloads_exactly_what_was_demoted(tmp_path):
    kv = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    io = KVBlockIO(kv)
    stats = KVStats()
    disk = DiskTier(8 * BLOCK_BYTES, str(tmp_path), stats=stats)
    host = HostTier(2 * BLOCK_BYTES, BLOCK_BYTES, stats=stats, lower=disk)
    chain = OffloadChain([host, disk], io, CostModel({"host": 1e9, "disk": 1e9}, 1e3), stats=stats)
    originals = {block_id: kv[:, :, block_id].clone() for block_id in range(5)}
    writer = BlockedWriter(disk)
    evicted = [(block_id, 100 + block_id, 99 + block_id if block_id else None, list(range(block_id, block_id + 4)),
                float("inf")) for block_id in range(5)]
    assert chain.demote_many(evicted) == [True] * 5  # more than host RAM holds: the 3 oldest go on to disk
    kv.zero_()  # the pool reuses every block at once
    assert chain.find([100 + i for i in range(5)], 0) == ["disk"] * 3 + ["host"] * 2
    assert stats.get("offloaded_blocks", tier="disk") == 3 and stats.get("offloaded_blocks", tier="host") == 2
    for block_id in range(5):  # the disk rows are read while their write is held, the host rows from RAM
        tier = "disk" if block_id < 3 else "host"
        assert chain.load(tier, block_id, 100 + block_id, evicted[block_id][2], evicted[block_id][3])
        assert torch.equal(kv[:, :, block_id], originals[block_id])
    writer.release()
    assert disk.flush(timeout_s=10) and len(os.listdir(disk.folder)) == 1
    kv.zero_()
    assert chain.load("disk", 7, 101, 100, [1, 2, 3, 4])  # from the file now
    assert torch.equal(kv[:, :, 7], originals[1])
    chain.close()


def test_chain_demotes_straight_from_the_pool_into_host_slots_and_pushes_host_blocks_to_disk_intact(tmp_path):
    """A batch that fits host RAM goes from the pool into the host slots with no staging copy (no read_blocks); the
    next batch pushes those blocks on to disk; every block reloads exactly."""
    kv = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    io = KVBlockIO(kv)
    io.read_blocks = lambda block_ids, out=None: pytest.fail("staging copy on a CPU pool")
    stats = KVStats()
    disk = DiskTier(8 * BLOCK_BYTES, str(tmp_path), stats=stats)
    host = HostTier(3 * BLOCK_BYTES, BLOCK_BYTES, stats=stats, lower=disk)
    chain = OffloadChain([host, disk], io, CostModel({"host": 1e9, "disk": 1e9}, 1e3), stats=stats)
    originals = {block_id: kv[:, :, block_id].clone() for block_id in range(6)}
    evicted = [(block_id, 100 + block_id, None, list(range(block_id, block_id + 4)), float("inf"))
               for block_id in range(6)]
    assert chain.demote_many(evicted[:3]) == [True] * 3
    assert chain.demote_many(evicted[3:]) == [True] * 3
    assert chain.demote_many([(7, 500, None, [0, 0, 0, 0], 0.0)]) == [False]  # expired: not stored
    kv.zero_()
    assert chain.find([100 + i for i in range(6)], 0) == ["disk"] * 3 + ["host"] * 3
    assert stats.get("offloaded_blocks", tier="host") == 6 and stats.get("offloaded_blocks", tier="disk") == 3
    for block_id in range(6):
        assert chain.load("disk" if block_id < 3 else "host", block_id, 100 + block_id, None, evicted[block_id][3])
        assert torch.equal(kv[:, :, block_id], originals[block_id])
    chain.close()


def test_reusable_rows_hand_back_buffers_and_stacked_rows_reads_consecutive_rows_without_a_copy():
    from worker.kv_cache.offload.base import ReusableRows, stacked_rows

    rows = ReusableRows(row_bytes=8, max_spare_buffers=2)
    first = rows.take(5)  # 8 rows underneath (a power of two)
    assert first.shape == (5, 8)
    small = rows.take(2)
    rows.release(small)
    rows.release(first)  # two spares of different sizes
    again = rows.take(7)
    assert again.data_ptr() == first.data_ptr()  # the released buffer that fits, not new memory
    assert rows.take(2).data_ptr() == small.data_ptr()
    assert rows.take(3).data_ptr() not in (again.data_ptr(), small.data_ptr())  # taken: not handed out twice
    buffer = torch.arange(32, dtype=torch.uint8).reshape(4, 8).clone()  # its own storage, as a staging buffer
    assert stacked_rows([buffer[1], buffer[2]]).data_ptr() == buffer[1].data_ptr()
    assert torch.equal(stacked_rows([buffer[2], buffer[1]]), torch.stack([buffer[2], buffer[1]]))


def test_chain_reload_verifies_token_ids_so_no_other_conversation_is_served(tmp_path):
    kv = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    io = KVBlockIO(kv)
    chain = build_offload_chain(KVConfig(host_cache_gib=1e-3, disk_cache_gib=0, swap_space_gib=0), io, "m",
                                "float32")
    original = kv[:, :, 2].clone()
    assert chain.demote(2, block_hash=77, parent_hash=None, token_ids=[1, 2, 3, 4], expires_at_s=float("inf"))
    kv[:, :, 2].zero_()
    assert chain.find([77, 78], 0) == ["host"]
    assert not chain.load("host", 6, 77, None, [1, 2, 3, 5])  # same hash, other tokens: a collision, refused
    assert chain.stats.get("reload_verify_failures_total") == 1
    assert chain.find([77], 0) == []  # the suspicious block is gone
    assert chain.demote(0, block_hash=77, parent_hash=None, token_ids=[1, 2, 3, 4], expires_at_s=float("inf"))
    assert chain.load("host", 6, 77, None, [1, 2, 3, 4])
    assert torch.equal(kv[:, :, 6], kv[:, :, 0])
    assert not torch.equal(kv[:, :, 6], original)  # block 0's content, as demoted under that hash
    assert chain.stats.get("reloaded_bytes", tier="host") == BLOCK_BYTES


# ---------------------------------------------------------------- Redis


def test_redis_tier_round_trip_key_layout_ttl_and_size_cap(redis_client, model_id):
    stats = KVStats()
    tier = RedisTier(REDIS_URL, model_id, "float32", BLOCK_BYTES, capacity_bytes=3 * BLOCK_BYTES, ttl_s=60.0,
                     stats=stats)
    for i in range(1, 7):
        assert tier.put(block(1000 + i, fill=i))
        assert tier.used_bytes <= tier.capacity_bytes
    assert tier.get(1006).token_ids == tuple(range(1006, 1010))  # readable before the writer sent it
    assert tier.flush(timeout_s=30)
    keys = sorted(k.decode() for k in redis_client.scan_iter(match=redis_key_prefix(model_id, "float32") + "*"))
    assert keys == [f"sluice:kv:{model_id}:float32:{1000 + i:016x}" for i in (4, 5, 6)]
    assert sum(redis_client.strlen(k) for k in keys) < 3 * BLOCK_BYTES + 3 * 100  # data + small header
    assert 0 < redis_client.pttl(keys[0]) <= 60_000
    assert tier.contains_many([1004, 1001, 1006]) == [True, False, True]
    got = tier.get(1005)
    assert got.token_ids == tuple(range(1005, 1009)) and got.parent_hash == 1004
    assert torch.equal(got.data, torch.full((BLOCK_BYTES,), 5, dtype=torch.uint8))
    # another worker on the same model reads it; another dtype or model never does
    other = RedisTier(REDIS_URL, model_id, "float32", BLOCK_BYTES, capacity_bytes=BLOCK_BYTES)
    assert other.get(1005) is not None
    assert RedisTier(REDIS_URL, model_id, "bfloat16", BLOCK_BYTES, BLOCK_BYTES).get(1005) is None
    assert stats.get("redis_errors_total") == 0


def test_redis_ttl_follows_a_shorter_block_retention(redis_client, model_id):
    clock = FakeClock()
    tier = RedisTier(REDIS_URL, model_id, "float32", BLOCK_BYTES, 4 * BLOCK_BYTES, ttl_s=3600.0, clock=clock)
    tier.put(block(5, expires_at_s=clock.now_s + 2.0))
    assert tier.flush(timeout_s=30)
    assert 0 < redis_client.pttl(tier.key(5)) <= 2000


def test_redis_down_is_logged_once_counted_and_never_raises():
    stats = KVStats()
    url = f"redis://127.0.0.1:{closed_port()}/0"
    tier = RedisTier(url, "m", "float32", BLOCK_BYTES, 4 * BLOCK_BYTES, timeout_s=0.2, retry_s=0.0, stats=stats)
    with capture_logs() as logs:
        assert tier.put(block(1))  # queued: the writer's failure is reported on the next call
        assert tier.flush(timeout_s=30)
        assert tier.contains_many([1, 2]) == [False, False]
        assert tier.get(1) is None
    assert stats.get("redis_errors_total") == 3
    assert stats.snapshot()["redis_up"] == 0.0
    assert [entry["event"] for entry in logs] == ["kv_redis_unavailable"]
    assert logs[0]["fallback"] == "recompute"
    backoff = RedisTier(url, "m", "float32", BLOCK_BYTES, BLOCK_BYTES, timeout_s=0.2, retry_s=60.0, stats=KVStats())
    backoff.contains(1)
    backoff.contains(1)
    assert backoff.stats.get("redis_errors_total") == 1  # no call while marked down


def test_redis_writes_leave_the_engine_thread_and_queued_blocks_are_read_from_memory():
    """A server that accepts connections but never answers: a synchronous SET would wait for the timeout and fail;
    the tier queues the block, serves it from memory, and reports the writer's timeout on the next call."""
    import socket

    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(8)
        url = f"redis://127.0.0.1:{stalled.getsockname()[1]}/0"
        stats = KVStats()
        tier = RedisTier(url, "m", "float32", BLOCK_BYTES, 4 * BLOCK_BYTES, timeout_s=0.5, retry_s=60.0, stats=stats)
        assert tier.put_many([block(1, fill=1), block(2, fill=2)]) == [True, True]
        assert stats.get("redis_errors_total") == 0
        got = tier.get(2)
        assert got is not None and torch.equal(got.data, torch.full((BLOCK_BYTES,), 2, dtype=torch.uint8))
        assert tier.contains_many([1, 2, 3]) == [True, True, False] or stats.get("redis_errors_total") == 1
        assert tier.flush(timeout_s=30)
        assert stats.get("redis_errors_total") >= 1 and stats.snapshot()["redis_up"] == 0.0
        assert not tier.put(block(3))  # marked down: nothing is queued
        tier.close()


def test_redis_block_dropped_before_or_after_its_write_leaves_no_key(redis_client, model_id):
    tier = RedisTier(REDIS_URL, model_id, "float32", BLOCK_BYTES, capacity_bytes=8 * BLOCK_BYTES)
    tier.put_many([block(10), block(11)])
    tier.discard(10)  # most likely still queued: never written
    assert tier.flush(timeout_s=30)
    tier.discard(11)  # written: deleted by the writer
    tier.put(block(12))
    assert tier.flush(timeout_s=30)
    keys = sorted(k.decode() for k in redis_client.scan_iter(match=redis_key_prefix(model_id, "float32") + "*"))
    assert keys == [tier.key(12)]
    tier.close()


# ---------------------------------------------------------------- cost model


def test_cost_model_reloads_when_transfer_beats_recompute_and_recomputes_otherwise():
    block_bytes, block_size = 1_000_000, 16
    cost = CostModel({"host": 10e9, "disk": 1e9, "redis": 0.1e9}, prefill_tokens_per_s=1000.0)
    # recompute 16 tokens = 16 ms; host 0.1 ms, disk 1 ms, redis 10 ms per block: everything reloads
    assert cost.num_blocks_to_reload(["host", "disk", "redis"], block_bytes, block_size) == 3
    cost.freeze(prefill_tokens_per_s=100_000.0)  # a GPU: 16 tokens = 0.16 ms
    assert cost.num_blocks_to_reload(["host", "host"], block_bytes, block_size) == 2  # 0.1 ms < 0.16 ms
    assert cost.num_blocks_to_reload(["disk", "redis"], block_bytes, block_size) == 0
    # a slow block in the middle is paid for by the fast ones behind it only when they save more
    assert cost.num_blocks_to_reload(["host", "disk", "host", "host"], block_bytes, block_size) == 1
    cost.freeze(bandwidth_bytes_per_s={"disk": 4e9})  # disk 0.25 ms: -0.06 + 0.09 - 0.06 - 0.06 < -0.06
    assert cost.num_blocks_to_reload(["host", "disk", "host", "host"], block_bytes, block_size) == 4


def test_cost_model_swap_or_recompute_and_measurements_replace_the_initial_estimate():
    cost = CostModel({"host": 1e9}, prefill_tokens_per_s=1000.0)
    assert cost.prefers_swap(num_blocks=4, block_bytes=1_000_000, num_computed_tokens=64)  # 8 ms < 64 ms
    assert not cost.prefers_swap(num_blocks=4, block_bytes=1_000_000, num_computed_tokens=4)  # 8 ms > 4 ms
    cost.observe_prefill(50_000, 1.0)
    assert cost.prefill_tokens_per_s == 50_000.0  # the first measurement replaces the guess
    cost.observe_prefill(100_000, 1.0)
    assert cost.prefill_tokens_per_s == pytest.approx(60_000.0)  # then a moving average (weight 0.2)
    cost.observe_transfer("host", 2_000_000_000, 1.0)
    assert cost.bandwidth_bytes_per_s("host") == 2e9
    assert not cost.prefers_swap(num_blocks=4, block_bytes=1_000_000, num_computed_tokens=64)  # 4 ms > 1.1 ms


def test_chain_skips_tiers_of_size_zero_and_links_the_rest(tmp_path):
    io = KVBlockIO(torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM))
    config = KVConfig(host_cache_gib=0, disk_cache_gib=1e-3, disk_cache_dir=str(tmp_path), swap_space_gib=0)
    chain = build_offload_chain(config, io, "m", "float32")
    assert [t.name for t in chain.tiers] == ["disk"] and chain.swap is None
    chain.close()
    both = build_offload_chain(KVConfig(disk_cache_dir=str(tmp_path)), io, "m", "float32")
    assert [t.name for t in both.tiers] == ["host", "disk"] and both.tiers[0].lower is both.tiers[1]
    assert isinstance(both, OffloadChain) and both.swap is not None
    both.close()


# ---------------------------------------------------------------- the manager's demotion batches


def test_blocks_one_allocation_evicts_are_demoted_in_one_copy_and_reload_exactly(tmp_path):
    from worker.kv_cache.manager import KVCacheManager
    from worker.sequence import Sequence, SequenceStatus

    kv = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    io = KVBlockIO(kv)
    reads: list[list[int]] = []
    read_blocks = io.read_blocks
    io.read_blocks = lambda block_ids, out=None: reads.append(list(block_ids)) or read_blocks(block_ids, out)
    stats = KVStats()
    disk = DiskTier(16 * BLOCK_BYTES, str(tmp_path), stats=stats)
    host = HostTier(2 * BLOCK_BYTES, BLOCK_BYTES, stats=stats, lower=disk)
    chain = OffloadChain([host, disk], io, CostModel({"host": 1e9, "disk": 1e9}, 1e3), stats=stats)
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, offload=chain)
    writer = BlockedWriter(disk)  # every disk row is still queued when it is reloaded

    def serve(request_id: str, prompt: list[int]) -> tuple[Sequence, int]:
        seq = Sequence(request_id, prompt, tier_priority=3)
        num_hit = manager.admit(seq, max_new_tokens=10**9)
        seq.num_computed_tokens = seq.num_cached_tokens = num_hit
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = seq.num_tokens
        manager.cache_blocks(seq)
        return seq, num_hit

    first_prompt = list(range(1000, 1029))  # 7 full blocks + 1 token
    first, _ = serve("a", first_prompt)
    first_table = manager.get_block_ids("a")
    written = {idx: kv[:, :, block_id].clone() for idx, block_id in enumerate(first_table[:7])}
    manager.free(first)
    other, _ = serve("b", list(range(5000, 5029)))  # evicts all 7 cached blocks of "a" in one allocation
    assert [sorted(ids) for ids in reads] == [sorted(first_table[:7])]  # one copy for the 7 blocks
    kv[:, :, manager.get_block_ids("b")] = 0.0  # "b" overwrites every block it got
    manager.free(other)
    again, num_hit = serve("c", first_prompt + [7, 8, 9])  # evicts b's blocks (one more batch), reloads a's
    assert len(reads) == 2 and num_hit == 7 * BLOCK_SIZE
    table = manager.get_block_ids("c")
    for idx in range(7):
        assert torch.equal(kv[:, :, table[idx]], written[idx])
    manager.free(again)
    assert manager.num_free_blocks == NUM_BLOCKS and manager.num_used_blocks == 0  # nothing leaked
    writer.release()
    assert disk.flush(timeout_s=10)
    chain.close()
