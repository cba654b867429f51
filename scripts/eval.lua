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
local args = require("luazero.args")
local data = require("luazero.data")
local held_out = require("luazero.held_out")
local inference = require("luazero.inference")

local spec = {
  { "load", "string", nil, "a luazero checkpoint: a step folder, a --save folder (its latest) or a consolidated file" },
  { "model", "string", nil, "with --load FILE (tools/ckpt consolidate's): the model's named size" },
  { "model-config", "string", nil, "with --load FILE: the model's Hugging Face config.json" },
  { "hf", "string", nil, "a Hugging Face model folder (config.json, *.safetensors)" },
  { "adapters", "string", nil, "with --hf: PEFT LoRA adapters (tools/ckpt export of a LoRA run)" },
  { "data", "string", nil, "the held-out file: text (bytes are tokens), a token file or instruction data (.jsonl or tools/prepare-data's), all of it" },
  { "tokenizer", "string", nil, "a .jsonl --data's Hugging Face tokenizer folder (default: the --hf folder)" },
  { "micro-batch", "int", nil, "sequences per batch (default: a checkpoint's, else 8)" },
  { "seq-len", "int", nil, "tokens per sequence (default: the model's context)" },
  { "max-batches", "int", 0, "evaluate the first N batches only (0: the whole file)" },
  { "dtype", "string", nil, "fp32, bf16 or fp16 (default: a checkpoint's, else fp32)" },
  { "json", "flag", false, "print one JSON object instead of a line of text" },
}

local function fail(msg)
  msg = tostring(msg):gsub("^[^%s:]+%.lua:%d+: ", "")
  io.stderr:write("eval: ", msg, "\n")
  os.exit(2)
end

local function checked(fn, ...) return args.checked(fail, fn, ...) end

local function main(argv)
  local flags, usage = checked(args.parse, argv, spec)
  if not flags then
    print("usage: luazero scripts/eval.lua (--load DIR | --hf DIR) --data FILE [flags]\n" .. usage)
    return
  end
  if not flags.data then fail("--data is required: the held-out text or token file") end
  for _, n in ipairs({ "micro_batch", "seq_len" }) do
    if flags[n] and flags[n] < 1 then fail(("--%s must be >= 1"):format(n:gsub("_", "-"))) end
  end
  if flags.max_batches < 0 then fail("--max-batches must be >= 0 (0: the whole file)") end
  local opts
  if data.is_jsonl(flags.data) and (flags.tokenizer or flags.hf) then
    -- Instruction examples: tokenised and masked as scripts/train.lua does.
    local tok, template = checked(require("luazero.data.instruct").open_tokenizer,
                                  flags.tokenizer or flags.hf)
    opts = { tokenizer = tok, template = template, max_len = flags.seq_len }
  end
  local corpus = checked(data.load, flags.data, opts)
  -- The batch: a checkpoint's micro-batch unless given.
  local B = flags.micro_batch
  if not B and flags.load and require("luazero.io.fs").is_dir(flags.load) then
    local checkpoint = require("luazero.checkpoint")
    local m = checked(function()
      return checkpoint.read_manifest(checkpoint.resolve(flags.load))
    end)
    B = type(m.config) == "table" and tonumber(m.config.train_micro_batch_size_per_gpu) or nil
  end
  B = B or 8
  local w = checked(inference.open, { models = require("models.registry"),
                                      lora = require("models.lora"), load = flags.load,
                                      hf = flags.hf, adapters = flags.adapters,
                                      model = flags.model, model_config = flags.model_config,
                                      dtype = flags.dtype, micro_batch = B,
                                      seq_len = flags.seq_len })
  local T = flags.seq_len or w.cfg.context
  local loader = checked(held_out.loader, corpus, { B = B, T = T, vocab = w.cfg.vocab })
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
