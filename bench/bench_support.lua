-- bench_support.lua — what the Lua benchmarks share (not a benchmark itself):
-- shell quoting, a scratch folder, and the corpus they train on.
--   local bench = dofile(lz.root .. "/bench/bench_support.lua")
--   local q, tmp = bench.quote, bench.scratch()
--   local data = bench.corpus(tmp, flags.data)   -- the given file, or a generated text
--   ... bench.cleanup(tmp)
local M = {}

function M.quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

function M.scratch()
  local dir = os.tmpname()
  os.remove(dir)
  os.execute("mkdir -p " .. M.quote(dir))
  return dir
end

-- `given` when set; else a generated text in dir.
function M.corpus(dir, given)
  if given then return given end
  local path = dir .. "/corpus.txt"
  local f = assert(io.open(path, "w"))
  f:write(("The quick brown fox jumps over the lazy dog. "):rep(20000))
  f:close()
  return path
end

function M.cleanup(dir) os.execute("rm -rf " .. M.quote(dir)) end

return M
