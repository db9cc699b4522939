"""The consumer's commit: one Lua script that publishes, acks and records message ids.

`COMMIT_SCRIPT` runs against one hash tag (a script may not span cluster slots): KEYS[1] is
the group's seen set of that partition, KEYS[2..] its streams. `commit_args` lays a batch of
acks and publishes out as the script's ARGV and returns the streams in KEYS order.
"""

from __future__ import annotations

import string
import time
from collections.abc import Sequence

from broker.codec import FIELD_BODY, FIELD_KIND, FIELD_VERSION

# (stream, entry id, message id): one entry to ack; a message id of "" is not recorded.
Ack = tuple[str, str, str]

# Publish (unless already committed), ack and mark seen, atomically.
# KEYS[1] = seen zset, KEYS[2..] = streams. ARGV: group, now, seen_ttl_s, n_acks,
# n_acks x (key index, entry id, message id), n_pubs, n_pubs x (key index,
# message id, kind, version, body). Returns published ids ("" if skipped). XADD never
# trims: a MAXLEN would drop entries a group has not acknowledged (broker.trim trims).
# Acks go out as one XACK per stream and one ZADD, in chunks that stay far under
# Lua's unpack() limit: a batch costs a few calls, not two per entry. Key types are
# checked before any write, so a batch fails whole rather than half-published.
_COMMIT_LUA = """
local group, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local chunk = 500
-- Scripts are not rolled back: refuse a wrong key type before the first write.
for k = 1, #KEYS do
  local t = redis.call('TYPE', KEYS[k])['ok']
  if t ~= 'none' and t ~= (k == 1 and 'zset' or 'stream') then
    return redis.error_reply('WRONGTYPE ' .. KEYS[k] .. ' holds a ' .. t)
  end
end
local i = 4
local n_acks = tonumber(ARGV[i]); i = i + 1
local acks, seen = {}, {}
for a = 1, n_acks do
  local key, eid, mid = tonumber(ARGV[i]), ARGV[i + 1], ARGV[i + 2]; i = i + 3
  acks[key] = acks[key] or {}
  table.insert(acks[key], eid)
  if mid ~= '' then seen[#seen + 1] = now; seen[#seen + 1] = mid end
end
local n_pubs = tonumber(ARGV[i]); i = i + 1
local published = {}
for p = 1, n_pubs do
  local key, mid = KEYS[tonumber(ARGV[i])], ARGV[i + 1]
  local k, v, b = ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  i = i + 5
  if mid ~= '' and redis.call('ZSCORE', KEYS[1], mid) then
    published[p] = ''
  else
    published[p] = redis.call('XADD', key, '*', $kind, k, $version, v, $body, b)
  end
end
for key, ids in pairs(acks) do
  for c = 1, #ids, chunk do
    redis.call('XACK', KEYS[key], group, unpack(ids, c, math.min(c + chunk - 1, #ids)))
  end
end
for c = 1, #seen, 2 * chunk do
  redis.call('ZADD', KEYS[1], unpack(seen, c, math.min(c + 2 * chunk - 1, #seen)))
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
return published
"""
# The entry's field names are the codec's, spelled here from its constants.
COMMIT_SCRIPT = string.Template(_COMMIT_LUA).substitute(
    kind=repr(FIELD_KIND.decode()),
    version=repr(FIELD_VERSION.decode()),
    body=repr(FIELD_BODY.decode()),
)


def commit_args(
    group: str,
    seen_ttl_s: float,
    acks: Sequence[Ack],
    publish: Sequence[tuple[str, str, dict[bytes, bytes]]],
) -> tuple[list[str], list[object]]:
    """The streams (KEYS[2..], in order) and ARGV of one commit; `publish` holds
    (stream, message id, encoded fields)."""
    streams: dict[str, int] = {}  # stream -> its index in KEYS (KEYS[1] is the seen set)

    def key_index(stream: str) -> int:
        return streams.setdefault(stream, len(streams) + 2)

    args: list[object] = [group, time.time(), seen_ttl_s, len(acks)]
    for stream, entry_id, mid in acks:
        args += [key_index(stream), entry_id, mid]
    args.append(len(publish))
    for stream, mid, fields in publish:
        args += [key_index(stream), mid]
        args += [fields[FIELD_KIND], fields[FIELD_VERSION], fields[FIELD_BODY]]
    return list(streams), args
