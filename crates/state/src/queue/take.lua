-- Takes a picked job out of its queue for a replica under a new lease, whose epoch fences every
-- earlier holder. When the job is no longer in the queue (another replica took it, a cancel
-- moved it), it is taken out of its tenant's queue too, which must not hold it either.
-- KEYS: [1] the queue, [2] running, [3] queued tenants, [4] the job's epoch, [5] its lease,
--       [6] its tenant's queue (absent when the job has no tenant).
-- ARGV: [1] id, [2] replica, [3] lease ms, [4] tenant ("" for none).
-- Returns the new epoch, or nil when the job was not in the queue any more.
local taken = redis.call('ZREM', KEYS[1], ARGV[1]) == 1
if KEYS[6] then
  redis.call('ZREM', KEYS[6], ARGV[1])
  if redis.call('ZCARD', KEYS[6]) == 0 then redis.call('SREM', KEYS[3], ARGV[4]) end
end
if not taken then return false end
local epoch = redis.call('INCR', KEYS[4])
redis.call('SET', KEYS[5], ARGV[2] .. '#' .. epoch, 'PX', ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return epoch
