"""make_tiny_chat_model.py FOLDER — the tiny chat model docs/finetune.md runs on.

A random LlamaForCausalLM (2 layers, 64 wide, 0.27M parameters, fp32
safetensors) and a SentencePiece-style tokenizer with Zephyr's chat template
in one Hugging Face folder: the model and tokenizer tests/ref/test_finetune.py
checks against transformers and PEFT. Its text is noise; it is there to run
the guide's commands without a download. Needs transformers and tokenizers
(build/ref-venv, which tools/setup makes):
    build/ref-venv/bin/python tests/ref/make_tiny_chat_model.py tiny
"""
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


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
    with tempfile.TemporaryDirectory(dir=os.path.dirname(folder)) as tmp:
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
