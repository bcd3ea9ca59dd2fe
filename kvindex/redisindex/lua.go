package redisindex

import (
	"crypto/sha1"
	"encoding/hex"
)

// redisScript is a Lua script run with EVALSHA (EVALSHA_RO when readOnly), falling back to EVAL
// when the server answers NOSCRIPT (after a restart or SCRIPT FLUSH). Immutable once built. No
// script runs on the lookup path.
type redisScript struct {
	src      string
	sha      string
	readOnly bool
}

func newRedisScript(src string, readOnly bool) redisScript {
	sum := sha1.Sum([]byte(src))
	return redisScript{src: src, sha: hex.EncodeToString(sum[:]), readOnly: readOnly}
}

// luaAssignID returns a backend's id, assigning one when it has none, atomically.
//
// KEYS[1]: <prefix>ids (HASH backend → id); KEYS[2]: <prefix>seen (ZSET backend → last write ms);
// KEYS[3]: <prefix>idseq (next new id).
// ARGV[1]: the backend; ARGV[2]: now (ms); ARGV[3]: idle time (ms) after which a backend's id may
// be given to another (its entries have all expired by then); ARGV[4]: the number of ids.
//
// A new backend (or one registered with id -1 by prefix events, which need no slot) takes the id of
// the backend idle the longest, when it has been idle long enough, else the next new id. Returns
// the id, or -1 when every id is taken. Marks the backend seen now.
const luaAssignID = `
local id = redis.call('HGET', KEYS[1], ARGV[1])
if id and tonumber(id) < 0 then id = nil end
if not id then
  local idle = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[3]), 'LIMIT', 0, 1)
  if #idle > 0 then
    id = redis.call('HGET', KEYS[1], idle[1])
    redis.call('HDEL', KEYS[1], idle[1])
    redis.call('ZREM', KEYS[2], idle[1])
  end
  if not id then
    local n = tonumber(redis.call('GET', KEYS[3]) or '0')
    if n >= tonumber(ARGV[4]) then return -1 end
    redis.call('SET', KEYS[3], n + 1)
    id = n
  end
  redis.call('HSET', KEYS[1], ARGV[1], id)
end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return tonumber(id)
`

// luaStats counts live memberships.
//
// KEYS: per backend, its confirmed, speculative and prefix membership sets (mb, ms, mp), in that
// order. ARGV[1]: now (ms); ARGV[2]: the most block memberships counted exactly.
//
// Returns {distinct blocks, exact (1 or 0), distinct prefixes, then per backend: its (block,
// backend) memberships, its speculative ones not also confirmed, its prefix entries}. Exact when
// the confirmed and speculative memberships of all backends number at most the limit (the script
// then reads them all); otherwise a block both confirmed and speculative counts twice, speculative
// counts are the live speculative members, and distinct blocks is the largest backend's count.
const luaStats = `
local live = '(' .. ARGV[1]
local lim = tonumber(ARGV[2])
local nb = #KEYS / 3
local counts, total = {}, 0
for i = 1, #KEYS do
  counts[i] = redis.call('ZCOUNT', KEYS[i], live, '+inf')
  if i % 3 ~= 0 then total = total + counts[i] end
end
local res = {0, 1, 0}
local prefixes, np = {}, 0
for b = 1, nb do
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3*b], live, '+inf')) do
    if not prefixes[m] then prefixes[m] = true np = np + 1 end
  end
end
res[3] = np
if total <= lim then
  local all, d = {}, 0
  for b = 1, nb do
    local mine, n, spec = {}, 0, 0
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3*b-2], live, '+inf')) do
      mine[m] = true
      n = n + 1
      if not all[m] then all[m] = true d = d + 1 end
    end
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3*b-1], live, '+inf')) do
      if not mine[m] then
        n = n + 1
        spec = spec + 1
        if not all[m] then all[m] = true d = d + 1 end
      end
    end
    res[3*b+1], res[3*b+2], res[3*b+3] = n, spec, counts[3*b]
  end
  res[1] = d
else
  local mx = 0
  for b = 1, nb do
    local n = counts[3*b-2] + counts[3*b-1]
    res[3*b+1], res[3*b+2], res[3*b+3] = n, counts[3*b-1], counts[3*b]
    if n > mx then mx = n end
  end
  res[1], res[2] = mx, 0
end
return res
`
