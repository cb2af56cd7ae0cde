"""``lora.check_adapter``: every adapter the workers could not serve exactly as PEFT does is refused from its
files alone, with one line naming the adapter; a good one gives its ``AdapterInfo``.

The adapters here are written by hand (PEFT's config class, tensors named as PEFT saves them) so that no
model is built; ``tests/engine/test_lora_slots.py`` checks adapters PEFT itself saved.
"""
import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from computron.lora import AdapterError, AdapterInfo, check_adapter
from computron.lora.adapter import linear_shapes

OPT = dict(model_type="opt", hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4)
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
PREFIX = {"opt": "base_model.model.model.decoder.layers", "llama": "base_model.model.model.layers"}


def lora_tensors(base, r=4, layers=range(4), paths=None, prefix=None):
    """A/B tensors named as PEFT saves them, shaped for ``base``."""
    shapes = linear_shapes(base["model_type"], base)
    out = {}
    for i in layers:
        for path in paths or shapes:
            fan_in, fan_out = shapes[path]
            key = f"{prefix or PREFIX[base['model_type']]}.{i}.{path}"
            out[f"{key}.lora_A.weight"] = torch.randn(r, fan_in)
            out[f"{key}.lora_B.weight"] = torch.randn(fan_out, r)
    return out


def write_adapter(path, base=OPT, config=None, tensors=None, r=4, alpha=8):
    """An adapter directory: PEFT's LoraConfig (changed by ``config``), then ``tensors`` (default: every
    projection of every layer)."""
    from peft import LoraConfig
    os.makedirs(path, exist_ok=True)
    names = sorted({p.rsplit(".", 1)[-1] for p in linear_shapes(base["model_type"], base)})
    LoraConfig(r=r, lora_alpha=alpha, target_modules=names, task_type="CAUSAL_LM").save_pretrained(path)
    cfg_file = os.path.join(path, "adapter_config.json")
    with open(cfg_file) as f:
        raw = json.load(f)
    raw.update(config or {})
    with open(cfg_file, "w") as f:
        json.dump(raw, f)
    save_file(lora_tensors(base, r) if tensors is None else tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def refused(adapter_id, path, base, match):
    with pytest.raises(AdapterError, match=match) as info:
        check_adapter(adapter_id, path, base)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"adapter {adapter_id!r}: "), msg
    assert info.value.adapter_id == adapter_id
    return msg


def test_good_adapters_give_their_info(tmp_path):
    opt = check_adapter("o", write_adapter(tmp_path / "o"), OPT)
    assert isinstance(opt, AdapterInfo)
    assert (opt.adapter_id, opt.r, opt.alpha, opt.scaling, opt.dtype) == ("o", 4, 8.0, 2.0, "float32")
    assert opt.target_modules == ("fc1", "fc2", "self_attn.k_proj", "self_attn.out_proj", "self_attn.q_proj",
                                  "self_attn.v_proj")
    assert opt.layers == (0, 1, 2, 3) and opt.path == str(tmp_path / "o")
    assert opt.nbytes == sum(t.numel() * 4 for t in lora_tensors(OPT).values())
    # Llama with grouped k/v heads, rslora, bfloat16, only some layers and modules (layers_to_transform)
    tensors = {k: v.to(torch.bfloat16) for k, v in lora_tensors(LLAMA, r=16, layers=[1, 3],
                                                                   paths=["self_attn.k_proj", "mlp.down_proj"]).items()}
    path = write_adapter(tmp_path / "l", LLAMA, {"use_rslora": True, "layers_to_transform": [1, 3],
                                                 "target_modules": ["k_proj", "down_proj"]}, tensors, r=16, alpha=32)
    llama = check_adapter("l", path, LLAMA)
    assert (llama.r, llama.scaling, llama.dtype, llama.layers) == (16, 32 / math.sqrt(16), "bfloat16", (1, 3))
    assert llama.target_modules == ("mlp.down_proj", "self_attn.k_proj")
    assert llama.nbytes == sum(t.numel() * 2 for t in tensors.values())


def test_missing_files(tmp_path):
    refused("a", str(tmp_path / "nowhere"), OPT, "directory .* does not exist")
    (tmp_path / "file").write_text("x")
    refused("a", str(tmp_path / "file"), OPT, "is not a directory")
    (tmp_path / "empty").mkdir()
    refused("a", str(tmp_path / "empty"), OPT, "has no adapter_config.json")
    path = write_adapter(tmp_path / "bin")
    os.rename(os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin"))
    refused("a", path, OPT, "has no adapter_model.safetensors .*adapter_model.bin pickles are not read")


@pytest.mark.parametrize("change, match", [
    ({"peft_type": "IA3"}, r"not a LoRA adapter \(peft_type='IA3'\)"),
    ({"use_dora": True}, "DoRA"),
    ({"bias": "lora_only"}, "bias='lora_only' is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=.*lm_head.* is not supported"),
    ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
    ({"alpha_pattern": {"q_proj": 8}}, "per-module alphas"),
    ({"use_qalora": True}, "use_qalora=True is not supported"),  # any option not known to be harmless
    ({"target_modules": ["q_proj", "embed_tokens"]}, "targets module 'embed_tokens': embeddings and lm_head"),
    ({"target_modules": ["lm_head"]}, "targets module 'lm_head': embeddings and lm_head"),
    ({"target_modules": ["q_proj", "o_proj"]}, "targets module 'o_proj': opt decoder layers have no such Linear"),
    ({"r": 0}, "r=0 must be positive"),
    ({"target_modules": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1"]}, "layers.0.fc2.lora_A.weight. is outside"),
    ({"target_modules": ".*self_attn.*"}, "'.*layers.0.fc1.lora_A.weight' is outside what its target_modules"),
    ({"exclude_modules": ["fc2"]}, "layers.0.fc2.lora_A.weight. is outside"),
    ({"layers_to_transform": [0, 1]}, "'.*layers.2.fc1.lora_A.weight' is outside what .*layers_to_transform select"),
])
def test_unsupported_configs(tmp_path, change, match):
    refused("bad", write_adapter(tmp_path / "a", config=change), OPT, match)


def test_config_that_peft_cannot_read(tmp_path):
    path = write_adapter(tmp_path / "a")
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{not json")
    refused("x", path, OPT, "cannot read .*adapter_config.json")


@pytest.mark.parametrize("tensors, match", [
    # what peft saves for an adapter of a Llama model, offered to an OPT base with the same widths
    (lora_tensors(LLAMA, paths=["self_attn.q_proj"]),
     "not a LoRA A/B weight of a opt decoder layer .*another architecture"),
    ({**lora_tensors(OPT), "base_model.model.lm_head.lora_A.weight": torch.randn(4, 64)}, "'base_model.model.lm_head"),
    ({**lora_tensors(OPT), "base_model.model.model.decoder.embed_tokens.lora_embedding_A": torch.randn(4, 512)},
     "embedding LoRA is not supported"),
    (lora_tensors(OPT, layers=[0, 7]), "is for layer 7, but the base has num_hidden_layers=4"),
    (lora_tensors(dict(OPT, hidden_size=128, ffn_dim=256)),
     r"layer 0 fc1: lora_A \[4, 128\] / lora_B \[256, 4\] do not fit the base \(expected \[4, 64\] / \[128, 4\]"),
    (lora_tensors(OPT, r=8), "layer 0 fc1 holds rank-8 weights but adapter_config.json says r=4"),
    ({k: v for k, v in lora_tensors(OPT).items() if "fc1.lora_B" not in k}, "fc1 has lora_A without lora_B"),
    ({k: v.to(torch.int32) for k, v in lora_tensors(OPT).items()}, "has dtype 'I32'"),
    ({}, "holds no LoRA weights"),
])
def test_weights_that_do_not_fit_the_base(tmp_path, tensors, match):
    refused("w", write_adapter(tmp_path / "a", tensors=tensors), OPT, match)


def test_llama_shapes_use_key_value_heads(tmp_path):
    wrong = lora_tensors(dict(LLAMA, num_key_value_heads=4), paths=["self_attn.v_proj"])
    path = write_adapter(tmp_path / "a", LLAMA, {"target_modules": ["v_proj"]}, wrong)
    refused("kv", path, LLAMA,
            r"self_attn.v_proj: lora_A \[4, 64\] / lora_B \[64, 4\] .*expected \[4, 64\] / \[32, 4\]")


def test_bases_that_cannot_carry_adapters(tmp_path):
    path = write_adapter(tmp_path / "a")
    refused("b", path, {"model_type": "bert", "hidden_size": 64}, "model_type='bert'; LoRA adapters are served on")
    refused("b", path, {k: v for k, v in OPT.items() if k != "ffn_dim"}, "base's config.json lacks 'ffn_dim'")


def test_damaged_weight_files(tmp_path):
    path = write_adapter(tmp_path / "a")
    file = os.path.join(path, "adapter_model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(4)
    refused("d", path, OPT, "truncated")
    with open(file, "wb") as f:
        f.write((1 << 40).to_bytes(8, "little"))
    refused("d", path, OPT, "not a safetensors file")
