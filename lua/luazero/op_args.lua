-- op_args.lua — lz.ops: each kernel lz_<name> as a Lua function whose
-- arguments are checked first against the parameters of its declaration in
-- core/luazero.h (luazero.cdef): a wrong one is an error naming the op, the
-- argument and what it takes, and a freed tensor never reaches C.
local ffi = require("ffi")

local M = {}

-- The public ops, in the order of their one declaration (core/mem/lz_ops.def),
-- read through lz_op_entry_name; filled by M.ops.
M.names = {}

function M.entry_names(C)
  local names, i = {}, 0
  while true do
    local p = C.lz_op_entry_name(i)
    if p == nil then return names end
    names[#names + 1] = ffi.string(p)
    i = i + 1
  end
end

local tensor_ptr = ffi.typeof("lz_tensor *")

-- lz_<op>'s parameters in the header text: { {name =, kind = "tensor" |
-- "number" | "pointer", ctype and base = (pointer: its type and the type
-- it points to, which FFI passes by reference)}, ... }.
function M.params(cdef, op)
  local decl = cdef:match("lz_status lz_" .. op .. "%(([^)]*)%)")
  if not decl then error("op_args: luazero.h declares no lz_" .. op, 2) end
  local out = {}
  for p in decl:gmatch("[^,]+") do
    local ty, name = p:match("^%s*(.-)%s*([%w_]+)%s*$")
    local kind = ty:find("lz_tensor", 1, true) and "tensor" or ty:find("*", 1, true) and "pointer"
                 or name:find("^trans_") and "flag" or "number"
    out[#out + 1] = { name = name, kind = kind, ctype = kind == "pointer" and ffi.typeof(ty),
                      base = kind == "pointer" and ffi.typeof((ty:gsub("%*%s*$", ""))) }
  end
  return out
end

local function shown(a)
  if type(a) == "string" then
    return ("a string (%q)"):format(#a > 20 and a:sub(1, 20) .. "..." or a)
  end
  if type(a) == "nil" then return "missing (nil)" end
  if type(a) == "cdata" then return ("a cdata (%s)"):format(tostring(ffi.typeof(a))) end
  return ("a %s (%s)"):format(type(a), tostring(a))
end

-- Why argument a does not fit parameter p, or nil. gone(t): why a tensor's
-- header is gone (freed), or nil.
local function misfit(p, a, gone)
  if p.kind == "tensor" then
    if a == nil then return nil end -- C names a missing tensor it needs
    if not ffi.istype(tensor_ptr, a) then return shown(a) .. "; it takes a tensor" end
    local why = gone(a)
    return why and ("a freed tensor: " .. why .. "; pass a live one")
  elseif p.kind == "flag" then
    if a == true or a == false or a == 0 or a == 1 then return nil end
    return shown(a) .. "; it takes true or false (or 1 or 0)"
  elseif p.kind == "number" then
    if type(a) == "number" or (type(a) == "cdata" and tonumber(a) ~= nil) then return nil end
    return shown(a) .. "; it takes a number"
  elseif a ~= nil and not ffi.istype(p.ctype, a) and not ffi.istype(p.base, a) then
    return shown(a) .. ("; it takes a %s"):format(tostring(p.ctype):match("^ctype<(.*)>$"))
  end
end

-- One line per parameter kind: true when argument A does not fit (A and I
-- replaced by the argument's name and number).
local test = {
  tensor = "A ~= nil and (not istype(tensor_ptr, A) or (dead[A] and gone(A)))",
  number = "type(A) ~= 'number' and not (type(A) == 'cdata' and tonumber(A))",
  flag = "A ~= 0 and A ~= 1 and A ~= true and A ~= false",
  pointer = "A ~= nil and not istype(P[I].ctype, A) and not istype(P[I].base, A)",
}

-- The ops table: ops.<name>(...) checks its arguments, calls lz_<name> of
-- library C and turns a failing status into an error carrying C's message.
-- Each op is Lua code written for its parameters (a loop over varargs
-- would cost the hot path more than the kernel call on small tensors).
-- dead, gone: tensor_guard's registry of tensors whose header is gone.
function M.ops(C, cdef, dead, gone)
  local ops = {}
  M.names = M.entry_names(C)
  for _, name in ipairs(M.names) do
    local params = M.params(cdef, name)
    local function fail(i, a, extra)
      if not i then
        local list = {}
        for k, p in ipairs(params) do list[k] = p.name end
        error(("luazero: ops.%s takes %d arguments (%s); got %d"):format(name, #params,
              table.concat(list, ", "), #params + extra), 3)
      end
      error(("luazero: ops.%s: argument %d (%s) is %s"):format(name, i, params[i].name,
            misfit(params[i], a, gone)), 3)
    end
    local args, checks = {}, {}
    for i, p in ipairs(params) do
      args[i] = "a" .. i
      checks[i] = ("  if %s then fail(%d, a%d) end"):format(
        test[p.kind]:gsub("A", "a" .. i):gsub("I", tostring(i)), i, i)
      if p.kind == "flag" then -- C takes an int
        checks[i] = checks[i] .. ("\n  a%d = (a%d == true or a%d == 1) and 1 or 0"):format(i, i, i)
      end
    end
    local list = table.concat(args, ", ")
    local src = ([[
local C, ffi, istype, tensor_ptr, dead, gone, P, fail = ...
local fn
return function(%s, ...)
  if select("#", ...) > 0 then fail(nil, nil, select("#", ...)) end
%s
  fn = fn or C.lz_%s
  if fn(%s) ~= 0 then error(ffi.string(C.lz_last_error()), 2) end
end]]):format(list, table.concat(checks, "\n"), name, list)
    ops[name] = assert(loadstring(src, "=ops." .. name))(C, ffi, ffi.istype, tensor_ptr, dead,
                                                        gone, params, fail)
  end
  local names = table.concat(M.names, ", ")
  return setmetatable(ops, { __index = function(_, k)
    error(("luazero: lz.ops.%s: there is no such op; the ops are %s (their arguments: " ..
           "core/luazero.h, docs/architecture.md)"):format(tostring(k), names), 2)
  end })
end

return M
