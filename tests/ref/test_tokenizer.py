"""test_tokenizer.py — luazero's tokenizer.json BPE against Hugging Face tokenizers.

Trains a byte-level BPE (vocabulary 1000, special token <|endoftext|>) with
`tokenizers` on ../shared/data/tinyshakespeare.txt (relative to the repository
root), saves its tokenizer.json, and encodes the whole corpus and texts with
special tokens, Unicode and odd whitespace with both `tokenizers` and luazero
(tests/ref/tokenize.lua); the same for a Llama 3 kind of tokenizer.json (Split
with Llama 3's pattern, ByteLevel without a regex, ignore_merges,
TemplateProcessing). Checks: identical ids, decode round-trips, the same
ids from "a b" string merges as from [a, b] list merges, tools/prepare-data
--tokenizer writes the same ids, and an unsupported tokenizer.json or a
vocabulary over 65536 is refused naming the field. Prints encoding MB/s of both.

Without `tokenizers` (pip install tokenizers; tools/setup makes build/ref-venv)
or without the corpus, prints a skip line and "0 passed, 0 failed": a skipped
test counts as neither passed nor failed. LZ_REF_VENV names a virtual
environment to take `tokenizers` from (default build/ref-venv).

    /usr/bin/python3 tests/ref/test_tokenizer.py     # ends with "N passed, N failed"
"""
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LUAZERO = os.environ.get("LUAZERO") or os.path.join(REPO, "build", "bin", "luazero")
CORPUS = os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
VENV = os.environ.get("LZ_REF_VENV") or os.path.join(REPO, "build", "ref-venv")

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
}


def import_tokenizers():
    try:
        import tokenizers
        return tokenizers, None
    except ImportError:
        pass
    for site in glob.glob(os.path.join(VENV, "lib", "python3*", "site-packages")):
        sys.path.insert(0, site)
    try:
        import tokenizers
        return tokenizers, None
    except ImportError:
        return None, (f"cannot import tokenizers (not in {sys.executable}'s packages nor in "
                      f"{VENV}): pip install tokenizers, or run tools/setup")


def read_token_file(path):
    with open(path, "rb") as f:
        magic, version, n = struct.unpack("<3i", f.read(12))
        f.seek(1024)
        body = f.read()
    return magic, version, list(struct.unpack(f"<{n}H", body[:2 * n]))


def main():
    passed, failed = 0, 0

    def check(name, ok, detail=""):
        nonlocal passed, failed
        print(("ok   " if ok else "FAIL ") + f"tokenizer.{name} {detail}", flush=True)
        if ok:
            passed += 1
        else:
            failed += 1

    tk, why = import_tokenizers()
    if tk is None:
        print(f"skip tokenizer: {why}")
        print("0 passed, 0 failed")
        return 0
    if not os.path.exists(CORPUS):
        print(f"skip tokenizer: {os.path.normpath(CORPUS)} is missing: put tinyshakespeare.txt "
              "there to run this test")
        print("0 passed, 0 failed")
        return 0
    if not os.access(LUAZERO, os.X_OK):
        check("luazero", False, f"{LUAZERO} is missing: build first (tools/setup), or set LUAZERO")
        print(f"{passed} passed, {failed} failed")
        return 1
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(CORPUS, encoding="utf-8") as f:
        corpus = f.read()
    texts = dict(TEXTS, corpus=corpus)

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

        def run_lua(tokenizer_json):
            run = subprocess.run([LUAZERO, os.path.join(REPO, "tests", "ref", "tokenize.lua"),
                                  tokenizer_json] + [paths[n] for n in texts],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 cwd=REPO)
            if run.returncode != 0:
                return None, run.stdout
            stats = {}
            for line in run.stdout.splitlines():
                r = json.loads(line)
                stats[r["input"]] = r
            out = {}
            for name, p in paths.items():
                with open(p + ".ids") as f:
                    ids = [int(x) for x in f.read().split()]
                with open(p + ".decoded", "rb") as f:
                    out[name] = (ids, f.read().decode("utf-8"), stats[p])
            return out, ""

        lua, err = run_lua(tok_json)
        check("luazero_runs", lua is not None, err.strip()[-2000:])
        if lua is None:
            print(f"{passed} passed, {failed} failed")
            return 1

        hf_ids = {}
        for name, text in texts.items():
            hf_ids[name] = hf.encode(text).ids
            ids, decoded, _ = lua[name]
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
        refused("normalizer", lambda j: j.update(normalizer={"type": "NFC"}),
                ["normalizer", '"NFC"', "supported: null"])
        refused("pre_tokenizer", lambda j: j.update(pre_tokenizer={"type": "Whitespace"}),
                ["pre_tokenizer", '"Whitespace"', '"ByteLevel"'])
        refused("vocab_over_uint16", lambda j: j["added_tokens"].append(
            {"id": 70000, "content": "<|big|>", "special": True}), ["70001", "65536"])

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

    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
