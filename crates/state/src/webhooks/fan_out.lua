-- Turns the oldest ended batch into one delivery per endpoint of its tenant subscribed to the
-- event, a chunk of the tenant's endpoints per call, so that no call holds Redis for longer
-- than a chunk takes, however many endpoints the tenant has. Delivery ids derive from the batch
-- and the endpoint, so doing a chunk twice (a replica dying in between, or a start again from
-- the first chunk) queues nothing twice. The batch leaves the ended list with the last chunk.
-- KEYS: [1] the ended list, [2] the due set of the batch's tenant, [3] the tenants with due
--       sets, [4] the batch's record, [5] its tenant's endpoint index (absent when the record is
--       gone), then for each endpoint of ARGV its record and its delivery.
-- ARGV: [1] the batch id, [2] now in ms (the same for every chunk), [3] the rank in the index
--       of the chunk's first endpoint, [4] "1" for the last chunk, then the chunk's endpoint
--       ids, as read from the index.
-- Returns 1 when done, 2 when the chunk is done and more follow, 0 when the list no longer
-- starts with the batch, -1 when the tenant's endpoints changed since they were read (start
-- again from the first chunk).
if redis.call('LINDEX', KEYS[1], 0) ~= ARGV[1] then return 0 end
local raw = redis.call('GET', KEYS[4])
if raw and KEYS[5] then
  local first = tonumber(ARGV[3])
  local n = #ARGV - 4
  local last = ARGV[4] == '1'
  local endpoints = {}
  if n > 0 then endpoints = redis.call('ZRANGE', KEYS[5], first, first + n - 1) end
  if #endpoints ~= n then return -1 end
  for i, ep in ipairs(endpoints) do
    if ep ~= ARGV[i + 4] then return -1 end
  end
  -- None added past the last chunk since it was read.
  if last and redis.call('ZCARD', KEYS[5]) ~= first + n then return -1 end
  local b = cjson.decode(raw)
  -- A record stored before it was flat has its status under `batch`.
  local kind = 'batch.' .. (b['status'] or b['batch']['status'])
  local created = tonumber(ARGV[2]) / 1000
  local event = 'evt_' .. string.sub(redis.sha1hex(ARGV[1] .. '/' .. kind), 1, 32)
  for i, ep in ipairs(endpoints) do
    local er = redis.call('GET', KEYS[4 + 2 * i])
    if er then
      local e = cjson.decode(er)['endpoint']
      local wants = false
      for _, t in ipairs(e['event_types']) do
        if t == kind then wants = true end
      end
      if wants and e['status'] == 'enabled' then
        local d = cjson.encode({event_id = event, endpoint = ep, type = kind, batch = ARGV[1],
          created_at = math.floor(created), attempt = 0})
        if redis.call('SET', KEYS[5 + 2 * i], d, 'NX') then
          -- The tenant leads the member, which sits in the tenant's own due set: the claim
          -- shares turns among tenants by it.
          redis.call('ZADD', KEYS[2], ARGV[2], b['tenant'] .. '/' .. ARGV[1] .. ':' .. ep)
          redis.call('SADD', KEYS[3], b['tenant'])
        end
      end
    end
  end
  if not last then return 2 end
end
redis.call('LPOP', KEYS[1])
return 1
