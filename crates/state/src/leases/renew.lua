-- Renews each lease still held. A lease that lapsed while nobody took the job (its epoch
-- unchanged, the job still this replica's) is taken again: nobody can have written for it
-- meanwhile, as every other writer would have needed a new epoch.
-- KEYS: [1] running, then for each job its lease and its epoch.
-- ARGV: [1] lease ms, then for each job its id and the lease value expected.
-- Returns a list: `n + 1` for the job at position n (0-based) whose lease was lost, `-(n + 1)`
-- for one whose lease was taken again; held leases are not listed.
local out = {}
for i = 2, #ARGV, 2 do
  local n = math.floor((i - 2) / 2)
  local id, expected = ARGV[i], ARGV[i + 1]
  local lease, epoch_key = KEYS[2 + 2 * n], KEYS[3 + 2 * n]
  local now = redis.call('GET', lease)
  if now == expected then
    redis.call('PEXPIRE', lease, ARGV[1])
  else
    local replica, epoch = string.match(expected, '^(.*)#(%d+)$')
    if now == false and redis.call('GET', epoch_key) == epoch
        and redis.call('HGET', KEYS[1], id) == replica then
      redis.call('SET', lease, expected, 'PX', ARGV[1])
      table.insert(out, -(n + 1))
    else
      table.insert(out, n + 1)
    end
  end
end
return out
