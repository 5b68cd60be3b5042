-- Hands results on to the list their requests named, and tells that list's reader where they
-- came from.
-- KEYS: [1] the list, [2] its handed-from key.
-- ARGV: [1] the list they arrived on, then the results, oldest first.
-- Returns the list's length.
redis.call('SET', KEYS[2], ARGV[1], 'EX', 86400)
return redis.call('LPUSH', KEYS[1], unpack(ARGV, 2))
