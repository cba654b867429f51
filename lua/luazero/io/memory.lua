-- io/memory.lua — how much memory this process may still take: the least of
-- what the machine has free (MemAvailable), the room its memory cgroup
-- leaves (v2 memory.max, v1 memory.limit_in_bytes, less what the group
-- uses but its inactive file cache, which the kernel reclaims first, over
-- the group and its parents) and the room `ulimit -v` leaves (RLIMIT_AS
-- less the address space mapped). A container's or a job scheduler's
-- limit is met before the machine's. The first two are the machine's or the
-- group's, shared by the ranks on it; ulimit -v's is each process's own.
--
--   local bytes, source = memory.available(ranks)  -- a rank's share
--   -- source: "MemAvailable / 2 local ranks", "ulimit -v", ...
local ffi = require("ffi")

pcall(ffi.cdef, [[
typedef struct { uint64_t cur, max; } lz_rlimit;
int getrlimit(int resource, lz_rlimit *rl);
]])

local M = {}

local read = require("luazero").read_file

local function number_in(path)
  local s = read(path)
  return s and tonumber(s:match("^%s*(%d+)"))
end

-- A limit this large is none (v1's "unlimited" is 2^63 rounded to a page).
local NONE = 2 ^ 60

-- The room the memory cgroups of this process leave (bytes), and the
-- limit's file; nil where none is set. cgroup_root: /sys/fs/cgroup (tests
-- give another), self_cgroup: the text of /proc/self/cgroup.
function M.cgroup_room(cgroup_root, self_cgroup)
  cgroup_root = cgroup_root or "/sys/fs/cgroup"
  self_cgroup = self_cgroup or read("/proc/self/cgroup") or ""
  local best, file
  local function consider(dir, limit_name, usage_name, inactive_key)
    -- the group and each parent up to the hierarchy's root
    while true do
      local limit = number_in(dir .. "/" .. limit_name)
      local used = number_in(dir .. "/" .. usage_name)
      -- (file pages not used lately: the kernel reclaims them before it
      -- kills, as MemAvailable counts them free)
      local inactive = tonumber(("\n" .. (read(dir .. "/memory.stat") or "")):match(
        "\n" .. inactive_key .. " (%d+)"))
      if used and inactive then used = math.max(0, used - inactive) end
      if limit and used and limit < NONE then
        local room = math.max(0, limit - used)
        if not best or room < best then best, file = room, dir .. "/" .. limit_name end
      end
      local up = dir:match("^(.+)/[^/]+$")
      if not up or #up < #cgroup_root then break end
      dir = up
    end
  end
  for line in self_cgroup:gmatch("[^\n]+") do
    local id, controllers, path = line:match("^(%d+):([^:]*):(.*)$")
    if id == "0" and controllers == "" then
      consider(cgroup_root .. (path == "/" and "" or path), "memory.max", "memory.current",
               "inactive_file")
    elseif controllers and (("," .. controllers .. ","):find(",memory,", 1, true)) then
      consider(cgroup_root .. "/memory" .. (path == "/" and "" or path),
               "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    end
  end
  return best, file
end

-- The room RLIMIT_AS (ulimit -v) leaves: the limit less VmSize; nil when unlimited.
function M.address_room()
  local rl = ffi.new("lz_rlimit")
  if ffi.C.getrlimit(9, rl) ~= 0 then return nil end -- RLIMIT_AS
  local cur = tonumber(rl.cur)
  if cur >= NONE then return nil end
  local kb = (read("/proc/self/status") or ""):match("VmSize:%s*(%d+)")
  return math.max(0, cur - (tonumber(kb) or 0) * 1024)
end

-- A rank's share of the three, the least of them, and where it comes from
-- ("MemAvailable / 2 local ranks", "the memory cgroup's limit (FILE) / 1
-- local rank", "ulimit -v"): MemAvailable and the cgroup's room divided
-- among `ranks` (the ranks on this machine, default 1), ulimit -v's whole.
-- nil where none can be read.
function M.available(ranks)
  ranks = ranks or 1
  local per = (" / %d local rank%s"):format(ranks, ranks == 1 and "" or "s")
  local kb = (read("/proc/meminfo") or ""):match("MemAvailable:%s*(%d+)")
  local best, source = kb and math.floor(tonumber(kb) * 1024 / ranks), "MemAvailable" .. per
  local room, file = M.cgroup_room()
  if room and (not best or room / ranks < best) then
    best, source = math.floor(room / ranks), ("the memory cgroup's limit (%s)%s"):format(file, per)
  end
  room = M.address_room()
  if room and (not best or room < best) then best, source = room, "ulimit -v" end
  return best, source
end

return M
