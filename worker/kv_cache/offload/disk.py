"""Local disk tier: one file per block in a folder of its own, least recently used evicted first.

File layout (little endian)::

    [4 bytes: header length H][H bytes: msgpack (parent_hash, token_ids)][block_bytes bytes: the block's data]

The header travels with the data so a reload verifies the token ids the bytes were computed from, not an index
that could disagree with the file. The folder is private to the worker (created at start, removed at close);
nothing survives a restart, so no stale file from another model or dtype can ever be read.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable

import msgspec
import structlog
import torch

from worker.kv_cache.offload.base import OffloadedBlock, OffloadTier, _Entry
from worker.kv_cache.stats import KVStats

log = structlog.get_logger("sluice.worker.kv")

_HEADER_LEN = struct.Struct("<I")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(tuple[int | None, tuple[int, ...]])


class DiskTier(OffloadTier):
    """Bounded on-disk store of KV blocks.

    Args:
        capacity_bytes: most bytes of block data on disk (headers not counted; they are < 1% of a block).
        root_dir: parent folder ("" = the system temp folder); the tier makes its own subfolder inside.
        stats, lower, clock: see :class:`OffloadTier`.
    """

    name = "disk"

    def __init__(self, capacity_bytes: int, root_dir: str = "", stats: KVStats | None = None,
                 lower: OffloadTier | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(capacity_bytes, stats, lower, clock)
        root = root_dir or tempfile.gettempdir()
        os.makedirs(root, exist_ok=True)
        self.folder = tempfile.mkdtemp(prefix=f"sluice-kv-{os.getpid()}-", dir=root)

    def _path(self, block_hash: int) -> str:
        return os.path.join(self.folder, f"{block_hash:016x}.kv")

    def _store(self, block: OffloadedBlock) -> str | None:
        path = self._path(block.block_hash)
        header = _ENCODER.encode((block.parent_hash, block.token_ids))
        try:
            with open(path, "wb") as f:
                f.write(_HEADER_LEN.pack(len(header)))
                f.write(header)
                f.write(memoryview(block.data.contiguous().numpy()))
        except OSError as exc:
            log.warning("kv_disk_write_failed", path=path, error=str(exc))
            return None
        return path

    def _load(self, entry: _Entry) -> tuple[int | None, tuple[int, ...], torch.Tensor] | None:
        try:
            with open(entry.handle, "rb") as f:
                raw = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(raw)
            (header_len,) = _HEADER_LEN.unpack_from(raw)
            parent_hash, token_ids = _DECODER.decode(raw[_HEADER_LEN.size:_HEADER_LEN.size + header_len])
        except (OSError, struct.error, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("kv_disk_read_failed", path=entry.handle, error=str(exc))
            return None
        offset = _HEADER_LEN.size + header_len
        if len(raw) - offset != entry.nbytes:
            return None
        data = torch.frombuffer(raw, dtype=torch.uint8, offset=offset, count=entry.nbytes).clone()  # aligned
        return parent_hash, tuple(token_ids), data

    def _drop(self, entry: _Entry) -> None:
        try:
            os.unlink(entry.handle)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.folder, ignore_errors=True)
