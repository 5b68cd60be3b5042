-- Deletes a file record and its listings; its bytes and the file leave the tenant's usage.
-- KEYS: [1] record, [2] the tenant's index, [3] the tenant's index of the purpose, [4] expiry,
--       [5] usage bytes, [6] usage files.
-- ARGV: [1] id, [2] tenant.
-- Returns 1 when the record existed, 0 when not.
local old = redis.call('GET', KEYS[1])
local n = redis.call('DEL', KEYS[1])
if old then
  local bytes = tonumber(cjson.decode(old)['file']['bytes']) or 0
  local left = tonumber(redis.call('HGET', KEYS[5], ARGV[2]) or '0') - bytes
  redis.call('HSET', KEYS[5], ARGV[2], math.max(left, 0))
  local files = tonumber(redis.call('HGET', KEYS[6], ARGV[2]) or '0') - 1
  redis.call('HSET', KEYS[6], ARGV[2], math.max(files, 0))
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return n
