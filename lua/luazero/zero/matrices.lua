-- zero/matrices.lua — whole-matrix placement, for an optimizer that updates
-- some parameters as whole matrices (Muon's Newton-Schulz: optim/muon.lua).
-- Its states stay flat and partitioned as every optimizer's do (so
-- checkpoints, resume and reshard read them as they read AdamW's), and the
-- elementwise parts of its step run on each rank's slices; only the
-- orthogonalisation needs a matrix whole. Each matrix has one owner rank,
-- chosen to balance the elements each rank orthogonalises; a step is
--   1. prepare: every rank, its slices of every matrix (the momentum and
--      the update U, written into the optimizer's matrix_state);
--   2. the slices of U are gathered (the engine's all-gather), each owner
--      turns its matrices' U into O, and each O is broadcast from its owner;
--   3. step: every rank applies O to its slices.
-- Where the optimizer is replicated (stage 0) every rank holds every
-- matrix and orthogonalises all of them itself, as stage 0 replicates
-- AdamW. Either way a matrix is orthogonalised from the same bits by the
-- same GEMMs, so every stage and world size gets the same parameters.
-- With the experts in their expert-data-parallel group (zero/experts.lua)
-- an expert's matrices are owned by a rank of its group, and their
-- gathers and broadcasts run over that group (comm_of).
--
--   local mx = matrices.new{ L = L, P = P, rank = r, world = W, comm = comm,
--                            ring = states, model = model, optimizer = opt, budget = n,
--                            comm_of = function(seg) -> its group or nil (the world) }
--   mx.matrix_of(entry) -> { A, B, ... } or nil;   mx:update(ms, opt, t, lr, scale)
local lz = require("luazero")

local M = {}
local Matrices = {}
Matrices.__index = Matrices

-- The modules of the model's hidden layers (model.layers.blocks), or nil
-- when the model names none (then every module counts as hidden).
function M.hidden_modules(model)
  local blocks = model.layers and model.layers.blocks
  if not blocks then return nil end
  local set = {}
  local function mark(m)
    set[m] = true
    for _, c in ipairs(m.children) do mark(c.module) end
  end
  for _, b in ipairs(blocks) do mark(b) end
  return set
end

-- Why a plan (zero/plan.lua) cannot hold an optimizer with whole matrices
-- (named `name`), or nil when it can: the orthogonalisation reads each
-- matrix's U whole from states held in memory, which a tier of swap files
-- (NVMe) streams a sub-group at a time. (The estimator leaves such rows
-- out with this reason.)
function M.refusal(P, name)
  if P:swapped("optimizer") then
    return ("%s orthogonalises whole matrices from states held in memory; " ..
            "offload_optimizer.device nvme is not supported with it (use cpu or none)"):format(name)
  end
end

-- The matrices of layout L that optimizer opt updates whole, and their
-- owners: { list (each { A, B, entry, seg, se, numel, index, owner, root }),
-- segs ({ seg, held } for each segment that holds some), load (world rank
-- -> elements it orthogonalises), by_entry }. hidden: M.hidden_modules's
-- set (nil: every module counts as hidden). ranks_of(seg): the world ranks
-- of the group a segment's collectives run over, by group rank, or nil for
-- the world. Plain numbers: the estimator reads the same placement.
function M.placement(L, hidden, opt, world, ranks_of)
  local self = { list = {}, segs = {}, by_entry = {}, load = {} }
  for _, seg in ipairs(L.segments) do
    local held = {}
    for _, se in ipairs(seg.entries) do
      local e = se.entry
      if opt.matrix(e, hidden == nil or hidden[e.module] == true) then
        local m = { e.shape[1], e.shape[2], entry = e, seg = seg, se = se, numel = e.numel,
                    index = #self.list + 1 }
        self.list[#self.list + 1] = m
        self.by_entry[e] = m
        held[#held + 1] = m
      end
    end
    if #held > 0 then self.segs[#self.segs + 1] = { seg = seg, held = held } end
  end
  -- Owners: the largest matrix first, each to the rank with the fewest
  -- elements so far (the lowest rank on a tie): the matrices every rank
  -- holds among all ranks, then an expert group's among its ranks (which
  -- all hold the same experts, so agree), on the loads the first left.
  -- m.owner is a world rank; m.root the owner's rank in the matrix's
  -- collectives' group.
  local function by_size(list)
    local order = {}
    for i, m in ipairs(list) do order[i] = m end
    table.sort(order, function(a, b)
      if a.numel ~= b.numel then return a.numel > b.numel end
      return a.index < b.index
    end)
    return order
  end
  for r = 0, world - 1 do self.load[r] = 0 end
  local function assign(list, ranks)
    for _, m in ipairs(by_size(list)) do
      local best = 1
      for i = 2, #ranks do if self.load[ranks[i]] < self.load[ranks[best]] then best = i end end
      m.owner, m.root = ranks[best], best - 1
      self.load[m.owner] = self.load[m.owner] + m.numel
    end
  end
  local everyones, grouped, world_ranks = {}, {}, {}
  for _, m in ipairs(self.list) do
    table.insert(ranks_of(m.seg) and grouped or everyones, m)
  end
  for r = 0, world - 1 do world_ranks[#world_ranks + 1] = r end
  assign(everyones, world_ranks)
  if #grouped > 0 then assign(grouped, ranks_of(grouped[1].seg)) end
  return self
end

-- The segments a sharded optimizer gathers at once: from segs[i], up to
-- `budget` gathered elements (one segment at least). Returns the last
-- index of the batch and its elements.
local function batch_end(segs, i, budget)
  local j, n = i, segs[i].seg.padded
  while j < #segs and n + segs[j + 1].seg.padded <= budget do
    j = j + 1
    n = n + segs[j].seg.padded
  end
  return j, n
end

-- The most workspace bytes orthogonalising takes at once on `rank`
-- (placement: M.placement's): replicated, each matrix's own scratch in
-- turn (opt:orthogonalize_scratch(A, B), the largest); sharded, each batch
-- of gathered f32 segments together with the scratch of the largest
-- matrix this rank owns in it. What the ledger's workspace peaks at in a
-- step beyond what it held (the estimator's "optimizer scratch").
function M.scratch_bytes(placement, opt, rank, replicated, budget)
  local function scratch(m)
    return opt.orthogonalize_scratch and opt:orthogonalize_scratch(m[1], m[2]) or 0
  end
  local peak = 0
  if replicated then
    for _, m in ipairs(placement.list) do peak = math.max(peak, scratch(m)) end
    return peak
  end
  local segs, i = placement.segs, 1
  while i <= #segs do
    local j, n = batch_end(segs, i, budget or math.huge)
    local own = 0
    for k = i, j do
      for _, m in ipairs(segs[k].held) do
        if m.owner == rank then own = math.max(own, scratch(m)) end
      end
    end
    peak = math.max(peak, n * 4 + own)
    i = j + 1
  end
  return peak
end

-- The whole-matrix placement, or nil when the optimizer has no matrices.
function M.new(parts)
  local opt = parts.optimizer
  if not opt.matrix then return nil end
  local self = setmetatable({}, Matrices)
  for _, k in ipairs({ "L", "P", "rank", "world", "comm", "ring" }) do self[k] = parts[k] end
  self.comm_of = parts.comm_of or function() return nil end
  -- Elements of U gathered at once on a sharded optimizer (the config's
  -- allgather_bucket_size, as the engine's parameter gathers).
  self.budget = parts.budget or math.huge
  local why = parts.ring.swap and M.refusal(parts.P, opt.name)
  if why then error("initialize: " .. why, 0) end
  self.slot = opt.matrix_state
  -- (a matrix runs its collectives over its segment's group: the world, or
  -- this rank's expert-data-parallel group, whose ranks() are by group rank)
  local placed = M.placement(self.L, M.hidden_modules(parts.model), opt, self.world, function(seg)
    local group = self.comm_of(seg)
    return group and group:ranks()
  end)
  self.list, self.segs, self.by_entry, self.load = placed.list, placed.segs, placed.by_entry,
                                                   placed.load
  self.replicated = self.P.optimizer.extent == "full"
  self.matrix_of = function(e) return self.by_entry[e] end
  return self
end

-- The placement as lines for the start-up report.
function Matrices:describe(name)
  local n, total = #self.list, 0
  for _, m in ipairs(self.list) do total = total + m.numel end
  local rest = self.L.numel - total
  local how
  if self.replicated then
    how = "every rank orthogonalises all of them (the optimizer is replicated)"
  else
    local mine = 0
    for _, m in ipairs(self.list) do if m.owner == self.rank then mine = mine + 1 end end
    how = ("each owned whole by one rank (this rank: %d, %d elements)"):format(mine,
                                                                                self.load[self.rank])
  end
  return ("%s: %d whole matrices (%d elements), %s; AdamW over the other %d elements, flat")
         :format(name, n, total, how, rest)
end

-- Turns U into O for every matrix (step 2 above).
function Matrices:orthogonalize(opt)
  local u = self.ring.s[self.slot]
  local dev = u:device_name()
  if self.replicated then
    for _, m in ipairs(self.list) do
      local x = u:view(m.seg.full_offset + m.se.seg_offset, { m[1], m[2] })
      opt:orthogonalize(x, m[1], m[2])
      x:free()
    end
    return
  end
  -- Batches of segments, up to `budget` gathered elements (one segment at
  -- least): each batch gathered whole, then each owner's matrices, then
  -- the broadcasts, so the owners of a batch work at the same time.
  local segs, i = self.segs, 1
  while i <= #segs do
    local j = batch_end(segs, i, self.budget)
    local full = {}
    for k = i, j do
      local seg = segs[k].seg
      full[k] = lz.tensor({ seg.padded }, "f32", "workspace", dev)
      local mine = u:view(seg.shard_offset, { seg.slice })
      local group_or_world = self.comm_of(seg) or self.comm.world()
      group_or_world:all_gather(mine, full[k])
      mine:free()
    end
    for k = i, j do
      for _, m in ipairs(segs[k].held) do
        if m.owner == self.rank then
          local x = full[k]:view(m.se.seg_offset, { m[1], m[2] })
          opt:orthogonalize(x, m[1], m[2])
          x:free()
        end
      end
    end
    for k = i, j do
      local seg = segs[k].seg
      local group_or_world = self.comm_of(seg) or self.comm.world()
      for _, m in ipairs(segs[k].held) do
        local x = full[k]:view(m.se.seg_offset, { m.numel })
        group_or_world:broadcast(x, m.root)
        x:free()
      end
      local mine, got = u:view(seg.shard_offset, { seg.slice }),
                        full[k]:view(seg.mine.full_offset - seg.full_offset, { seg.slice })
      mine:copy(got)
      mine:free(); got:free()
      full[k]:free()
    end
    i = j + 1
  end
end

-- The optimizer's step over model states ms (zero/states.lua) with its
-- whole matrices: the matrices' pieces prepared, the matrices, then every
-- piece's step and the working copies' pushes. Only the second pass
-- writes (the states are in memory: Matrices.refusal), so a working shard
-- on NVMe is written once a step. (The other pieces' steps read nothing
-- the matrices change: their place in the step changes no bit.)
function Matrices:update(ms, opt, t, lr, scale)
  local calls, push, overlap = ms.calls, ms.P.push_params, ms.overlap
  ms.ring:each_group(false, function(k)
    for _, c in ipairs(calls[k]) do
      if c.matrix then
        if c.half_g then c.g:copy(c.half_g) end
        opt:prepare(c, t, scale)
      end
    end
  end, nil, true)
  self:orthogonalize(opt)
  ms.ring:each_group(true, function(k)
    for _, c in ipairs(calls[k]) do
      if not c.matrix and c.half_g then c.g:copy(c.half_g) end
      ms:step_call(opt, c, t, lr, scale)
    end
    if push then
      for _, c in ipairs(calls[k]) do
        if overlap then lz.copy_async(c.wdev, c.w, "copy") else c.wdev:copy(c.w) end
      end
    end
  end, nil, true)
end

return M
