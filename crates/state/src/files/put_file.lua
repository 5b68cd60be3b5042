-- Stores a file record and lists it, counting it in its tenant's usage, unless that would pass
-- a quota; checked and counted in one step. A record stored again counts once, at its new size.
-- KEYS: [1] record, [2] the tenant's index, [3] the tenant's index of the purpose, [4] expiry,
--       [5] usage bytes, [6] usage files.
-- ARGV: [1] id, [2] record json, [3] expires_at or "", [4] tenant, [5] bytes, [6] most bytes,
--       [7] most files (each "0": no quota).
-- Returns 1 when stored, -1 when refused over the bytes, -2 over the files.
local old = redis.call('GET', KEYS[1])
local old_bytes = 0
if old then old_bytes = tonumber(cjson.decode(old)['file']['bytes']) or 0 end
local bytes = tonumber(redis.call('HGET', KEYS[5], ARGV[4]) or '0') - old_bytes + tonumber(ARGV[5])
if ARGV[6] ~= '0' and bytes > tonumber(ARGV[6]) then return -1 end
local files = tonumber(redis.call('HGET', KEYS[6], ARGV[4]) or '0')
if not old and ARGV[7] ~= '0' and files + 1 > tonumber(ARGV[7]) then return -2 end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[5], ARGV[4], math.max(bytes, 0))
if not old then redis.call('HINCRBY', KEYS[6], ARGV[4], 1) end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
if ARGV[3] ~= '' then redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1]) end
return 1
