"""test_chat_template.py — luazero's chat templates against transformers.

For the chat templates of Llama 3, Zephyr/TinyLlama, ChatML, Llama 2 and
Mistral (tests/fixtures/chat/*/tokenizer_config.json) this saves a Hugging
Face tokenizer folder with transformers (a byte-level BPE for Llama 3 and
ChatML, a SentencePiece-style one for the others, each trained with
`tokenizers` on ../shared/data/tinyshakespeare.txt and holding the
template's special tokens), renders several conversations (system, user and
assistant, multi-turn, Unicode and odd whitespace, special tokens inside a
message) with add_generation_prompt off and on through transformers'
apply_chat_template and through luazero (tests/ref/chat_render.lua), and
checks: the same text (tokenize=False), the same ids (tokenize=True against
luazero's tokenizer on luazero's text), the same refusals (a template's
raise_exception), and that each assistant span is the message's content as
the template writes it followed by its end-of-turn token, whose id ends the
tokens starting inside the span.

Without transformers, jinja2 or tokenizers (tools/setup puts them in
build/ref-venv), or without the corpus, prints a skip line and "0 passed, 0
failed".

    /usr/bin/python3 tests/ref/test_chat_template.py     # ends with "N passed, N failed"
"""
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_tokenizer as tt  # noqa: E402  (the corpus, the venv, the SentencePiece layout)
from refenv import LUAZERO, REPO  # noqa: E402

FIXTURES = os.path.join(REPO, "tests", "fixtures", "chat")

BYTE_LEVEL_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                       "<|end_header_id|>", "<|eot_id|>", "<|endoftext|>", "<|im_start|>",
                       "<|im_end|>"]

# name: (tokenizer kind, what an assistant span holds: its content as written,
# then this end-of-turn text; strip: whether the template strips the content)
MODELS = {
    "llama3": ("byte_level", "<|eot_id|>", True),
    "zephyr": ("sentencepiece", "</s>", False),
    "chatml": ("byte_level", "<|im_end|>", False),
    "llama2": ("sentencepiece", " </s>", True),  # and the " " written before the content
    "mistral": ("sentencepiece", "</s>", False),
}

CONVERSATIONS = [
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "  Two  spaces, a tab\tand a newline\n"},
     {"role": "assistant", "content": "\nSure:\n\n- one\n- two  "},
     {"role": "user", "content": "Now in Unicode: café, 日本語, 😀, e\u0301."},
     {"role": "assistant", "content": "Ça marche — 好的 👍"}],
    [{"role": "user", "content": "Hello?"}],
    [{"role": "user", "content": "Say </s> or <|eot_id|> or <|im_end|> back."},
     {"role": "assistant", "content": "</s> <|eot_id|> <|im_end|>"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    [{"role": "system", "content": "Only a system message."}],
]


def train_byte_level(tokenizers):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([tt.CORPUS], trainers.BpeTrainer(
        vocab_size=800, special_tokens=BYTE_LEVEL_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def sentencepiece(tokenizers):
    from tokenizers import Tokenizer
    spec = tt.sentencepiece_spec(tokenizers)
    spec.update(normalizer=tt.LLAMA2_NORMALIZER, decoder=tt.LLAMA2_DECODER,
                post_processor=tt.LLAMA2_POST)
    return Tokenizer.from_str(json.dumps(spec))


def start(name, *more, pip=""):
    """The checks of suite `name`, the exit code when it cannot run (see
    tt.preflight; None to go on), then tokenizers, transformers and the
    modules named in `more` (None where one is missing); pip: what more to
    install for them."""
    check = tt.Checks(name)
    tokenizers, why = tt.import_tokenizers()
    modules = [None] * (1 + len(more))
    try:
        import jinja2  # noqa: F401
        modules = [importlib.import_module(m) for m in ("transformers",) + more]
    except ImportError as e:
        why = why or (f"cannot import {e.name} (pip install transformers==4.40.2 jinja2 {pip}into "
                      f"{tt.VENV}, or run tools/setup)")
    return (check, tt.preflight(check, why), tokenizers, *modules)


def main():
    check, code, tokenizers, transformers = start("chat_template")
    if code is not None:
        return code
    PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast
    print(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")
    from jinja2.exceptions import TemplateError

    backends = {"byte_level": train_byte_level(tokenizers),
                "sentencepiece": sentencepiece(tokenizers)}
    with tempfile.TemporaryDirectory() as tmp:
        conv_path = os.path.join(tmp, "conversations.json")
        with open(conv_path, "w", encoding="utf-8") as f:
            json.dump(CONVERSATIONS, f, ensure_ascii=False)
        for name, (kind, ender, strip) in MODELS.items():
            with open(os.path.join(FIXTURES, name, "tokenizer_config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
            specials = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                        if cfg.get(k) is not None}
            hf = PreTrainedTokenizerFast(tokenizer_object=backends[kind].__class__.from_str(
                backends[kind].to_str()), chat_template=cfg["chat_template"], **specials)
            folder = os.path.join(tmp, name)
            hf.save_pretrained(folder)
            out = os.path.join(tmp, name + ".json")
            run = subprocess.run([LUAZERO, os.path.join(HERE, "chat_render.lua"), folder, conv_path,
                                  out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 cwd=REPO)
            check(f"{name}.runs", run.returncode == 0, run.stdout.strip()[-2000:])
            if run.returncode != 0:
                continue
            with open(out, encoding="utf-8") as f:
                ours = json.load(f)
            k = 0
            texts_same = ids_same = refusals_same = spans_ok = True
            details = {"text": [], "ids": [], "refusal": [], "span": []}
            rendered = 0
            for ci, conv in enumerate(CONVERSATIONS):
                for agp in (False, True):
                    mine = ours[k]
                    k += 1
                    where = f"conversation {ci} add_generation_prompt={agp}"
                    try:
                        want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=agp)
                        want_ids = hf.apply_chat_template(conv, tokenize=True,
                                                          add_generation_prompt=agp)
                    except TemplateError as e:
                        if "error" not in mine or str(e) not in mine["error"] or \
                                "\n" in mine["error"]:
                            refusals_same = False
                            details["refusal"].append(f"{where}: transformers refuses ({e}); "
                                                      f"luazero {mine.get('error', 'renders')!r}")
                        continue
                    if "error" in mine:
                        texts_same = False
                        details["text"].append(f"{where}: luazero refuses: {mine['error']}")
                        continue
                    rendered += 1
                    if mine["text"] != want:
                        texts_same = False
                        details["text"].append(f"{where}: luazero {mine['text']!r} "
                                               f"transformers {want!r}")
                    ids = mine["ids"] or []
                    if ids != want_ids:
                        ids_same = False
                        details["ids"].append(f"{where}: luazero {ids[:12]} transformers "
                                              f"{want_ids[:12]}")
                    # Spans: one per assistant message, its content then the end of turn.
                    spans = mine["spans"] or []
                    assistants = [m["content"] for m in conv if m["role"] == "assistant"]
                    data = mine["text"].encode("utf-8")
                    ender_id = hf.convert_tokens_to_ids(ender.strip())
                    starts = mine["starts"] or []
                    if len(spans) != len(assistants):
                        spans_ok = False
                        details["span"].append(f"{where}: {len(spans)} spans for "
                                               f"{len(assistants)} assistant messages")
                    for s, content in zip(spans, assistants):
                        got = data[s["first"]:s["last"]].decode("utf-8")
                        body = content.strip() if strip else content
                        if name == "llama2":
                            body = " " + body
                        inside = [i for i, st in zip(ids, starts) if s["first"] <= st < s["last"]]
                        if got != body + ender or s["role"] != "assistant" or \
                                not inside or inside[-1] != ender_id:
                            spans_ok = False
                            details["span"].append(f"{where}: span {got!r}, want "
                                                   f"{body + ender!r}; its last token "
                                                   f"{inside[-1:] } (end of turn {ender_id})")
                    # token_mask: the tokens overlapping the spans decode to every
                    # assistant content (a first word glued to the blank before it
                    # too), blanks aside (a SentencePiece decode of a part adds some).
                    mask = mine["mask"] or []
                    masked = " ".join(hf.decode([i for i, m in zip(ids, mask) if m == 1]).split())
                    for content in assistants:
                        body = " ".join(content.split())
                        if body and body not in masked:
                            spans_ok = False
                            details["span"].append(f"{where}: token_mask's tokens decode to "
                                                   f"{masked!r}, without {body.strip()!r}")
            check(f"{name}.same_text", texts_same and rendered > 0,
                  f"{rendered} renderings " + "; ".join(details["text"])[:1500])
            check(f"{name}.same_ids", ids_same, "; ".join(details["ids"])[:1500])
            check(f"{name}.same_refusals", refusals_same, "; ".join(details["refusal"])[:1500])
            check(f"{name}.assistant_spans", spans_ok, "; ".join(details["span"])[:1500])
            # The config transformers wrote loads, and so does the fixture itself.
            shutil.copy(os.path.join(FIXTURES, name, "tokenizer_config.json"),
                        os.path.join(folder, "tokenizer_config.json"))
            run = subprocess.run([LUAZERO, os.path.join(HERE, "chat_render.lua"), folder, conv_path,
                                  out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 cwd=REPO)
            with open(out, encoding="utf-8") as f:
                from_fixture = json.load(f)
            check(f"{name}.fixture_renders_the_same", run.returncode == 0 and all(
                a.get("text") == b.get("text") for a, b in zip(ours, from_fixture)),
                run.stdout.strip()[-500:])

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
