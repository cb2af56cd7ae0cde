"""What a LoRA adapter is, checked from its files before anything reaches a worker.

A served adapter is a PEFT LoRA directory: ``adapter_config.json`` (read with peft's ``LoraConfig``, the
library that defines the format) and ``adapter_model.safetensors``, of which only the header is read here
(names, shapes, dtypes, byte offsets; no tensor). ``check_adapter`` refuses, each with a one-line
``AdapterError`` naming the adapter, whatever the workers could not serve exactly as PEFT computes it:

- missing directory or files (an ``adapter_model.bin`` pickle is not read);
- another PEFT method than LoRA, and LoRA variants that change the math (DoRA, biases, ``modules_to_save``,
  per-module ``rank_pattern``/``alpha_pattern``, and any other config field this module does not know to
  be harmless: a future PEFT option is refused until someone looks at it, not silently served wrong);
- targets outside the decoder layers' Linear projections of the base's family (embeddings, ``lm_head``)
  and projections that family does not have;
- tensors of another layout (an adapter for another architecture: its names do not fit the base's layer
  path), shapes that do not fit the base's projections, layer indices past ``num_hidden_layers``.

``layers_to_transform`` needs no support of its own: the weights say which layers carry the adapter.
Importing this module imports neither torch nor peft (the master checks adapters beside its event loop);
``check_adapter`` imports peft when called, which imports torch and transformers the first time.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Tuple

from ..loading import checkpoint_of

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

_HARMLESS = frozenset({
    "peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
    "peft_version", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "use_rslora",
    "layers_to_transform", "layers_pattern", "runtime_config", "megatron_core", "qalora_group_size",
    "ensure_weight_tying",
    # how the weights were initialised before training: the saved A and B are plain LoRA factors
    "init_lora_weights", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
})
"""LoraConfig fields that do not change what a trained adapter computes at inference (or only matter with
a field that is refused). Any other field away from its default is refused by name."""

_SPECIFIC = {
    "use_dora": "DoRA (use_dora=true) is not supported, only plain LoRA",
    "modules_to_save": "modules_to_save={v!r} is not supported (it replaces whole base modules)",
    "rank_pattern": "per-module ranks (rank_pattern={v!r}) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern={v!r}) are not supported",
    "lora_bias": "lora_bias=true is not supported (a bias on lora_B)",
    "fan_in_fan_out": "fan_in_fan_out=true is not supported (Conv1D weights; these bases use Linear)",
    "layer_replication": "layer_replication={v!r} is not supported",
    "target_parameters": "target_parameters={v!r} is not supported, only target_modules",
    "trainable_token_indices": "trainable_token_indices={v!r} is not supported (it changes embeddings)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
}


class AdapterError(ValueError):
    """An adapter that cannot be served on its base: one line naming the adapter and the problem."""

    def __init__(self, adapter_id: str, problem: str):
        super().__init__(f"adapter {adapter_id!r}: {' '.join(str(problem).split())}")
        self.adapter_id = adapter_id


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter: what the master sends the workers (plain values, picklable)."""
    adapter_id: str
    path: str
    """The adapter directory; the workers read ``adapter_model.safetensors`` from it."""
    r: int
    alpha: float
    scaling: float
    """What B @ A is multiplied by: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``."""
    target_modules: Tuple[str, ...]
    """Layer-relative paths of the Linear modules the adapter changes (``self_attn.q_proj``), sorted."""
    layers: Tuple[int, ...]
    """Model-wide indices of the decoder layers that carry the adapter, sorted."""
    nbytes: int
    """Bytes of all A and B tensors in the file (every rank holds a share of them)."""
    dtype: str
    """The file's dtype name (``float32``, ``float16``, ``bfloat16``); workers cast to the base's."""

    @property
    def weights_file(self) -> str:
        return os.path.join(self.path, WEIGHTS_NAME)


def family_of_config(adapter_id: str, base_config: Mapping[str, Any]):
    """The ``models.families`` entry of a causal-LM base config, else AdapterError."""
    from ..models.families import CAUSAL_LM, FAMILIES
    model_type = base_config.get("model_type")
    fam = next((f for f in FAMILIES if model_type in f.model_types), None)
    if fam is None or fam.runner != CAUSAL_LM:
        served = sorted(t for f in FAMILIES if f.runner == CAUSAL_LM for t in f.model_types)
        raise AdapterError(adapter_id, f"its base has model_type={model_type!r}; LoRA adapters are served on "
                                       f"causal LMs of model_type {served}")
    return fam


def linear_shapes(family: str, cfg: Mapping[str, Any]) -> Dict[str, Tuple[int, int]]:
    """(in_features, out_features) of each LoRA-capable Linear of one decoder layer, by layer-relative path,
    from a base config.json; KeyError names a missing field."""
    h = cfg["hidden_size"]
    if family == "opt":
        f = cfg["ffn_dim"]
        return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, h), "self_attn.v_proj": (h, h),
                "self_attn.out_proj": (h, h), "fc1": (h, f), "fc2": (f, h)}
    if family == "llama":
        heads = cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads") or heads
        hd = cfg.get("head_dim") or h // heads
        f = cfg["intermediate_size"]
        return {"self_attn.q_proj": (h, heads * hd), "self_attn.k_proj": (h, kv * hd),
                "self_attn.v_proj": (h, kv * hd), "self_attn.o_proj": (heads * hd, h),
                "mlp.gate_proj": (h, f), "mlp.up_proj": (h, f), "mlp.down_proj": (f, h)}
    raise KeyError(f"no LoRA shapes for the {family} family")


def tensor_key_pattern(family) -> "re.Pattern[str]":
    """The names PEFT saves a LoRA A/B weight of a decoder layer under (``base_model.model.`` then the
    causal LM's backbone attribute, the family's layer list, the index, the Linear's path): groups are
    (layer index, layer-relative path, 'A' or 'B')."""
    return re.compile(r"^base_model\.model\.(?:model\.)?" + re.escape(family.layers)
                      + r"\.(\d+)\.(.+)\.lora_([AB])\.weight$")


def read_safetensors_header(adapter_id: str, file: str) -> Dict[str, Dict[str, Any]]:
    """The tensor entries (``dtype``, ``shape``, ``data_offsets``) of a safetensors file's header."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise AdapterError(adapter_id, f"{file} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise AdapterError(adapter_id, f"{file} is not a safetensors file (header of {n} bytes)")
            text = f.read(n)
        if len(text) < n:
            raise AdapterError(adapter_id, f"{file} is truncated (header cut short)")
        header = json.loads(text)
    except (OSError, ValueError) as exc:
        if isinstance(exc, AdapterError):
            raise
        raise AdapterError(adapter_id, f"cannot read {file}: {exc}") from None
    header.pop("__metadata__", None)
    return header


def _load_config(adapter_id: str, path: str):
    """peft's LoraConfig of the directory, after a plain-JSON look at peft_type (so that another method's
    config never reaches LoraConfig)."""
    file = os.path.join(path, CONFIG_NAME)
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise AdapterError(adapter_id, f"cannot read {file}: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterError(adapter_id, f"{file} does not hold a JSON object")
    if raw.get("peft_type") != "LORA":
        raise AdapterError(adapter_id, f"not a LoRA adapter (peft_type={raw.get('peft_type')!r}); only LoRA "
                                       "adapters are served")
    import warnings
    from peft import LoraConfig
    try:
        with warnings.catch_warnings():  # peft warns about fields of newer versions it drops
            warnings.simplefilter("ignore")
            return LoraConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - whatever peft says about it, on one line
        raise AdapterError(adapter_id, f"peft cannot read {file}: {type(exc).__name__}: {exc}") from None


def _refuse_unsupported(adapter_id: str, config) -> None:
    if config.bias != "none":
        raise AdapterError(adapter_id, f"bias={config.bias!r} is not supported (it trains base biases); "
                                       "only bias='none'")
    for field in dataclasses.fields(config):
        if field.name in _HARMLESS or field.name == "bias":
            continue
        value = getattr(config, field.name, None)
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = None
        if value == default or (not value and not default):
            continue
        problem = _SPECIFIC.get(field.name, "{f}={v!r} is not supported by Computron's LoRA serving")
        raise AdapterError(adapter_id, problem.format(f=field.name, v=value))


def _check_target_names(adapter_id: str, config, fam) -> None:
    """Named targets (a list) must be Linear projections of the family's decoder layers; a regex or
    'all-linear' is left to the tensors, which say what was matched."""
    targets = config.target_modules
    if targets is None or isinstance(targets, str):
        return
    known = {p.rsplit(".", 1)[-1] for p in fam.colwise + fam.rowwise}
    for t in sorted(targets):
        if t.rsplit(".", 1)[-1] not in known:
            what = "embeddings and lm_head cannot carry LoRA here" if any(
                k in t for k in ("embed", "lm_head", "wte")) else f"{fam.name} decoder layers have no such Linear"
            raise AdapterError(adapter_id, f"targets module {t!r}: {what}; targets may be {sorted(known)}")


def _peft_loads(config, module_key: str, layer: int) -> bool:
    """Whether PEFT would put a LoRA layer on ``module_key`` (as ``PeftModel`` names it) for ``config``: a
    tensor it would not is dropped by PEFT, so serving it would compute something else."""
    layers = config.layers_to_transform
    if layers is not None and layer not in ([layers] if isinstance(layers, int) else layers):
        return False
    if _names(config.exclude_modules, module_key):
        return False
    return config.target_modules in (None, "all-linear") or _names(config.target_modules, module_key)


def _names(names, module_key: str) -> bool:
    """PEFT's matching: a string is a regex of the whole key, a list names keys or their dotted suffixes."""
    if not names:
        return False
    if isinstance(names, str):
        return re.fullmatch(names, module_key) is not None
    return any(module_key == n or module_key.endswith("." + n) for n in names)


def _check_tensors(adapter_id: str, header: Dict[str, Dict[str, Any]], fam, base_config, config
                   ) -> Tuple[Tuple[str, ...], Tuple[int, ...], int, str]:
    """(target paths, layers, nbytes, dtype) of a header checked against the base's layout and shapes."""
    r = int(config.r)
    try:
        shapes = linear_shapes(fam.name, base_config)
        n_layers = int(base_config["num_hidden_layers"])
    except KeyError as exc:
        raise AdapterError(adapter_id, f"its base's config.json lacks {exc}") from None
    pattern = tensor_key_pattern(fam)
    found: Dict[Tuple[int, str], Dict[str, List[int]]] = {}
    nbytes, dtypes = 0, []
    for key in sorted(header):
        entry = header[key]
        m = pattern.match(key)
        if m is None:
            hint = ("embedding LoRA is not supported" if "lora_embedding" in key else
                    "DoRA is not supported" if "lora_magnitude" in key else
                    f"not a LoRA A/B weight of a {fam.name} decoder layer ({fam.layers}.N....): "
                    "an adapter for another architecture?")
            raise AdapterError(adapter_id, f"tensor {key!r}: {hint}")
        layer, path, which = int(m.group(1)), m.group(2), m.group(3)
        if path not in shapes:
            raise AdapterError(adapter_id, f"tensor {key!r} targets {path!r}, which {fam.name} decoder layers do "
                                           f"not have (LoRA-capable: {sorted(shapes)})")
        if layer >= n_layers:
            raise AdapterError(adapter_id, f"tensor {key!r} is for layer {layer}, but the base has "
                                           f"num_hidden_layers={n_layers}")
        if not _peft_loads(config, key[len("base_model.model."):].rsplit(".lora_", 1)[0], layer):
            raise AdapterError(adapter_id, f"tensor {key!r} is outside what its target_modules/exclude_modules/"
                                           "layers_to_transform select: PEFT would not load it")
        dt = _ST_DTYPES.get(entry.get("dtype"))
        if dt is None:
            raise AdapterError(adapter_id, f"tensor {key!r} has dtype {entry.get('dtype')!r}; LoRA weights must "
                                           f"be one of {sorted(_ST_DTYPES)}")
        dtypes.append(dt)
        start, end = entry["data_offsets"]
        nbytes += end - start
        found.setdefault((layer, path), {})[which] = list(entry["shape"])
    if not found:
        raise AdapterError(adapter_id, f"{WEIGHTS_NAME} holds no LoRA weights")
    for (layer, path), ab in sorted(found.items()):
        where = f"layer {layer} {path}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(adapter_id, f"{where} has lora_{''.join(ab)} without lora_{'B' if 'A' in ab else 'A'}")
        fan_in, fan_out = shapes[path]
        if len(ab["A"]) == 2 and len(ab["B"]) == 2 and ab["A"][0] == ab["B"][1] != r:
            raise AdapterError(adapter_id, f"{where} holds rank-{ab['A'][0]} weights but {CONFIG_NAME} says r={r}")
        want_a, want_b = [r, fan_in], [fan_out, r]
        if ab["A"] != want_a or ab["B"] != want_b:
            raise AdapterError(adapter_id, f"{where}: lora_A {ab['A']} / lora_B {ab['B']} do not fit the base "
                                           f"(expected {want_a} / {want_b} for r={r} on {fam.name} with "
                                           f"in={fan_in}, out={fan_out}): an adapter for another model?")
    targets = tuple(sorted({p for _, p in found}))
    layers = tuple(sorted({layer for layer, _ in found}))
    dtype = max(set(dtypes), key=dtypes.count)
    return targets, layers, nbytes, dtype


def check_adapter(adapter_id: str, path: str, base_config: Mapping[str, Any]) -> AdapterInfo:
    """Validate the PEFT LoRA adapter at ``path`` for a base with config.json ``base_config`` (a dict, or a
    transformers config) from its files alone; return its ``AdapterInfo`` or raise ``AdapterError``."""
    if not isinstance(base_config, Mapping):
        base_config = base_config.to_dict()
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise AdapterError(adapter_id, f"directory {path!r} " +
                           ("is not a directory" if os.path.exists(path) else "does not exist"))
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        raise AdapterError(adapter_id, f"{path!r} has no {CONFIG_NAME}: not a PEFT adapter directory")
    weights = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights):
        pickle = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise AdapterError(adapter_id, f"{path!r} has no {WEIGHTS_NAME}" + (
            " (adapter_model.bin pickles are not read: save it with safe_serialization)" if pickle else ""))
    fam = family_of_config(adapter_id, base_config)
    config = _load_config(adapter_id, path)
    _refuse_unsupported(adapter_id, config)
    _check_target_names(adapter_id, config, fam)
    r = int(config.r)
    if r <= 0:
        raise AdapterError(adapter_id, f"r={r} must be positive")
    header = read_safetensors_header(adapter_id, weights)
    targets, layers, nbytes, dtype = _check_tensors(adapter_id, header, fam, base_config, config)
    alpha = float(config.lora_alpha)
    scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
    return AdapterInfo(adapter_id=adapter_id, path=os.path.abspath(path), r=r, alpha=alpha, scaling=scaling,
                       target_modules=targets, layers=layers, nbytes=nbytes, dtype=dtype)


def check_adapter_config(mc, base, max_rank: int) -> AdapterInfo:
    """The master's checks of adapter ``mc`` (a ``ModelConfig``) against the checkpoint of ``base``, the
    version it would go on (files only, no weights): its ``AdapterInfo``, or ``AdapterError`` in one line."""
    where = checkpoint_of(base)
    config_file = os.path.join(where[0], "config.json") if where is not None else None
    if config_file is None or not os.path.isfile(config_file):
        raise AdapterError(mc.model_id, f"its base {mc.base!r} has no local checkpoint with a config.json to "
                           "check the adapter against")
    with open(config_file) as f:
        info = check_adapter(mc.model_id, mc.adapter, json.load(f))
    if info.r > max_rank:
        raise AdapterError(mc.model_id, f"its rank {info.r} is over EngineConfig.max_lora_rank={max_rank}")
    return info


__all__ = ["AdapterError", "AdapterInfo", "check_adapter", "check_adapter_config", "linear_shapes",
           "tensor_key_pattern", "family_of_config", "read_safetensors_header", "CONFIG_NAME", "WEIGHTS_NAME"]
