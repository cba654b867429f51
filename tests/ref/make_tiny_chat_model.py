"""make_tiny_chat_model.py FOLDER — the tiny chat model docs/finetune.md runs on.

A random LlamaForCausalLM (2 layers, 64 wide, 0.27M parameters, fp32
safetensors) and a SentencePiece-style tokenizer with Zephyr's chat template
in one Hugging Face folder: the model and tokenizer tests/ref/test_finetune.py
checks against transformers and PEFT. Its text is noise; it is there to run
the guide's commands without a download. Its tokenizer trains on
../shared/data/tinyshakespeare.txt beside the checkout where that is there,
else on docs/*.md (other ids: the guide's numbers come from the first).
Needs transformers and tokenizers (build/ref-venv, which tools/setup makes):
    build/ref-venv/bin/python tests/ref/make_tiny_chat_model.py tiny
"""
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def find_corpus_name(tt):
    return os.path.join(tt.REPO, "..", "shared", "data", "tinyshakespeare.txt")


def main(argv):
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: make_tiny_chat_model.py FOLDER (a folder that does not exist yet)", file=sys.stderr)
        return 2
    folder = os.path.abspath(argv[0])
    if os.path.exists(folder):
        print(f"make_tiny_chat_model: {folder} exists; give a new folder", file=sys.stderr)
        return 2
    try:
        import tokenizers
        import torch
        import transformers
    except ImportError as e:
        print(f"make_tiny_chat_model: {e}; run it with build/ref-venv/bin/python "
              "(tools/setup makes it)", file=sys.stderr)
        return 2
    import test_finetune as tf
    import test_tokenizer as tt
    with tempfile.TemporaryDirectory(dir=os.path.dirname(folder)) as tmp:
        if not os.path.exists(tt.CORPUS):
            # The tokenizer trains on tinyshakespeare beside the checkout
            # (../shared/data); without it, on this checkout's docs.
            docs = os.path.join(tt.REPO, "docs")
            tt.CORPUS = os.path.join(tmp, "corpus.txt")
            with open(tt.CORPUS, "w", encoding="utf-8") as out:
                for name in sorted(os.listdir(docs)):
                    if name.endswith(".md"):
                        with open(os.path.join(docs, name), encoding="utf-8") as f:
                            out.write(f.read())
            print(f"make_tiny_chat_model: no {os.path.normpath(find_corpus_name(tt))}: the "
                  "tokenizer is trained on docs/*.md instead (its ids, and the guide's "
                  "numbers, differ)", file=sys.stderr)
        base, tok = os.path.join(tmp, "base"), os.path.join(tmp, "tok")
        tf.tiny_llama(transformers, torch, base)
        tf.tokenizer_folder(tokenizers, transformers.PreTrainedTokenizerFast, "sentencepiece",
                            tok, base)
        os.makedirs(os.path.join(tmp, "out"))
        for name in os.listdir(tok):  # the tokenizer's files and links to the model's: as files
            shutil.copyfile(os.path.join(tok, name), os.path.join(tmp, "out", name))
        os.rename(os.path.join(tmp, "out"), folder)
    print(f"make_tiny_chat_model: {folder}: " + ", ".join(sorted(os.listdir(folder))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
