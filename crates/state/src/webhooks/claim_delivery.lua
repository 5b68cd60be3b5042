-- Claims a due delivery, fairly among tenants: of the most overdue ones (ARGV[3] of them), the
-- one of the tenant whose last claim is the oldest, the most overdue on a tie. A tenant with
-- many deliveries to receivers that never answer thus gets every other turn, not every turn.
-- The claim moves the delivery's due time to now + lease: nobody else sends it meanwhile, and
-- another sender's turn comes when this one dies.
-- KEYS: [1] the due set, [2] each tenant's last claim time in ms (a hash).
-- ARGV: [1] now in ms, [2] lease in ms, [3] how many of the most overdue are weighed.
-- Members are `<tenant>/<batch>:<endpoint>` (`<batch>:<endpoint>`, tenant '', when queued by an
-- earlier version). Returns the member claimed, or nil when none is due.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
if #due == 0 then return false end
local best, best_served, best_tenant = nil, nil, nil
local weighed = {}
for _, id in ipairs(due) do
  local slash = string.find(id, '/', 1, true)
  local tenant = slash and string.sub(id, 1, slash - 1) or ''
  if not weighed[tenant] then
    weighed[tenant] = true
    local served = tonumber(redis.call('HGET', KEYS[2], tenant) or '0')
    if best == nil or served < best_served then
      best, best_served, best_tenant = id, served, tenant
    end
  end
end
redis.call('HSET', KEYS[2], best_tenant, ARGV[1])
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]), best)
return best
