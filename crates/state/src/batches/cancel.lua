-- Asks for a batch to be cancelled: its record moves to `cancelling` (unless it changed since the
-- caller read it), and a job still waiting in the queue moves to the cancel queue (and out of its
-- tenant's queue).
-- KEYS: [1] cancel marker, [2] queue, [3] cancel queue, [4] tenant_of, [5] queued tenants,
--       [6] record, [7] status counts, [8] the job's lease epoch,
--       [9] the batch tenant's queue (absent when the batch has no tenant_of entry).
-- ARGV: [1] id, [2] now (Unix seconds), [3] the record as read, [4] the record cancelling,
--       [5] its status as read, [6] its new status.
-- Returns {n, epoch}: n is -1 when the record changed since it was read (nothing written), 0 when
-- asked before, 1 when the job was queued, 2 when it is running; epoch is the job's lease epoch
-- (0: never claimed).
local epoch = tonumber(redis.call('GET', KEYS[8]) or '0')
if redis.call('GET', KEYS[6]) ~= ARGV[3] then return {-1, epoch} end
if redis.call('SET', KEYS[1], ARGV[2], 'NX') == false then return {0, epoch} end
redis.call('SET', KEYS[6], ARGV[4])
if ARGV[5] ~= ARGV[6] then
  redis.call('HINCRBY', KEYS[7], ARGV[5], -1)
  redis.call('HINCRBY', KEYS[7], ARGV[6], 1)
end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('ZADD', KEYS[3], 0, ARGV[1])
  if KEYS[9] then
    redis.call('ZREM', KEYS[9], ARGV[1])
    if redis.call('ZCARD', KEYS[9]) == 0 then
      local t = redis.call('HGET', KEYS[4], ARGV[1])
      if t then redis.call('SREM', KEYS[5], t) end
    end
  end
  return {1, epoch}
end
return {2, epoch}
