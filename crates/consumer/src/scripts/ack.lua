-- Acknowledges the n rightmost (oldest) in-flight results once they are written, parking those
-- of jobs that run elsewhere.
-- KEYS: [1] inflight, [2] the lease, [3] acked, [4] jobs, then one parked list per job to park
--       for.
-- ARGV: [1] holder, [2] nonce, [3] n, [4] oldest, [5] newest, [6] now (Unix s), then triples
--       (list-order position among the n, index into KEYS of the parked list, job id), oldest
--       first.
-- Returns {1, parked} when applied (or when this very nonce was applied already: {1, -1}),
-- {-1} when the lease is not ours, {-2} when the entries are not the ones written.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {-1} end
if redis.call('GET', KEYS[3]) == ARGV[2] then return {1, -1} end
local n = tonumber(ARGV[3])
if redis.call('LLEN', KEYS[1]) < n
  or redis.call('LINDEX', KEYS[1], -1) ~= ARGV[4]
  or redis.call('LINDEX', KEYS[1], -n) ~= ARGV[5] then
  return {-2}
end
local now = tonumber(ARGV[6])
local parked = 0
for i = 7, #ARGV, 3 do
  local deadline = tonumber(redis.call('HGET', KEYS[4], ARGV[i + 2]) or '0')
  if deadline > now then
    local key = KEYS[tonumber(ARGV[i + 1])]
    redis.call('LPUSH', key, redis.call('LINDEX', KEYS[1], -n + tonumber(ARGV[i])))
    redis.call('EXPIREAT', key, deadline + 86400)
    parked = parked + 1
  end
end
redis.call('LTRIM', KEYS[1], 0, -n - 1)
redis.call('SET', KEYS[3], ARGV[2], 'EX', 3600)
return {1, parked}
