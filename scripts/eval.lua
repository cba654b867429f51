-- scripts/eval.lua — the loss and perplexity of a trained model over a
-- held-out file, deterministic: the same windows, kernels and dtype as
-- scripts/train.lua's validation (a checkpoint's val_loss, given the file
-- that run validated on as --val-data and the same batch, comes back to
-- the last bit).
--   luazero scripts/eval.lua --load runs/ck --data val.txt
--   luazero scripts/eval.lua --hf tinyllama --data val.bin --seq-len 512 --max-batches 50
--   luazero scripts/eval.lua --hf base --adapters lora-out --data val.bin
-- Flags: luazero scripts/eval.lua --help. docs/training.md, "Evaluation".
local cjson = require("cjson")
local data = require("luazero.data")
local held_out = require("luazero.held_out")
local exits = require("luazero.run.exits")
local run_flags = require("luazero.run.flags")
local inputs = require("luazero.run.inputs")

local spec = run_flags.spec(run_flags.weights("config.json, *.safetensors"), {
  { "data", "string", nil, "the held-out file: text (bytes are tokens), a token file or instruction data (.jsonl or tools/prepare-data's), all of it",
    required = "the held-out text or token file" },
  { "tokenizer", "string", nil, "a .jsonl --data's Hugging Face tokenizer folder (default: the --hf folder)",
    needs = { ok = function(f) return f.data ~= nil and data.is_jsonl(f.data) end,
              with = { "--data", "val.jsonl" },
              says = "tokenises instruction examples (a .jsonl --data) only; --data is not " ..
                     "one: drop it" } },
  { "micro-batch", "int", nil, "sequences per batch (default: a checkpoint's, else 8)", min = 1 },
  { "seq-len", "int", nil, "tokens per sequence (default: the model's context)", min = 1 },
  { "max-batches", "int", 0, "evaluate the first N batches only (0: the whole file)",
    min = 0, why = "0 evaluates the whole file" },
  { "dtype", "string", nil, "fp32, bf16 or fp16 (default: a checkpoint's, else fp32)",
    choices = { "fp32", "bf16", "fp16" } },
  { "json", "flag", false, "print one JSON object instead of a line of text" },
})

-- What a message gains on the user's terminal: the flag that lowers it.
local ex = exits.new({ script = "eval", hints = {
  { "for activations failed", "the activations do not fit: lower --micro-batch or --seq-len" },
} })
local checked = ex.checked

local function main(argv)
  local flags = run_flags.parse(ex, argv, spec,
                                "luazero scripts/eval.lua (--load DIR | --hf DIR) --data FILE [flags]")
  if not flags then return end
  local jsonl
  -- (the tokenizer: --tokenizer, else the --hf folder's, else that of the
  -- folder a --load checkpoint was trained from, as generate.lua finds it)
  local fs = require("luazero.io.fs")
  local tok_dir = flags.tokenizer or flags.hf
  if not tok_dir and flags.load and fs.is_dir(flags.load) then
    local m = inputs.manifest(ex, flags.load)
    if type(m.init) == "string" and fs.exists(m.init .. "/tokenizer.json") then tok_dir = m.init end
  end
  if data.is_jsonl(flags.data) and tok_dir then
    -- Instruction examples: tokenised and masked as scripts/train.lua does.
    local tok, template = inputs.tokenizer(ex, tok_dir)
    jsonl = { tokenizer = tok, template = template, max_len = flags.seq_len }
  end
  local corpus = inputs.corpus(ex, flags.data, jsonl)
  -- The batch: a checkpoint's micro-batch unless given.
  local B = flags.micro_batch
  if not B and flags.load and require("luazero.io.fs").is_dir(flags.load) then
    local m = inputs.manifest(ex, flags.load)
    B = type(m.config) == "table" and tonumber(m.config.train_micro_batch_size_per_gpu) or nil
  end
  B = B or 8
  local w = inputs.weights(ex, flags, { dtype = flags.dtype, micro_batch = B,
                                        seq_len = flags.seq_len })
  local T = flags.seq_len or w.cfg.context
  -- (the weights fix the vocabulary: the data's ids must be the model's tokenizer's)
  local fixed = "the weights in " .. (flags.hf or flags.load)
  if jsonl and flags.tokenizer then
    inputs.check_tokenizer_vocab(ex, jsonl.tokenizer, flags.tokenizer, w.cfg.vocab, fixed)
  end
  local loader = checked(held_out.loader, corpus, { B = B, T = T, vocab = w.cfg.vocab,
                                                    vocab_fixed = fixed })
  local n = loader.val_batches
  if flags.max_batches > 0 then n = math.min(n, flags.max_batches) end
  local loss = checked(w.engine.evaluate, w.engine, loader, n)
  local rec = { loss = loss, perplexity = math.exp(loss), batches = n, batch = { B, T },
                tokens = n * B * T, data = flags.data, dtype = w.dtype }
  if flags.json then
    print(cjson.encode(rec))
  else
    print(("%s: loss %.6f, perplexity %.4f over %d batches of %d x %d tokens (%d tokens, %s)")
          :format(flags.data, loss, rec.perplexity, n, B, T, rec.tokens, w.dtype))
    print(("val_loss %.17g"):format(loss))
  end
  loader:free()
  corpus.tokens:free()
  w.free()
end

main(arg)
