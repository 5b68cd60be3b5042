-- Puts a job that gave its slot back into the queue again, by its deadline, while its lease is
-- still the one given: its lease and running entry go, and whichever replica claims it next
-- resumes it from its checkpoint. When the lease was lost meanwhile, nothing changes but the
-- yield entry.
-- KEYS: [1] the job's lease, [2] running, [3] queue, [4] its tenant's queue, [5] queued tenants,
--       [6] yielding.
-- ARGV: [1] the lease value expected, [2] id, [3] deadline, [4] tenant.
-- Returns 1 when queued again, 0 when the lease was lost.
redis.call('HDEL', KEYS[6], ARGV[2])
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[2])
redis.call('SADD', KEYS[5], ARGV[4])
return 1
