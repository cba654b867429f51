-- scripts/examples/own_model.lua — a model of one's own, assembled from
-- luazero.nn modules, trained by the ZeRO engine at stage 3 on 2 ranks.
--   luazero -n 2 scripts/examples/own_model.lua corpus.txt [steps]
local lz = require("luazero")
local nn = require("luazero.nn")
local comm = require("luazero.comm")
local config = require("luazero.config")
local data = require("luazero.data")
local zero = require("luazero.zero")

local path, steps = arg[1], tonumber(arg[2] or "20")
assert(path and steps and steps >= 1 and steps % 1 == 0,
       "usage: luazero -n 2 -m examples/own_model corpus.txt [steps] (steps: a whole number >= 1, default 20)")
comm.init() -- joins the ranks `luazero -n 2` started (one rank without -n)
local rank, world = comm.rank(), comm.size()

-- A 2-layer byte-level transformer: what each block is made of, by name.
-- The names become the parameter names in checkpoints.
local cfg = { name = "mine", n_layer = 2, n_embd = 64, context = 64, vocab = 256,
              padded_vocab = 256 } -- token rows: vocab rounded up (here already a multiple of 64)
local description = {
  names = { body = "body", embedding = "embed", blocks = "blocks", norm = "norm", head = "head",
            block = { attn_norm = "norm1", attn = "attn", mlp_norm = "norm2", mlp = "mlp" } },
  embedding = function(c) return nn.Embedding.new(c.padded_vocab, c.context, c.n_embd) end,
  norm = function(c) return nn.LayerNorm.new(c.n_embd) end,
  attention = function(c) return nn.CausalSelfAttention.new(c.n_embd, 4, 0.02) end,
  mlp = function(c) return nn.MLP.new(c.n_embd, 0.02) end,
  -- no head: the output layer is tied to the embedding's token table
}
local Mine = nn.CausalLM:extend("Mine")
local model = Mine:new(description, cfg) -- declared only: the engine owns the memory

-- A DeepSpeed configuration as a table (a ds_config.json path works too).
local ds = config.load({
  train_micro_batch_size_per_gpu = 4,
  gradient_clipping = 1.0,
  optimizer = { type = "AdamW", params = { lr = 3e-3, weight_decay = 0.01 } },
  zero_optimization = { stage = 3 },
}, world)
local B, T = ds.train_micro_batch_size_per_gpu, 32
local engine = zero.initialize{ model = model, config = ds, seed = 1, batch = { B, T } }

-- Any text file: bytes are tokens. Each rank reads its own batches.
local corpus = data.load(path)
local loader = data.loader(corpus, { B = B, T = T, seed = 1, vocab = cfg.vocab,
                                     rank = rank, world = world })
for step = 1, steps do
  local r = engine:train_batch(loader) -- forward, backward, step
  if rank == 0 then print(("step %d loss %.4f"):format(step, r.loss)) end
end
-- Collectives: every rank calls them (stage 3 gathers the parameters).
local val, sum = engine:evaluate(loader, 1), engine:params_checksum()
if rank == 0 then print(("val_loss %.4f\nparams_checksum %s"):format(val, sum)) end
engine:free(); loader:free(); data.free(corpus)
