-- Deletes the lease only if it is ours.
-- KEYS: [1] the lease.
-- ARGV: [1] me (the holder).
-- Returns 1 when deleted, 0 when it is not ours (or gone).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
