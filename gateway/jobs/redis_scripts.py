"""The Redis job store's server-side scripts and its hash codec (``gateway.jobs.redis_store``).

The Lua scripts run atomically in Redis (https://redis.io/docs/latest/develop/interactive/programmability/eval-intro/):
each state change that must not interleave with another gateway's (first final state wins, lease checks, the
per-owner active count) is one script. A record is stored as a hash with one field per Struct field, encoded by
:func:`to_hash` and read back by :func:`from_hash`.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

GROUP = "runners"

# KEYS: job hash, active hash, expiry zset. ARGV: status, finished_at, result, error json, status_code,
# request_id, key prefix, retention seconds, job id.
FINISH_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if (not st) or (st ~= 'queued' and st ~= 'running') then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', ARGV[2], 'result', ARGV[3], 'error', ARGV[4],
           'status_code', ARGV[5], 'request_id', ARGV[6], 'lease_owner', '', 'lease_expires_at', '0')
local owner = redis.call('HGET', KEYS[1], 'owner')
redis.call('HINCRBY', KEYS[2], owner, -1)
redis.call('ZREM', KEYS[3], ARGV[9])
local batch = redis.call('HGET', KEYS[1], 'batch_id')
if batch and batch ~= '' then
  local counter = 'num_failed'
  if ARGV[1] == 'succeeded' then counter = 'num_completed' end
  redis.call('HINCRBY', ARGV[7] .. ':batch:' .. batch, counter, 1)
end
local sk = redis.call('HGET', KEYS[1], 'stream_key')
local sid = redis.call('HGET', KEYS[1], 'stream_id')
if sk and sk ~= '' and sid and sid ~= '' then
  redis.call('XACK', sk, 'runners', sid)
  redis.call('XDEL', sk, sid)
end
redis.call('EXPIRE', KEYS[1], math.max(1, math.floor(tonumber(ARGV[8]))))
return 1
"""

# KEYS: job hash. ARGV: runner, lease_expires_at, now, stream key, entry id.
# Returns 1 when the job is now running for this runner, 0 when the entry was stale (job final or gone).
START_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if (not st) or (st ~= 'queued' and st ~= 'running') then
  redis.call('XACK', ARGV[4], 'runners', ARGV[5])
  redis.call('XDEL', ARGV[4], ARGV[5])
  return 0
end
redis.call('HSET', KEYS[1], 'status', 'running', 'lease_owner', ARGV[1], 'lease_expires_at', ARGV[2],
           'stream_key', ARGV[4], 'stream_id', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local started = tonumber(redis.call('HGET', KEYS[1], 'started_at') or '0')
if (not started) or started == 0 then redis.call('HSET', KEYS[1], 'started_at', ARGV[3]) end
return 1
"""

# KEYS: job hash. ARGV: runner, lease_expires_at.
RENEW_LUA = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
if redis.call('HGET', KEYS[1], 'lease_owner') ~= ARGV[1] then return 0 end
local sk = redis.call('HGET', KEYS[1], 'stream_key')
local sid = redis.call('HGET', KEYS[1], 'stream_id')
local claimed = redis.call('XCLAIM', sk, 'runners', ARGV[1], 0, sid, 'JUSTID')
if #claimed == 0 then return 0 end
redis.call('HSET', KEYS[1], 'lease_expires_at', ARGV[2])
return 1
"""

# KEYS: job hash. ARGV: runner, queue stream key, attempts to take back (0 or 1).
REQUEUE_LUA = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
if redis.call('HGET', KEYS[1], 'lease_owner') ~= ARGV[1] then return 0 end
local sk = redis.call('HGET', KEYS[1], 'stream_key')
local sid = redis.call('HGET', KEYS[1], 'stream_id')
if sk and sk ~= '' and sid and sid ~= '' then
  redis.call('XACK', sk, 'runners', sid)
  redis.call('XDEL', sk, sid)
end
local job_id = redis.call('HGET', KEYS[1], 'id')
local new_id = redis.call('XADD', ARGV[2], '*', 'job', job_id)
redis.call('HSET', KEYS[1], 'status', 'queued', 'lease_owner', '', 'lease_expires_at', '0',
           'stream_key', ARGV[2], 'stream_id', new_id)
if ARGV[3] ~= '0' then redis.call('HINCRBY', KEYS[1], 'attempts', -1) end
return 1
"""

# KEYS: active hash. ARGV: owner, n, limit. Returns the new count, or -(current + 1) when over the limit.
RESERVE_LUA = """
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if current + tonumber(ARGV[2]) > tonumber(ARGV[3]) then return -(current + 1) end
return redis.call('HINCRBY', KEYS[1], ARGV[1], tonumber(ARGV[2]))
"""

# KEYS: batch hash. ARGV[1]: comma-separated expected statuses; then field, value pairs.
UPDATE_BATCH_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 0 end
local ok = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == st then ok = true end end
if not ok then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""


def encode_field(value: Any) -> bytes | str:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float, str)):
        return str(value)
    return json.dumps(value)


def to_hash(record: msgspec.Struct) -> dict[str, bytes | str]:
    return {name: encode_field(getattr(record, name)) for name in record.__struct_fields__}


def from_hash(raw: dict[bytes, bytes], cls: type[msgspec.Struct]) -> Any:
    """Decode a hash written by :func:`to_hash` back into ``cls`` (unknown hash fields are ignored)."""
    values: dict[str, Any] = {}
    for field in msgspec.structs.fields(cls):
        data = raw.get(field.name.encode())
        if data is None:
            continue
        kind = field.type
        if kind is bytes:
            values[field.name] = data
        elif kind is str:
            values[field.name] = data.decode()
        elif kind is bool:
            values[field.name] = data == b"1"
        elif kind is int:
            values[field.name] = int(float(data))
        elif kind is float:
            values[field.name] = float(data)
        else:
            values[field.name] = json.loads(data)
    return cls(**values)
