-- Asks for a batch to be cancelled. A job still waiting in the queue moves to the cancel queue
-- (and out of its tenant's queue).
-- KEYS: [1] cancel marker, [2] queue, [3] cancel queue, [4] tenant_of, [5] queued tenants,
--       [6] the batch tenant's queue (absent when the batch has no tenant_of entry).
-- ARGV: [1] id, [2] now (Unix seconds).
-- Returns 0 when asked before, 1 when the job was queued, 2 when it is running.
if redis.call('SET', KEYS[1], ARGV[2], 'NX') == false then return 0 end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('ZADD', KEYS[3], 0, ARGV[1])
  if KEYS[6] then
    redis.call('ZREM', KEYS[6], ARGV[1])
    if redis.call('ZCARD', KEYS[6]) == 0 then
      local t = redis.call('HGET', KEYS[4], ARGV[1])
      if t then redis.call('SREM', KEYS[5], t) end
    end
  end
  return 1
end
return 2
