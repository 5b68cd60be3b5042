-- Lets go of the rebuild lock only if still held by the caller.
-- KEYS: [1] the lock.
-- ARGV: [1] holder.
-- Returns 1 when let go, 0 when another holds it.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
