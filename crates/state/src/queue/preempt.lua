-- Asks one of a replica's running jobs to give its slot back, when the tenant the next free slot
-- would go to (as `pick` chooses it) is below its share and the job's tenant above it. Checked
-- and recorded in one step, so that two replicas never both give a slot back for one slot's
-- worth of a tenant's share: a job asked counts as its slot's new tenant's (running, and one of
-- its queued jobs no longer waiting) until it is queued again or ends.
-- Fair shares as in `pick`: a tenant's share is running / weight (running on all replicas). The
-- waiting tenant W is the one `pick` takes next, (running + 1) / weight smallest, and not at the
-- cap; the job's tenant O the most served among the candidates'. A slot moves only when it
-- makes the shares fairer, running_O / weight_O > (running_W + 1) / weight_W, so that it never
-- moves back at once; and never from a tenant to itself, so a lone tenant keeps every slot.
-- KEYS: [1] running, [2] tenant_of, [3] yielding, then the queue of each tenant in ARGV.
-- ARGV: [1] cap ("0": none), [2] replica, [3] n, then n queued tenants (in the order of their
--       queues in KEYS), then n weights, then m, then m pairs (candidate id, its tenant's
--       weight): this replica's jobs that may be asked, the first of a tenant asked first.
-- Returns the id of the job asked, or nil.
local cap = tonumber(ARGV[1])
local replica = ARGV[2]
local n = tonumber(ARGV[3])
local counts = {}
for _, r in ipairs(redis.call('HKEYS', KEYS[1])) do
  local t = redis.call('HGET', KEYS[2], r)
  if t then counts[t] = (counts[t] or 0) + 1 end
end
-- Slots already being given back count as their new tenants'. An entry whose job ended, or is
-- held by another replica now (its holder stopped), is forgotten.
local promised = {}
local yielding = redis.call('HGETALL', KEYS[3])
for i = 1, #yielding, 2 do
  local id, entry = yielding[i], yielding[i + 1]
  local holder, to = string.match(entry, '^([^#]*)#(.*)$')
  local from = redis.call('HGET', KEYS[2], id)
  if holder and from and redis.call('HGET', KEYS[1], id) == holder then
    counts[from] = (counts[from] or 0) - 1
    counts[to] = (counts[to] or 0) + 1
    promised[to] = (promised[to] or 0) + 1
  else
    redis.call('HDEL', KEYS[3], id)
  end
end
local waiting, waiting_after
for i = 1, n do
  local t = ARGV[3 + i]
  -- Its queued jobs a slot was already promised to do not wait for another.
  if redis.call('ZCARD', KEYS[3 + i]) > (promised[t] or 0) then
    local running = counts[t] or 0
    local after = (running + 1) / tonumber(ARGV[3 + n + i])
    if not (cap > 0 and running >= cap) and (waiting == nil or after < waiting_after) then
      waiting, waiting_after = t, after
    end
  end
end
if waiting == nil then return false end
local m = tonumber(ARGV[4 + 2 * n])
local victim, victim_share
for j = 1, m do
  local id = ARGV[3 + 2 * n + 2 * j]
  local weight = tonumber(ARGV[4 + 2 * n + 2 * j])
  local t = redis.call('HGET', KEYS[2], id)
  if t and t ~= waiting and redis.call('HGET', KEYS[1], id) == replica
      and redis.call('HEXISTS', KEYS[3], id) == 0 then
    local share = (counts[t] or 0) / weight
    if victim == nil or share > victim_share then
      victim, victim_share = id, share
    end
  end
end
if victim == nil or victim_share <= waiting_after then return false end
redis.call('HSET', KEYS[3], victim, replica .. '#' .. waiting)
return victim
