"""test_finetune.py — the fine-tuning path end to end against transformers and PEFT.

A tiny random LlamaForCausalLM (save_pretrained, fp32 safetensors) and two
tokenizer folders with chat templates: a SentencePiece-style BPE with
byte_fallback and TinyLlama/Zephyr's template, and a byte-level BPE with
Llama 3's template (both trained with `tokenizers` as in
test_chat_template.py). A JSONL of chat examples (system, user, assistant,
multi-turn). For each tokenizer:

  ids      tools/prepare-data --format jsonl: the token ids and loss weights
           of every example equal transformers' apply_chat_template ids, and
           weights built here from the assistant spans (the tokens starting
           inside each assistant message's content and its end-of-turn token)
  loss     scripts/eval.lua on one example (the base model) equals
           transformers' loss with labels -100 outside the spans (1e-5)
  peft     scripts/train.lua --init --tokenizer --data x.jsonl --lora-r 4 (fp32),
           tools/ckpt export: PeftModel.from_pretrained on the same base gives
           the loss scripts/eval.lua --adapters gives (1e-5)
  generate scripts/generate.lua --hf --adapters --chat, greedy: the same tokens
           as transformers + PEFT generate(do_sample=False), 16 of them (no
           early end-of-turn, so the comparison is not one token)

transformers 4.40.2, tokenizers, jinja2 and peft 0.10.0 come from
build/ref-venv (tools/setup); without one of them this file says it skipped.
    /usr/bin/python3 tests/ref/test_finetune.py     # ends with "N passed, N failed"
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_chat_template as ct  # noqa: E402  (the trained tokenizers, the fixtures)
from refenv import LUAZERO, REPO  # noqa: E402

FIXTURES = ct.FIXTURES
VOCAB = 1472  # above both tokenizers' vocabularies
TOL = 1e-5

# kind: (template fixture, tokenizer backend, end-of-turn text, template strips content)
KINDS = {
    "sentencepiece": ("zephyr", "sentencepiece", "</s>", False),
    "byte_level": ("llama3", "byte_level", "<|eot_id|>", True),
}

EXAMPLES = [
    ct.CONVERSATIONS[0],  # with a system message
    [{"role": "user", "content": "Name two rivers."},
     {"role": "assistant", "content": "The Thames and the Nile."},
     {"role": "user", "content": "And a third?"},
     {"role": "assistant", "content": "The Danube, café côté."}],
    [{"role": "system", "content": "Answer in verse."},
     {"role": "user", "content": "Who was Romeo?"},
     {"role": "assistant", "content": "A Montague who loved in vain."}],
    [{"role": "user", "content": "Count to three."},
     {"role": "assistant", "content": "One, two, three."}],
    [{"role": "user", "content": "Say hello."},
     {"role": "assistant", "content": "Hello there, good friend."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Is the sea salty?"},
     {"role": "assistant", "content": "Yes."},
     {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Rivers carry minerals into it."}],
]
PROMPT = [{"role": "user", "content": "Who was Romeo?"}]


def tiny_llama(transformers, torch, folder):
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="eager",
        bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from their start of 1
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)


def tokenizer_folder(tokenizers, PreTrainedTokenizerFast, kind, folder, base_folder):
    """Saves the tokenizer (with its chat template) beside the model's weights."""
    fixture, backend, _, _ = KINDS[kind]
    with open(os.path.join(FIXTURES, fixture, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    specials = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if cfg.get(k) is not None}
    tok = ct.train_byte_level(tokenizers) if backend == "byte_level" else ct.sentencepiece(tokenizers)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=cfg["chat_template"], **specials)
    hf.save_pretrained(folder)
    for name in os.listdir(base_folder):  # the model folder holds both
        if not os.path.exists(os.path.join(folder, name)):
            os.symlink(os.path.join(base_folder, name), os.path.join(folder, name))
    return hf


def ids_and_weights(hf, kind, messages):
    """transformers' ids of the rendered conversation, and the loss weight of
    each token built from the assistant spans: 1 for a token starting inside
    an assistant message's content (as the template writes it) or its
    end-of-turn text."""
    _, _, ender, strip = KINDS[kind]
    text = hf.apply_chat_template(messages, tokenize=False)
    ids = hf.apply_chat_template(messages, tokenize=True)
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids, "apply_chat_template's ids are not its text's"
    spans, at = [], 0
    for m in messages:
        if m["role"] != "assistant":
            continue
        body = (m["content"].strip() if strip else m["content"]) + ender
        start = text.index(body, at)
        spans.append((start, start + len(body)))
        at = start + len(body)
    weights = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return ids, weights


def read_instruction_file(path):
    raw = open(path, "rb").read()
    magic, version, n, d = struct.unpack_from("<4i", raw, 0)
    assert magic == 20240521 and version == 1, (magic, version)
    toks = np.frombuffer(raw, dtype="<u4", count=n, offset=1024)
    w = np.frombuffer(raw, dtype=np.uint8, count=n, offset=1024 + 4 * n)
    starts = np.frombuffer(raw, dtype="<u4", count=d + 1, offset=1024 + 5 * n)
    return [(toks[starts[i]:starts[i + 1]].tolist(), w[starts[i]:starts[i + 1]].tolist())
            for i in range(d)]


def lz(*argv, cwd=REPO):
    r = subprocess.run([LUAZERO, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, errors="replace", cwd=cwd)
    return r.returncode, r.stdout


def write_jsonl(path, examples):
    with open(path, "w", encoding="utf-8") as f:
        for m in examples:
            f.write(json.dumps({"messages": m}, ensure_ascii=False) + "\n")


def val_loss(out):
    for line in out.splitlines():
        if line.startswith("val_loss "):
            return float(line.split()[1])
    return None


def hf_loss(torch, model, ids, weights):
    """transformers' loss with labels -100 where a token weighs 0."""
    x = torch.tensor([ids])
    labels = torch.tensor([[t if w else -100 for t, w in zip(ids, weights)]])
    with torch.no_grad():
        return float(model(input_ids=x, labels=labels).loss)


def main():
    check, code, tokenizers, transformers, torch, peft = ct.start("finetune", "torch", "peft",
                                                                  pip="peft==0.10.0 ")
    if code is not None:
        return code
    PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast
    print(f"transformers {transformers.__version__}, peft {peft.__version__}")
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        tiny_llama(transformers, torch, base)
        data = os.path.join(tmp, "chat.jsonl")
        write_jsonl(data, EXAMPLES)
        one = os.path.join(tmp, "one.jsonl")  # the multi-turn example alone
        write_jsonl(one, EXAMPLES[1:2])
        prompts = os.path.join(tmp, "prompts.jsonl")
        write_jsonl(prompts, [PROMPT])
        for kind in KINDS:
            folder = os.path.join(tmp, kind)
            hf = tokenizer_folder(tokenizers, PreTrainedTokenizerFast, kind, folder, base)
            want = [ids_and_weights(hf, kind, m) for m in EXAMPLES]
            # ids: the instruction file's tokens and weights.
            ifile = os.path.join(tmp, kind + ".bin")
            st, out = subprocess.run([os.path.join(REPO, "tools", "prepare-data"), "--format",
                                      "jsonl", "--tokenizer", folder, data, ifile],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=REPO).returncode, ""
            got = read_instruction_file(ifile) if st == 0 else []
            check(f"{kind}.ids", [g[0] for g in got] == [w[0] for w in want],
                  f"{len(got)} examples, {sum(len(g[0]) for g in got)} tokens")
            check(f"{kind}.weights", [g[1] for g in got] == [w[1] for w in want],
                  f"{sum(sum(g[1]) for g in got)} trained")
            # loss: the base model's masked loss on one example (--steps 0 validates).
            model = transformers.LlamaForCausalLM.from_pretrained(base).float().eval()
            ref = hf_loss(torch, model, *want[1])
            st, out = lz("scripts/train.lua", "--init", base, "--tokenizer", folder, "--data", data,
                         "--val-data", one, "--packing", "pad", "--micro-batch", "1",
                         "--seq-len", "128", "--steps", "0")
            ours = val_loss(out)
            err = abs(ours - ref) / abs(ref) if ours is not None else float("inf")
            check(f"{kind}.loss", err <= TOL, f"luazero {ours} transformers {ref:.10g} err {err:.1e}"
                  + ("" if ours is not None else out[-2000:]))
            # peft: a LoRA fine-tune, its adapters exported and loaded by PEFT.
            ck, peft_dir = os.path.join(tmp, kind + "-ck"), os.path.join(tmp, kind + "-peft")
            st, out = lz("scripts/train.lua", "--init", base, "--tokenizer", folder, "--data", data,
                         "--packing", "pad", "--micro-batch", "2", "--seq-len", "128",
                         "--lora-r", "4", "--lr", "0.002", "--steps", "6", "--save", ck,
                         "--log", os.path.join(tmp, kind + ".jsonl"))
            check(f"{kind}.train", st == 0, "" if st == 0 else out[-2000:])
            st, out = lz("tools/ckpt.lua", "export", ck, peft_dir)
            check(f"{kind}.export", st == 0, "" if st == 0 else out[-2000:])
            one_bin = os.path.join(tmp, kind + "-one.bin")
            subprocess.run([os.path.join(REPO, "tools", "prepare-data"), "--format", "jsonl",
                            "--tokenizer", folder, one, one_bin], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, cwd=REPO)
            st, out = lz("scripts/eval.lua", "--hf", base, "--adapters", peft_dir, "--data",
                         one_bin, "--micro-batch", "1", "--seq-len", "128")
            ours = val_loss(out)
            tuned = peft.PeftModel.from_pretrained(model, peft_dir).eval()
            ref = hf_loss(torch, tuned, *want[1])
            err = abs(ours - ref) / abs(ref) if ours is not None else float("inf")
            check(f"{kind}.peft_loss", err <= TOL,
                  f"luazero {ours} peft {ref:.10g} err {err:.1e}" + ("" if ours is not None else out[-2000:]))
            # generate: greedy, the chat prompt, against transformers + PEFT.
            gen_out = os.path.join(tmp, kind + "-gen.jsonl")
            st, out = lz("scripts/generate.lua", "--hf", folder, "--adapters", peft_dir, "--chat", "--prompts", prompts,
                         "--max-new-tokens", "16", "--out", gen_out)
            rec = json.loads(open(gen_out).readline()) if st == 0 else {}
            x = hf.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
            with torch.no_grad():
                y = tuned.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                   max_new_tokens=16, eos_token_id=hf.eos_token_id,
                                   pad_token_id=hf.eos_token_id)
            ref_ids = y[0, x.shape[1]:].tolist()
            check(f"{kind}.generate", st == 0 and rec.get("ids") == ref_ids and len(ref_ids) >= 8,
                  f"{ref_ids}" if st == 0 else out[-2000:])
            if st == 0 and rec.get("ids") != ref_ids:
                print(f"  luazero {rec}")
        # The folder docs/finetune.md makes: this file's model and its
        # SentencePiece-style tokenizer, as plain files.
        import make_tiny_chat_model
        made = os.path.join(tmp, "made")
        code = make_tiny_chat_model.main([made])
        same = code == 0 and all(
            open(os.path.join(made, n), "rb").read() ==
            open(os.path.join(tmp, "sentencepiece", n), "rb").read()
            for n in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"))
        check("docs_tiny_folder", same and not any(
            os.path.islink(os.path.join(made, n)) for n in os.listdir(made)), f"exit {code}")
        # A plain prompt's ids are transformers' tokenizer(prompt): its BOS
        # comes from tokenizer.json's post-processor (no add_bos_token).
        hf = PreTrainedTokenizerFast.from_pretrained(made)
        plain = os.path.join(tmp, "plain.jsonl")
        st, out = lz("scripts/generate.lua", "--hf", made, "--prompt", "Hello world",
                     "--max-new-tokens", "1", "--out", plain)
        ids = json.loads(open(plain).readline())["prompt_ids"] if st == 0 else None
        check("plain_prompt_ids", ids == hf("Hello world").input_ids,
              f"luazero {ids}, transformers {hf('Hello world').input_ids}")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
