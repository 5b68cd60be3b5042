-- Moves the whole result list into flight when nothing is in flight; O(1). Resent after a
-- dropped connection it changes nothing: the results are in flight already.
-- KEYS: [1] the list, [2] inflight, [3] the lease.
-- ARGV: [1] the lease holder.
-- Returns -1 when the lease is not ours, else how many results are in flight now.
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return -1 end
local n = redis.call('LLEN', KEYS[2])
if n > 0 then return n end
n = redis.call('LLEN', KEYS[1])
if n > 0 then redis.call('RENAME', KEYS[1], KEYS[2]) end
return n
