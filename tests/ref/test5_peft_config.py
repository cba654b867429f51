"""test5_peft_config.py — the adapter_config.json keys luazero honours, against
PEFT 0.21.2 (reference environment 5): adapters of a tiny Llama made by PEFT with
use_rslora (scale alpha / sqrt(r)), rank_pattern and alpha_pattern (per-module r
and alpha, by name and by dotted path), dotted target_modules, their weights drawn at random so every
adapter counts, saved with save_pretrained; scripts/eval.lua --hf --adapters
gives PEFT's loss on the same window (1e-5); rsLoRA's loss is not plain
LoRA's, so honouring it is seen. And GPT-2's: PEFT saves adapters of its
Conv1D layers with fan_in_fan_out true (how the base weight is stored),
which luazero reads as PEFT does.

Run with the python of ~/.cache/luazero/ref5-venv (tests/ref/run.py does).
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import refenv  # noqa: E402
from checks import Checks  # noqa: E402

REPO, LUAZERO = refenv.REPO, refenv.LUAZERO
T = 24
TOL = 1e-5
TEXT = ("It is the east, and Juliet is the sun. Arise, fair sun, and kill the envious "
        "moon, who is already sick and pale with grief.\n") * 3
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj"]
CASES = {
    "plain": {},
    "rslora": {"use_rslora": True},
    "patterns": {"rank_pattern": {"q_proj": 2, "model.layers.1.self_attn.v_proj": 6,
                                  "gate_proj": 3},
                 "alpha_pattern": {"v_proj": 3, "layers.0.self_attn.o_proj": 20}},
    # dotted targets: PEFT matches the end of a module's path
    "dotted": {"target_modules": ["self_attn.q_proj", "layers.1.mlp.gate_proj", "v_proj"]},
}


def lz(*argv):
    p = subprocess.run([LUAZERO, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, cwd=REPO)
    return p.returncode, p.stdout


def val_loss(out):
    for line in out.splitlines():
        if line.startswith("val_loss "):
            return float(line.split()[1])
    return None


def adapters_agree(check, label, torch, pm, base, ad, ids, data, also=True):
    """pm's adapters drawn at random (the generator as seeded), saved to ad:
    scripts/eval.lua --hf base --adapters ad gives PEFT's loss on ids (and
    `also` holds). Returns PEFT's loss."""
    with torch.no_grad():
        for pname, p in pm.named_parameters():
            if "lora_" in pname:
                p.copy_(0.2 * torch.randn_like(p))
    pm.eval()
    pm.save_pretrained(ad)
    with torch.no_grad():
        ref = float(pm(input_ids=ids, labels=ids).loss)
    st, out = lz("scripts/eval.lua", "--hf", base, "--adapters", ad, "--data", data,
                 "--seq-len", str(T), "--micro-batch", "1", "--max-batches", "1")
    ours = val_loss(out)
    err = abs(ours - ref) / abs(ref) if ours is not None else float("inf")
    check(label, st == 0 and err <= TOL and also,
          f"luazero {ours} peft {ref:.10g} err {err:.1e}" + ("" if st == 0 else " " + out[-1500:]))
    return ref


def main():
    check = Checks("peft_config")
    import torch
    import transformers
    import peft
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}")
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(3)
        cfg = transformers.LlamaConfig(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="eager")
        base = os.path.join(tmp, "base")
        transformers.LlamaForCausalLM(cfg).save_pretrained(base)
        data = os.path.join(tmp, "text.txt")
        with open(data, "wb") as f:
            f.write(TEXT.encode())
        ids = torch.tensor([list(TEXT.encode()[:T + 1])])
        losses = {}
        for name, extra in CASES.items():
            model = transformers.LlamaForCausalLM.from_pretrained(base).float().eval()
            lc = peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                 **{"target_modules": TARGETS, **extra})
            pm = peft.get_peft_model(model, lc)
            torch.manual_seed(7)  # plain and rslora: the same adapter weights
            ref = adapters_agree(check, f"{name}.loss", torch, pm, base,
                                 os.path.join(tmp, "ad-" + name), ids, data)
            losses[name] = ref
        check("rslora_changes_the_loss", abs(losses["rslora"] - losses["plain"]) > 1e-4,
              f"plain {losses['plain']:.8g} rslora {losses['rslora']:.8g}")
        g2 = os.path.join(tmp, "gpt2")
        torch.manual_seed(5)
        transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4)).save_pretrained(g2)
        model = transformers.GPT2LMHeadModel.from_pretrained(g2).float().eval()
        pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                        target_modules=["c_attn", "c_proj"],
                                                        task_type="CAUSAL_LM"))
        adapters_agree(check, "gpt2_fan_in_fan_out.loss", torch, pm, g2,
                       os.path.join(tmp, "ad-gpt2"), ids, data,
                       pm.peft_config["default"].fan_in_fan_out)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
