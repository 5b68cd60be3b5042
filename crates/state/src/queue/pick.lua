-- Picks, without taking it, the job a replica should claim next: the most urgent of the queue;
-- when its tenant already runs `share` jobs (on all replicas), the most urgent job of a tenant
-- running fewer, if one waits. One tenant's many queued batches do not keep the others from
-- every slot, and no slot stays idle while any batch waits.
-- KEYS: [1] a queue, [2] running, [3] tenant_of, then the queue of each tenant in ARGV.
-- ARGV: [1] share ("0": none), then the queued tenants, in the order of their queues in KEYS.
-- Returns `{id, tenant}` of the job (tenant "" when it has none), or nil when the queue is empty.
local first = redis.call('ZRANGE', KEYS[1], 0, 0)
if #first == 0 then return false end
local id = first[1]
local share = tonumber(ARGV[1])
local tenant = redis.call('HGET', KEYS[3], id)
if share > 0 and tenant then
  local counts = {}
  for _, r in ipairs(redis.call('HKEYS', KEYS[2])) do
    local t = redis.call('HGET', KEYS[3], r)
    if t then counts[t] = (counts[t] or 0) + 1 end
  end
  if (counts[tenant] or 0) >= share then
    local best, best_at = nil, nil
    for i = 2, #ARGV do
      local t = ARGV[i]
      if (counts[t] or 0) < share then
        local head = redis.call('ZRANGE', KEYS[i + 2], 0, 0, 'WITHSCORES')
        if #head > 0 and (best_at == nil or tonumber(head[2]) < best_at) then
          best, best_at = head[1], tonumber(head[2])
        end
      end
    end
    if best then id = best end
  end
end
return {id, redis.call('HGET', KEYS[3], id) or ''}
