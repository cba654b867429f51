-- run/inputs.lua — what the scripts read, opened the same way by each: a
-- checkpoint's manifest, a tokenizer (and its chat template), a data file,
-- trained weights for inference. Errors are the input's fault: exit 2.
-- ex: a luazero.run.exits.
local data = require("luazero.data")
local M = {}

-- The manifest of a checkpoint: a step folder, or a --save folder's latest.
function M.manifest(ex, path)
  local checkpoint = require("luazero.checkpoint")
  return ex.checked(function() return checkpoint.read_manifest(checkpoint.resolve(path)) end)
end

-- A tokenizer.json, or a Hugging Face folder holding one: the tokenizer and
-- a function that loads the folder's chat template.
function M.tokenizer(ex, path)
  return ex.checked(require("luazero.data.instruct").open_tokenizer, path)
end

-- Refuses a tokenizer (opened from `path`) whose ids the model's vocabulary
-- `vocab` cannot embed: with weights that fix the vocabulary (`fixed`, the
-- words naming them: "the weights in DIR"), the fix is the model's own
-- tokenizer; else a larger --vocab.
function M.check_tokenizer_vocab(ex, tok, path, vocab, fixed)
  local n = tok:vocab_size()
  if n <= vocab then return end
  if fixed then
    ex.user_error(("--tokenizer %s: %d tokens, more than the model's vocab %d (fixed by %s); " ..
                   "use the tokenizer the model was trained with"):format(path, n, vocab, fixed))
  end
  ex.user_error(("--tokenizer %s: %d tokens, more than the model's vocab %d; give --vocab %d " ..
                 "or more"):format(path, n, vocab, n))
end

-- A token file made with one tokenizer read with another (--tokenizer, at
-- `path`, opened as tok) would decode as other text and train on ids that
-- mean other tokens: refused, naming the fix. A file recording none
-- (llm.c's, an older one) is taken as it is. Text (each byte a token) or a
-- byte-level token file beside a model that reads a tokenizer's ids
-- (--tokenizer, or `named`: "--init DIR's tokenizer.json", tok nil) is
-- refused too: its bytes would train as unrelated tokens.
function M.check_made_with(ex, c, path, tok, named)
  if not path then return end
  named = named or ("--tokenizer " .. path)
  if c.kind == "text" then
    ex.user_error(("--data %s is text, read as bytes (each byte a token), but the model reads " ..
                   "the ids of %s: make a token file with that tokenizer (tools/prepare-data " ..
                   "--tokenizer %s %s OUT.bin) and train on it"):format(c.path, named, path, c.path))
  end
  local made = c.made_with
  if not made then return end
  local files = require("luazero.data.files")
  if files.same_tokenizer(made, files.BYTE_LEVEL) then
    ex.user_error(("--data %s was made at byte level (each byte a token), not with %s: " ..
                   "%smake it with that tokenizer (tools/prepare-data --tokenizer %s ...)")
                  :format(c.path, named, tok and "drop --tokenizer, or " or "", path))
  end
  if not tok then return end
  if not files.same_tokenizer(made, files.tokenizer_record(path, tok:vocab_size())) then
    ex.user_error(("--tokenizer %s is not the tokenizer --data %s was made with (tools/prepare-data " ..
                   "recorded one of %d tokens whose tokenizer.json differs): give that " ..
                   "tokenizer, or make the data again with this one"):format(path, c.path,
                   made.vocab))
  end
end

-- A data file as a corpus (luazero.data.load); text: nil, or { tokenizer,
-- template, max_len } for instruction examples (.jsonl).
function M.corpus(ex, path, text)
  return ex.checked(data.load, path, text)
end

-- Trained weights for evaluation or generation (luazero.inference.open):
-- --load, --model, --model-config, --hf, --adapters from flags (run/flags.lua's
-- weights), the rest (dtype, micro_batch, seq_len, seed) from opts.
function M.weights(ex, flags, opts)
  local o = { models = require("models.registry"), lora = require("models.lora"),
              load = flags.load, hf = flags.hf, adapters = flags.adapters, model = flags.model,
              model_config = flags.model_config }
  for k, v in pairs(opts) do o[k] = v end
  return ex.checked(require("luazero.inference").open, o)
end

return M
