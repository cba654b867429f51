"""test5_moe.py — the MoE families (models/mixtral.lua, models/qwen2_moe.lua,
models/qwen3_moe.lua, models/olmoe.lua) against transformers 5.x's
MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM and
OlmoeForCausalLM (clip_qkv set).

Each a tiny random model with enough experts and top-k that the test's batch
routes unevenly (8 experts, top-2 or top-3; some experts get few rows), and
output_router_logits on, so the loss is transformers' language-model loss
plus router_aux_loss_coef times its load-balancing loss (coefficient raised
so the term weighs in the gradients). Saved with save_pretrained: the
experts one tensor each, as the Hub holds them (transformers 5.x fuses them
into gate_up_proj / down_proj at load time only).

  init_loss   the loss (cross-entropy + coef * aux) of a fixed batch within
              1e-5 relative (fp32), tests/ref/family_run.lua --init
  aux         luazero's load-balancing loss alone equals transformers' aux_loss
  padded      the same three with the second row's last 5 tokens padding
              (data/packed.lua's layout: mask 0, target -1) against
              transformers given the attention_mask and labels -100: the
              padding out of the load-balancing loss and its gradient
  clip        (OLMoE) the same weights without clip_qkv give another loss
  grads       every parameter's gradient within 1e-4 relative (per tensor,
              max |ours - theirs| / max |theirs|), transformers' fused expert
              tensors split back into the checkpoint's per-expert ones
  generate    greedy, 64 new tokens, several prompts (tests/ref/family_ref.py)
  export      20 steps at ZeRO-3 on 2 ranks, tools/ckpt export: transformers
              loads it with no missing or unexpected tensor, the same loss
  lora        PEFT 0.21.2 loads the adapters (the family's default targets,
              q_proj and v_proj, checked) and gives luazero's loss
  lora_experts  adapters on the attention and the experts (--lora-targets
              ...,experts.gate_up_proj,experts.down_proj) trained at ZeRO-3
              on 2 ranks: the export's target_parameters, PEFT loads it (its
              ParamWrappers over the fused expert tensors) and gives
              luazero's --adapters loss, which switching the experts'
              wrappers off moves

    /root/.cache/luazero/ref5-venv/bin/python tests/ref/test5_moe.py [family]
    tests/ref/run.py test5_moe.py       # ends with "N passed, N failed"
"""
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from refenv import VERSIONS5  # noqa: E402
import family_ref  # noqa: E402

COEF = 0.05
# every MoE family file's lora_default (PEFT 0.21.2's own default for Mixtral)
LORA_DEFAULT = ["q_proj", "v_proj"]
CLIP = 1.5  # OLMoE's clip_qkv: low enough that the clamp bites at the test's weights


PAD = 5  # the padded check's padding: the second row's last tokens


def moe_loss(torch, model, tokens, pad=0):
    """Cross-entropy of the fixed batch (inputs then targets, 2 x 16) plus the
    routers' load-balancing loss times its coefficient, as the model adds it;
    pad: the second row's last tokens are padding (attention_mask 0, label
    -100)."""
    t = torch.tensor(tokens, dtype=torch.int64).reshape(2, 2, 16)
    labels, mask = t[1].clone(), None
    if pad:
        mask = torch.ones(2, 16, dtype=torch.int64)
        mask[1, 16 - pad:] = 0
        labels[1, 16 - pad:] = -100
    out = model(t[0], attention_mask=mask, output_router_logits=True)
    logits = out.logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1), ignore_index=-100)
    model._last_aux = float(out.aux_loss.detach())
    return ce + model.config.router_aux_loss_coef * out.aux_loss


def theirs_of(named, name):
    """transformers' gradient for one of luazero's (checkpoint) parameter names:
    the per-expert slice of a fused expert tensor where the name is an expert's."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    m = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", name)
    if not m:
        p = named.get(name)
        return None if p is None else p.grad
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj in ("w2", "down_proj"):
        return named[prefix + ".down_proj"].grad[e]
    gu = named[prefix + ".gate_up_proj"].grad[e]
    h = gu.shape[0] // 2
    return gu[:h] if proj in ("w1", "gate_proj") else gu[h:]


def init_and_grads(check, name, torch, model, folder, tmp, pad=0):
    gfile = os.path.join(tmp, "grads.f32")
    label = f"{name}.padded" if pad else name
    rc, out = family_ref.lz("tests/ref/family_run.lua", "--init", folder, "--grads", gfile,
                            *(["--pad", str(pad)] if pad else []))
    if rc != 0:
        check(f"{label}.init_loss", False, out[-2000:])
        return
    res = family_ref.last_json(out)
    model.zero_grad()
    loss = moe_loss(torch, model, res["tokens"], pad)
    ours = float(res["loss"])
    err = family_ref.rel(ours, loss.item())
    check(f"{label}.init_loss", err <= family_ref.TOL,
          f"(luazero {ours:.9f}, transformers {loss.item():.9f}, relative {err:.1e})")
    aux = res.get("aux_loss")
    theirs_aux = model._last_aux
    check(f"{label}.aux_loss", aux is not None and
          family_ref.rel(float(aux), theirs_aux) <= family_ref.TOL,
          f"(luazero {aux}, transformers {theirs_aux:.9f})")
    if pad:  # the mask matters at this batch: without it transformers counts the padding
        with torch.no_grad():
            moe_loss(torch, model, res["tokens"])
        check(f"{label}.mask_matters", family_ref.rel(model._last_aux, theirs_aux) > 1e-4,
              f"(aux without the mask {model._last_aux:.9f}, with it {theirs_aux:.9f})")
    loss.backward()
    with open(gfile, "rb") as f:
        flat = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    named = dict(model.named_parameters())
    worst, where, seen = 0.0, "", 0
    for p in res["params"]:
        r = theirs_of(named, p["name"])
        if r is None:
            check(f"{label}.grads", False, f"transformers has no parameter {p['name']}")
            return
        g = flat[p["offset"]:p["offset"] + p["numel"]].reshape(p["shape"])
        g = g[:r.shape[0]]  # the token tables: the real vocabulary's rows
        e = float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
        seen += 1
        if e > worst:
            worst, where = e, p["name"]
    check(f"{label}.grads", worst <= family_ref.GRAD_TOL and seen == len(res["params"]),
          f"({seen} tensors, worst {worst:.1e} at {where})")
    if pad:
        return
    if getattr(model.config, "clip_qkv", None):
        # the clamp bites: the same weights without it give another loss
        free = type(model)(type(model.config)(**{**model.config.to_dict(), "clip_qkv": None}))
        free.load_state_dict(model.state_dict())
        with torch.no_grad():
            unclipped = moe_loss(torch, free.float().eval(), res["tokens"]).item()
        check(f"{name}.clip_qkv_bites", family_ref.rel(unclipped, loss.item()) > 1e-4,
              f"(without clip_qkv {unclipped:.9f})")
    counts = res.get("expert_tokens") or []
    check(f"{name}.uneven_routing", any(min(c) < max(c) for c in counts), str(counts))


def lora_experts(check, name, transformers, torch, peft, folder, corpus, tmp):
    """LoRA on the attention and on the experts (PEFT's target_parameters
    over transformers 5.x's fused gate_up_proj / down_proj), trained at
    ZeRO-3 on 2 ranks: PEFT 0.21.2 loads the exported folder and gives the
    loss luazero gives with --adapters, which the experts' adapters move."""
    import json
    targets = "q_proj,v_proj,experts.gate_up_proj,experts.down_proj"
    ck, peft_dir = os.path.join(tmp, "lora-experts-ck"), os.path.join(tmp, "lora-experts-peft")
    rc, out = family_ref.lz("-n", "2", "scripts/train.lua", "--init", folder, "--data", corpus,
                            "--steps", "6", "--seq-len", "16", "--micro-batch", "2", "--sample",
                            "0", "--stage", "3", "--lora-r", "4", "--lora-alpha", "8",
                            "--lora-targets", targets, "--lr", "2e-2", "--save", ck)
    rc2, out2 = family_ref.lz("tools/ckpt.lua", "export", ck, peft_dir) if rc == 0 else (1, "")
    rc3, out3 = (family_ref.lz("tests/ref/family_run.lua", "--hf", folder, "--adapters", peft_dir)
                 if rc2 == 0 else (1, ""))
    if rc3 != 0:
        check(f"{name}.lora_experts_loss", False, (out + out2 + out3)[-2000:])
        return
    res = family_ref.last_json(out3)
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    check(f"{name}.lora_experts_config",
          sorted(cfg["target_modules"]) == ["q_proj", "v_proj"] and
          sorted(cfg["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"],
          f"(target_modules {cfg['target_modules']}, target_parameters "
          f"{cfg.get('target_parameters')})")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    with torch.no_grad():
        plain = family_ref.batch_loss(torch, base, res["tokens"]).item()
    tuned = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    wrapped = [n for n, m in tuned.named_modules() if type(m).__name__ == "ParamWrapper"]
    with torch.no_grad():
        loss = family_ref.batch_loss(torch, tuned, res["tokens"]).item()
        # the attention's adapters alone: the experts' must move the loss too
        for _, m in tuned.named_modules():
            if type(m).__name__ == "ParamWrapper":
                m.enable_adapters(False)
        attention_only = family_ref.batch_loss(torch, tuned, res["tokens"]).item()
    ours = float(res["loss"])
    err = family_ref.rel(ours, loss)
    check(f"{name}.lora_experts_loss", err <= family_ref.TOL and len(wrapped) > 0,
          f"(luazero {ours:.9f}, peft {loss:.9f}, relative {err:.1e}; {len(wrapped)} "
          f"ParamWrappers; base {plain:.9f})")
    check(f"{name}.lora_experts_bite", family_ref.rel(attention_only, loss) > 1e-5,
          f"(without the experts' adapters {attention_only:.9f}, with {loss:.9f})")
    # --merge-lora folds the experts' adapters into the base as PEFT's
    # merge_and_unload does: every weight equal to fp32 rounding, the
    # merged model loaded with nothing missing or unexpected, PEFT's loss.
    merged_dir = os.path.join(tmp, "lora-experts-merged")
    rc4, out4 = family_ref.lz("tools/ckpt.lua", "export", ck, merged_dir, "--merge-lora")
    if rc4 != 0:
        check(f"{name}.lora_experts_merge", False, out4[-2000:])
        return
    ours, info = transformers.AutoModelForCausalLM.from_pretrained(merged_dir,
                                                                   output_loading_info=True)
    ours = ours.float().eval()
    fresh = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    theirs = peft.PeftModel.from_pretrained(fresh, peft_dir).merge_and_unload().eval()
    mine, want = ours.state_dict(), theirs.state_dict()
    worst = max((mine[k] - want[k]).abs().max().item() for k in want) if mine.keys() == want.keys() \
        else float("inf")
    base0 = transformers.AutoModelForCausalLM.from_pretrained(folder).float().state_dict()
    moved = max((want[k] - v).abs().max().item() for k, v in base0.items() if "experts" in k)
    with torch.no_grad():
        merged_loss = family_ref.batch_loss(torch, ours, res["tokens"]).item()
    missing = sorted(info["missing_keys"]) + sorted(info["unexpected_keys"])
    err = family_ref.rel(merged_loss, loss)
    check(f"{name}.lora_experts_merge",
          worst <= 1e-6 and moved > 1e-4 and not missing and err <= family_ref.TOL,
          f"(largest difference from merge_and_unload {worst:.1e}, the experts moved "
          f"{moved:.1e}; missing/unexpected {missing}; "
          f"merged loss {merged_loss:.9f}, PEFT's {loss:.9f}, relative {err:.1e})")


def models_of(transformers):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=250, max_position_embeddings=128,
                  initializer_range=0.3, tie_word_embeddings=False, output_router_logits=True,
                  router_aux_loss_coef=COEF, attn_implementation="eager")
    return {
        "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
            rms_norm_eps=1e-5, router_jitter_noise=0.0, **common)),
        "qwen2_moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            **{**common, "num_hidden_layers": 3}, intermediate_size=96,
            moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
            mlp_only_layers=[1], qkv_bias=True, rms_norm_eps=1e-6)),
        "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **common, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, rms_norm_eps=1e-6)),
        "olmoe": (transformers.OlmoeForCausalLM, transformers.OlmoeConfig(
            **{**common, "num_key_value_heads": 4}, intermediate_size=32, num_experts=8,
            num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=CLIP, rms_norm_eps=1e-5,
            pad_token_id=None, eos_token_id=None)),
    }


def main():
    check = Checks("moe")
    try:
        import torch
        import transformers
        import peft
    except ImportError as e:
        print(f"skip: cannot import {e.name}: run with the second reference environment's "
              f"python (tests/ref/run.py {os.path.basename(__file__)})")
        return check.summary()
    if transformers.__version__ != VERSIONS5["transformers"]:
        print(f"skip: transformers {transformers.__version__}, not {VERSIONS5['transformers']}")
        return check.summary()
    transformers.logging.set_verbosity_error()
    only = sys.argv[1:]
    family_ref.batch_loss = moe_loss  # the export and LoRA checks compare this loss too
    for name, (cls, config) in models_of(transformers).items():
        if only and name not in only:
            continue
        torch.manual_seed(7)
        torch.set_num_threads(2)
        model = cls(config)
        with torch.no_grad():  # norms and biases away from their start
            for _, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
        with tempfile.TemporaryDirectory() as tmp:
            folder = os.path.join(tmp, name)
            model.save_pretrained(folder, safe_serialization=True)
            corpus = os.path.join(tmp, "corpus.txt")
            with open(corpus, "w", encoding="utf-8") as f:
                f.write(family_ref.CORPUS)
            model = model.float().eval()
            init_and_grads(check, name, torch, model, folder, tmp)
            init_and_grads(check, name, torch, model, folder, tmp, PAD)
            family_ref.generate(check, name, torch, model, folder, tmp)
            family_ref.export(check, name, transformers, torch, folder, corpus, tmp)
            family_ref.lora(check, name, transformers, torch, peft, folder, corpus, tmp,
                            want_targets=LORA_DEFAULT)
            lora_experts(check, name, transformers, torch, peft, folder, corpus, tmp)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
