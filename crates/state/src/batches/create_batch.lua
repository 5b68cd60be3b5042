-- Stores a new batch, lists it, counts it and queues it by its deadline, unless its tenant
-- already has the most unfinished batches; checked and counted in one step.
-- KEYS: [1] record, [2] the tenant's index, [3] queue, [4] status counts, [5] active (unfinished
--       batches per tenant), [6] tenant_of, [7] the tenant's queue, [8] queued tenants.
-- ARGV: [1] id, [2] record json, [3] deadline, [4] status, [5] tenant, [6] most unfinished
--       batches ("0": no quota).
-- Returns 1 when stored, 0 when the record already existed, -1 when refused over the quota.
if ARGV[6] ~= '0' and tonumber(redis.call('HGET', KEYS[5], ARGV[5]) or '0') >= tonumber(ARGV[6]) then
  return -1
end
if redis.call('SET', KEYS[1], ARGV[2], 'NX') == false then return 0 end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('HINCRBY', KEYS[4], ARGV[4], 1)
redis.call('HINCRBY', KEYS[5], ARGV[5], 1)
redis.call('HSET', KEYS[6], ARGV[1], ARGV[5])
redis.call('ZADD', KEYS[7], ARGV[3], ARGV[1])
redis.call('SADD', KEYS[8], ARGV[5])
return 1
