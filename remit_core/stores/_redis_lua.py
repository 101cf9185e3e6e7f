"""The Lua scripts of the Redis engine: one per primitive that reads then writes.

Each script runs atomically on the server, so it is the engine's transaction.
Scripts first check every condition, then write: a refused primitive writes
nothing (Redis does not roll a script back). They answer a status first
(`ok`, `fenced`, `head`, `dup`, `taken`, `unknown`, `conflict`) that
`remit_core.stores.redis` turns into the matching `RemitError`.

Conventions shared with the Python side:

- Composite hash fields and sorted-set members join escaped ids with NUL;
  a hash field of a record with columns ends in NUL and one column letter.
- An optional argument is "" for NULL and "=" followed by the value otherwise.
- The fence check takes the fence's claims hash as KEYS[1] and, as ARGV[1],
  "" (no fence presented) or the fence number, ":", the escaped scope, NUL,
  the holder.
"""

from __future__ import annotations

_PRELUDE = r"""
local NUL = "\0"

-- The fence check of every fenced primitive: nil when the claim still has
-- the fence and holder presented, else the claim's fence and holder now.
local function fenced()
  local f = ARGV[1]
  if f == "" then return nil end
  local colon = string.find(f, ":", 1, true)
  local nul = string.find(f, NUL, colon + 1, true)
  local m = string.sub(f, colon + 1, nul - 1)
  local row = redis.call("HMGET", KEYS[1], m .. NUL .. "f", m .. NUL .. "h")
  if row[1] ~= string.sub(f, 1, colon - 1) or row[2] ~= string.sub(f, nul + 1) then
    return {"fenced", row[1], row[2]}
  end
  return nil
end

-- HSET field to an optional argument's value, if it is not NULL.
local function hset_opt(key, field, arg)
  if arg ~= "" then redis.call("HSET", key, field, string.sub(arg, 2)) end
end

-- HMGET in chunks: unpack() of a long list overflows the Lua stack.
local function hmget(key, fields)
  local out = {}
  for i = 1, #fields, 1000 do
    local part = redis.call("HMGET", key, unpack(fields, i, math.min(i + 999, #fields)))
    for _, v in ipairs(part) do out[#out + 1] = v end
  end
  return out
end

-- A checkpoint's hash field ("cid NUL ns") from its index member:
-- "x" .. cid NUL ns (by id) or "n" .. ns NUL cid (by namespace).
local function ckpt_field(member)
  if string.sub(member, 1, 1) == "x" then return string.sub(member, 2) end
  local p = string.find(member, NUL, 1, true)
  return string.sub(member, p + 1) .. NUL .. string.sub(member, 2, p - 1)
end

-- Step writes from ARGV[i] (absent: none): a count, then (writes-key index, index-key index,
-- field, value) per write. mode "expect_absent" answers the 0-based position of
-- the first write whose slot is taken (by the store or an earlier write of the
-- batch) and writes nothing; "first" keeps present values; "overwrite" replaces.
local function put_writes(i, mode)
  local n = tonumber(ARGV[i] or "0")
  if mode == "expect_absent" then
    local seen = {}
    for j = 0, n - 1 do
      local b = i + 1 + 4 * j
      local key, field = KEYS[tonumber(ARGV[b])], ARGV[b + 2]
      seen[key] = seen[key] or {}
      if seen[key][field] or redis.call("HEXISTS", key, field) == 1 then return j end
      seen[key][field] = true
    end
  end
  for j = 0, n - 1 do
    local b = i + 1 + 4 * j
    local key, index, field = KEYS[tonumber(ARGV[b])], KEYS[tonumber(ARGV[b + 1])], ARGV[b + 2]
    if mode == "first" then
      redis.call("HSETNX", key, field, ARGV[b + 3])
    else
      redis.call("HSET", key, field, ARGV[b + 3])
    end
    redis.call("ZADD", index, 0, field)
  end
  return nil
end
"""

#: KEYS: fence claims, checkpoints, checkpoint index, branches, run index, then
#: blob/write keys. ARGV: fence, expected head (opt), ns, branch, id (escaped),
#: head seq, created_at, record, escaped run id, then (absent: none) a blob
#: count, (key index, field, value) per blob, and the writes. A branch that had
#: no head is new to the run, which then enters the run index.
COMMIT = (
    _PRELUDE
    + r"""
local err = fenced()
if err then return err end
local ns, cid = ARGV[3], ARGV[5]
local member = ns .. NUL .. ARGV[4]
local head = redis.call("HGET", KEYS[4], member .. NUL .. "h")
if ARGV[2] == "" then
  if head then return {"head"} end
elseif head ~= string.sub(ARGV[2], 2) then
  return {"head"}
end
local field = cid .. NUL .. ns
if redis.call("HSETNX", KEYS[2], field, ARGV[8]) == 0 then return {"dup"} end
redis.call("ZADD", KEYS[3], 0, "x" .. field, 0, "n" .. ns .. NUL .. cid)
if not head then
  redis.call("HSETNX", KEYS[4], member .. NUL .. "c", ARGV[7])
  redis.call("SADD", KEYS[5], ARGV[9])
end
redis.call("HSET", KEYS[4], member .. NUL .. "h", cid, member .. NUL .. "q", ARGV[6])
local nblobs = tonumber(ARGV[10] or "0")
for j = 0, nblobs - 1 do
  local b = 11 + 3 * j
  redis.call("HSETNX", KEYS[tonumber(ARGV[b])], ARGV[b + 1], ARGV[b + 2])
end
put_writes(11 + 3 * nblobs, "overwrite")
return {"ok"}
"""
)

#: KEYS: fence claims, then write keys. ARGV: fence, mode, the writes.
PUT_WRITES = (
    _PRELUDE
    + r"""
local err = fenced()
if err then return err end
local taken = put_writes(3, ARGV[2])
if taken then return {"taken", taken} end
return {"ok"}
"""
)

#: KEYS: checkpoints, checkpoint index. ARGV: max, min, limit of index members.
#: Answers the packed records, newest id first.
LIST_CHECKPOINTS = (
    _PRELUDE
    + r"""
local members = redis.call("ZREVRANGEBYLEX", KEYS[2], ARGV[1], ARGV[2], "LIMIT", 0, ARGV[3])
for i, m in ipairs(members) do members[i] = ckpt_field(m) end
return hmget(KEYS[1], members)
"""
)

#: KEYS: writes, write index. ARGV: min, max of one checkpoint's members.
GET_WRITES = (
    _PRELUDE
    + r"""
return hmget(KEYS[1], redis.call("ZRANGEBYLEX", KEYS[2], ARGV[1], ARGV[2]))
"""
)

#: KEYS: checkpoints, writes, write index. ARGV: the checkpoint's field, then min,
#: max of its writes' members. Answers {} if the checkpoint is absent, else the
#: packed checkpoint followed by its writes: one snapshot, so a concurrent delete
#: cannot leave the checkpoint read without its writes.
GET_CHECKPOINT_AND_WRITES = (
    _PRELUDE
    + r"""
local ckpt = redis.call("HGET", KEYS[1], ARGV[1])
if not ckpt then return {} end
local out = hmget(KEYS[2], redis.call("ZRANGEBYLEX", KEYS[3], ARGV[2], ARGV[3]))
table.insert(out, 1, ckpt)
return out
"""
)

#: KEYS: branches, checkpoints. ARGV: branch member, escaped ns.
#: Answers the packed head checkpoint of the branch, or nil.
GET_HEAD = r"""
local head = redis.call("HGET", KEYS[1], ARGV[1] .. "\0h")
if not head then return nil end
return redis.call("HGET", KEYS[2], head .. "\0" .. ARGV[2])
"""

#: KEYS: branches, checkpoints. ARGV: branch member, expected head (opt), new head
#: (opt), seq, new head's checkpoint field ("" for none). Answers 1 if the branch
#: had the expected head and now has the new one, 0 if it had another head, -1 if
#: the new head's checkpoint is gone (nothing moved).
MOVE_HEAD = r"""
local m = ARGV[1]
if redis.call("HEXISTS", KEYS[1], m .. "\0c") == 0 then return 0 end
local head = redis.call("HGET", KEYS[1], m .. "\0h")
if ARGV[2] == "" then
  if head then return 0 end
elseif head ~= string.sub(ARGV[2], 2) then
  return 0
end
if ARGV[5] ~= "" and redis.call("HEXISTS", KEYS[2], ARGV[5]) == 0 then return -1 end
if ARGV[3] == "" then
  redis.call("HDEL", KEYS[1], m .. "\0h")
else
  redis.call("HSET", KEYS[1], m .. "\0h", string.sub(ARGV[3], 2))
end
redis.call("HSET", KEYS[1], m .. "\0q", ARGV[4])
return 1
"""

#: KEYS: fence claims, branches, fork tokens, run index, checkpoints. ARGV: fence,
#: branch member, token field ("" for none), head id (opt), head seq, base id
#: (opt), fork token (opt), created_at, escaped run id, base's checkpoint field
#: ("" for none). Answers the member and columns (h, q, b, t, c) of the token's
#: branch, nil, or {"nobase"} if a new branch's base checkpoint is gone.
CREATE_BRANCH = (
    _PRELUDE
    + r"""
local err = fenced()
if err then return err end
local m, tf = ARGV[2], ARGV[3]
if redis.call("HEXISTS", KEYS[2], m .. NUL .. "c") == 0
    and (tf == "" or redis.call("HEXISTS", KEYS[3], tf) == 0) then
  if ARGV[10] ~= "" and redis.call("HEXISTS", KEYS[5], ARGV[10]) == 0 then
    return {"nobase"}
  end
  hset_opt(KEYS[2], m .. NUL .. "h", ARGV[4])
  hset_opt(KEYS[2], m .. NUL .. "b", ARGV[6])
  hset_opt(KEYS[2], m .. NUL .. "t", ARGV[7])
  redis.call("HSET", KEYS[2], m .. NUL .. "q", ARGV[5], m .. NUL .. "c", ARGV[8])
  if tf ~= "" then redis.call("HSET", KEYS[3], tf, m) end
  redis.call("SADD", KEYS[4], ARGV[9])
end
if tf == "" then return nil end
local owner = redis.call("HGET", KEYS[3], tf)
if not owner then return nil end
local cols = {"h", "q", "b", "t", "c"}
local out = {owner}
for i, c in ipairs(cols) do out[i + 1] = redis.call("HGET", KEYS[2], owner .. NUL .. c) end
return out
"""
)

#: KEYS: fence claims, then interrupt keys. ARGV: fence, then per record:
#: key index, member, checkpoint id (opt), prompt (opt), created_at.
OPEN_INTERRUPTS = (
    _PRELUDE
    + r"""
local err = fenced()
if err then return err end
for b = 2, #ARGV, 5 do
  local key, m = KEYS[tonumber(ARGV[b])], ARGV[b + 1]
  if redis.call("HSETNX", key, m .. NUL .. "s", "pending") == 1 then
    hset_opt(key, m .. NUL .. "k", ARGV[b + 2])
    hset_opt(key, m .. NUL .. "p", ARGV[b + 3])
    redis.call("HSET", key, m .. NUL .. "c", ARGV[b + 4])
  end
end
return {"ok"}
"""
)

#: KEYS: fence claims, interrupts, then write keys. ARGV: fence, member, value,
#: consumer, now, then (absent: none) the writes, kept where present ("first").
#: Answers checkpoint id, prompt and created_at of the consumed interrupt.
CONSUME_INTERRUPT = (
    _PRELUDE
    + r"""
local err = fenced()
if err then return err end
local m = ARGV[2]
local status = redis.call("HGET", KEYS[2], m .. NUL .. "s")
if not status then return {"unknown"} end
if status ~= "pending" then return {"conflict"} end
redis.call("HSET", KEYS[2], m .. NUL .. "s", "consumed", m .. NUL .. "v", ARGV[3],
           m .. NUL .. "u", ARGV[4], m .. NUL .. "t", ARGV[5])
put_writes(6, "first")
return {"ok", redis.call("HMGET", KEYS[2], m .. NUL .. "k", m .. NUL .. "p", m .. NUL .. "c")}
"""
)

#: KEYS: claims. ARGV: scope member, holder, now, expires_at. Answers the fence.
ACQUIRE_CLAIM = r"""
local m, holder, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local fh, ff, fe = m .. "\0h", m .. "\0f", m .. "\0e"
local row = redis.call("HMGET", KEYS[1], fh, ff, fe)
local current = row[1]
if not current then
  redis.call("HSET", KEYS[1], fh, holder, ff, 1, fe, ARGV[4])
  return {"ok", "1"}
end
local live = tonumber(row[3]) > now
if current ~= holder and current ~= "" and live then return {"conflict"} end
local fence = row[2]
if current ~= holder or not live then
  fence = tostring(redis.call("HINCRBY", KEYS[1], ff, 1))
end
redis.call("HSET", KEYS[1], fh, holder, fe, ARGV[4])
return {"ok", fence}
"""

#: KEYS: claims. ARGV: scope member, holder, fence, new expires_at ("" to release).
#: Answers 1 if the claim was still this holder's at this fence, else 0.
UPDATE_CLAIM = r"""
local m = ARGV[1]
local fh, ff, fe = m .. "\0h", m .. "\0f", m .. "\0e"
if redis.call("HGET", KEYS[1], ff) ~= ARGV[3] or redis.call("HGET", KEYS[1], fh) ~= ARGV[2] then
  return 0
end
if ARGV[4] == "" then
  redis.call("HSET", KEYS[1], fh, "", fe, "0")
else
  redis.call("HSET", KEYS[1], fe, ARGV[4])
end
return 1
"""

#: KEYS: fence claims, effects. ARGV: fence, member, idempotency key, now.
#: Answers created (0/1) and the entry's columns (k, s, o, c, d, w); a new intent
#: keeps its caller's fence argument in w (the claim it was recorded under).
BEGIN_EFFECT = (
    _PRELUDE
    + r"""
local err = fenced()
if err then return err end
local m = ARGV[2]
local created = 0
if redis.call("HSETNX", KEYS[2], m .. NUL .. "s", "intent") == 1 then
  redis.call("HSET", KEYS[2], m .. NUL .. "k", ARGV[3], m .. NUL .. "c", ARGV[4])
  if ARGV[1] ~= "" then redis.call("HSET", KEYS[2], m .. NUL .. "w", ARGV[1]) end
  created = 1
end
return {"ok", created, redis.call("HMGET", KEYS[2], m .. NUL .. "k", m .. NUL .. "s",
        m .. NUL .. "o", m .. NUL .. "c", m .. NUL .. "d", m .. NUL .. "w")}
"""
)

#: KEYS: fence claims, effects. ARGV: fence, member, the fence argument of the
#: claim the intent is expected under ("" for none). Moves an intent still recorded
#: under that claim to the caller's (w); answers adopted (0/1), then the entry's
#: columns (k, s, o, c, d, w), or nil columns if it is gone.
ADOPT_EFFECT = (
    _PRELUDE
    + r"""
local err = fenced()
if err then return err end
local m = ARGV[2]
local adopted = 0
if redis.call("HGET", KEYS[2], m .. NUL .. "s") == "intent"
    and (redis.call("HGET", KEYS[2], m .. NUL .. "w") or "") == ARGV[3] then
  if ARGV[1] == "" then
    redis.call("HDEL", KEYS[2], m .. NUL .. "w")
  else
    redis.call("HSET", KEYS[2], m .. NUL .. "w", ARGV[1])
  end
  adopted = 1
end
return {"ok", adopted, redis.call("HMGET", KEYS[2], m .. NUL .. "k", m .. NUL .. "s",
        m .. NUL .. "o", m .. NUL .. "c", m .. NUL .. "d", m .. NUL .. "w")}
"""
)

#: KEYS: fence claims, effects. ARGV: fence, member, outcome, now.
#: Answers the entry's columns (k, s, o, c, d, w) after the move.
FINISH_EFFECT = (
    _PRELUDE
    + r"""
local err = fenced()
if err then return err end
local m = ARGV[2]
if redis.call("HGET", KEYS[2], m .. NUL .. "s") == "intent" then
  redis.call("HSET", KEYS[2], m .. NUL .. "s", "done", m .. NUL .. "o", ARGV[3],
             m .. NUL .. "d", ARGV[4])
end
return {"ok", redis.call("HMGET", KEYS[2], m .. NUL .. "k", m .. NUL .. "s",
        m .. NUL .. "o", m .. NUL .. "c", m .. NUL .. "d", m .. NUL .. "w")}
"""
)

#: KEYS: branches, checkpoints, checkpoint index, writes, write index.
#: ARGV: escaped ns, then the escaped ids. Answers the count.
DELETE_CHECKPOINTS = r"""
local NUL = "\0"
local ns = ARGV[1]
local prefix = ns .. NUL
local pinned = {}
local branches = redis.call("HGETALL", KEYS[1])
for i = 1, #branches, 2 do
  local f = branches[i]
  local col = string.sub(f, -2)
  if string.sub(f, 1, #prefix) == prefix and (col == NUL .. "h" or col == NUL .. "b") then
    pinned[branches[i + 1]] = true
  end
end
local deleted = 0
for b = 2, #ARGV do
  local cid = ARGV[b]
  if not pinned[cid] then
    local field = cid .. NUL .. ns
    deleted = deleted + redis.call("HDEL", KEYS[2], field)
    redis.call("ZREM", KEYS[3], "x" .. field, "n" .. ns .. NUL .. cid)
    local lo, hi = "[" .. ns .. NUL .. cid .. NUL, "(" .. ns .. NUL .. cid .. "\1"
    local writes = redis.call("ZRANGEBYLEX", KEYS[5], lo, hi)
    for i = 1, #writes, 1000 do
      redis.call("HDEL", KEYS[4], unpack(writes, i, math.min(i + 999, #writes)))
    end
    redis.call("ZREMRANGEBYLEX", KEYS[5], lo, hi)
  end
end
return deleted
"""

#: KEYS: the source run's keys, the target run's keys (both in `RUN_KEYS` order),
#: the run index. ARGV: escaped target run id. Insert-if-absent, like the SQL copy.
COPY_RUN = (
    _PRELUDE
    + r"""
local n = (#KEYS - 1) / 2
local function src(i) return KEYS[i] end
local function dst(i) return KEYS[n + i] end
-- 1 ck, 2 ix, 3 br, 4 bt, 5 bl, 6 wr, 7 wx (see RUN_KEYS)
local rows = redis.call("HGETALL", src(1))
for i = 1, #rows, 2 do
  if redis.call("HSETNX", dst(1), rows[i], rows[i + 1]) == 1 then
    local p = string.find(rows[i], NUL, 1, true)
    local ns_cid = string.sub(rows[i], p + 1) .. NUL .. string.sub(rows[i], 1, p - 1)
    redis.call("ZADD", dst(2), 0, "x" .. rows[i], 0, "n" .. ns_cid)
  end
end
local token_of = {}
rows = redis.call("HGETALL", src(4))
for i = 1, #rows, 2 do token_of[rows[i + 1]] = rows[i] end
rows = redis.call("HGETALL", src(3))
local columns = {}
local order = {}
for i = 1, #rows, 2 do
  local m = string.sub(rows[i], 1, -3)
  if not columns[m] then columns[m] = {}; order[#order + 1] = m end
  columns[m][string.sub(rows[i], -1)] = rows[i + 1]
end
for _, m in ipairs(order) do
  local tf = token_of[m]
  if redis.call("HEXISTS", dst(3), m .. NUL .. "c") == 0
      and (not tf or redis.call("HEXISTS", dst(4), tf) == 0) then
    for c, v in pairs(columns[m]) do redis.call("HSET", dst(3), m .. NUL .. c, v) end
    if tf then redis.call("HSET", dst(4), tf, m) end
  end
end
rows = redis.call("HGETALL", src(5))
for i = 1, #rows, 2 do redis.call("HSETNX", dst(5), rows[i], rows[i + 1]) end
rows = redis.call("HGETALL", src(6))
for i = 1, #rows, 2 do
  if redis.call("HSETNX", dst(6), rows[i], rows[i + 1]) == 1 then
    redis.call("ZADD", dst(7), 0, rows[i])
  end
end
-- 8 in (interrupts), 10 ef (effects), whole records: one the target has is kept as
-- it is (its status column "s" says so). 9 cl (claims) is not copied.
for _, k in ipairs({8, 10}) do
  rows = redis.call("HGETALL", src(k))
  local kept = {}
  for i = 1, #rows, 2 do
    local m = string.sub(rows[i], 1, -3)
    if kept[m] == nil then kept[m] = redis.call("HEXISTS", dst(k), m .. NUL .. "s") == 1 end
    if not kept[m] then redis.call("HSET", dst(k), rows[i], rows[i + 1]) end
  end
end
if redis.call("EXISTS", dst(1), dst(3)) > 0 then redis.call("SADD", KEYS[#KEYS], ARGV[1]) end
return {"ok"}
"""
)

#: KEYS: every key of the run, then the run index. ARGV: escaped run id.
DELETE_RUN = r"""
redis.call("DEL", unpack(KEYS, 1, #KEYS - 1))
redis.call("SREM", KEYS[#KEYS], ARGV[1])
return 1
"""
