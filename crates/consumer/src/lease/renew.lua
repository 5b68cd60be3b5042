-- Renews the lease for ttl ms while it is ours.
-- KEYS: [1] the lease.
-- ARGV: [1] me (the holder), [2] ttl ms.
-- Returns 1 when renewed, 0 when another holds it, -1 when the key is gone.
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
  return 1
end
if not v then return -1 end
return 0
