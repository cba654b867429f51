"""test_tokenizer.py — luazero's tokenizer.json BPE against Hugging Face tokenizers.

Trains a byte-level BPE (vocabulary 1000, special token <|endoftext|>) with
`tokenizers` on ../shared/data/tinyshakespeare.txt (relative to the repository
root), saves its tokenizer.json, and encodes the whole corpus and texts with
special tokens, Unicode and odd whitespace with both `tokenizers` and luazero
(tests/ref/tokenize.lua); the same for a Llama 3 kind of tokenizer.json (Split
with Llama 3's pattern, ByteLevel without a regex, ignore_merges,
TemplateProcessing); and for SentencePiece-style ones (Llama 2, Mistral,
TinyLlama, Phi-3: a BPE with byte_fallback trained here, <0xNN> byte tokens
added at ids 3..258 as in Llama 2's vocabulary) in nine layouts: Llama 2's
Prepend/Replace normalizer with its Replace/ByteFallback/Fuse/Strip decoder,
Metaspace (first, always, never; split or not) with either decoder or none,
unknown tokens fused or not without byte_fallback, normalized added tokens,
Phi-3's added tokens that take the blanks beside them (lstrip, rstrip); then
Qwen2's kind (an NFC normalizer, Split with Qwen2's pattern, ByteLevel) and
Gemma's (its Replace normalizer and Split on " ", byte fallback, 256,000 ids)
trained on the corpus and tests/fixtures/tokenizer/unicode_corpus.txt.
Checks: identical ids, identical offsets (luazero's byte offsets read as the
character tokenizers counts), decode round-trips and decode as tokenizers
does with and without special tokens, bos and eos ids, the same ids from
"a b" string merges as from [a, b] list merges, tools/prepare-data
--tokenizer writes the same ids (also cutting a long text into pieces of a
few KB, for each kind), and an unsupported tokenizer.json is refused
naming the field; a vocabulary over 65536 writes token file version 2.
Prints encoding MB/s of both.

Without `tokenizers` (pip install tokenizers; tools/setup makes build/ref-venv)
or without the corpus, prints a skip line and "0 passed, 0 failed": a skipped
test counts as neither passed nor failed. LZ_REF_VENV names a virtual
environment to take `tokenizers` from (default build/ref-venv).

    /usr/bin/python3 tests/ref/test_tokenizer.py     # ends with "N passed, N failed"
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402  (test_chat_template.py, test_finetune.py use it as tt.Checks)

from refenv import LUAZERO, REPO, VENV, import_from_venv  # noqa: E402,F401  (VENV: for tt.VENV)


def find_corpus():
    """../shared/data/tinyshakespeare.txt beside the repository, or beside the
    main checkout when this is a git worktree."""
    places = [REPO]
    try:
        common = subprocess.run(["git", "-C", REPO, "rev-parse", "--git-common-dir"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if common.returncode == 0:
            places.append(os.path.dirname(os.path.abspath(os.path.join(REPO, common.stdout.strip()))))
    except OSError:
        pass
    for place in places:
        path = os.path.join(place, "..", "shared", "data", "tinyshakespeare.txt")
        if os.path.exists(path):
            return path
    return os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt")


CORPUS = find_corpus()
# Committed: NFD input, marks out of canonical order, singletons and
# composition exclusions, Hangul (composed and as jamo), CJK, emoji (ZWJ,
# flags, skin tones), whitespace runs, digits of several scripts.
UNICODE = os.path.join(REPO, "tests", "fixtures", "tokenizer", "unicode_corpus.txt")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TEXTS = {
    "special": "Hello<|endoftext|>world's  I'm\t\tcafé — naïve “quotes” 日本語 😀 ½ ٣٤ x²"
               "\u00a0y\u2003z\n\n\n  end  <|endoftext|><|endoftext|>",
    "contractions": "'s 'S ''s it's they're we've I'll he'd 'm 'x' ' s",
    "whitespace": "a  b   c\t\td\n\ne \n f\r\n\r\ng\u3000h\u2028i  \n  \n",
    "numbers": "123abc ab123 1,000.50 ...!!?? #$%^&*() \x00\x01\x7f é1 ١٢٣",
    "trailing": "ends with spaces   ",
    "only_space": "   ",
    "one_newline": "\n",
    "empty": "",
    "llama_cases": "'S 'T 'RE 'Ll \"Hello (x) 12345678 a1b22c333 \t\tfoo  \n \n\t x.\n\n\r\n!!\n\n",
    "invalid_utf8_free": "Ωμέγα Привет мир مرحبا שלום नमस्ते 中文字符 한국어",
    "byte_fallback": "e\u0301 n\u0303o 😀👍🏽 🇫🇷 日本語の テキスト \u200b\ufeff \U0001F9EA ∑∫√ ﬁ",
    "sp_specials": "<s>Hello</s> world<s>  two  spaces</s>\n</s></s>x<unk> <s>",
    "leading_spaces": "   three leading, one trailing \n\ttab\t and\r\nCRLF ",
    "lone_space": " ",
    "newlines_only": "\n\n\n",
    "metaspace_in_text": "a\u2581b \u2581 c\u2581\u2581 <s>\u2581</s>\u2581",
    "phi3_turns": "<|system|>\nBe brief.<|end|>\n<|user|>\n  Hi\tthere <|end|>\n<|assistant|>\n"
                  "Hello!<|end|>\n<|endoftext|>  x  <|system|> y\u3000<|end|>\u3000\n z<|user|>",
    "gemma_turns": "<bos><start_of_turn>user\nHi  there<end_of_turn>\n<start_of_turn>model\n"
                   "日本 😀<end_of_turn>\n<eos>",
}


def import_tokenizers():
    try:
        import tokenizers
        return tokenizers, None
    except ImportError:
        return import_from_venv("tokenizers")


def read_token_file(path):
    with open(path, "rb") as f:
        magic, version, n = struct.unpack("<3i", f.read(12))
        f.seek(1024)
        body = f.read()
    width, code = (4, "I") if version == 2 else (2, "H")  # uint32 ids in version 2
    return magic, version, list(struct.unpack(f"<{n}{code}", body[:width * n]))


def char_starts(text, byte_starts):
    """Byte offsets in text as the index of the character holding each byte
    (tokenizers' Python offsets count characters)."""
    of_byte = []
    for i, c in enumerate(text):
        of_byte.extend([i] * len(c.encode("utf-8")))
    of_byte.append(len(text))
    return [of_byte[min(b, len(of_byte) - 1)] for b in byte_starts]


def sentencepiece_spec(tk):
    """A SentencePiece-style BPE (Llama 2's layout: <unk> <s> </s>, then the 256
    <0xNN> byte tokens, then the merged pieces) trained on the corpus with
    tokenizers, as a tokenizer.json dict without normalizer or pre-tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    base = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                  split=True)
    base.train([CORPUS], trainers.BpeTrainer(vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"],
                                             show_progress=False))
    spec = json.loads(base.to_str())
    old = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for t, i in old if i < 3}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({t: i + 256 for t, i in old if i >= 3})
    spec["model"]["vocab"] = vocab
    spec["normalizer"] = spec["pre_tokenizer"] = spec["decoder"] = spec["post_processor"] = None
    return spec


LLAMA2_NORMALIZER = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "\u2581"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
LLAMA2_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
LLAMA2_POST = {"type": "TemplateProcessing",
               "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}}],
               "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}},
                        {"SpecialToken": {"id": "<s>", "type_id": 1}},
                        {"Sequence": {"id": "B", "type_id": 1}}],
               "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}


def metaspace(scheme, split):
    return {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": split}


def check_sentencepiece(check, tk, tmp, texts, run_lua):
    """Llama 2 / Mistral / TinyLlama kinds of tokenizer.json against tokenizers:
    ids, offsets and decoding (with and without special tokens)."""
    from tokenizers import Tokenizer
    spec = sentencepiece_spec(tk)
    check("sentencepiece.trained", len(spec["model"]["vocab"]) == 1200 + 256 and
          spec["model"]["byte_fallback"], f"vocab {len(spec['model']['vocab'])}")

    def variant(edit):
        v = json.loads(json.dumps(spec))
        edit(v)
        return v

    def legacy(v):  # Llama 2, TinyLlama, Mistral v0.1: Prepend + Replace, no pre-tokenizer
        v.update(normalizer=LLAMA2_NORMALIZER, decoder=LLAMA2_DECODER, post_processor=LLAMA2_POST)

    def phi3(v):  # Phi-3's control tokens take the blanks after them (rstrip); one, before too
        legacy(v)
        n = max(v["model"]["vocab"].values()) + 1
        for k, (t, left, right) in enumerate([
                ("<|endoftext|>", False, False), ("<|assistant|>", False, True), ("<|end|>", False, True),
                ("<|user|>", False, True), ("<|system|>", True, True)]):
            v["added_tokens"].append({"id": n + k, "content": t, "single_word": False, "lstrip": left,
                                      "rstrip": right, "normalized": False, "special": True})

    variants = {
        "legacy": variant(legacy),
        "phi3_strip": variant(phi3),
        "metaspace_first": variant(lambda v: v.update(pre_tokenizer=metaspace("first", False),
                                                      decoder=metaspace("first", False))),
        "metaspace_always_split": variant(lambda v: v.update(pre_tokenizer=metaspace("always", True),
                                                             decoder=LLAMA2_DECODER)),
        "metaspace_never": variant(lambda v: v.update(pre_tokenizer=metaspace("never", True),
                                                      decoder=metaspace("never", True))),
        "unk_fused": variant(lambda v: (legacy(v), v["model"].update(byte_fallback=False))),
        "unk_unfused": variant(lambda v: (legacy(v), v["model"].update(byte_fallback=False,
                                                                       fuse_unk=False))),
        "normalized_added": variant(lambda v: (legacy(v), [a.update(normalized=True)
                                                           for a in v["added_tokens"]])),
        "no_decoder": variant(lambda v: v.update(pre_tokenizer=metaspace("always", True))),
    }
    with_corpus = {"legacy", "metaspace_first"}
    for name, v in variants.items():
        path = os.path.join(tmp, f"tokenizer-sp-{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(v, f, ensure_ascii=False)
        hf = Tokenizer.from_file(path)
        names = [n for n in texts if n != "corpus" or name in with_corpus]
        lua, err = run_lua(path, names)
        check(f"sentencepiece.{name}.runs", lua is not None, err.strip()[-2000:])
        if lua is None:
            continue
        bad_ids, bad_offsets, bad_decode = [], [], []
        for n in names:
            enc = hf.encode(texts[n], add_special_tokens=False)
            ids, decoded, _, starts, decoded_skip = lua[n]
            if ids != enc.ids:
                k = next((i for i, (a, b) in enumerate(zip(ids, enc.ids)) if a != b),
                         min(len(ids), len(enc.ids)))
                bad_ids.append(f"{n}: first difference at token {k}: luazero {ids[k:k + 6]} "
                               f"tokenizers {enc.ids[k:k + 6]} {enc.tokens[k:k + 6]}")
                continue
            if char_starts(texts[n], starts) != [o[0] for o in enc.offsets]:
                got = char_starts(texts[n], starts)
                k = next(i for i, (a, b) in enumerate(zip(got, enc.offsets)) if a != b[0])
                bad_offsets.append(f"{n}: token {k} {enc.tokens[k]!r}: luazero {got[k]} "
                                   f"tokenizers {enc.offsets[k][0]}")
            want = hf.decode(enc.ids, skip_special_tokens=False)
            want_skip = hf.decode(enc.ids, skip_special_tokens=True)
            if decoded != want or decoded_skip != want_skip:
                bad_decode.append(f"{n}: luazero {decoded[:50]!r} / {decoded_skip[:50]!r} "
                                  f"tokenizers {want[:50]!r} / {want_skip[:50]!r}")
        check(f"sentencepiece.{name}.same_ids", not bad_ids, "; ".join(bad_ids)[:1500])
        check(f"sentencepiece.{name}.offsets", not bad_offsets, "; ".join(bad_offsets)[:1500])
        check(f"sentencepiece.{name}.decode", not bad_decode, "; ".join(bad_decode)[:1500])
        stats = lua[names[0]][2]
        check(f"sentencepiece.{name}.bos_eos", (stats["bos_id"], stats["eos_id"]) == (1, 2),
              f"bos_id {stats['bos_id']} eos_id {stats['eos_id']}")
        if name in ("legacy", "metaspace_first", "phi3_strip"):
            prepare_in_pieces(check, f"sentencepiece.{name}", path, texts, tmp, hf)
        if name == "legacy":
            print(f"speed: sentencepiece legacy: corpus {lua['corpus'][2]['bytes'] / 1e6:.2f} MB "
                  f"in {lua['corpus'][2]['seconds']:.2f} s (one word: no pre-tokenizer)")


def prepare_in_pieces(check, prefix, path, texts, tmp, tok=None):
    """tools/prepare-data cuts a long text into pieces of a few KB
    (LZ_PREPARE_PIECE_BYTES; tokenizer/stream.lua) and writes the ids
    tokenizers gives for the whole text."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(path) if tok is None else tok
    others = "\n".join(texts[n] for n in sorted(texts) if n != "corpus")
    text = texts["corpus"][:300000] + "\n" + (others + "\n") * 4 + texts["corpus"][300000:400000]
    src, out = os.path.join(tmp, prefix + "-long.txt"), os.path.join(tmp, prefix + "-long.bin")
    with open(src, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    r = subprocess.run([os.path.join(REPO, "tools", "prepare-data"), "--tokenizer", path, src, out],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, LUAZERO=LUAZERO, LZ_PREPARE_PIECE_BYTES="5000"))
    want = tok.encode(text, add_special_tokens=False).ids
    got = read_token_file(out)[2] if r.returncode == 0 else None
    detail = r.stdout.strip()[-500:]
    if got is not None and got != want:
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        detail = (f"{len(got)} ids against {len(want)}; first difference at token {k}: luazero "
                  f"{got[k:k + 6]} tokenizers {want[k:k + 6]}")
    check(f"{prefix}.prepare_data_in_pieces", got == want, detail)


def compare(check, prefix, hf, path, texts, run_lua, round_trip):
    """ids, offsets and decoding (with and without special tokens) of luazero
    against tokenizers for every text; round_trip: decoding gives the text back."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(path) if hf is None else hf
    lua, err = run_lua(path, list(texts))
    check(f"{prefix}.runs", lua is not None, err.strip()[-2000:])
    if lua is None:
        return None
    for n, text in texts.items():
        enc = tok.encode(text, add_special_tokens=False)
        ids, decoded, _, starts, decoded_skip = lua[n]
        detail = f"{len(ids)} tokens"
        if ids != enc.ids:
            k = next((i for i, (a, b) in enumerate(zip(ids, enc.ids)) if a != b),
                     min(len(ids), len(enc.ids)))
            detail = (f"first difference at token {k}: luazero {ids[k:k + 6]} tokenizers "
                      f"{enc.ids[k:k + 6]} {enc.tokens[k:k + 6]}")
        check(f"{prefix}.same_ids.{n}", ids == enc.ids, detail)
        got = char_starts(text, starts)
        want = [o[0] for o in enc.offsets]
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        check(f"{prefix}.offsets.{n}", got == want,
              "" if k is None else f"token {k} {enc.tokens[k]!r}: luazero {got[k]} tokenizers {want[k]}")
        want_dec = tok.decode(enc.ids, skip_special_tokens=False)
        want_skip = tok.decode(enc.ids, skip_special_tokens=True)
        check(f"{prefix}.decode.{n}", decoded == want_dec and decoded_skip == want_skip and
              (not round_trip or decoded == text),
              f"luazero {decoded[:50]!r} / {decoded_skip[:50]!r} tokenizers {want_dec[:50]!r} / "
              f"{want_skip[:50]!r}")
    return lua


def check_qwen2(check, tmp, texts, run_lua):
    """Qwen2's kind (Qwen2, Qwen2.5, Qwen3): an NFC normalizer, Split with
    Qwen2's pattern then ByteLevel without a regex, a ByteLevel decoder and
    post-processor, <|endoftext|> <|im_start|> <|im_end|>; trained here on the
    corpus and the Unicode corpus, so merges cover composed characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers
    q = Tokenizer(models.BPE())
    q.normalizer = normalizers.NFC()
    q.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    q.decoder = decoders.ByteLevel()
    q.post_processor = processors.ByteLevel(trim_offsets=False)
    q.train([CORPUS, UNICODE], trainers.BpeTrainer(
        vocab_size=1200, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = os.path.join(tmp, "tokenizer-qwen2.json")
    q.save(path)
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    check("qwen2.layout", spec["normalizer"] == {"type": "NFC"} and
          spec["pre_tokenizer"]["pretokenizers"][0]["pattern"] == {"Regex": QWEN2_PATTERN},
          json.dumps(spec["pre_tokenizer"])[:300])
    nfd = "e\u0301 A\u030a \u1100\u1161\u11a8"
    check("qwen2.normalizes", q.encode(nfd).ids == q.encode("\u00e9 \u00c5 \uac01").ids,
          "tokenizers does not compose NFD input: the test would prove nothing")
    compare(check, "qwen2", q, path, texts, run_lua, round_trip=False)
    prepare_in_pieces(check, "qwen2", path, texts, tmp, q)


def gemma_spec(tk):
    """Gemma's layout, 256k-shaped: <pad> <eos> <bos> <unk> <mask> at 0..4,
    <start_of_turn> <end_of_turn> at 106 and 107 among <unusedN>, the 256
    <0xNN> byte tokens at 217..472, and the pieces trained here at the top of
    256,000 ids (past uint16); Gemma's normalizer (" " to "▁"), pre-tokenizer
    (Split " ", MergedWithPrevious), decoder and post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    base = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never",
                                                  split=True)
    base.train([CORPUS, UNICODE], trainers.BpeTrainer(vocab_size=1500, special_tokens=["<unk>"],
                                                      show_progress=False))
    spec = json.loads(base.to_str())
    learned = sorted(((t, i) for t, i in spec["model"]["vocab"].items() if t != "<unk>"),
                     key=lambda kv: kv[1])
    named = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 106: "<start_of_turn>",
             107: "<end_of_turn>"}
    vocab = {named.get(i, f"<unused{i}>"): i for i in range(217)}
    vocab.update({f"<0x{b:02X}>": 217 + b for b in range(256)})
    top = 256000 - len(learned)
    vocab.update({f"<unused{i}>": i for i in range(473, top)})
    vocab.update({t: top + k for k, (t, _) in enumerate(learned)})
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}
                            for i, t in sorted(named.items())]
    spec["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "},
                             "behavior": "MergedWithPrevious", "invert": False}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}]}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<bos>", "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}}}
    return spec


def check_gemma(check, tk, tmp, texts, run_lua):
    """Gemma's kind (Gemma 1/2/3; Mistral's is the SentencePiece layout above)."""
    spec = gemma_spec(tk)
    path = os.path.join(tmp, "tokenizer-gemma.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    check("gemma.layout", len(spec["model"]["vocab"]) == 256000 and
          max(spec["model"]["vocab"].values()) == 255999, f"{len(spec['model']['vocab'])} entries")
    lua = compare(check, "gemma", None, path, texts, run_lua, round_trip=False)
    prepare_in_pieces(check, "gemma", path, texts, tmp)
    if lua is not None:
        ids = lua["unicode"][0]
        stats = lua["gemma_turns"][2]
        check("gemma.ids_past_uint16", max(ids) > 65535 and (stats["bos_id"], stats["eos_id"]) == (2, 1),
              f"largest id {max(ids)}, bos_id {stats['bos_id']} eos_id {stats['eos_id']}")


def preflight(check, why):
    """The start the suites that need the venv, the corpus and luazero share:
    a skip (exit code 0, counted as neither passed nor failed) when a package
    is missing (why) or the corpus is absent, a failure when luazero is not
    built; None to go on."""
    if why:
        print(f"skip {check.prefix}: {why}")
        print("0 passed, 0 failed")
        return 0
    if not os.path.exists(CORPUS):
        print(f"skip {check.prefix}: {os.path.normpath(CORPUS)} is missing: put "
              "tinyshakespeare.txt there to run this test")
        print("0 passed, 0 failed")
        return 0
    if not os.access(LUAZERO, os.X_OK):
        check("luazero", False, f"{LUAZERO} is missing: build first (tools/setup), or set LUAZERO")
        return check.summary()
    return None


def main():
    check = Checks("tokenizer")
    tk, why = import_tokenizers()
    code = preflight(check, why if tk is None else None)
    if code is not None:
        return code
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(CORPUS, encoding="utf-8") as f:
        corpus = f.read()
    with open(UNICODE, encoding="utf-8", newline="") as f:
        unicode_corpus = f.read()
    texts = dict(TEXTS, corpus=corpus, unicode=unicode_corpus)

    with tempfile.TemporaryDirectory() as tmp:
        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        hf.train([CORPUS], trainer)
        tok_json = os.path.join(tmp, "tokenizer.json")
        hf.save(tok_json)
        with open(tok_json, encoding="utf-8") as f:
            spec = json.load(f)
        check("trained", hf.get_vocab_size() == 1000 and spec["model"]["type"] == "BPE",
              f"vocab {hf.get_vocab_size()}")

        paths = {}
        for name, text in texts.items():
            paths[name] = os.path.join(tmp, name + ".txt")
            with open(paths[name], "w", encoding="utf-8", newline="") as f:
                f.write(text)

        def run_lua(tokenizer_json, names=None):
            names = list(texts) if names is None else names
            run = subprocess.run([LUAZERO, os.path.join(REPO, "tests", "ref", "tokenize.lua"),
                                  tokenizer_json] + [paths[n] for n in names],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 cwd=REPO)
            if run.returncode != 0:
                return None, run.stdout
            stats = {}
            for line in run.stdout.splitlines():
                r = json.loads(line)
                stats[r["input"]] = r
            out = {}
            for name in names:
                p = paths[name]
                with open(p + ".ids") as f:
                    ids = [int(x) for x in f.read().split()]
                with open(p + ".starts") as f:
                    starts = [int(x) for x in f.read().split()]
                with open(p + ".decoded", "rb") as f:
                    decoded = f.read().decode("utf-8", errors="surrogateescape")
                with open(p + ".decoded_skip", "rb") as f:
                    decoded_skip = f.read().decode("utf-8", errors="surrogateescape")
                out[name] = (ids, decoded, stats[p], starts, decoded_skip)
            return out, ""

        lua, err = run_lua(tok_json)
        check("luazero_runs", lua is not None, err.strip()[-2000:])
        if lua is None:
            return check.summary()

        hf_ids = {}
        for name, text in texts.items():
            hf_ids[name] = hf.encode(text).ids
            ids, decoded = lua[name][:2]
            same = ids == hf_ids[name]
            detail = f"{len(ids)} tokens"
            if not same:
                k = next((i for i, (a, b) in enumerate(zip(ids, hf_ids[name])) if a != b),
                         min(len(ids), len(hf_ids[name])))
                detail = (f"first difference at token {k}: luazero {ids[k:k + 6]} tokenizers "
                          f"{hf_ids[name][k:k + 6]} near {hf.decode(hf_ids[name][k:k + 6])!r}")
            check(f"same_ids.{name}", same, detail)
            check(f"decode_round_trip.{name}", decoded == text and
                  decoded == hf.decode(ids, skip_special_tokens=False),
                  "" if decoded == text else f"got {decoded[:60]!r}")
        check("offsets", all(char_starts(t, lua[n][3]) == [o[0] for o in hf.encode(t).offsets]
                             for n, t in texts.items()), "byte-level: starts differ from tokenizers")
        eot = hf.token_to_id("<|endoftext|>")
        check("special_token_is_one_id", hf_ids["special"].count(eot) == 3 and
              lua["special"][0].count(eot) == 3, f"<|endoftext|> = {eot}")

        # The same tokenizer with its merges written as "a b" strings.
        if spec["model"]["merges"] and isinstance(spec["model"]["merges"][0], list):
            spec["model"]["merges"] = [" ".join(m) for m in spec["model"]["merges"]]
        str_json = os.path.join(tmp, "tokenizer-string-merges.json")
        with open(str_json, "w", encoding="utf-8") as f:
            json.dump(spec, f, ensure_ascii=False)
        hf_str = Tokenizer.from_file(str_json)
        lua_str, err = run_lua(str_json)
        check("string_merges", lua_str is not None and all(
            lua_str[n][0] == hf_ids[n] == hf_str.encode(t).ids for n, t in texts.items()),
            err.strip()[-500:])

        # tools/prepare-data --tokenizer writes the same ids into a token file.
        bin_path = os.path.join(tmp, "corpus.bin")
        run = subprocess.run([os.path.join(REPO, "tools", "prepare-data"), "--tokenizer", tok_json,
                              paths["corpus"], bin_path], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env=dict(os.environ, LUAZERO=LUAZERO))
        ok = run.returncode == 0 and read_token_file(bin_path) == (20240520, 1, hf_ids["corpus"])
        check("prepare_data", ok, run.stdout.strip())
        prepare_in_pieces(check, "byte_level", tok_json, texts, tmp, hf)

        # Refusals name the field and what is supported.
        def refused(name, edit, expect):
            bad = json.loads(json.dumps(spec))
            edit(bad)
            p = os.path.join(tmp, name + ".json")
            with open(p, "w", encoding="utf-8") as f:
                json.dump(bad, f)
            r = subprocess.run([os.path.join(REPO, "tools", "prepare-data"), "--tokenizer", p,
                                paths["special"], os.path.join(tmp, "x.bin")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, LUAZERO=LUAZERO))
            out = r.stdout.strip()
            check(f"refuses.{name}", r.returncode != 0 and all(e in out for e in expect) and
                  len(out.splitlines()) == 1, out)

        refused("wordpiece", lambda j: j["model"].update(type="WordPiece"),
                ["model.type", '"WordPiece"', '"BPE"'])
        refused("normalizer", lambda j: j.update(normalizer={"type": "NFKC"}),
                ["normalizer", '"NFKC"', "supported: null", '"NFC"'])
        refused("pre_tokenizer", lambda j: j.update(pre_tokenizer={"type": "Whitespace"}),
                ["pre_tokenizer", '"Whitespace"', '"ByteLevel"'])
        # A vocabulary past uint16 is no refusal: the token file is version 2
        # (uint32 ids), llm.c's layout.
        big = json.loads(json.dumps(spec))
        big["added_tokens"].append({"id": 70000, "content": "<|big|>", "special": True})
        p = os.path.join(tmp, "vocab_over_uint16.json")
        with open(p, "w", encoding="utf-8") as f:
            json.dump(big, f)
        out_bin = os.path.join(tmp, "big.bin")
        r = subprocess.run([os.path.join(REPO, "tools", "prepare-data"), "--tokenizer", p,
                            paths["special"], out_bin],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=dict(os.environ, LUAZERO=LUAZERO))
        header = open(out_bin, "rb").read(12) if r.returncode == 0 else b""
        check("vocab_over_uint16_writes_version_2", r.returncode == 0 and len(header) == 12 and
              struct.unpack("<3i", header)[:2] == (20240520, 2), r.stdout.strip())

        # Llama 3's kind: Split with its pattern, then ByteLevel without a regex,
        # ignore_merges, and a TemplateProcessing post-processor (adds nothing
        # to encode(text, add_special_tokens=False)).
        from tokenizers import Regex, processors
        l3 = Tokenizer(models.BPE(ignore_merges=True))
        l3.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        l3.decoder = decoders.ByteLevel()
        l3.train([CORPUS], trainers.BpeTrainer(
            vocab_size=1000, special_tokens=["<|begin_of_text|>", "<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        l3.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
        l3_json = os.path.join(tmp, "tokenizer-llama3.json")
        l3.save(l3_json)
        lua3, err = run_lua(l3_json)
        check("llama3_runs", lua3 is not None, err.strip()[-2000:])
        for name, text in texts.items():
            want = l3.encode(text, add_special_tokens=False).ids
            got = lua3[name][0] if lua3 else None
            detail = f"{len(want)} tokens"
            if lua3 and got != want:
                k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
                detail = (f"first difference at token {k}: luazero {got[k:k + 6]} tokenizers "
                          f"{want[k:k + 6]} near {l3.decode(want[k:k + 6])!r}")
            check(f"llama3.same_ids.{name}", got == want, detail)
            check(f"llama3.decode_round_trip.{name}", lua3 is not None and lua3[name][1] == text)

        prepare_in_pieces(check, "llama3", l3_json, texts, tmp, l3)
        check("llama3.offsets", lua3 is not None and all(
            char_starts(t, lua3[n][3]) == [o[0] for o in l3.encode(t, add_special_tokens=False).offsets]
            for n, t in texts.items()))

        check_sentencepiece(check, tk, tmp, texts, run_lua)
        check_qwen2(check, tmp, texts, run_lua)
        check_gemma(check, tk, tmp, texts, run_lua)

        # Speed on the whole corpus: one encode call each (luazero: one thread;
        # tokenizers: encode of the whole string, and encode_batch of its lines on
        # its thread pool).
        mb = len(corpus.encode("utf-8")) / 1e6
        t0 = time.perf_counter()
        hf.encode(corpus)
        hf_one = mb / (time.perf_counter() - t0)
        lines = corpus.splitlines(keepends=True)
        t0 = time.perf_counter()
        hf.encode_batch(lines)
        hf_batch = mb / (time.perf_counter() - t0)
        lua_speed = mb / max(lua["corpus"][2]["seconds"], 1e-9)
        print(f"speed: corpus {mb:.2f} MB: luazero {lua_speed:.1f} MB/s (one thread, cold cache), "
              f"tokenizers encode {hf_one:.1f} MB/s, encode_batch of lines {hf_batch:.1f} MB/s "
              f"({os.cpu_count()} CPUs)")

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
