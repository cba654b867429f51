-- test_op_binding.lua — lz.ops against the ops' one declaration
-- (core/mem/lz_ops.def): the binding lists exactly the declared public ops,
-- in their order, read from C; each is declared in the header with tensor
-- parameters the declaration names; a toy op added by one line (a test
-- build of the core) runs on cpu and sim.
local lz = require("luazero")
local T = {}

local support = dofile(lz.root .. "/tests/lua/support.lua")
local expect_error = support.expect_error
local op_args = require("luazero.op_args")
local cdef = require("luazero.cdef")

-- The declaration's lines: { {name =, op =, args = {...}}, ... } in order;
-- an alias carries its op's arguments.
local function declared()
  local f = assert(io.open(lz.root .. "/core/mem/lz_ops.def"))
  -- an op's ARG(name, dtypes) list may go on over indented lines
  local text = f:read("*a"):gsub("/%*.-%*/", ""):gsub(",%s*\n%s+", ", ")
  f:close()
  local out, by_id = {}, {}
  for line in text:gmatch("[^\n]+") do
    local id, name, rest = line:match("^LZ_OP%((%u[%u%d_]*), ([%w_]+), %d, (.*)%)%s*$")
    if id then
      local args = {}
      for a in rest:gmatch("ARG%(([%w_]+),") do args[#args + 1] = a end
      by_id[id] = args
      out[#out + 1] = { name = name, op = id, args = args }
    end
    local alias, of = line:match("^LZ_OP_ALIAS%(([%w_]+), (%u[%u%d_]*)%)")
    if alias then out[#out + 1] = { name = alias, op = of, args = assert(by_id[of], of) } end
  end
  return out
end

function T.ops_are_the_declaration_in_order()
  local decl = declared()
  assert(#decl >= 28, #decl .. " declared ops")
  local names = op_args.entry_names(lz.C)
  assert(#names == #decl, #names .. " names from C, " .. #decl .. " declared")
  for i, d in ipairs(decl) do
    assert(names[i] == d.name, ("entry %d: %s from C, %s declared"):format(i, names[i], d.name))
    assert(op_args.names[i] == d.name, "op_args.names[" .. i .. "]")
    assert(type(lz.ops[d.name]) == "function", "lz.ops." .. d.name)
  end
  expect_error(function() return lz.ops.conv2d end, "there is no such op")
end

function T.each_op_takes_the_tensors_its_declaration_names()
  for _, d in ipairs(declared()) do
    local named = {}
    for _, a in ipairs(d.args) do named[a] = true end
    local tensors = 0
    for _, p in ipairs(op_args.params(cdef, d.name)) do
      if p.kind == "tensor" then
        tensors = tensors + 1
        assert(named[p.name], ("lz_%s's tensor %s is not among %s's declared arguments (%s)")
               :format(d.name, p.name, d.op, table.concat(d.args, ", ")))
      end
    end
    assert(tensors >= 1, d.name)
  end
end

-- The core built again with one more line in the declaration
-- (tests/toy/lz_ops_extra.def) and that op's kernel: it runs on cpu and sim.
function T.a_toy_op_declared_by_one_line_runs_on_cpu_and_sim()
  local bin = lz.executable():gsub("luazero$", "lz_ops_toy")
  assert(support.exists(bin), bin .. " is missing: build the lz_ops_toy project")
  local out, st = support.sh(support.quote(bin))
  assert(st == 0 and out:find("2 passed, 0 failed", 1, true), out)
end

return T
