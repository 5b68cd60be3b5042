-- Claims the most overdue delivery by moving its due time to now + lease: nobody else sends it
-- meanwhile, and another sender's turn comes when this one dies.
-- KEYS: [1] the due set.
-- ARGV: [1] now in ms, [2] lease in ms.
-- Returns the delivery's id, or nil when none is due.
local d = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1)
if #d == 0 then return false end
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]), d[1])
return d[1]
