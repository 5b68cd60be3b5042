-- Replaces a batch's record while the writer holds its lease, moving the status count along
-- (the old status read from the stored record itself). A batch reaching a final status leaves
-- its tenant's count of unfinished batches once (only while tenant_of still names it) and is
-- then pushed on the list the webhook sender reads.
-- KEYS: [1] record, [2] status counts, [3] lease, [4] active, [5] tenant_of, [6] webhook ended.
-- ARGV: [1] record json, [2] new status, [3] the lease it needs ("" for none), [4] id.
-- A batch asked to cancel stays `cancelling` until it ends: a save that would move it back (it
-- raced the cancel request) is refused.
-- Returns 1 when saved, 0 when the writer no longer holds the lease, 2 when the stored record is
-- `cancelling` and the new status neither that nor a final one.
if ARGV[3] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[3] then return 0 end
local s = ARGV[2]
local final = s == 'completed' or s == 'failed' or s == 'expired' or s == 'cancelled'
local old = redis.call('GET', KEYS[1])
-- The status is at the top of the record; a record stored before it was flat has it under
-- `batch`.
local was = nil
if old then
  local r = cjson.decode(old)
  was = r['status'] or r['batch']['status']
end
if was == 'cancelling' and s ~= 'cancelling' and not final then return 2 end
redis.call('SET', KEYS[1], ARGV[1])
if old then
  if was ~= ARGV[2] then
    redis.call('HINCRBY', KEYS[2], was, -1)
    redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  end
else
  redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
end
if final then
  local tenant = redis.call('HGET', KEYS[5], ARGV[4])
  if tenant and redis.call('HDEL', KEYS[5], ARGV[4]) == 1 then
    local left = redis.call('HINCRBY', KEYS[4], tenant, -1)
    if left < 0 then redis.call('HSET', KEYS[4], tenant, 0) end
    redis.call('RPUSH', KEYS[6], ARGV[4])
  end
end
return 1
