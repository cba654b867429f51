-- data/packed.lua — batches from instruction data: whole examples laid into
-- rows of T tokens, never split across rows.
--
--   pack: several examples per row, in a shuffled order; an example that
--         does not fit the rest of a row starts the next one.
--   pad:  one example per row.
-- Either way the rest of a row is padding: token pad_id, target -1, its own
-- segment. Each batch returns tokens, targets and extra = { pos, seg, mask }
-- (i32 [B, T]): pos counts from 0 at each example's first token, seg numbers
-- the examples of a row from 0 (attention never crosses a change of seg),
-- mask is 1 on the examples' tokens and 0 on the padding (transformers'
-- attention_mask: the MoE routers' load-balancing loss leaves padding out).
-- targets[t] is the next token when it is trained (weight 1) and in the
-- same example, else -1.
--
-- The first 1 - val_fraction of the examples train: each epoch shuffles
-- them (seeded) and packs the order into rows; batch k takes the next
-- world * B rows of the run, rank r rows r*B+1 .. (r+1)*B, so the global
-- batch does not depend on the world size. The last val_fraction of the
-- examples, packed in file order, are the validation rows (the same on
-- every rank).
local ffi = require("ffi")
local lz = require("luazero")
local rng = require("luazero.rng")
local stream = require("luazero.data.stream")
local fail = require("luazero.data.files").fail

local M = {}

local Loader = {}
Loader.__index = Loader

-- Rows from documents order[1..#order]: a list of first indices into
-- order, closed by #order + 1.
local function lay_rows(c, order, T, packing)
  local rows, used = {}, T
  for i, d in ipairs(order) do
    local len = c.st[d + 1] - c.st[d]
    if packing == "pad" or used + len > T then
      rows[#rows + 1], used = i, 0
    end
    used = used + len
  end
  rows[#rows + 1] = #order + 1
  return rows
end

local function check(c, opts)
  local path, T = c.path, opts.T
  require("luazero.data.files").check_vocab(path, c.max_id, opts.vocab,
                                            ", or prepare the data with the model's tokenizer",
                                            opts.vocab_fixed, c.made_with)
  for d = 0, c.docs - 1 do
    local len = c.st[d + 1] - c.st[d]
    if len > T then
      fail(path, ("the example from line %d is %d tokens, longer than the sequence length " ..
                  "%d; raise --seq-len to %d or drop that line"):format(c.ln[d], len, T, len))
    end
  end
end

-- corpus: an instruction corpus (data/instruct.lua). opts: B, T, seed,
-- vocab, val_fraction (0.1), rank, world, packing ("pack" or "pad"), pad_id
-- (0).
function M.loader(c, opts)
  local B, T = opts.B, opts.T
  local packing = opts.packing or "pack"
  if packing ~= "pack" and packing ~= "pad" then
    error(("data: --packing must be pack or pad (got %s)"):format(tostring(packing)), 0)
  end
  check(c, opts)
  local n_val = math.floor(c.docs * (opts.val_fraction or 0.1))
  local n_train = c.docs - n_val
  local self = setmetatable({
    data = c, B = B, T = T, packing = packing, pad_id = opts.pad_id or 0,
    docs_train = n_train, docs_val = n_val,
    n_train = c.st[n_train], n_val = c.count - c.st[n_train],
    rng = rng.new(opts.seed or 0, 2), epoch = 0,
    rank = opts.rank or 0, world = opts.world or 1,
    inputs = lz.tensor({ B, T }, "i32", "workspace"),
    targets = lz.tensor({ B, T }, "i32", "workspace"),
    extra = { pos = lz.tensor({ B, T }, "i32", "workspace"),
              seg = lz.tensor({ B, T }, "i32", "workspace"),
              mask = lz.tensor({ B, T }, "i32", "workspace") },
  }, Loader)
  local val = {}
  for d = n_train, c.docs - 1 do val[#val + 1] = d end
  self.val_order, self.val_rows = val, lay_rows(c, val, T, packing)
  -- (a validation batch is world * B rows, rank r's the r-th B)
  self.val_batches = math.floor((#self.val_rows - 1) / (self.world * B))
  self:new_epoch()
  local trained = 0
  for i = 0, self.n_train - 1 do trained = trained + c.w[i] end
  self.layout = ("instruction data: %d examples (%d for training, %d held out), %s: %.2f " ..
                 "examples per row of %d, %.0f%% of the rows' tokens padding, %.0f%% of the " ..
                 "training tokens trained")
                :format(c.docs, n_train, n_val, packing == "pack" and "packed" or "padded",
                        n_train / (#self.rows - 1), T,
                        100 * (1 - self.n_train / ((#self.rows - 1) * T)),
                        100 * trained / math.max(self.n_train, 1))
  return self
end

-- Shuffles the training examples (from the rng's state now, kept as the
-- epoch's start for a checkpoint) and lays them into rows.
function Loader:new_epoch()
  self.epoch = self.epoch + 1
  self.epoch_state = self.rng.state[0]
  local order = {}
  for d = 0, self.docs_train - 1 do order[d + 1] = d end
  for i = #order, 2, -1 do
    local j = self.rng:int(i) + 1
    order[i], order[j] = order[j], order[i]
  end
  self.order, self.rows, self.row = order, lay_rows(self.data, order, self.T, self.packing), 1
end

-- Fills row b of the batch with documents order[first .. last - 1].
local function fill_row(self, b, order, first, last)
  local c, T = self.data, self.T
  local ids, w, st = c.ids, c.w, c.st
  local x = ffi.cast("int32_t *", self.inputs.data) + b * T
  local y = ffi.cast("int32_t *", self.targets.data) + b * T
  local pos = ffi.cast("int32_t *", self.extra.pos.data) + b * T
  local seg = ffi.cast("int32_t *", self.extra.seg.data) + b * T
  local mask = ffi.cast("int32_t *", self.extra.mask.data) + b * T
  local j, s = 0, 0
  for i = first, last - 1 do
    local a = st[order[i]]
    local len = st[order[i] + 1] - a
    for k = 0, len - 1 do
      x[j + k], pos[j + k], seg[j + k], mask[j + k] = ids[a + k], k, s, 1
      y[j + k] = (k + 1 < len and w[a + k + 1] ~= 0) and ids[a + k + 1] or -1
    end
    j, s = j + len, s + 1
  end
  for k = j, T - 1 do x[k], y[k], pos[k], seg[k], mask[k] = self.pad_id, -1, k - j, s, 0 end
end

-- The next training batch: tokens, targets, extra (reused each call).
function Loader:next_batch()
  local first = self.rank * self.B
  for i = 0, self.world * self.B - 1 do
    if self.row >= #self.rows then self:new_epoch() end
    local r = self.row
    if i >= first and i < first + self.B then
      fill_row(self, i - first, self.order, self.rows[r], self.rows[r + 1])
    end
    self.row = r + 1
  end
  return self.inputs, self.targets, self.extra
end

-- The trained targets of the next n training batches, every rank's rows
-- together, the loader left where it is: what a step's loss is the mean
-- over (zero/batches.lua), as the rows' own counts would give it at any
-- split into ranks and micro-batches.
function Loader:step_targets(n)
  local c = self.data
  if not self.doc_targets then -- a document's trained targets: w of tokens 2 .. len
    local t = ffi.new("int32_t[?]", c.docs)
    for d = 0, c.docs - 1 do
      for i = c.st[d] + 1, c.st[d + 1] - 1 do t[d] = t[d] + (c.w[i] ~= 0 and 1 or 0) end
    end
    self.doc_targets = t
  end
  local t, state = self.doc_targets, self.rng.state[0]
  local kept = { self.epoch, self.epoch_state, self.order, self.rows, self.row }
  local total = 0
  for _ = 1, n * self.world * self.B do
    if self.row >= #self.rows then self:new_epoch() end
    for i = self.rows[self.row], self.rows[self.row + 1] - 1 do total = total + t[self.order[i]] end
    self.row = self.row + 1
  end
  self.rng.state[0] = state
  self.epoch, self.epoch_state, self.order, self.rows, self.row = unpack(kept, 1, 5)
  return total
end

-- Validation batch i (1-based, i <= val_batches): this rank's rows of it.
function Loader:val_batch(i)
  require("luazero.data.files").check_val_batch(i, self.val_batches)
  for b = 0, self.B - 1 do
    local r = ((i - 1) * self.world + self.rank) * self.B + b + 1
    fill_row(self, b, self.val_order, self.val_rows[r], self.val_rows[r + 1])
  end
  return self.inputs, self.targets, self.extra
end

-- Where the loader is, for a checkpoint's manifest (extra.data): the rng at
-- the current epoch's start, the epoch and the next row in it; and back.
function Loader:position()
  return { rng_state = stream.hex_u64(self.epoch_state), epoch = self.epoch, row = self.row,
           packing = self.packing, examples = self.docs_train, seq = self.T }
end

function Loader:set_position(pos)
  require("luazero.data.files").check_position(pos)
  local saved = ("%s %s, %s training examples, sequences of %s"):format(
    pos.packing and "--packing" or "a token stream", tostring(pos.packing or ""),
    tostring(pos.examples or "?"), tostring(pos.seq or "?"))
  if pos.packing ~= self.packing or pos.examples ~= self.docs_train or pos.seq ~= self.T or
     type(pos.row) ~= "number" or type(pos.rng_state) ~= "string" then
    error(("data: %s: the checkpoint's data position (%s) is not this run's (--packing %s, " ..
           "%d training examples, sequences of %d); resume with the same --data, --packing " ..
           "and --seq-len"):format(self.data.path, saved, self.packing, self.docs_train,
           self.T), 0)
  end
  self.rng.state[0] = stream.u64_hex(pos.rng_state)
  self.epoch = (pos.epoch or 1) - 1
  self:new_epoch()
  self.row = pos.row
end

function Loader:free()
  self.inputs:free()
  self.targets:free()
  self.extra.pos:free()
  self.extra.seg:free()
  self.extra.mask:free()
end

return M
