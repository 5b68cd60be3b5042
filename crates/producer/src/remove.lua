-- ZREMs each member given from a request sorted set. Cancel markers are set outside the
-- script: they are keys of other hash slots.
-- KEYS: [1] the sorted set.
-- ARGV: the members.
-- Returns the 1-based positions in ARGV of the members that were not there.
local missing = {}
for i = 1, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 0 then missing[#missing + 1] = i end
end
return missing
