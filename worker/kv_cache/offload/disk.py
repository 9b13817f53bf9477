"""Local disk tier: blocks are written by a background thread, one file per batch of blocks demoted together.

File layout (little endian)::

    [4 bytes: header length H][H bytes: msgpack [(parent_hash, token_ids), …] per row][n × block_bytes: the rows]

The header travels with the data so a reload verifies the token ids the bytes were computed from, not an index
that could disagree with the file. The folder (``sluice-kv-<pid>-<8 random characters>``) is private to the worker:
created at start, removed at close; nothing survives a restart, so no stale file from another model or dtype can
ever be read. A worker that was killed cannot remove its folder, so a new disk tier removes the folders beside its
own whose pid is no running process (:func:`remove_folders_of_dead_workers`).

The engine thread never waits for the disk: :meth:`DiskTier.put_many` copies the batch into memory (a buffer the
writer handed back, :class:`~worker.kv_cache.offload.base.ReusableRows`) and queues it; the writer thread writes it
to a temporary name and renames it into place, then hands the memory back. A
lookup in between is served from the memory copy, so a block is readable the moment it is stored and a lookup never
sees a half-written file. The queue is bounded in bytes (``max_pending_bytes``): a batch that would exceed it is
dropped (counted in ``offload_dropped_blocks{tier=disk}``) rather than making the engine wait.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable

import msgspec
import structlog
import torch

from worker.kv_cache.offload.base import OffloadedBlock, OffloadTier, ReusableRows, _Entry
from worker.kv_cache.stats import KVStats

log = structlog.get_logger("sluice.worker.kv")

_HEADER_LEN = struct.Struct("<I")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[tuple[int | None, tuple[int, ...]]])


#: A disk tier's folder: ``tempfile.mkdtemp(prefix=f"sluice-kv-{pid}-")`` (8 characters of mkdtemp's alphabet).
_FOLDER_NAME = re.compile(r"sluice-kv-(?P<pid>[0-9]+)-[a-z0-9_]{8}")


def _is_running(pid: int) -> bool:
    """Return whether process ``pid`` exists (one of another user counts: signalling it is not allowed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _folder_bytes(path: str) -> int:
    """Return the bytes of the files under ``path`` (those that vanish or cannot be read count 0)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def remove_folders_of_dead_workers(root: str) -> list[str]:
    """Remove the disk tier folders in ``root`` (``sluice-kv-<pid>-<8 characters>``, nothing else) whose pid is no
    running process: those of workers that were killed before they could remove their own. Logs one
    ``kv_disk_dead_worker_folder_removed`` line per folder, with its size.

    Returns:
        The paths removed.
    """
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError as exc:
        log.warning("kv_disk_dead_worker_folders_unreadable", root=root, error=str(exc))
        return removed
    for entry in entries:
        match = _FOLDER_NAME.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False) or _is_running(int(match["pid"])):
            continue
        size_bytes = _folder_bytes(entry.path)
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            log.info("kv_disk_dead_worker_folder_removed", path=entry.path, pid=int(match["pid"]),
                     size_bytes=size_bytes)
            removed.append(entry.path)
    return removed


class _Batch:
    """One file of rows: in memory (``data``) until the writer thread has renamed the complete file into place.

    ``data``, ``written``, ``failed`` and ``cancelled`` are read and set under the tier's lock; ``num_live`` (rows
    still indexed) only on the engine thread.
    """

    def __init__(self, path: str, data: torch.Tensor, headers: list[tuple[int | None, tuple[int, ...]]],
                 reusable_rows: ReusableRows) -> None:
        self.path = path
        self.rows = data  # [n, block_bytes] uint8 taken from reusable_rows; the writer hands it back when done
        self.reusable_rows = reusable_rows
        self.data: torch.Tensor | None = data  # the same rows, readable until written (None once dropped)
        self.headers = headers
        self.nbytes = data.numel()
        self.num_live = len(headers)
        self.written = False
        self.failed = False
        self.cancelled = False  # every row dropped before it was written: skip or delete the file


class DiskTier(OffloadTier):
    """Bounded on-disk store of KV blocks, written in the background.

    Args:
        capacity_bytes: most bytes of block data on disk (headers not counted; they are < 1% of a block).
        root_dir: parent folder ("" = the system temp folder); the tier makes its own subfolder inside and removes
            those of workers that died (:func:`remove_folders_of_dead_workers`).
        max_pending_bytes: most bytes of block data queued for the writer; a batch beyond it is dropped.
        stats, lower, clock: see :class:`OffloadTier`.
    """

    name = "disk"

    def __init__(self, capacity_bytes: int, root_dir: str = "", stats: KVStats | None = None,
                 lower: OffloadTier | None = None, clock: Callable[[], float] = time.monotonic,
                 max_pending_bytes: int = 256 * 1024**2) -> None:
        super().__init__(capacity_bytes, stats, lower, clock)
        if max_pending_bytes < 0:
            raise ValueError(f"disk tier: max_pending_bytes must be >= 0, got {max_pending_bytes}")
        root = root_dir or tempfile.gettempdir()
        os.makedirs(root, exist_ok=True)
        self.folder = tempfile.mkdtemp(prefix=f"sluice-kv-{os.getpid()}-", dir=root)
        remove_folders_of_dead_workers(root)
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._idle = threading.Condition(self._lock)  # notified whenever pending_bytes drops
        self._num_batches = 0
        self._reusable_rows: ReusableRows | None = None  # made at the first batch, when the block size is known
        self._writer = threading.Thread(target=self._write_loop, name="sluice-kv-disk-writer", daemon=True)
        self._writer.start()

    def _store(self, block: OffloadedBlock) -> tuple[_Batch, int] | None:
        return self._store_many([block])[0]

    def _store_many(self, blocks) -> list[tuple[_Batch, int] | None]:
        nbytes = sum(block.data.numel() for block in blocks)
        with self._lock:
            if self.pending_bytes + nbytes > self.max_pending_bytes:
                self.stats.add("offload_dropped_blocks", len(blocks), tier=self.name)
                return [None] * len(blocks)
            self.pending_bytes += nbytes
        reusable_rows = self._rows(blocks[0].data.numel())
        data = reusable_rows.take(len(blocks))  # owned: the caller may reuse its memory
        torch.stack([block.data.reshape(-1) for block in blocks], out=data)
        self._num_batches += 1
        batch = _Batch(os.path.join(self.folder, f"{self._num_batches:08d}.kv"), data,
                       [(block.parent_hash, block.token_ids) for block in blocks], reusable_rows)
        self._queue.put(batch)
        return [(batch, row) for row in range(len(blocks))]

    def _rows(self, row_bytes: int) -> ReusableRows:
        if self._reusable_rows is None or self._reusable_rows.row_bytes != row_bytes:
            self._reusable_rows = ReusableRows(row_bytes)
        return self._reusable_rows

    def _load(self, entry: _Entry) -> tuple[int | None, tuple[int, ...], torch.Tensor] | None:
        batch, row = entry.handle
        with self._lock:
            data, failed = batch.data, batch.failed
        if failed:
            return None
        if data is not None:  # still queued or being written: the memory copy is the block
            return entry.parent_hash, entry.token_ids, data[row]
        try:
            with open(batch.path, "rb") as f:
                (header_len,) = _HEADER_LEN.unpack(f.read(_HEADER_LEN.size))
                headers = _DECODER.decode(f.read(header_len))
                f.seek(_HEADER_LEN.size + header_len + row * entry.nbytes)
                raw = bytearray(entry.nbytes)
                num_read = f.readinto(raw)
        except (OSError, struct.error, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("kv_disk_read_failed", path=batch.path, error=str(exc))
            return None
        if num_read != entry.nbytes or row >= len(headers):
            return None
        parent_hash, token_ids = headers[row]
        return parent_hash, tuple(token_ids), torch.frombuffer(raw, dtype=torch.uint8)

    def _drop(self, entry: _Entry) -> None:
        batch, _ = entry.handle
        batch.num_live -= 1
        if batch.num_live > 0:
            return
        with self._lock:
            written = batch.written
            batch.cancelled = True
            batch.data = None
        if written:
            self._unlink(batch.path)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued batch is written (or skipped); True when the queue is empty."""
        with self._idle:
            return self._idle.wait_for(lambda: self.pending_bytes == 0, timeout_s)

    def close(self) -> None:
        super().close()
        self._queue.put(None)
        self._writer.join(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)

    # ------------------------------------------------------------------ the writer thread

    def _write_loop(self) -> None:
        while (batch := self._queue.get()) is not None:
            with self._lock:
                data = None if batch.cancelled else batch.data
            ok = data is not None and self._write(batch, data)
            with self._idle:
                self.pending_bytes -= batch.nbytes
                batch.written = ok
                batch.failed = data is not None and not ok
                if ok or batch.failed:
                    batch.data = None
                cancelled = batch.cancelled
                self._idle.notify_all()
            batch.reusable_rows.release(batch.rows)
            if ok and cancelled:
                self._unlink(batch.path)

    def _write(self, batch: _Batch, data: torch.Tensor) -> bool:
        tmp_path = batch.path + ".tmp"
        header = _ENCODER.encode(batch.headers)
        try:
            with open(tmp_path, "wb") as f:
                f.write(_HEADER_LEN.pack(len(header)))
                f.write(header)
                f.write(memoryview(data.numpy()))
            os.replace(tmp_path, batch.path)  # complete or absent: never half written under its name
        except OSError as exc:
            log.warning("kv_disk_write_failed", path=batch.path, error=str(exc))
            self._unlink(tmp_path)
            return False
        return True

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
