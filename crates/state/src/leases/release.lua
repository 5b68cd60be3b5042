-- Lets go of a lease still held; with `running`, the job is also no longer anybody's (it ended).
-- KEYS: [1] the job's lease, [2] running (optional).
-- ARGV: [1] the lease value expected, [2] id.
-- Returns 1, or 0 when running was given and the lease was lost meanwhile (nothing changed).
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) else
  if KEYS[2] then return 0 end
end
if KEYS[2] then redis.call('HDEL', KEYS[2], ARGV[2]) end
return 1
