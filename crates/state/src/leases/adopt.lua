-- Takes a running job whose lease lapsed (its replica is gone), or one this replica held in an
-- earlier life, under a new epoch that fences every earlier holder.
-- KEYS: [1] running, [2] the job's lease, [3] its epoch.
-- ARGV: [1] id, [2] replica, [3] lease ms.
-- Returns the new epoch, or nil when the job is not running or another replica holds it.
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return false end
local lease = redis.call('GET', KEYS[2])
if lease and string.match(lease, '^(.*)#') ~= ARGV[2] then return false end
local epoch = redis.call('INCR', KEYS[3])
redis.call('SET', KEYS[2], ARGV[2] .. '#' .. epoch, 'PX', ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return epoch
