-- scripts/examples/lora.lua — LoRA on a Hugging Face folder (config.json,
-- *.safetensors, tokenizer.json with its chat template) from chat examples
-- in a JSON Lines file, saved; then an answer generated.
--   luazero scripts/examples/lora.lua HF_FOLDER chat.jsonl SAVE_DIR [steps]
local config = require("luazero.config")
local data = require("luazero.data")
local zero = require("luazero.zero")
local hf = require("luazero.hf")
local instruct = require("luazero.data.instruct")
local models = require("models.registry")
local lora = require("models.lora")

local folder, jsonl, save_dir, steps = arg[1], arg[2], arg[3], tonumber(arg[4] or "10")
assert(save_dir and steps and steps >= 1 and steps % 1 == 0,
       "usage: luazero -m examples/lora HF_FOLDER chat.jsonl SAVE_DIR [steps] (steps: a whole number >= 1, default 10)")
local B, T = 2, 128

-- The model as its config.json says, adapters on its default targets (q_proj,
-- v_proj), everything else frozen; the weights are read after the engine is made.
local model = models.new(hf.model_config(models, hf.config_path(folder)))
lora.apply(model, { r = 4, alpha = 8 })
local ds = config.load({ train_micro_batch_size_per_gpu = B,
                         optimizer = { type = "AdamW", params = { lr = 1e-2 } } })
local engine = zero.initialize{ model = model, config = ds, batch = { B, T }, draw_weights = false }
hf.load_into(engine, folder)
engine:set_init_path(folder, hf.checksum(folder)) -- an export knows its base

-- Loss on the assistant turns only, each example padded to its own row.
local tok, template = instruct.open_tokenizer(folder)
local corpus = data.load(jsonl, { tokenizer = tok, template = template, max_len = T })
local loader = data.loader(corpus, { B = B, T = T, seed = 1, vocab = model.cfg.vocab,
                                     packing = "pad", val_fraction = 0 })
for step = 1, steps do
  print(("step %d loss %.4f"):format(step, engine:train_batch(loader).loss))
end
print("saved " .. engine:save(save_dir)) -- tools/ckpt export SAVE_DIR DIR: a PEFT folder

-- An answer, greedy, from the prompt as the chat template renders it.
local prompt = template():render({ { role = "user", content = "Who was Romeo?" } },
                                 { add_generation_prompt = true })
local out = require("luazero.generate").run(model, { tok:encode(prompt) },
                                            { max_new = 12, temperature = 0 })
-- (ids past the tokenizer's vocabulary, which a model's may exceed, show as <id>)
print("answer: " .. require("luazero.run.text").decode(tok, out[1].ids))
engine:free(); loader:free(); data.free(corpus)
