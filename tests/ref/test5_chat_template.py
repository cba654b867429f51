"""test5_chat_template.py — the chat templates of Qwen2.5, Qwen3, Gemma 2,
Gemma 3, Phi-3 and Mistral v0.3 against transformers 5.23's apply_chat_template.

The templates are the published ones, committed under tests/fixtures/chat/
(each folder's PROVENANCE names the model and file). For each, this saves a
Hugging Face tokenizer folder with transformers 5.23 (its renderer is the
judge: tojson as transformers writes it, keys in their order, UTF-8 kept) over
a tokenizer of the family's kind trained here with `tokenizers` (Qwen2's
byte-level BPE with NFC and its split; Gemma's 256k-shaped SentencePiece BPE;
Llama 2's layout for Phi-3 and Mistral), renders conversations with system, user and
assistant turns (multi-turn, Unicode and odd whitespace), tools and tool calls
and tool results where the template has them (Qwen2.5, Qwen3, Mistral v0.3:
its 9-character call ids, refused when shorter), thinking on and
off (Qwen3: enable_thinking, reasoning_content, a <think> block in the
content), list contents (Gemma 3), each with add_generation_prompt off and on,
through transformers and through luazero (tests/ref/chat_render.lua), and
checks: the same text, the same refusals (raise_exception), the same ids as
`tokenizers` for the text, and that each assistant span holds the message's
content (its answer, after a <think> block) and ends with the template's
end-of-turn token. The fixture itself
renders the same as the folder transformers wrote (chat_template.jinja).

Runs with the second reference environment's python (tests/ref/run.py does
that; or /root/.cache/luazero/ref5-venv/bin/python tests/ref/test5_chat_template.py);
without it, or without the corpus, prints a skip line and "0 passed, 0 failed".
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_tokenizer as tt  # noqa: E402  (the corpus, the tokenizer layouts, Checks)
from refenv import LUAZERO, REPO  # noqa: E402

FIXTURES = os.path.join(REPO, "tests", "fixtures", "chat")

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                 "<think>", "</think>"]
PHI_SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]
MISTRAL_SPECIALS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]

CONVERSATIONS = [
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "  Two  spaces, a tab\tand a newline\n"},
     {"role": "assistant", "content": "\nSure:\n\n- one\n- two  "},
     {"role": "user", "content": "Now in Unicode: café, 日本語, 😀, e\u0301."},
     {"role": "assistant", "content": "Ça marche — 好的 👍"}],
    [{"role": "user", "content": "Hello?"}],
    [{"role": "system", "content": "Only a system message."}],
    [{"role": "user", "content": "A"}, {"role": "user", "content": "B"}],
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, now.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "Its name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "now", "description": "The time; no arguments.",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
]

TOOL_TURNS = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Zürich and the time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather",
                                          "arguments": {"unit": "celsius", "city": "Zürich"}}},
        {"type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
    {"role": "tool", "content": "12:00"},
    {"role": "assistant", "content": "21 °C and clear; it is noon."},
]


def case(messages, spans=True, **variables):
    return {"messages": messages, "vars": variables, "spans": spans}


def tool_cases(arguments_as_text=False):
    turns = json.loads(json.dumps(TOOL_TURNS))
    if arguments_as_text:
        for call in turns[2]["tool_calls"]:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    # No spans: an assistant turn of tool calls alone has an empty content,
    # so an empty span (its tool calls are template text around it).
    return [case(turns, spans=False, tools=TOOLS), case(turns[1:], spans=False, tools=TOOLS),
            case(turns[1:2], tools=TOOLS)]


# Mistral's tool calls carry 9-character ids; its tool results name them.
MISTRAL_TOOL_TURNS = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "tool_calls": [
        {"id": "call00001", "type": "function",
         "function": {"name": "get_weather", "arguments": {"unit": "celsius", "city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "call00001", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "21 °C."},
    {"role": "user", "content": "Thanks!"},
]

THINK = [{"role": "user", "content": "2 + 2?"},
         {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4."},
         {"role": "user", "content": "And 3 + 3?"},
         {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n6."}]
REASONED = [{"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}]

# name: (tokenizer kind, end-of-turn token, extra cases)
FAMILIES = {
    "qwen2.5": ("qwen", "<|im_end|>", tool_cases()),
    "qwen3": ("qwen", "<|im_end|>", tool_cases() + tool_cases(arguments_as_text=True) + [
        case(CONVERSATIONS[0], enable_thinking=False), case(CONVERSATIONS[1], enable_thinking=True),
        case(THINK), case(THINK, enable_thinking=False),
        case(REASONED), case(REASONED[:1] + [{"role": "assistant", "content": "\n\n4."}])]),
    "gemma2": ("gemma", "<end_of_turn>", []),
    "gemma3": ("gemma", "<end_of_turn>", [
        case([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
              {"role": "user", "content": [{"type": "text", "text": " Hi "},
                                           {"type": "text", "text": "there"}]},
              {"role": "assistant", "content": "Hello."}])]),
    "phi3": ("phi", "<|end|>", []),
    "mistral-v0.3": ("mistral", "</s>", [
        case(MISTRAL_TOOL_TURNS, tools=TOOLS), case(MISTRAL_TOOL_TURNS[:2], tools=TOOLS),
        case(MISTRAL_TOOL_TURNS[1:], tools=TOOLS),
        case([{"role": "user", "content": "Same"}, {"role": "assistant", "content": "A"},
              {"role": "user", "content": "Same"}], tools=TOOLS),
        case(MISTRAL_TOOL_TURNS[1:3] + [{"role": "tool", "tool_call_id": "short", "content": "x"}],
             tools=TOOLS)]),
}


def qwen_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers
    q = Tokenizer(models.BPE())
    q.normalizer = normalizers.NFC()
    q.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tt.QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    q.decoder = decoders.ByteLevel()
    q.post_processor = processors.ByteLevel(trim_offsets=False)
    q.train([tt.CORPUS, tt.UNICODE], trainers.BpeTrainer(
        vocab_size=1000, special_tokens=QWEN_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return q


def gemma_tokenizer(tokenizers):
    from tokenizers import Tokenizer
    return Tokenizer.from_str(json.dumps(tt.gemma_spec(tokenizers)))


def llama2_layout_tokenizer(tokenizers, specials, rstrip=()):
    """Llama 2's layout (Phi-3's and Mistral's kind) with the template's control
    tokens; those in rstrip take the blanks after them (Phi-3's turn tokens)."""
    from tokenizers import AddedToken, Tokenizer
    spec = tt.sentencepiece_spec(tokenizers)
    spec.update(normalizer=tt.LLAMA2_NORMALIZER, decoder=tt.LLAMA2_DECODER,
                post_processor=tt.LLAMA2_POST)
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=t in rstrip)
                            for t in specials])
    return tok


def span_problems(where, mine, messages, ender):
    """Each assistant span holds its content (as the template trims it; the
    answer after a </think>) and ends with the end-of-turn token."""
    out = []
    contents = [m["content"] for m in messages
                if m["role"] == "assistant" and isinstance(m.get("content"), str)]
    spans = mine.get("spans") or []
    if len(spans) != len(contents):
        return [f"{where}: {len(spans)} spans for {len(contents)} assistant messages"]
    data = mine["text"].encode("utf-8")
    for s, content in zip(spans, contents):
        got = data[s["first"]:s["last"]].decode("utf-8")
        answer = content.split("</think>")[-1].strip()
        if answer not in got or not got.endswith(ender) or s["role"] != "assistant":
            out.append(f"{where}: span {got!r} for content {content!r}")
    return out


def main():
    check = tt.Checks("chat_template5")
    tokenizers, why = tt.import_tokenizers()
    try:
        import jinja2  # noqa: F401
        import transformers
    except ImportError as e:
        why = why or f"cannot import {e.name}: run with the reference environment 5 (tools/setup)"
    code = tt.preflight(check, why)
    if code is not None:
        return code
    if not transformers.__version__.startswith("5."):
        print(f"skip chat_template5: transformers {transformers.__version__} is not 5.x: run with "
              "the reference environment 5's python (tests/ref/run.py does)")
        print("0 passed, 0 failed")
        return 0
    transformers.logging.set_verbosity_error()
    from jinja2.exceptions import TemplateError
    print(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")
    backends = {"qwen": qwen_tokenizer(), "gemma": gemma_tokenizer(tokenizers),
                "phi": llama2_layout_tokenizer(tokenizers, PHI_SPECIALS, rstrip=PHI_SPECIALS[1:]),
                "mistral": llama2_layout_tokenizer(tokenizers, MISTRAL_SPECIALS)}

    with tempfile.TemporaryDirectory() as tmp:
        for name, (kind, ender, extra) in FAMILIES.items():
            with open(os.path.join(FIXTURES, name, "tokenizer_config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
            specials = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                        if cfg.get(k) is not None}
            backend = backends[kind]
            hf = transformers.PreTrainedTokenizerFast(
                tokenizer_object=backend.__class__.from_str(backend.to_str()),
                chat_template=cfg["chat_template"], **specials)
            folder = os.path.join(tmp, name)
            hf.save_pretrained(folder)
            cases = [case(c) for c in CONVERSATIONS] + extra
            cases_path = os.path.join(tmp, name + "-cases.json")
            with open(cases_path, "w", encoding="utf-8") as f:
                json.dump(cases, f, ensure_ascii=False)
            out = os.path.join(tmp, name + ".json")

            def render():
                run = subprocess.run([LUAZERO, os.path.join(HERE, "chat_render.lua"), folder,
                                      cases_path, out], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=REPO)
                if run.returncode != 0:
                    return None, run.stdout.strip()[-2000:]
                with open(out, encoding="utf-8") as f:
                    return json.load(f), ""

            ours, err = render()
            check(f"{name}.runs", ours is not None, err)
            if ours is None:
                continue
            problems = {"text": [], "refusal": [], "ids": [], "span": []}
            rendered = refused = 0
            k = 0
            for ci, c in enumerate(cases):
                for agp in (False, True):
                    mine = ours[k]
                    k += 1
                    where = f"case {ci} add_generation_prompt={agp}"
                    try:
                        want = hf.apply_chat_template(c["messages"], tokenize=False,
                                                      add_generation_prompt=agp, **c["vars"])
                    except TemplateError as e:
                        refused += 1
                        if "error" not in mine or str(e) not in mine["error"] or \
                                "\n" in mine["error"]:
                            problems["refusal"].append(f"{where}: transformers refuses ({e}); "
                                                       f"luazero {mine.get('error', 'renders')!r}")
                        continue
                    if "error" in mine:
                        problems["text"].append(f"{where}: luazero refuses: {mine['error']}")
                        continue
                    rendered += 1
                    if mine["text"] != want:
                        problems["text"].append(f"{where}: luazero {mine['text']!r} "
                                                f"transformers {want!r}")
                        continue
                    want_ids = backend.encode(want, add_special_tokens=False).ids
                    if mine["ids"] != want_ids:
                        problems["ids"].append(f"{where}: luazero {mine['ids'][:12]} tokenizers "
                                               f"{want_ids[:12]}")
                    if c["spans"]:
                        problems["span"] += span_problems(where, mine, c["messages"], ender)
            check(f"{name}.same_text", not problems["text"] and rendered > 0,
                  f"{rendered} renderings " + "; ".join(problems["text"])[:2500])
            check(f"{name}.same_refusals", not problems["refusal"],
                  f"{refused} refused " + "; ".join(problems["refusal"])[:1500])
            check(f"{name}.same_ids", not problems["ids"], "; ".join(problems["ids"])[:1500])
            check(f"{name}.assistant_spans", not problems["span"], "; ".join(problems["span"])[:1500])
            # transformers 5 wrote chat_template.jinja; the fixture's own config renders the same.
            shutil.copy(os.path.join(FIXTURES, name, "tokenizer_config.json"),
                        os.path.join(folder, "tokenizer_config.json"))
            os.remove(os.path.join(folder, "chat_template.jinja"))
            again, err = render()
            check(f"{name}.fixture_renders_the_same", again is not None and
                  [a.get("text") for a in again] == [a.get("text") for a in ours], err)

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
