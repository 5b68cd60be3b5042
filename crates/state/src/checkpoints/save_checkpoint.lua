-- Records a job's checkpoint while the writer holds its lease.
-- KEYS: [1] the job's checkpoint, [2] its lease.
-- ARGV: [1] checkpoint json, [2] the lease value expected.
-- Returns 1 when recorded, 0 when the lease is no longer held.
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
