-- Puts back one batch as it was before Redis lost it, unless Redis already has its record
-- (written after the loss: left as it is). A job that had started is put in the running set
-- with no lease, so that a replica adopts it and resumes it from its checkpoint; its epoch
-- counter starts above every epoch that wrote for it, so no earlier holder passes a fence.
-- KEYS: [1] record, [2] the tenant's index, [3] status counts, [4] active, [5] tenant_of,
--       [6] queue, [7] the tenant's queue, [8] queued tenants, [9] running, [10] epoch,
--       [11] cancel marker, [12] cancel queue, [13] checkpoint.
-- ARGV: [1] id, [2] record json, [3] status, [4] tenant, [5] deadline, [6] mode (`done`,
--       `queue`, `cancelq`, `resume`), [7] epoch floor, [8] cancel time or "", [9] checkpoint
--       json or "".
-- Returns 1 when put back, 0 when Redis already had the record.
if redis.call('SET', KEYS[1], ARGV[2], 'NX') == false then return 0 end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
local floor = tonumber(ARGV[7])
if tonumber(redis.call('GET', KEYS[10]) or '0') < floor then redis.call('SET', KEYS[10], floor) end
if ARGV[8] ~= '' then redis.call('SET', KEYS[11], ARGV[8]) end
if ARGV[9] ~= '' then redis.call('SET', KEYS[13], ARGV[9]) end
local mode = ARGV[6]
if mode == 'done' then return 1 end
redis.call('HINCRBY', KEYS[4], ARGV[4], 1)
redis.call('HSET', KEYS[5], ARGV[1], ARGV[4])
if mode == 'queue' then
  redis.call('ZADD', KEYS[6], ARGV[5], ARGV[1])
  redis.call('ZADD', KEYS[7], ARGV[5], ARGV[1])
  redis.call('SADD', KEYS[8], ARGV[4])
elseif mode == 'cancelq' then
  redis.call('ZADD', KEYS[12], 0, ARGV[1])
else
  redis.call('HSET', KEYS[9], ARGV[1], 'recovered')
end
return 1
