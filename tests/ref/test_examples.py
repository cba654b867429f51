"""test_examples.py — scripts/examples/lora.lua against transformers and PEFT.

The base model is a tiny random LlamaForCausalLM made here by transformers'
save_pretrained (fp32 safetensors), with a SentencePiece-style tokenizer and
Zephyr's chat template (test_finetune.py's). The example fine-tunes it with
LoRA on chat examples (JSON Lines), saves, and generates; its loss must fall,
its answer come out, and its adapters (tools/ckpt export) load in PEFT 0.10.0
and move the model: the PEFT model's logits differ from the base's.
"""
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_finetune as ft  # noqa: E402  (the tiny model, the tokenizer folder, the examples)


def main():
    check, code, tokenizers, transformers, torch, peft = ft.ct.start("examples", "torch", "peft",
                                                                     pip="peft==0.10.0 ")
    if code is not None:
        return code
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        ft.tiny_llama(transformers, torch, base)
        folder = os.path.join(tmp, "tiny")
        ft.tokenizer_folder(tokenizers, transformers.PreTrainedTokenizerFast, "sentencepiece",
                            folder, base)
        data = os.path.join(tmp, "chat.jsonl")
        ft.write_jsonl(data, ft.EXAMPLES)
        ck, peft_dir = os.path.join(tmp, "ck"), os.path.join(tmp, "peft")
        # Run from another folder: the example needs no checkout as its working directory.
        st, out = ft.lz(os.path.join(ft.REPO, "scripts", "examples", "lora.lua"), folder, data, ck,
                        "8", cwd=tmp)
        losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)", out, re.M)]
        check("lora.runs", st == 0 and len(losses) == 8, out[-2000:])
        check("lora.loss_falls", len(losses) == 8 and sum(losses[-3:]) < sum(losses[:3]) - 0.1,
              f"losses {losses}")
        answer = re.search(r"^answer: (.*)$", out, re.M)
        check("lora.generates", answer is not None, out[-500:])
        st, out = ft.lz("tools/ckpt.lua", "export", ck, peft_dir)
        check("lora.export", st == 0, out[-2000:])
        model = transformers.LlamaForCausalLM.from_pretrained(base).float().eval()
        x = torch.tensor([[1, 5, 9, 200, 31, 7]])
        with torch.no_grad():
            before = model(x).logits.clone()
            tuned = peft.PeftModel.from_pretrained(model, peft_dir).eval()
            after = tuned(x).logits
        moved = float((after - before).abs().max())
        check("lora.peft_loads", 1e-6 < moved < 10, f"largest logit change {moved:.3g}")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
