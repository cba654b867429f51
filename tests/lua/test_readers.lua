-- test_readers.lua — inputs that tests/fuzz/fuzz_readers.lua found a reader
-- mishandling, each kept here: the reader now refuses it in its own one
-- line ("tokenizer: FILE: ...", "config: ...", "checkpoint: FILE: ..."); and
-- that the fuzzer's inputs replay from their numbers.
local cjson = require("cjson")
local support = dofile(require("luazero").root .. "/tests/lua/support.lua")

local T = {}
local write_file = support.scratch()

-- pcall(fn, ...) must fail with one line starting `prefix` and naming each
-- of `needles`.
local function refused(prefix, needles, fn, ...)
  local ok, err = pcall(fn, ...)
  assert(not ok, "accepted")
  err = tostring(err)
  assert(err:sub(1, #prefix) == prefix, ("%q does not start with %q"):format(err, prefix))
  assert(not err:find("\n"), ("%q is not one line"):format(err))
  for _, n in ipairs(needles) do
    assert(err:find(n, 1, true), ("%q does not name %q"):format(err, n))
  end
end

local function tokenizer_json(edit)
  local j = {
    pre_tokenizer = { type = "ByteLevel", add_prefix_space = false, use_regex = true },
    decoder = { type = "ByteLevel" },
    model = { type = "BPE", vocab = { a = 0, b = 1, ab = 2 }, merges = { "a b" } },
  }
  edit(j)
  return write_file("tokenizer.json", cjson.encode(j))
end

-- added_tokens that is not a list raised ipairs' own error; an added
-- token's id out of the id range made a vocabulary of 1e308 ids.
function T.tokenizer_added_tokens_not_a_list_or_with_a_wild_id()
  local load = require("luazero.tokenizer").load
  local p = tokenizer_json(function(j) j.added_tokens = "eos" end)
  refused("tokenizer: " .. p .. ": ", { 'added_tokens is "eos"; give a list' }, load, p)
  for _, id in ipairs({ -1, 1e308, 2.5 }) do
    p = tokenizer_json(function(j) j.added_tokens = { { id = id, content = "<e>" } } end)
    refused("tokenizer: " .. p .. ": ", { "added_tokens[1] (<e>) has id", "ids are integers 0.." },
            load, p)
  end
end

-- A string holding a newline was echoed as is: a refusal over two lines.
function T.config_and_manifest_refusals_stay_one_line_whatever_the_file_holds()
  local config = require("luazero.config")
  local p = write_file("ds.json", '{"optimizer": {"type": "a\\nb"}}')
  refused("config: ", { 'optimizer.type "a\\nb" is not available' }, config.load, p)
  local manifest = require("luazero.checkpoint.manifest")
  refused("checkpoint: m.json: format: ", { "a\\10b" }, manifest.decode,
          '{"format": "a\\nb"}', "m.json")
  local tokenizer = require("luazero.tokenizer")
  p = tokenizer_json(function(j) j.model.vocab["x\ny"] = -1 end)
  refused("tokenizer: " .. p .. ": ", { "model.vocab[" }, tokenizer.load, p)
end

-- A header number beyond a double (1e999: inf) or NaN in data_offsets or a
-- shape raised cjson's "Cannot serialise number" while the refusal quoted it.
function T.safetensors_header_with_nan_or_inf_is_refused_quoting_it()
  local safetensors = require("luazero.checkpoint.safetensors")
  for _, case in ipairs({
    { '"shape": [2], "data_offsets": [0, NaN]', "data_offsets [0,nan]" },
    { '"shape": [2], "data_offsets": [0, 1e999]', "data_offsets span inf bytes" },
    { '"shape": [-1e999], "data_offsets": [0, 8]', "shape [-inf]" },
    { '"shape": [NaN], "data_offsets": [0, 8]', "shape [nan]" },
  }) do
    local header = '{"w": {"dtype": "F32", ' .. case[1] .. '}}'
    local bytes = string.char(#header, 0, 0, 0, 0, 0, 0, 0) .. header .. string.rep("\0", 8)
    local p = write_file("nan.safetensors", bytes)
    refused("safetensors " .. p .. ": ", { case[2] }, safetensors.open, p)
  end
end

-- A folder given as a safetensors file raised pread's "Is a directory"
-- from an assert; an index whose weight_map names "", "." or ".." opened
-- the folder itself; a name with a newline made a refusal of two lines.
function T.hf_index_naming_folders_and_a_folder_as_safetensors()
  local safetensors = require("luazero.checkpoint.safetensors")
  local hf = require("luazero.hf")
  local dir = select(2, support.scratch())
  refused("safetensors " .. dir .. ": ", { "cannot read it (Is a directory)" }, safetensors.open,
          dir)
  for _, name in ipairs({ "", ".", "..", "a\nb" }) do
    local f = assert(io.open(dir .. "/model.safetensors.index.json", "w"))
    f:write(cjson.encode({ weight_map = { ["wte.weight"] = name } }))
    f:close()
    refused("init: " .. dir .. "/model.safetensors.index.json: ",
            { name == "a\nb" and "a\\10b" or "not a file name" }, hf.open, dir)
  end
end

-- tests/fuzz/mutate.lua: an input number gives the same input every time
-- (so a failure replays), whatever order the process hashes keys in.
function T.fuzz_inputs_replay_from_their_number()
  local lz = require("luazero")
  local mutate = dofile(lz.root .. "/tests/fuzz/mutate.lua")
  local seed = '{"b": [1, 2, {"c": "x", "d": null}], "a": {"e": 1.5, "f": true, "g": "text"}}'
  local seen = {}
  for n = 1, 200 do
    local a = mutate.json(mutate.rng(n), seed, { seed })
    local b = mutate.json(mutate.rng(n), seed, { seed })
    assert(a == b, ("input %d differs between two makings:\n%s\n%s"):format(n, a, b))
    seen[a] = true
  end
  local distinct = 0
  for _ in pairs(seen) do distinct = distinct + 1 end
  assert(distinct > 150, ("only %d distinct inputs of 200"):format(distinct))
  -- a table built in another key order encodes to the same text
  local x, y = {}, {}
  for _, k in ipairs({ "p", "q", "r", "s" }) do x[k] = k end
  for _, k in ipairs({ "s", "r", "q", "p" }) do y[k] = k end
  assert(mutate.encode(x) == mutate.encode(y) and
         mutate.encode(x) == '{"p":"p","q":"q","r":"r","s":"s"}', mutate.encode(x))
end

return T
