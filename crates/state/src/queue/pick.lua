-- Picks, without taking it, the job a replica should claim next.
-- Fair (ARGV[2] = "1"): among the tenants with a queued job, the one whose share of the running
-- jobs (on all replicas) after taking one more is smallest, (running + 1) / weight; a tenant at
-- `share` running jobs only when no tenant under it waits; ties go to the earliest deadline.
-- Within a tenant, its most urgent job. So a tenant with little queued never waits for a tenant
-- with much, and no slot stays idle while any batch waits.
-- Not fair (the cancel queue): the most urgent job of the queue.
-- KEYS: [1] a queue, [2] running, [3] tenant_of, then the queue of each tenant in ARGV.
-- ARGV: [1] share ("0": none), [2] fair ("1" or "0"), [3] n, then n queued tenants (in the order
--       of their queues in KEYS), then n weights (whole numbers >= 1), in the same order.
-- Returns `{id, tenant}` of the job (tenant "" when it has none), or nil when the queue is empty.
local first = redis.call('ZRANGE', KEYS[1], 0, 0)
if #first == 0 then return false end
local share = tonumber(ARGV[1])
local n = tonumber(ARGV[3])
-- One tenant waiting is picked whatever its share: counting the running jobs (a Redis call per
-- running job, on every claim) is only needed to choose between two or more.
if ARGV[2] == '1' and n > 1 then
  local counts = {}
  for _, r in ipairs(redis.call('HKEYS', KEYS[2])) do
    local t = redis.call('HGET', KEYS[3], r)
    if t then counts[t] = (counts[t] or 0) + 1 end
  end
  local best, best_capped, best_share, best_at
  for i = 1, n do
    local t = ARGV[3 + i]
    local head = redis.call('ZRANGE', KEYS[3 + i], 0, 0, 'WITHSCORES')
    if #head > 0 then
      local running = counts[t] or 0
      local capped = (share > 0 and running >= share) and 1 or 0
      local after = (running + 1) / tonumber(ARGV[3 + n + i])
      local at = tonumber(head[2])
      local better = best == nil or capped < best_capped
        or (capped == best_capped and (after < best_share
          or (after == best_share and at < best_at)))
      if better then
        best, best_capped, best_share, best_at = head[1], capped, after, at
      end
    end
  end
  -- A tenant's queue holding a job the queue does not would be a fault of the state (both
  -- change together); the queue's head is then taken, so that nothing stalls.
  if best and redis.call('ZSCORE', KEYS[1], best) then
    return {best, redis.call('HGET', KEYS[3], best) or ''}
  end
end
return {first[1], redis.call('HGET', KEYS[3], first[1]) or ''}
