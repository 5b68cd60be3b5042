-- Lists a new endpoint under its tenant unless the tenant already has its cap of them: the
-- check and the add are one step, so creates racing each other cannot pass the cap together.
-- KEYS: [1] the tenant's endpoint index.
-- ARGV: [1] the cap, [2] the created time (the score), [3] the endpoint's id.
-- Returns 1 when listed, 0 when the tenant is at its cap.
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
return 1
