-- optim/registry.lua — the optimizer table (DESIGN.md decision 9): every
-- optimizer luazero knows, each declared in its own file, and what the rest
-- of luazero asks of them. config.lua reads a config's optimizer block
-- through it, config/defaults.lua takes the default optimizer and its
-- defaults from it, the engine allocates the states it declares, a
-- checkpoint's manifest records the type and hyperparameters it names, and
-- inference, resume, tools/ckpt and the REPL read that record back. No
-- optimizer name is written anywhere else.
--
-- An optimizer file returns its declaration (docs/extending.md):
--   name          the optimizer (the engine's start-up line, the REPL)
--   types         the optimizer.type names DeepSpeed's config writes for it,
--                 matched case-insensitively; each is kept as spelled here
--                 (default { name })
--   params        its config schema: { key, kind, default = ..., min, below }
--                 (kinds: optim/schema.lua)
--   states        its per-element states, in the order update's call.s holds
--                 them: { { name = "m", format = "f32" }, ... }; a format is
--                 one of optim/formats.lua's (f32 when absent; `dtype` is
--                 its older spelling); signed = true: a block-scaled
--                 state whose values take either sign (8-bit AdamW's m:
--                 the signed map; else the unsigned one)
--   step          step(self, call, step, lr, grad_scale): one update over a
--                 call's views (the engine's interface, optim/adamw.lua)
--   step_sround   optional step_sround(self, call, step, lr, grad_scale,
--                 seed, index): step over a bf16 master (call.p bf16, on
--                 the cpu) rounded stochastically in the same pass, the bits
--                 of lz_bf16_round_stochastic(seed, step, index + i); absent,
--                 the engine widens, steps and rounds in three
--   init          optional init(self): what new() adds (kernel arguments)
--   small_below   optional: the param under whose element count a tensor
--                 keeps f32 states beside block-scaled ones (AdamW8bit's
--                 min_8bit_size); new() sets block_min_numel from it
--   read_config   optional read_config(p, key, type, unimplemented): the
--                 params block's other keys; returns the block's extra fields
--   accepted      keys read_config reads (never reported as unimplemented)
--   quiet         key -> the value that asks for nothing (default: false)
--   defaults_name optional: the name its defaults also go by in
--                 luazero.config (adam_defaults)
--   keeps         optional: the formats its states may be kept in (a
--                 config's choice: AdamW's f32 or bf16; by default the
--                 formats its states are declared in); tools/ckpt
--                 convert-states to another is refused unless
--   converts_to   names, per format, the optimizer.type that keeps the same
--                 states in it (AdamW8bit's f32: AdamW)
--   resumes       optional: other optimizers' names whose checkpoints it
--                 resumes as its own (the same update and states under
--                 other defaults: Adam8bit's AdamW8bit and back)
--   matrix        optional matrix(entry, hidden): true for a parameter the
--                 optimizer updates as a whole matrix (Muon's); the engine
--                 then runs prepare(self, call, step, grad_scale) over its
--                 pieces, orthogonalize(self, u, A, B) over each whole
--                 matrix on the rank that owns it, then step (zero/matrices.lua);
--                 matrix_state: the index of the state that carries a
--                 matrix's update from prepare to step; optional
--                 orthogonalize_scratch(self, A, B): the workspace bytes
--                 orthogonalize makes and frees for an A x B matrix (what
--                 the estimator counts)
--
--   local optimizers = require("luazero.optim.registry")
--   local class, spelling = optimizers.find("adamw")   -- AdamW, "AdamW"
--   local opt = optimizers.new({ type = "Lion", params = { lr = 1e-4 } })
--   opt:record()                                       -- { type = "Lion", params = {...} }
local schema = require("luazero.optim.schema")
local formats = require("luazero.optim.formats")
local hyper = require("luazero.optim.hyper")
local values = require("luazero.config.values")

local M = {}

-- The optimizer files of this tree. The first is the default: what
-- DeepSpeed's engine builds when a config names no optimizer. More come
-- from LZ_OPTIMIZERS (below) and M.register.
-- (Plain requires, so the layer check sees each arrow.)
local BUILT_IN = { require("luazero.optim.adamw"), require("luazero.optim.lion"),
                   require("luazero.optim.muon"), require("luazero.optim.adamw8bit"),
                   require("luazero.optim.adam8bit") }

M.list = {}    -- classes, in the order they were declared
M.by_name = {} -- name -> class
local by_type = {} -- lower-cased DeepSpeed type -> { class, spelling }
local spellings = {} -- every DeepSpeed type, in order

local function bad(origin, fmt, ...) error(("optim: %s: " .. fmt):format(origin, ...), 0) end

-- What every optimizer object answers besides its step.
local Base = {}

-- The manifest's record: the type the config named and the
-- hyperparameters it was made with (the config's, not a schedule's
-- current betas).
function Base:record()
  return { type = self.type, params = values.deep_copy(self.configured),
           state_formats = values.deep_copy(self.state_formats),
           master_format = self.master_format }
end


-- True when type_name (a config's or a record's optimizer.type) names this
-- optimizer.
function Base:accepts(type_name)
  local e = type(type_name) == "string" and by_type[type_name:lower()]
  if not e then return false end
  local mine = getmetatable(self)
  if e.class == mine then return true end
  for _, name in ipairs(mine.resumes or {}) do
    if name == e.class.name then return true end
  end
  return false
end

local function check_states(states, origin)
  if type(states) ~= "table" or #states > 7 then
    bad(origin, "states must be a list of up to 7 { name = ..., format = \"f32\" }")
  end
  local names, fmts, signed = {}, {}, {}
  for i, s in ipairs(states) do
    if type(s) ~= "table" or type(s.name) ~= "string" or s.name == "master" or fmts[s.name] then
      bad(origin, "states[%d] must be { name = ..., format = \"f32\" } with a name of its own " ..
          "(not \"master\")", i)
    end
    local f = s.format or s.dtype or formats.default
    if not formats.by_name[f] then
      bad(origin, "state %s has format %s: a state is kept in %s", s.name, tostring(f),
          table.concat(formats.names, ", "))
    end
    names[i], fmts[s.name], signed[s.name] = s.name, f, s.signed == true
  end
  return names, fmts, signed
end

-- Adds an optimizer from its declaration (origin: where it came from, for
-- errors); returns its class.
function M.define(spec, origin)
  if type(spec) ~= "table" then bad(origin, "must return the optimizer's declaration (a table)") end
  if type(spec.name) ~= "string" or spec.name == "" then bad(origin, "name must be a string") end
  if M.by_name[spec.name] then
    bad(origin, "the optimizer %s is declared already (by %s)", spec.name,
        M.by_name[spec.name].origin)
  end
  if type(spec.step) ~= "function" then
    bad(origin, "step must be a function(self, call, step, lr, grad_scale)")
  end
  if spec.matrix and (type(spec.matrix) ~= "function" or type(spec.prepare) ~= "function" or
                      type(spec.orthogonalize) ~= "function") then
    bad(origin, "matrix, prepare and orthogonalize must be functions, all three or none")
  end
  local types = spec.types or { spec.name }
  for i, t in ipairs(types) do
    if type(t) ~= "string" then bad(origin, "types[%d] must be a string", i) end
    if by_type[t:lower()] then
      bad(origin, "optimizer.type %s is %s's already", t, by_type[t:lower()].class.name)
    end
  end
  if spec.resumes ~= nil then
    if type(spec.resumes) ~= "table" then bad(origin, "resumes must be a list of optimizer names") end
    for i, t in ipairs(spec.resumes) do
      if type(t) ~= "string" then bad(origin, "resumes[%d] must be a string", i) end
    end
  end
  local defaults = schema.check(spec.params, origin)
  local names, fmts, signed = check_states(spec.states, origin)
  -- keeps by default: the formats its states are declared in (Lion's f32)
  local keeps = spec.keeps
  if not keeps then
    local seen = {}
    keeps = {}
    for _, n in ipairs(names) do
      if not seen[fmts[n]] then seen[fmts[n]] = true; keeps[#keeps + 1] = fmts[n] end
    end
  end
  local class = {
    name = spec.name, types = types, params = spec.params, defaults = defaults,
    states = names, state_formats = fmts, state_signed = signed, origin = origin,
    update = spec.step, update_sround = spec.step_sround,
    read_config = spec.read_config, accepted = spec.accepted, quiet = spec.quiet,
    defaults_name = spec.defaults_name, matrix = spec.matrix, prepare = spec.prepare,
    orthogonalize = spec.orthogonalize, matrix_state = spec.matrix_state,
    orthogonalize_scratch = spec.orthogonalize_scratch,
    keeps = keeps, converts_to = spec.converts_to, resumes = spec.resumes,
    small_below = spec.small_below,
  }
  class.__index = class
  setmetatable(class, { __index = Base })
  -- params: the config's optimizer.params (what is absent takes the
  -- declared defaults); type_name: the type the config spelled;
  -- state_formats: name -> format for the states a config keeps in another
  -- format than the declaration's (its read_config's extra field).
  function class.new(params, type_name, state_formats)
    -- (each declared parameter given is checked as a config's is: a table
    -- handed to optim.new directly is held to the same rules)
    local checked = {}
    for k, v in pairs(params or {}) do checked[k] = v end
    for _, d in ipairs(spec.params) do
      local v = checked[d[1]]
      if values.given(v) then
        checked[d[1]] = schema.KINDS[d[2]]("optimizer.params." .. d[1], v, d)
      end
    end
    local self = hyper.read(checked, class.defaults)
    self.type = type_name or class.name
    self.configured = {}
    for k in pairs(class.defaults) do self.configured[k] = values.deep_copy(self[k]) end
    self.state_formats = {}
    for _, n in ipairs(names) do
      local f = state_formats and state_formats[n] or fmts[n]
      self.state_formats[n] = formats.get(f).name
    end
    setmetatable(self, class)
    -- (tensors of fewer elements keep their states in f32: the engine reads it)
    if spec.small_below then self.block_min_numel = self[spec.small_below] end
    if spec.init then spec.init(self) end
    return self
  end
  for _, t in ipairs(types) do
    by_type[t:lower()] = { class = class, spelling = t }
    spellings[#spellings + 1] = t
  end
  M.list[#M.list + 1] = class
  M.by_name[class.name] = class
  return class
end

-- Adds the optimizer a file declares (a Lua file returning its
-- declaration); returns its class. via: where the path came from, for errors.
function M.register(path, via)
  local origin = via and (via .. ": " .. path) or path
  local chunk, err = loadfile(path)
  if not chunk then bad(origin, "cannot load it (%s)", tostring(err):gsub("^[^:]*:%d*:? ?", "")) end
  local ok, spec = pcall(chunk)
  if not ok then bad(origin, "%s", tostring(spec)) end
  return M.define(spec, origin)
end

for i, spec in ipairs(BUILT_IN) do M.define(spec, ("optim/registry.lua BUILT_IN[%d]"):format(i)) end
M.default = M.list[1]

-- LZ_OPTIMIZERS: optimizer files outside the tree, colon-separated; every
-- process of a job reads it (the launcher's ranks inherit it).
for path in (os.getenv("LZ_OPTIMIZERS") or ""):gmatch("[^:]+") do
  M.register(path, "LZ_OPTIMIZERS")
end

-- The class a DeepSpeed optimizer.type names (case-insensitively) and its
-- spelling as declared; nil when none does.
function M.find(type_name)
  local e = type(type_name) == "string" and by_type[type_name:lower()]
  if not e then return nil end
  return e.class, e.spelling
end

-- Every DeepSpeed type luazero has, for messages: `Adam, AdamW or Lion`;
-- quoted, `"Adam", "AdamW" and "Lion"`.
function M.types_text(quoted, conjunction)
  local q = {}
  for i, t in ipairs(spellings) do q[i] = quoted and ('"' .. t .. '"') or t end
  if #q == 1 then return q[1] end
  return table.concat(q, ", ", 1, #q - 1) .. " " .. conjunction .. " " .. q[#q]
end

-- The optimizer a config's block ({type, params}) names, made; a block
-- without a type (a partial table from Lua) is the default optimizer.
function M.new(block)
  block = block or {}
  local t = block.type or M.default.name
  local class, spelling = M.find(t)
  if not class then
    error(("config: optimizer.type must be %s (got %s)"):format(M.types_text(false, "or"),
                                                               tostring(t)), 2)
  end
  -- The formats config.lua read from the params; a block made in Lua
  -- (never through config.lua) has them read here.
  local fmts, master = block.state_formats, block.master_format
  if fmts == nil and class.read_config then
    local extra = class.read_config(block.params or {}, "optimizer.params.", spelling,
                                    function() end) or {}
    fmts, master = extra.state_formats, master or extra.master_format
  end
  local self = class.new(block.params or {}, spelling, fmts)
  -- (nil: the fp32 master; "bf16": bf16_stochastic_round, no fp32 master)
  self.master_format = master
  return self
end

-- The block DeepSpeed's engine uses when a config names no optimizer: the
-- default optimizer over its own defaults table.
function M.default_block()
  local d = M.default
  local extra = d.read_config and d.read_config({}, "optimizer.params.", d.name, function() end)
  local out = { type = d.name, params = d.defaults }
  for k, v in pairs(extra or {}) do out[k] = v end
  return out
end

-- The class of a manifest's optimizer record (where: the checkpoint, for
-- the error), or a one-line error when this luazero does not have it.
function M.of_record(rec, where)
  local class = M.find(rec.type)
  if not class then
    error(("%s was saved by the optimizer %s, which this luazero does not have (it has %s); " ..
           "name that optimizer's file in LZ_OPTIMIZERS"):format(where, tostring(rec.type),
                                                                 M.types_text(false, "and")), 0)
  end
  return class
end

-- A record as one line: `AdamW lr 0.003 betas (0.9, 0.95) eps 1e-08
-- weight_decay 0.1`; from (checkpoint/manifest.lua's optimizer_of) "config"
-- adds where it came from, no record says so.
function M.describe(rec, from)
  if not rec then return "not recorded (a checkpoint saved without a config)" end
  local class = M.find(rec.type)
  local params = schema.describe(type(rec.params) == "table" and rec.params or {},
                                 class and class.params)
  return tostring(rec.type) .. (params ~= "" and (" " .. params) or "") ..
         (from == "config" and " (from its config)" or "")
end

return M
