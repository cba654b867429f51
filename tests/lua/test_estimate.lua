-- test_estimate.lua — model-state bytes per rank (lua/luazero/estimate.lua)
-- against formulas worked out by hand (luazero's fp32 gradients, and the ZeRO
-- paper's 2-byte ones), stage "auto"'s pick, parameter counts and padded
-- layouts of the named models, and tools/estimate end to end.
local estimate = require("luazero.estimate")
local gpt2 = require("models.gpt2")
local lz = require("luazero")
local ffi = require("ffi")
local support = dofile(lz.root .. "/tests/lua/support.lua")

local T = {}

------------------------------------------------------ against the engine

-- Every stage x offload_optimizer x offload_param the engine allows, built
-- on a tiny GPT-2 (and LoRA on a tiny Llama), one optimizer step taken: the
-- estimator's host bytes against the ledger's growth (params, grads,
-- optimizer, offload: a cpu rank's one memory), its NVMe bytes against the
-- swap files on disk (the engine unlinks them at once: found through
-- /proc/PID/fd), its NVMe reads and writes per step against the swap
-- files' counters, and engine:estimate() against both. Runs in this process
-- (world 1) and as a script under the launcher (world 2):
--   luazero -n 2 tests/lua/test_estimate.lua check CORPUS SWAP_DIR
pcall(ffi.cdef, "int getpid(void);")
local TOLERANCE = 0.05

-- Bytes of this process's swap files under dir.
local function swap_file_bytes(dir)
  local p = io.popen(("for f in /proc/%d/fd/*; do case \"$(readlink $f)\" in '%s'/luazero-swap-*) " ..
                      "stat -L -c %%s $f;; esac; done 2>/dev/null"):format(ffi.C.getpid(), dir))
  local n = 0
  for l in p:lines() do n = n + tonumber(l) end
  p:close()
  return n
end

-- Bytes an engine's swap files have read and written (the metrics log's
-- figure, the frozen parameters' file included).
local function nvme_io(engine) return engine:nvme_bytes() end

local function close_to(got, want)
  if want == 0 then return got == 0 end
  return math.abs(got - want) <= TOLERANCE * want
end

-- The cases: placements x stages x dtypes, the LoRA ones, and accumulation.
-- Beside the figures each case checks what the engine is described to do
-- (docs/offload.md, docs/zero.md): the fp32 gradient shard on NVMe with the
-- optimizer there at stage >= 2, frozen parameters sharded at stage 3 where
-- offload_param puts the working shard.
local function cases()
  local list = {}
  for _, dtype in ipairs({ "bf16", "fp32" }) do
    for _, pl in ipairs(estimate.placements) do
      for stage = 0, 3 do
        -- overlap_comm changes what stage 3 reads ahead and holds at once
        for _, overlap in ipairs(stage == 3 and { false, true } or { false }) do
          list[#list + 1] = { stage = stage, pl = pl, dtype = dtype, overlap = overlap }
        end
      end
    end
  end
  for _, name in ipairs({ "none", "cpu+param", "nvme+param" }) do
    local pl = estimate.placement_of[name]
    for stage = 0, 3 do
      list[#list + 1] = { stage = stage, pl = pl, dtype = "bf16", lora = true, overlap = stage == 3 }
    end
  end
  -- Accumulation: the gradient file read back, the parameter file read per micro-step.
  for _, c in ipairs({ { 2, "nvme" }, { 3, "nvme" }, { 3, "nvme+param" } }) do
    list[#list + 1] = { stage = c[1], pl = estimate.placement_of[c[2]], dtype = "bf16",
                        overlap = c[1] == 3, accum = 3 }
  end
  -- Each optimizer choice on each kind of tier (in place, host memory, NVMe
  -- states, the NVMe parameter shard, the two apart): bf16 moments, the bf16
  -- master (a copy beside the states where the parameters are out of the
  -- optimizer's reach), 8-bit states (u8 and their scales, small tensors'
  -- f32 states beside), Muon (refused with its states on NVMe: the estimate
  -- gives no row, with the engine's reason).
  local choices = {
    { label = "adamw bf16 moments", type = "AdamW",
      params = { lr = 1e-3, momentum_dtype = "bfloat16", variance_dtype = "bfloat16" } },
    { label = "adamw bf16 master", type = "AdamW", params = { lr = 1e-3, bf16_stochastic_round = true } },
    { label = "adamw8bit", type = "AdamW8bit", params = { lr = 1e-3, min_8bit_size = 1000 } },
    { label = "adamw8bit bf16 master", type = "AdamW8bit",
      params = { lr = 1e-3, min_8bit_size = 1000, bf16_stochastic_round = true } },
    { label = "muon", type = "Muon", params = { lr = 0.01 } },
    { label = "muon bf16 master", type = "Muon", params = { lr = 0.01, bf16_stochastic_round = true } },
  }
  for _, o in ipairs(choices) do
    for _, c in ipairs({ { 0, "none" }, { 2, "cpu" }, { 2, "nvme" }, { 3, "nvme+param" },
                         { 3, "cpu+nvme-param" } }) do
      list[#list + 1] = { stage = c[1], pl = estimate.placement_of[c[2]], dtype = "bf16",
                          overlap = c[1] == 3, optimizer = o }
    end
  end
  return list
end

-- Runs every case on `device` ("cpu": one memory; "sim": device memory
-- apart, the host's the pinned staging, as on a GPU); say(line) reports
-- "ok ..." or "BAD ...", pending(line) what the engine does not have yet.
-- Returns the count of bad cases.
local function check_engines(comm, corpus, swap_dir, say, pending, device)
  device = device or "cpu"
  local zero = require("luazero.zero")
  local data = require("luazero.data")
  local llama = require("models.llama")
  local Placement = require("luazero.zero.plan")
  local rank, world = comm.rank(), comm.size()
  local bad, pend = 0, {}
  for _, c in ipairs(cases()) do
    local pl, stage = c.pl, c.stage
    local allowed = (pl.opt == "none" or Placement.stage_allows("offload_optimizer", stage)) and
                    (pl.param == "none" or Placement.stage_allows("offload_param", stage))
    -- On a device the optimizer there cannot update a working shard kept
    -- in host memory or on NVMe: the plan refuses it, naming the fix.
    local on_device_alone = device ~= "cpu" and pl.opt == "none" and pl.param ~= "none"
    if allowed and on_device_alone then
      local ok, err = pcall(Placement.new, { stage = stage, offload_param = pl.param,
                                             device = device })
      if ok or not tostring(err):find("add offload_optimizer", 1, true) then
        bad = bad + 1
        say(("BAD  stage %d offload_param %s on %s without offload_optimizer: %s")
            :format(stage, pl.param, device, ok and "accepted" or tostring(err)))
      end
    end
    if (device == "cpu" or c.dtype == "bf16") and allowed and not on_device_alone then
      local name = ("world %d %s stage %d %s %s%s%s%s%s"):format(world, device, stage, c.dtype,
                   pl.name, c.overlap and " overlap" or "", c.lora and " lora" or "",
                   c.accum and (" accumulation " .. c.accum) or "",
                   c.optimizer and (" " .. c.optimizer.label) or "")
      local function dev(d)
        return d ~= "none" and { device = d, nvme_path = swap_dir, buffer_count = 3 } or nil
      end
      local cfg = { train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = c.accum or 1,
                    bf16 = { enabled = c.dtype == "bf16" },
                    zero_optimization = { stage = stage, stage3_param_persistence_threshold = 600,
                                          sub_group_size = 4096, overlap_comm = c.overlap,
                                          offload_optimizer = dev(pl.opt),
                                          offload_param = dev(pl.param) },
                    optimizer = c.optimizer and { type = c.optimizer.type, params = c.optimizer.params }
                                or { type = "AdamW", params = { lr = 1e-3 } } }
      local model, vocab
      if c.lora then
        local mc = llama.config("llama-tiny", { context = 16 })
        model, vocab = llama.new(mc), mc.vocab
        require("models.lora").apply(model, { r = 4, targets = { "q_proj", "v_proj" } })
      else
        local mc = gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
        model, vocab = gpt2.new(mc), mc.vocab
      end
      local est_settings = estimate.settings_of(cfg, device == "cpu" and "cpu" or "cuda")
      local counts = estimate.counts(model, world, 600,
                                     require("luazero.optim.formats").block_of(est_settings.formats))
      local _, refused = estimate.rank(counts, est_settings)
      if refused then
        -- The estimate offers no row: the engine must refuse with its reason.
        local ok, err = pcall(zero.initialize, { model = model, config = cfg, seed = 1,
                                                 batch = { 2, 16 }, comm = comm, device = device })
        if ok then err:free() end
        if ok or not tostring(err):find(refused, 1, true) then
          bad = bad + 1
          say(("BAD  %s: the estimate refuses it (%s); the engine %s"):format(name, refused,
              ok and "trains it" or ("says " .. tostring(err))))
        else
          say(("ok   %s: refused by both (%s)"):format(name, refused))
        end
        goto next_case
      end
      local states = support.ledger_mark()
      local engine = zero.initialize({ model = model, config = cfg, seed = 1, batch = { 2, 16 },
                                       comm = comm, device = device })
      local loader = data.loader(corpus, { B = 2, T = 16, seed = 1, vocab = vocab, rank = rank,
                                           world = world })
      engine:train_batch(loader)
      local r0, w0 = nvme_io(engine)
      engine:train_batch(loader)
      local r1, w1 = nvme_io(engine)
      -- A cpu rank's one memory is all host; on sim the device's ledger
      -- holds the device tier and the host's offload category the rest.
      local host, dev_bytes = states(device)
      local files = swap_file_bytes(swap_dir)
      local r = estimate.rank(counts, est_settings)
      local live = engine:estimate()
      local why
      if not close_to(host, estimate.kept(r, "host")) then
        why = ("host bytes: the ledger %d, the estimate %d"):format(host, estimate.kept(r, "host"))
      elseif not close_to(dev_bytes, estimate.kept(r, "device")) then
        why = ("device bytes: the ledger %d, the estimate %d"):format(dev_bytes,
                                                                     estimate.kept(r, "device"))
      elseif not close_to(files, r.nvme.total) then
        why = ("NVMe bytes: swap files %d, the estimate %d"):format(files, r.nvme.total)
      elseif r0 and not (close_to(r1 - r0, r.traffic.read) and close_to(w1 - w0, r.traffic.written)) then
        why = ("NVMe bytes per step: read %d written %d, the estimate %d and %d")
              :format(r1 - r0, w1 - w0, r.traffic.read, r.traffic.written)
      elseif not r0 and r.traffic.read + r.traffic.written > 0 then
        why = "the estimate moves NVMe bytes; the engine has no swap files"
      elseif live.host.total ~= r.host.total or live.nvme.total ~= r.nvme.total or
             live.live.nvme ~= files then
        why = ("engine:estimate() host %d nvme %d (swap files %d), the estimate %d and %d")
              :format(live.host.total, live.nvme.total, live.live.nvme, r.host.total, r.nvme.total)
      end
      -- What the engine is described to do (docs/offload.md), where it may not yet.
      local P = engine:plan()
      if pl.opt == "nvme" and stage >= 2 then
        if P.opt_grads.tier ~= "nvme" then
          pend["the fp32 gradient shard on NVMe (plan opt_grads tier nvme) with " ..
               "offload_optimizer nvme at stage >= 2"] = true
        elseif not why and not (r.nvme.gradients and (r.host.grads or 0) == 0) then
          why = "the gradient shard is not on NVMe in the estimate"
        end
      end
      if c.lora and stage == 3 then
        if not (P.frozen and P.frozen.extent == "shard") then
          pend["frozen parameters sharded at stage 3 (plan frozen extent shard)"] = true
        elseif not why and pl.param == "nvme" and not r.nvme.frozen then
          why = "the frozen shard is not on NVMe in the estimate"
        end
      end
      if why then
        bad = bad + 1
        say(("BAD  %s: %s"):format(name, why))
      else
        say(("ok   %s: host %d, nvme %d, per step read %d written %d"):format(name, host, files,
            r.traffic.read, r.traffic.written))
      end
      engine:free()
      loader:free()
    end
    ::next_case::
  end
  for what in pairs(pend) do pending(what) end
  return bad
end

-- As a script under the launcher (world 2): "check CORPUS SWAP_DIR".
if arg and arg[1] == "check" and (arg[0] or ""):find("test_estimate%.lua$") then
  local comm = require("luazero.comm").init()
  local corpus = require("luazero.data").load(arg[2])
  local rank = comm.rank()
  local function say(line) if rank == 0 then print(line) end end
  local bad = check_engines(comm, corpus, arg[3], say, function(what) say("pending: " .. what) end)
  corpus.tokens:free()
  say(("done: %d bad"):format(bad))
  return T
end

local write_file, scratch = support.scratch()
local corpus_path = write_file("corpus.txt", ("Now is the winter of our discontent\nMade " ..
                                              "glorious summer by this sun of York;\n"):rep(40))
local swap_dir = scratch .. "/nvme"
os.execute("mkdir -p " .. support.quote(swap_dir))

local function report(n, out)
  local oks = select(2, out:gsub("ok   world", ""))
  for what in out:gmatch("pending: ([^\n]+)") do
    print("    PENDING (skipped, the engine does not have it yet): " .. what)
  end
  assert(out:find("done: 0 bad", 1, true) and oks > 0, out)
  print(("    world %d: %d engines: host, NVMe and per-step NVMe bytes within %d%% of the " ..
         "estimate"):format(n, oks, TOLERANCE * 100))
end

function T.host_and_nvme_bytes_match_the_engine_at_world_1()
  local comm = require("luazero.comm").init("local")
  -- Steps of a tiny model: one thread is faster than two waiting on each other.
  local threads = lz.threads()
  lz.threads(1)
  local corpus = require("luazero.data").load(corpus_path)
  local lines = {}
  local ok, bad = pcall(check_engines, comm, corpus, swap_dir,
                        function(l) lines[#lines + 1] = l end,
                        function(what) lines[#lines + 1] = "pending: " .. what end)
  corpus.tokens:free()
  lz.threads(threads)
  if not ok then error(bad, 0) end
  lines[#lines + 1] = ("done: %d bad"):format(bad)
  report(1, table.concat(lines, "\n"))
end

-- On sim (device memory apart from the host's, as on a GPU): the pinned
-- staging, the reduced gradients' host copies, the pushed working shard.
function T.device_host_and_nvme_bytes_match_the_engine_on_sim()
  local comm = require("luazero.comm").init("local")
  local threads = lz.threads()
  lz.threads(1)
  local corpus = require("luazero.data").load(corpus_path)
  local lines = {}
  local ok, bad = pcall(check_engines, comm, corpus, swap_dir,
                        function(l) lines[#lines + 1] = l end,
                        function(what) lines[#lines + 1] = "pending: " .. what end, "sim")
  corpus.tokens:free()
  lz.threads(threads)
  if not ok then error(bad, 0) end
  lines[#lines + 1] = ("done: %d bad"):format(bad)
  report(1, table.concat(lines, "\n"))
end

function T.host_and_nvme_bytes_match_the_engine_at_world_2()
  local out = support.sh(("cd %s && %s -n 2 tests/lua/test_estimate.lua check %s %s")
                         :format(support.quote(lz.root), support.quote(lz.executable()),
                                 support.quote(corpus_path), support.quote(swap_dir)))
  report(2, out)
end

local function named(name) return gpt2.new(gpt2.config(name)) end

local function bytes(params, world, stage, dtype, offload, persistent, grads)
  return estimate.model_states(params, world, stage, { dtype = dtype, offload = offload,
                               persistent = persistent, grads = grads })
end

-- The ZeRO paper's accounting: gradients in the working dtype.
local function paper(params, world, stage, dtype, offload, persistent)
  return bytes(params, world, stage, dtype, offload, persistent, "working")
end

local function eq(got, want, what)
  assert(got == want, ("%s: got %.17g, want %.17g"):format(what, got, want))
end

function T.luazero_mixed_precision_has_fp32_gradients()
  local P = 1e9
  -- stage 0: 2Ψ + 4Ψ + 12Ψ = 18Ψ; 1: 6Ψ + 12Ψ/N; 2: 2Ψ + 16Ψ/N; 3: 18Ψ/N.
  local want = { [1] = { 18e9, 18e9, 18e9, 18e9 }, [4] = { 18e9, 9e9, 6e9, 4.5e9 } }
  for world, w in pairs(want) do
    for stage = 0, 3 do
      eq(bytes(P, world, stage, "bf16").device, w[stage + 1],
         ("bf16 world %d stage %d"):format(world, stage))
    end
  end
  local r = bytes(P, 4, 2, "fp16")
  eq(r.device_parts.params, 2e9, "2Ψ f16 params")
  eq(r.device_parts.grads, 1e9, "4Ψ/N fp32 gradient shard")
  eq(r.device_parts.optimizer, 3e9, "12Ψ/N fp32 master + m + v")
  -- Offload: device 6Ψ at stage 1 (full fp32 gradients), 2Ψ at stage 2.
  eq(bytes(P, 4, 1, "bf16", "cpu").device, 6e9, "stage 1 offload")
  eq(bytes(P, 4, 2, "bf16", "cpu").device, 2e9, "stage 2 offload")
end

function T.paper_mixed_precision_per_stage_and_world_size()
  local P = 1e9 -- Ψ; divides by 1, 2, 4 and 8
  -- stage 0: 16Ψ; 1: 4Ψ + 12Ψ/N; 2: 2Ψ + 14Ψ/N; 3: 16Ψ/N.
  local want = {
    [1] = { 16e9, 16e9, 16e9, 16e9 },
    [2] = { 16e9, 10e9, 9e9, 8e9 },
    [4] = { 16e9, 7e9, 5.5e9, 4e9 },
    [8] = { 16e9, 5.5e9, 3.75e9, 2e9 },
  }
  for _, dtype in ipairs({ "bf16", "fp16" }) do
    for world, w in pairs(want) do
      for stage = 0, 3 do
        local r = paper(P, world, stage, dtype)
        eq(r.device, w[stage + 1], ("%s world %d stage %d"):format(dtype, world, stage))
        eq(r.cpu, 0, "no offload, no cpu bytes")
      end
    end
  end
  -- The split by ledger category at world size 4, stage 2.
  local r = paper(P, 4, 2, "bf16")
  eq(r.device_parts.params, 2e9, "2Ψ bf16 params")
  eq(r.device_parts.grads, 0.5e9, "2Ψ/N gradient shard")
  eq(r.device_parts.optimizer, 3e9, "12Ψ/N fp32 master + m + v")
end

function T.fp32_has_no_master_copy()
  local P = 1e9
  -- stage 0: 4Ψ + 4Ψ + 8Ψ; 1: 8Ψ + 8Ψ/N; 2: 4Ψ + 12Ψ/N; 3: 16Ψ/N.
  local want = { 16e9, 10e9, 7e9, 4e9 }
  for stage = 0, 3 do eq(bytes(P, 4, stage, "fp32").device, want[stage + 1], "fp32 stage " .. stage) end
  eq(bytes(P, 4, 1, "fp32").device_parts.optimizer, 2e9, "moments only: 8Ψ/N")
end

function T.offload_moves_the_optimizer_to_the_cpu()
  local P = 1e9
  -- device | cpu: stage 1: 4Ψ | 16Ψ/N; 2: 2Ψ | 16Ψ/N; 3: 2Ψ/N | 16Ψ/N;
  -- 3 with offload_param: 0 | 18Ψ/N.
  local cases = { { 1, "cpu", 4e9, 4e9 }, { 2, "cpu", 2e9, 4e9 }, { 3, "cpu", 0.5e9, 4e9 },
                  { 3, "cpu+param", 0, 4.5e9 } }
  for _, c in ipairs(cases) do
    local r = paper(P, 4, c[1], "bf16", c[2])
    eq(r.device, c[3], ("stage %d %s device"):format(c[1], c[2]))
    eq(r.cpu, c[4], ("stage %d %s cpu"):format(c[1], c[2]))
  end
  eq(bytes(P, 4, 2, "bf16", "cpu").cpu_parts.optimizer, 3e9, "fp32 master + m + v: 12Ψ/N")
  assert(bytes(P, 4, 0, "bf16", "cpu") == nil, "DeepSpeed has no offload at stage 0")
  assert(bytes(P, 4, 2, "bf16", "cpu+param") == nil, "offload_param is stage 3 only")
  eq(#estimate.table_rows(P, 4, "bf16"), 8, "4 + 3 + 1 rows")
end

function T.shards_round_up_and_persistent_parameters_stay_whole()
  -- Ψ = 10 over 4 ranks: shards of 3 elements.
  eq(paper(10, 4, 3, "bf16").device, 16 * 3, "16 * ceil(10/4)")
  eq(paper(10, 4, 1, "bf16").device, 4 * 10 + 12 * 3, "4Ψ + 12 * ceil(Ψ/N)")
  eq(bytes(10, 4, 3, "bf16").device, 18 * 3, "18 * ceil(10/4)")
  eq(paper(1e9, 4, 3, "bf16", "none", 1000).device, 4e9 + 2 * 1000, "16Ψ/N + 2P")
  eq(bytes(1e9, 4, 3, "bf16", "none", 1000).device, 4.5e9 + 2 * 1000, "18Ψ/N + 2P")
  eq(bytes(1e9, 4, 3, "bf16", "cpu+param", 1000).device, 2 * 1000, "2P on the device")
  eq(bytes(1e9, 4, 2, "bf16", "none", 1000).device, 6e9, "P matters at stage 3 only")
end

function T.formulas_read_as_the_paper()
  local f = function(stage, dtype, offload) return estimate.formula(stage, dtype, offload, "working") end
  assert(f(0, "bf16") == "16Ψ" and f(1, "bf16") == "4Ψ + 12Ψ/N")
  assert(f(2, "bf16") == "2Ψ + 14Ψ/N" and f(3, "bf16") == "16Ψ/N + 2P")
  assert(f(1, "fp32") == "8Ψ + 8Ψ/N" and f(2, "bf16", "cpu") == "2Ψ | 16Ψ/N")
  assert(f(3, "bf16", "cpu+param") == "2P | 18Ψ/N")
  -- luazero's (the engine's doc, docs/zero.md "Layout")
  assert(estimate.formula(0, "bf16") == "18Ψ" and estimate.formula(1, "bf16") == "6Ψ + 12Ψ/N")
  assert(estimate.formula(2, "bf16") == "2Ψ + 16Ψ/N" and estimate.formula(3, "bf16") == "18Ψ/N + 2P")
  assert(estimate.formula(2, "fp32") == "4Ψ + 12Ψ/N")
end

function T.bad_arguments_are_errors()
  local ok, err = pcall(estimate.model_states, 1e9, 0, 1)
  assert(not ok and err == "estimate: the world size must be a whole number >= 1 (got 0)", err)
  ok, err = pcall(estimate.model_states, 1e9, 2, 4)
  assert(not ok and err == "estimate: stage must be 0..3 (got 4)", err)
  ok, err = pcall(estimate.model_states, 1e9, 2, 1, { dtype = "int8" })
  assert(not ok and err == "estimate: dtype must be fp32, bf16 or fp16 (got int8)", err)
end

------------------------------------------------------------------ stage "auto"

function T.pick_stage_picks_the_lowest_stage_that_fits()
  local P = 1e6 -- world 2, bf16: stage 0 18e6, 1 12e6, 2 10e6, 3 9e6 bytes
  local stage, why, fits = estimate.pick_stage(P, 2, 2 ^ 30, "bf16")
  assert(stage == 0 and fits, why)
  assert(why == "stage 0 needs 17.2 MiB per rank; budget 1.0 GiB: picked stage 0", why)
  stage, why, fits = estimate.pick_stage(P, 2, 18e6 - 1, "bf16")
  assert(stage == 1 and fits, why)
  assert(why == "stage 0 needs 17.2 MiB per rank; budget 17.2 MiB; stage 1 needs 11.4 MiB: " ..
         "picked stage 1", why)
  stage = estimate.pick_stage(P, 2, 10e6, "bf16")
  assert(stage == 2, "a budget equal to the need fits")
  stage, why = estimate.pick_stage(P, 2, 9.5e6, "bf16")
  assert(stage == 3, why)
  assert(why:find("stage 0 needs 17.2 MiB, stage 1 needs 11.4 MiB, stage 2 needs 9.5 MiB per " ..
                  "rank", 1, true), why)
  -- The paper's accounting would fit stage 2 (9e6) in the same budget.
  assert(estimate.pick_stage(P, 2, 9.5e6, "bf16", { grads = "working" }) == 2)
  stage, why, fits = estimate.pick_stage(P, 2, 8e6, "bf16")
  assert(stage == 3 and fits == false and why:find("no stage fits", 1, true), why)
  -- A small model with the machine's memory picks stage 0.
  local m = estimate.model_params(named("gpt2-nano"))
  stage = estimate.pick_stage(m.params, 2, 2 ^ 30, "bf16", { persistent = m.persistent })
  assert(stage == 0)
end

------------------------------------------------------------------ models

function T.model_parameter_counts_match_the_parameter_table()
  -- GPT-2 124M by hand: wte Vp*C + wpe ctx*C + L (12C^2 + 13C) + ln_f 2C.
  local C, L, Vp, ctx = 768, 12, 50304, 1024
  local want = Vp * C + ctx * C + L * (12 * C * C + 13 * C) + 2 * C
  local m = estimate.model_params(named("gpt2"))
  eq(m.params, want, "gpt2 allocated parameters")
  eq(m.params, 124475904, "gpt2")
  eq(m.real, 124439808, "gpt2 without the 47 padding rows")
  -- Tensors of <= 1e5 elements: every bias and LayerNorm: L * 13C + 2C.
  -- Modules of <= 1e5 elements stay whole at stage 3: the 2L + 1 LayerNorms.
  eq(m.persistent, (2 * L + 1) * 2 * C, "gpt2 persistent")
  eq(m.largest_layer, Vp * C + ctx * C, "the embedding owns wte and wpe")
  local xl = named("gpt2-xl")
  eq(estimate.model_params(xl).params, xl.n_params, "xl")
  eq(estimate.model_params(named("gpt2-nano")).params, 858880, "nano")
end

function T.model_layout_is_the_engines_padding()
  -- gpt2-nano at world 3: every module padded to a multiple of 3 * 16 = 48:
  -- embedding 65536 -> 65568, LayerNorm 256 -> 288, c_attn 49536, attn
  -- c_proj 16512, c_fc 66048, mlp c_proj 65664 (multiples already).
  local m = estimate.model_params(named("gpt2-nano"), nil, 3)
  local full = 65568 + 4 * (288 + 49536 + 16512 + 288 + 66048 + 65664) + 288
  eq(m.layout.full, full, "padded full")
  eq(m.layout.shard, full / 3, "shard")
  eq(m.persistent, full, "every nano module is under 1e5 elements")
  local r = estimate.model_states(m.params, 3, 3, { dtype = "bf16", layout = m.layout,
                                  persistent = m.persistent })
  eq(r.device, 2 * full / 3 + 2 * full + 4 * full / 3 + 12 * full / 3, "stage 3 bf16 nano")
  r = estimate.model_states(m.params, 3, 0, { dtype = "bf16", layout = m.layout })
  eq(r.device, 18 * full, "stage 0 counts the padded buffer")
end

function T.deepspeeds_own_estimators()
  -- estimate_zero2_model_states_mem_needs(1e9, 8 GPUs, 1 node):
  -- no offload: gpu 4Ψ + 16Ψ/8, cpu 4Ψ * 8 * 1.5; offload: gpu 2Ψ, cpu Ψ * max(32, 16) * 1.5.
  local cpu, gpu = estimate.deepspeed_zero2(1e9, 8, 1, false)
  eq(gpu, 6e9, "zero2 gpu"); eq(cpu, 48e9, "zero2 cpu")
  cpu, gpu = estimate.deepspeed_zero2(1e9, 8, 1, true)
  eq(gpu, 2e9, "zero2 offload gpu"); eq(cpu, 48e9, "zero2 offload cpu")
  -- zero3, largest layer 1e8: gpu 4e8 + 18Ψ/8; offload: 4e8 + 2Ψ/8 and cpu 16Ψ * 1.5.
  cpu, gpu = estimate.deepspeed_zero3(1e9, 1e8, 8, 1, false, false)
  eq(gpu, 4e8 + 2.25e9, "zero3 gpu"); eq(cpu, 1e8 * 4 * 8 * 1.5, "zero3 cpu (zero_init)")
  cpu, gpu = estimate.deepspeed_zero3(1e9, 1e8, 8, 1, true, false)
  eq(gpu, 4e8 + 2.5e8, "zero3 offload gpu"); eq(cpu, 24e9, "zero3 offload cpu")
end

------------------------------------------------------------------ the tool

local exe = lz.executable

local function run_tool(flags)
  local cmd = ("cd '%s' && LUAZERO='%s' tools/estimate %s 2>&1; echo \"EXIT:$?\"")
              :format(lz.root, exe(), flags)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return out:gsub("EXIT:%d+%s*$", ""), tonumber(out:match("EXIT:(%d+)%s*$"))
end

function T.tools_estimate_prints_the_table_and_the_pick()
  local out, status = run_tool("--params 1e9 --world 4 --budget 8GiB")
  assert(status == 0, out)
  local function row(stage, offload)
    return out:match("\n" .. stage .. "%s+" .. offload:gsub("%+", "%%+") .. "%s+([%d,]+)")
  end
  assert(row(0, "none") == "18,000,000,000", out)
  assert(row(1, "none") == "9,000,000,000", out)
  assert(row(2, "none") == "6,000,000,000", out)
  assert(row(3, "none") == "4,500,000,000", out)
  assert(row(3, "cpu") == "500,000,000", out)
  assert(row(3, "cpu+param") == "0", out)
  assert(out:find('stage "auto" (budget from --budget): stage 0 needs 16.8 GiB, stage 1 needs ' ..
                  "8.4 GiB per rank; budget 8.0 GiB; stage 2 needs 5.6 GiB: picked stage 2",
                  1, true), out)
  out, status = run_tool("--params 1e9 --world 4 --budget 8GiB --grads working")
  assert(status == 0, out)
  assert(row(2, "none") == "5,500,000,000", out)
  assert(out:find("stage 1 needs 6.5 GiB: picked stage 1", 1, true), out)
  out, status = run_tool("--model gpt2 --world 2 --dtype fp32 --budget 1GiB")
  assert(status == 0 and out:find("gpt2: 124,475,904 parameters", 1, true), out)
  out, status = run_tool("--params lots")
  assert(status == 2 and out == "estimate: --params 'lots' is not a parameter count " ..
         "(e.g. 1.5e9, 124M, 1.5B)\n", out)
  out, status = run_tool("")
  assert(status == 2 and out:find("give either --params N", 1, true), out)
  out, status = run_tool("--help")
  assert(status == 0 and out:find("usage: tools/estimate", 1, true), out)
end

-- The optimizer's choices: the header says what is counted, the bytes a
-- parameter follow the state formats and the master's (8-bit states: 1 +
-- 4/256 bytes each), the NVMe rows the engine refuses for Muon are left
-- out with its reason, and a bf16 master without bf16 parameters is one line.
function T.tools_estimate_counts_each_optimizer_choice()
  local out, status = run_tool("--params 1e9 --world 4 --budget 64GiB")
  assert(status == 0 and out:find("bf16 parameters, fp32 gradients; AdamW: m, v in f32, fp32 " ..
                                   "master weights (12 bytes a parameter)", 1, true), out)
  local function row(o, stage, offload)
    return o:match("\n" .. stage .. "%s+" .. offload .. "%s+[%d,]+%s+[%d.]+ GiB%s+[%d,]+%s+[%d.]+ GiB%s+([^\n]+)")
  end
  assert(row(out, 3, "cpu") == "2Ψ/N + 2P | 16Ψ/N", out)
  local bf16m = write_file("bf16m.json", '{"train_micro_batch_size_per_gpu": 1, "optimizer": ' ..
    '{"type": "AdamW", "params": {"momentum_dtype": "bfloat16", "variance_dtype": "bfloat16"}}}')
  out, status = run_tool("--params 1e9 --world 4 --budget 64GiB --config " .. bf16m)
  assert(status == 0 and out:find("AdamW: m, v in bf16, fp32 master weights (8 bytes a parameter)",
                                  1, true), out)
  assert(row(out, 3, "cpu") == "2Ψ/N + 2P | 12Ψ/N", out)
  out, status = run_tool("--params 1e9 --world 4 --optimizer AdamW8bit --master bf16 --budget 64GiB")
  assert(status == 0 and out:find("AdamW8bit: m, v in u8, bf16 master weights (stochastic " ..
                                  "rounding) (4.03125 bytes a parameter)", 1, true), out)
  -- (the bf16 master is the working shard in place; a host optimizer keeps its own copy)
  assert(row(out, 3, "none") == "8.03125Ψ/N + 2P", out)
  assert(row(out, 3, "cpu") == "2Ψ/N + 2P | 8.03125Ψ/N", out)
  out, status = run_tool("--params 1e9 --world 4 --optimizer Muon --budget 64GiB")
  assert(status == 0 and out:find("Muon: m, v in f32, fp32 master weights", 1, true), out)
  assert(out:find("not offered: nvme, nvme+param, nvme+cpu-param (Muon orthogonalises whole " ..
                  "matrices from states held in memory", 1, true), out)
  assert(not out:find("\n  3     nvme ", 1, true), out)
  out, status = run_tool("--params 1e9 --master bf16 --dtype fp32")
  assert(status == 2 and out == "estimate: bf16 master weights are the bf16 working parameters: " ..
         "give --dtype bf16 (got --dtype fp32)\n", out)
end

-- Stage "auto" does not fall back on NVMe for an optimizer the engine
-- refuses there (Muon): it says why.
function T.pick_stage_offers_no_nvme_to_muon()
  local stage, why, fits = estimate.pick_stage(3e9, 1, 8 * 2 ^ 30, "bf16", {
    nvme = true, nvme_path = "/x", settings = { whole_matrices = "Muon", sub_group_size = 1e7 } })
  assert(stage == 3 and fits == false, why)
  assert(why:find("; NVMe is not offered (Muon orthogonalises whole matrices from states held " ..
                  "in memory;", 1, true), why)
  -- (AdamW's states on NVMe fit that budget)
  local _, why2, fits2 = estimate.pick_stage(3e9, 1, 8 * 2 ^ 30, "bf16", {
    nvme = true, nvme_path = "/x", settings = { sub_group_size = 1e7 } })
  assert(fits2 and why2:find("picked stage 3, the optimizer states", 1, true), why2)
end

-- Counts past 2^53, non-positive micro-batches and sequence lengths, a
-- negative threshold: one line, exit 2, and no table before it.
function T.tools_estimate_refuses_out_of_range_numbers_with_one_line()
  for _, c in ipairs({
    { "--params 1e19", "--params '1e19' is more than 2^53" },
    { "--model gpt2 --micro-batch -4 --seq-len 8", "--micro-batch must be >= 1 (got -4)" },
    { "--model gpt2 --micro-batch 4 --seq-len 0", "--seq-len must be >= 1 (got 0)" },
    { "--model gpt2 --persistence-threshold -1", "--persistence-threshold must be a whole number" },
    { "--params 1e9 --persistent 2e9", "--persistent must be a whole number from 0" },
    { "--model gpt2 --micro-batch 4", "--micro-batch and --seq-len go together" },
    { "--model gpt2 --micro-batch 4 --seq-len 99999", "--seq-len 99999 is longer than" },
  }) do
    local out, status = run_tool(c[1])
    assert(status == 2, c[1] .. ": exit " .. tostring(status) .. "\n" .. out)
    assert(out:find("^estimate: ") and out:find(c[2], 1, true) and select(2, out:gsub("\n", "")) == 1,
           c[1] .. ":\n" .. out)
  end
end


------------------------------------------------------------ NVMe, by hand

-- One rank, bf16, stage 3, a bare count of 2^20 parameters: shards of 2^20,
-- sub-groups of 2^18 elements (4 of them), buffer_count 4.
function T.nvme_bytes_and_traffic_by_hand()
  local n, G = 2 ^ 20, 2 ^ 18
  local counts = estimate.counts_of_params(n, 1, 0)
  local function rank(offload, accum)
    return estimate.rank(counts, { stage = 3, dtype = "bf16", offload = offload, device = "cpu",
                                   sub_group_size = G, accum = accum })
  end
  local r = rank("nvme", 1)
  eq(r.groups, 4, "sub-groups")
  -- master, m and v: 12 bytes an element, in a file, read and written once
  -- a step; the fp32 gradients, 4 bytes, in another: written as backward
  -- completes each sub-group, read by the optimizer.
  eq(r.nvme.optimizer, 12 * n, "the optimizer's swap file")
  eq(r.nvme.gradients, 4 * n, "the gradient file")
  eq(r.traffic.read, 16 * n, "read per step"); eq(r.traffic.written, 16 * n, "written per step")
  eq(r.host["optimizer staging"], 4 * 12 * G, "4 staging buffers of master + m + v")
  -- (each at least 2 MiB: 2^19 f32 elements, not G)
  eq(r.host["gradient staging"], 4 * 2 ^ 21, "and 4 of a sub-group's gradients")
  eq(r.disk_s, 16 * n / 1.9e9 + 16 * n / 1.1e9, "the disk's time at 1.9 / 1.1 GB/s")
  assert(not r.host.optimizer and not r.host.grads, "no optimizer states or gradients in memory")
  -- Accumulation: each micro-step after the first reads the gradients back.
  local r4 = rank("nvme", 4)
  eq(r4.traffic.parts.gradients.read, 4 * 4 * n, "3 read-backs + the optimizer's")
  eq(r4.traffic.parts.gradients.written, 4 * 4 * n, "written every micro-step")
  -- The parameter shard too: bf16, read per forward and backward gather
  -- of every micro-step, written once a step, plus a page of slack.
  r = rank("nvme+param", 2)
  eq(r.nvme.params, 2 * n + 4096, "the parameter swap file")
  eq(r.traffic.parts.parameters.read, 2 * 2 * 2 * n, "2 micro-steps x (forward + backward)")
  eq(r.traffic.parts.parameters.written, 2 * n, "written once")
  -- (each of the ring's working-copy buffers at least 2 MiB: 2^20 bf16 elements, not G)
  eq(r.host["update staging"], 4 * 2 ^ 21, "the ring's working-copy buffers")
  -- Staging buffers are at least 2 MiB (huge pages): a tiny model pays that.
  local tiny = estimate.rank(estimate.counts_of_params(1000, 1, 0),
                             { stage = 3, dtype = "bf16", offload = "nvme", device = "cpu" })
  eq(tiny.host["optimizer staging"], 2 ^ 21, "one group, one 2 MiB buffer")
  assert(estimate.rank(counts, { stage = 2, offload = "nvme+param" }) == nil,
         "offload_param needs stage 3")
end

function T.pick_stage_falls_back_on_nvme_and_asks_for_a_path()
  -- 1e8 fp32 parameters, one rank: every stage needs 16 bytes a parameter
  -- in memory (1.5 GiB); with the optimizer's m and v on NVMe, 8 bytes and
  -- 4 staging buffers of a sub-group's m and v (sub-groups of 1e7 rounded
  -- up to a multiple of 2048 elements).
  -- (An engine that spills the gradient shard to NVMe keeps 4 bytes and 4
  -- gradient buffers of a sub-group instead.)
  local n, budget, G = 1e8, 1.2e9, 10000384
  local spill = estimate.plan(3, "fp32", "nvme", nil, "cpu").opt_grads.tier == "nvme"
  local opts = { nvme = true, device = "cpu",
                 settings = { sub_group_size = 1e7, param_buffer_size = 1e6 } }
  local need = spill and 4 * n + 4 * 2 * G * 4 + 4 * G * 4 or 8 * n + 4 * 2 * G * 4
  local ok, err = pcall(estimate.pick_stage, n, 1, budget, "fp32", opts)
  assert(not ok and err:find(("no stage fits in memory; stage 3 with the optimizer states on " ..
                              "NVMe needs %s and fits: give --nvme-path DIR")
                             :format(estimate.format_bytes(need)), 1, true), err)
  opts.nvme_path = "/nvme"
  local stage, why, fits, placement = estimate.pick_stage(n, 1, budget, "fp32", opts)
  assert(stage == 3 and fits and placement == "nvme", why)
  assert(why:find("picked stage 3, the optimizer states on NVMe (nvme_path /nvme)", 1, true), why)
  -- Smaller still: the parameter shard goes too (1.06e9: the gradients,
  -- the ring's master, m and v (an fp32 master of its own now) and working
  -- copies, 5 parameter reads of 1e6).
  stage, why, fits, placement = estimate.pick_stage(n, 1, 1.1e9, "fp32", opts)
  assert(fits and (placement == "nvme+param" or spill and placement == "nvme"), why)
  -- Nothing fits: stage 3, as before, saying what NVMe would need.
  stage, why, fits, placement = estimate.pick_stage(n, 1, 1e6, "fp32", opts)
  assert(stage == 3 and not fits and not placement and
         why:find("NVMe does not fit either", 1, true), why)
  -- A budget a stage fits is unchanged by the NVMe rows.
  assert(estimate.pick_stage(n, 1, 2e9, "fp32", opts) == 0)
end

function T.engine_estimate_is_the_tools_figures_for_the_live_engine()
  local zero = require("luazero.zero")
  local mc = gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
  local cfg = { train_micro_batch_size_per_gpu = 2, bf16 = { enabled = true },
                zero_optimization = { stage = 3, sub_group_size = 4096, offload_optimizer =
                                      { device = "nvme", nvme_path = swap_dir } } }
  local engine = zero.initialize({ model = gpt2.new(mc), config = cfg, seed = 1,
                                   batch = { 2, 16 }, comm = require("luazero.comm").init("local") })
  local r = engine:estimate()
  local want = estimate.rank(estimate.counts(gpt2.new(mc), 1), estimate.settings_of(cfg, "cpu"))
  eq(r.host.total, want.host.total, "host"); eq(r.nvme.total, want.nvme.total, "nvme")
  eq(r.live.nvme, want.nvme.total, "the engine's swap files")
  eq(r.live.staging, want.host["optimizer staging"] + want.host["gradient staging"],
     "the engine's staging")
  local text = tostring(r)
  assert(text:find("ZeRO stage 3, nvme, per rank: ", 1, true) and
         text:find("nvme per optimizer step: ", 1, true), text)
  engine:free()
end

-- Muon's step makes and frees workspace: at stage 0 each matrix's
-- Newton-Schulz scratch in turn (fp32: gram and poly k x k and the next X,
-- A x B; bf16: X in bf16, gram in f32 and bf16, poly in bf16); sharded, each
-- batch of gathered f32 segments (allgather_bucket_size elements) with the
-- scratch of the largest matrix the rank owns in it. The estimate's
-- "optimizer scratch" is the ledger's workspace peak in the step beyond what
-- it held, to the byte; AdamW has none.
function T.muon_newton_schulz_scratch_is_the_ledgers_workspace_peak()
  local zero = require("luazero.zero")
  local _, x, y = support.engine_batch()
  local function peak_and_estimate(stage, optimizer, bucket)
    local mc = gpt2.config("gpt2-nano", { n_layer = 1, n_embd = 32, n_head = 2, context = 16 })
    local cfg = { train_micro_batch_size_per_gpu = 2, bf16 = { enabled = true },
                  zero_optimization = { stage = stage, allgather_bucket_size = bucket },
                  optimizer = optimizer }
    local engine = zero.initialize({ model = gpt2.new(mc), config = cfg, seed = 1,
                                     batch = { 2, 8 },
                                     comm = require("luazero.comm").init("local") })
    engine:backward(engine:forward(x, y))
    -- (no other test's garbage freed inside the step: a collection there
    -- would lower the peak below what the step itself made)
    collectgarbage()
    collectgarbage("stop")
    local held = lz.mem().workspace
    lz.mem_reset_peak()
    engine:step()
    local peak = lz.mem_peak().workspace - held
    collectgarbage("restart")
    local r = estimate.rank(estimate.counts(gpt2.new(mc), 1), estimate.settings_of(cfg, "cpu"))
    eq(engine:estimate().host["optimizer scratch"] or 0, r.host["optimizer scratch"] or 0,
       "engine:estimate()")
    engine:free()
    return peak, r.host["optimizer scratch"] or 0
  end
  local muon = { type = "Muon", params = { lr = 0.01 } }
  local bf16 = { type = "Muon", params = { lr = 0.01, ns_dtype = "bfloat16" } }
  -- the largest matrix is the MLP's 128 x 32: k 32
  local fp32_ns, bf16_ns = (2 * 32 * 32 + 128 * 32) * 4, 128 * 32 * 2 + 32 * 32 * (4 + 2 + 2)
  -- the four segments holding matrices (weights and biases): 3168, 1056,
  -- 4224, 4128 elements; a bucket of 4224 gathers them in three batches,
  -- the MLP's 4224 beside its 128 x 32 the largest
  local all = (3168 + 1056 + 4224 + 4128) * 4
  for _, c in ipairs({ { 0, muon, nil, fp32_ns }, { 3, muon, nil, all + fp32_ns },
                       { 0, bf16, nil, bf16_ns }, { 3, bf16, nil, all + bf16_ns },
                       { 3, muon, 4224, 4224 * 4 + fp32_ns },
                       { 3, { type = "AdamW", params = { lr = 1e-3 } }, nil, 0 } }) do
    local what = ("stage %d %s%s%s"):format(c[1], c[2].type, c[2].params.ns_dtype and
                                            (" " .. c[2].params.ns_dtype) or "",
                                            c[3] and (" allgather_bucket_size " .. c[3]) or "")
    local peak, est = peak_and_estimate(c[1], c[2], c[3])
    eq(peak, c[4], what .. ": the ledger's workspace peak in the step")
    eq(est, c[4], what .. ": the estimate's optimizer scratch")
  end
  -- (the scratch is no model state: kept leaves it out)
  local r = estimate.rank(estimate.counts(named("gpt2-nano"), 1),
                          estimate.settings_of({ optimizer = muon }, "cpu"))
  assert(r.host["optimizer scratch"] > 0, "gpt2-nano under Muon: no optimizer scratch")
  eq(estimate.kept(r, "host"), r.host.total - (r.host.comm or 0) - r.host["optimizer scratch"],
     "kept")
  -- tools/estimate --optimizer Muon prints it (gpt2-nano's largest matrix
  -- 512 x 128 at stage 0: (2 x 128^2 + 512 x 128) x 4 bytes)
  eq(r.host["optimizer scratch"], (2 * 128 * 128 + 512 * 128) * 4, "gpt2-nano at stage 0")
  local out, status = run_tool("--model gpt2-nano --optimizer Muon --device cpu")
  assert(status == 0 and out:find("\n  0 none +[^\n]*%+ optimizer scratch 384%.0 KiB\n") and
         out:find("\n  1 none +[^\n]*optimizer scratch"), out)
end

function T.tools_estimate_has_nvme_rows_lora_and_json()
  local out, status = run_tool("--model llama-tiny --lora-r 4 --world 2 --budget 1GiB --json 1")
  assert(status == 0, out)
  -- --json is a switch: bare, or with a 1 after it (the same output)
  local bare, bst = run_tool("--model llama-tiny --lora-r 4 --world 2 --budget 1GiB --json")
  local j = require("cjson").decode(out)
  local jb = bst == 0 and require("cjson").decode(bare)
  assert(jb and jb.stage_auto == j.stage_auto and #jb.rows == #j.rows and
         jb.params.trainable == j.params.trainable, bare)
  local llama = require("models.llama")
  local m = llama.new(llama.config("llama-tiny"))
  local base = m.n_params
  local n = require("models.lora").apply(m, { r = 4, targets = { "q_proj", "v_proj" } })
  assert(n > 0)
  local trainable = select(2, m:trainable_table())
  eq(j.params.trainable, trainable, "adapters train")
  eq(j.params.frozen, base, "the base is frozen")
  local seen = {}
  for _, row in ipairs(j.rows) do
    seen[row.stage .. " " .. row.placement] = row
    assert(row.host.total and row.device.total and row.nvme.total, out)
  end
  for _, k in ipairs({ "3 nvme", "3 nvme+param", "3 cpu+nvme-param", "1 nvme", "2 nvme" }) do
    assert(seen[k], k .. " missing:\n" .. out)
  end
  assert(seen["3 nvme+param"].nvme_read > 0 and seen["3 nvme"].device.frozen, out)
  assert(j.disk.assumed and j.disk.read_gbps == 1.9, out)
  out, status = run_tool("--params 1e9 --world 8 --read-gbps 3 --write-gbps 2 --sub-group-size 1e8")
  assert(status == 0, out)
  local row = out:match("\n  3     nvme%+param  [^\n]*")
  assert(row, out)
  assert(out:find("disk: 3.00 GB/s read, 2.00 GB/s write;", 1, true), out)
  -- A DeepSpeed config's settings: Lion (master and m), 2 staging
  -- buffers, sub-groups of 1e7 (10000384 elements), 4 micro-steps a step.
  local cfg = write_file("ds.json", '{"train_micro_batch_size_per_gpu": 1, ' ..
    '"gradient_accumulation_steps": 4, "bf16": {"enabled": true}, "optimizer": {"type": ' ..
    '"Lion", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3, "sub_group_size": 1e7, ' ..
    '"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 2}}}')
  out, status = run_tool("--params 1e8 --json 1 --config " .. support.quote(cfg))
  assert(status == 0, out)
  -- a config without a batch key (the batch is no model state) reads
  local nobatch = write_file("nobatch.json", '{"zero_optimization": {"stage": 1}}')
  local out2, status2 = run_tool("--params 1e8 --config " .. support.quote(nobatch))
  assert(status2 == 0 and out2:find("stage", 1, true), out2)
  local G = 10000384
  for _, row in ipairs(require("cjson").decode(out).rows) do
    if row.stage == 3 and row.placement == "nvme" then
      eq(row.host["optimizer staging"], 2 * 2 * G * 4, "2 buffers of master + m")
      eq(row.host["gradient staging"], 2 * G * 4, "2 buffers of gradients")
      eq(row.nvme_parts.gradients.written, 4 * 10 * G * 4, "the gradient file, 4 micro-steps")
      seen.config = true
    end
  end
  assert(seen.config, out)
  -- Measured through the swap file's own I/O on the disk given.
  out, status = run_tool("--params 1e9 --measure-disk " .. support.quote(swap_dir))
  local rd, wr = out:match("disk: ([%d.]+) GB/s read, ([%d.]+) GB/s write %(measured in ")
  assert(status == 0 and tonumber(rd) > 0 and tonumber(wr) > 0, out)
  out, status = run_tool("--params 1e9 --lora-r 4")
  assert(status == 2 and out:find("--lora-r and --lora-targets go with --model", 1, true), out)
  -- a folder that is not there, and a word that is not a flag, named as such
  out, status = run_tool("--params 1e9 --measure-disk " .. support.quote(swap_dir .. "/none"))
  assert(status == 2 and out:find("--measure-disk " .. swap_dir .. "/none: no such folder; " ..
                                  "give a folder on the disk", 1, true), out)
  out, status = run_tool("--params 1e9 extra")
  assert(status == 2 and out:find("unexpected argument 'extra' (only flags are taken, each " ..
                                  "--name or --name VALUE; --help lists them)", 1, true), out)
end

-- The trainer's --stage auto on a budget no stage fits in memory: stage 3
-- with the optimizer states on NVMe, said at start-up; without a path, an
-- error naming --nvme-path.
-- A budget the run holds sees the comm buffers and what the process holds
-- already: stage auto counts both, so the NVMe placement it picks passes the
-- run's own check at its first step (stage 0 needs 196.4 MiB of the 190, the
-- optimizer states on NVMe 104.5 beside 11.3 of activations).
function T.stage_auto_picks_nvme_in_the_trainer()
  local cfg = write_file("auto.json", '{"train_micro_batch_size_per_gpu": 2, ' ..
                         '"zero_optimization": {"stage": "auto", "sub_group_size": 1000000, ' ..
                         '"stage3_prefetch_bucket_size": 200000, "reduce_bucket_size": 200000}}')
  local base = ("cd %s && %s scripts/train.lua --model gpt2-nano --n-embd 512 --n-head 4 " ..
                "--n-layer 4 --seq-len 32 --micro-batch 2 --sample 0 --data %s --steps 1 " ..
                "--config %s --memory-budget 190MiB")
               :format(support.quote(lz.root), support.quote(lz.executable()),
                       support.quote(corpus_path), support.quote(cfg))
  local out, status = support.sh(base)
  assert(status == 2 and out:find("give --nvme-path DIR", 1, true), out)
  out, status = support.sh(base .. " --nvme-path " .. support.quote(swap_dir))
  assert(status == 0 and out:find("picked stage 3, the optimizer states on NVMe (nvme_path " ..
                                  swap_dir, 1, true), out)
  assert(out:find("zero stage 3,", 1, true) and out:find("offload: optimizer states on nvme", 1, true),
         out)
  out, status = support.sh(base:gsub("%-%-config %S+", "--stage 2") .. " --nvme-path /nvme")
  assert(status == 2 and out:find("train: --nvme-path is where --stage auto puts swap files", 1,
                                   true), out)
end

return T
