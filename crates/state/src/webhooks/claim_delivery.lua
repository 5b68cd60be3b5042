-- Claims a due delivery, fairly among tenants: of the tenants with one due, the one whose last
-- claim is the oldest, and its most overdue delivery (the most overdue of all on a tie). Each
-- tenant's deliveries sit in a due set of their own, so however many one tenant has due (to
-- receivers that never answer), another's is weighed at the next claim and sent within as many
-- claims as there are tenants with deliveries due.
-- The claim moves the delivery's due time to now + lease: nobody else sends it meanwhile, and
-- another sender's turn comes when this one dies.
-- Deliveries queued by an earlier version sit in one shared due set: its most overdue (ARGV[3]
-- of them) take part as their tenants' (tenant '' for a member without one) until they drain.
-- KEYS: [1] the shared due set, [2] each tenant's last claim time in ms (a hash), [3] the
--       tenants with due sets, then the due set of each tenant in ARGV.
-- ARGV: [1] now in ms, [2] lease in ms, [3] how many of the shared set are weighed, [4] n, then
--       n tenants (in the order of their due sets in KEYS).
-- Members are `<tenant>/<batch>:<endpoint>` (`<batch>:<endpoint>` when queued by an earlier
-- version). Returns the member claimed, or nil when none is due.
local now = tonumber(ARGV[1])
local best, best_served, best_at, best_tenant, best_set = nil, nil, nil, nil, nil
local function weigh(id, at, tenant, set)
  local served = tonumber(redis.call('HGET', KEYS[2], tenant) or '0')
  if best == nil or served < best_served or (served == best_served and at < best_at) then
    best, best_served, best_at, best_tenant, best_set = id, served, at, tenant, set
  end
end
local n = tonumber(ARGV[4])
for i = 1, n do
  local head = redis.call('ZRANGE', KEYS[3 + i], 0, 0, 'WITHSCORES')
  if #head == 0 then
    redis.call('SREM', KEYS[3], ARGV[4 + i])
  elseif tonumber(head[2]) <= now then
    weigh(head[1], tonumber(head[2]), ARGV[4 + i], KEYS[3 + i])
  end
end
local shared = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0,
  tonumber(ARGV[3]))
local seen = {}
for j = 1, #shared, 2 do
  local id = shared[j]
  local slash = string.find(id, '/', 1, true)
  local tenant = slash and string.sub(id, 1, slash - 1) or ''
  if not seen[tenant] then
    seen[tenant] = true
    weigh(id, tonumber(shared[j + 1]), tenant, KEYS[1])
  end
end
if best == nil then return false end
redis.call('HSET', KEYS[2], best_tenant, ARGV[1])
redis.call('ZADD', best_set, now + tonumber(ARGV[2]), best)
return best
