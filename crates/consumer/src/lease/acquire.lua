-- Takes the lease when it is free, already ours, or held by a holder known dead, for ttl ms.
-- KEYS: [1] the lease.
-- ARGV: [1] me (the holder taking it), [2] ttl ms, [3] a holder known dead ('' if none).
-- Returns {1, me} when taken (or renewed), {0, holder} when another holds it.
local v = redis.call('GET', KEYS[1])
if (not v) or v == ARGV[1] or (ARGV[3] ~= '' and v == ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
  return {1, ARGV[1]}
end
return {0, v}
