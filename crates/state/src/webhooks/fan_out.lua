-- Turns the oldest ended batch into one delivery per endpoint of its tenant subscribed to the
-- event. Delivery ids derive from the batch and the endpoint, so doing it twice (a replica
-- dying in between) queues nothing twice.
-- KEYS: [1] the ended list, [2] the due set, [3] the batch's record, [4] its tenant's endpoint
--       index (absent when the record is gone), then for each endpoint of ARGV its record and
--       its delivery.
-- ARGV: [1] the batch id, [2] now in ms, then the ids of the endpoints in that index.
-- Returns 1 when done, 0 when the list no longer starts with the batch, -1 when the tenant's
-- endpoints changed since they were read (read them again).
if redis.call('LINDEX', KEYS[1], 0) ~= ARGV[1] then return 0 end
local raw = redis.call('GET', KEYS[3])
if raw and KEYS[4] then
  local endpoints = redis.call('ZRANGE', KEYS[4], 0, -1)
  if #endpoints ~= #ARGV - 2 then return -1 end
  for i, ep in ipairs(endpoints) do
    if ep ~= ARGV[i + 2] then return -1 end
  end
  local b = cjson.decode(raw)
  -- A record stored before it was flat has its status under `batch`.
  local kind = 'batch.' .. (b['status'] or b['batch']['status'])
  local created = tonumber(ARGV[2]) / 1000
  local event = 'evt_' .. string.sub(redis.sha1hex(ARGV[1] .. '/' .. kind), 1, 32)
  for i, ep in ipairs(endpoints) do
    local er = redis.call('GET', KEYS[3 + 2 * i])
    if er then
      local e = cjson.decode(er)['endpoint']
      local wants = false
      for _, t in ipairs(e['event_types']) do
        if t == kind then wants = true end
      end
      if wants and e['status'] == 'enabled' then
        local d = cjson.encode({event_id = event, endpoint = ep, type = kind, batch = ARGV[1],
          created_at = math.floor(created), attempt = 0})
        if redis.call('SET', KEYS[4 + 2 * i], d, 'NX') then
          -- The tenant leads the member: the claim shares turns among tenants by it.
          redis.call('ZADD', KEYS[2], ARGV[2], b['tenant'] .. '/' .. ARGV[1] .. ':' .. ep)
        end
      end
    end
  end
end
redis.call('LPOP', KEYS[1])
return 1
