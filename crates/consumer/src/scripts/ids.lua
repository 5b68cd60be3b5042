-- The ids of the results in a range of positions of a list that start with a prefix; a range at
-- a time, so a long list never holds Redis up for long.
-- KEYS: [1] the list.
-- ARGV: [1] the prefix, [2] the first position, [3] the last position (LRANGE's start, stop).
-- Returns the matching ids.
local out = {}
for _, item in ipairs(redis.call('LRANGE', KEYS[1], ARGV[2], ARGV[3])) do
  local id = string.match(item, '"id"%s*:%s*"([^"]*)"')
  if id and string.sub(id, 1, #ARGV[1]) == ARGV[1] then out[#out + 1] = id end
end
return out
