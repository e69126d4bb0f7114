"""LoRA adapter files of a MoE layer's experts: safetensors / torch files and PEFT adapter
directories read into per-expert (A, B) pairs (FusedMoE.load_adapter's formats)."""

import collections
import json
import math
import os
import re

import numpy as np
import torch

from .checkpoint import _SafetensorsFile

# ---- adapter files -------------------------------------------------------------------
#
# What load_adapter reads. The packed 3-D layout is PEFT's (peft/tuners/lora/layer.py,
# ParamWrapper, LoRA on a 3-D nn.Parameter through LoraConfig.target_parameters): the
# parameter [E, d1, d2] is read as [E, in, out]; lora_A = Linear(in, r * E) and lora_B =
# Linear(r * E, out), so lora_A.weight [E*r, in] reshapes to [E, r, in] and lora_B.weight
# [out, r*E] to [out, r, E], and the delta is einsum("ore,eri->eio"). Targeting both
# gate_up_proj and down_proj of one `experts` module nests the wrappers: the saved keys are
# "experts.lora_*" and "experts.base_layer.lora_*". vLLM's loader for these (lora/
# model_manager.py, _stack_moe_lora_weights, models with is_3d_moe_weight such as gpt-oss)
# reshapes the same way and takes base_layer as gate_up_proj; here the two are told apart by
# their shapes. vLLM's docs name the fused keys "experts.gate_up_proj.lora_A.weight", also
# accepted, flat as PEFT writes them or stacked per expert ([E, r, in] / [E, out, r], as
# SGLang normalises them).

_ROLE_OF_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PER_EXPERT_KEY = re.compile(
    r"(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.lora_(?P<ab>[AB])\.weight")
_PACKED_KEY = re.compile(r"(?P<proj>gate_up_proj|down_proj)\.lora_(?P<ab>[AB])\.weight")
_WRAPPER_KEY = re.compile(r"(?P<nest>(?:base_layer\.)*)lora_(?P<ab>[AB])\.weight")
_LAYOUTS = ("in_out", "out_in")

_ExpertShape = collections.namedtuple(
    "_ExpertShape", "num_experts hidden_size intermediate_size max_rank interleaved_gate_up")



def _error(message):
    return ValueError(f"FusedMoE.load_adapter: {message}")


def read_safetensors(path):
    """name -> CPU tensor of a .safetensors file, read without the safetensors package
    (moelora.checkpoint's reader, every tensor at once)."""
    file = _SafetensorsFile(path)
    return {name: file.read(name) for name in file.entries}


def _load_tensor_file(path):
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:  # the format is simple enough to read without the package
            return read_safetensors(path)
        return load_file(path, device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


# An adapter already read (read_adapter's result): load_adapter takes it as a source, so
# that a model's blocks share one read of the files.
ReadAdapter = collections.namedtuple("ReadAdapter", "tensors config")


def read_adapter(source):
    """(tensors: name -> tensor, config: dict or None) of a load_adapter source."""
    if isinstance(source, ReadAdapter):
        return dict(source.tensors), source.config
    if isinstance(source, dict):
        return dict(source), None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"FusedMoE.load_adapter: source expected a path or a dict name -> tensor, "
                        f"got {type(source).__name__}")
    path = os.fspath(source)
    if os.path.isdir(path):
        folder = path
        for name in ("adapter_model.safetensors", "adapter_model.bin"):
            if os.path.isfile(os.path.join(path, name)):
                weights = os.path.join(path, name)
                break
        else:
            raise _error(f"'{path}' holds no adapter_model.safetensors (nor adapter_model.bin)")
    elif os.path.isfile(path):
        folder, weights = os.path.dirname(path), path
    else:
        raise _error(f"source '{path}' is neither a directory nor a file")
    config = None
    config_path = os.path.join(folder, "adapter_config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
    return _load_tensor_file(weights), config


def _as_float_tensor(name, value):
    if isinstance(value, np.ndarray):
        if value.dtype.name == "bfloat16":
            value = value.astype(np.float32)
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise _error(f"key '{name}' expected a tensor, got {type(value).__name__}")
    if not (value.is_floating_point()):
        raise _error(f"key '{name}' expected a floating-point tensor, got {value.dtype}")
    return value.detach().to("cpu", torch.float32)


def _select_prefix(keys, prefix):
    """{key: remainder after '<module prefix>.experts.'} of the keys of one MoE block."""
    by_prefix = collections.defaultdict(dict)
    for key in keys:
        parts = key.split(".")
        positions = [i for i, part in enumerate(parts) if part == "experts"]
        if not positions:
            continue
        i = positions[-1]
        by_prefix[".".join(parts[:i])][key] = ".".join(parts[i + 1:])
    if prefix is not None:
        prefix = prefix.strip(".")
        if prefix == "experts" or prefix.endswith(".experts"):
            prefix = prefix[:-len("experts")].rstrip(".")
        found = {p: v for p, v in by_prefix.items() if p == prefix or p.endswith("." + prefix) or not prefix}
    else:
        found = by_prefix
    described = sorted(by_prefix)[:6]
    if not found:
        where = f" under prefix '{prefix}'" if prefix is not None else ""
        raise _error(f"no expert LoRA keys ('<prefix>.experts.*.lora_A.weight'){where}; expert module prefixes "
                     f"in the source: {described or 'none'}")
    if len(found) > 1:
        raise _error(f"the source holds the experts of several layers {sorted(found)[:6]}: pass prefix= to "
                     f"choose one" if prefix is None else
                     f"prefix '{prefix}' matches several layers {sorted(found)[:6]}: pass a longer prefix")
    (module_prefix, remainders), = found.items()
    return module_prefix, remainders


class _ParsedAdapter:
    """The (A [r, K], B [N, r]) pairs, in nn.Linear orientation, of each role (gate, up,
    down) and global expert, with per-role scale folded into B; the slot's scale; the
    largest rank."""

    def __init__(self):
        self.pairs = {}
        self.scale = 1.0
        self.rank = 0

    def get(self, role, expert):
        return self.pairs.get((role, expert))


def _module_scale(config, module_name, rank):
    """PEFT's scaling of one LoRA module: lora_alpha / r, or / sqrt(r) with use_rslora;
    alpha_pattern entries override lora_alpha for the modules they match."""
    alpha = config.get("lora_alpha")
    if alpha is None:
        raise _error("adapter_config.json has no lora_alpha: pass scale=")
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module_name):
            alpha = value
            break
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _check_config(config):
    peft_type = config.get("peft_type")
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise _error(f"adapter_config.json peft_type expected 'LORA', got {peft_type!r}")
    if config.get("use_dora"):
        raise _error("adapter_config.json use_dora: DoRA adapters are not supported")


def _check_rank(key, rank, max_rank):
    if rank < 1:
        raise _error(f"key '{key}' has rank {rank}; expected at least 1")
    if rank > max_rank:
        raise _error(f"key '{key}' has rank {rank}, above the layer's max_lora_rank {max_rank}")


def _per_expert_pairs(entries, shape, full_key):
    """entries: {(role, expert): {"A": tensor, "B": tensor}} -> {(role, expert): (A, B)}."""
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
    in_out = {"gate": (H, I), "up": (H, I), "down": (I, H)}  # (K, N) of each role
    pairs = {}
    roles = sorted({role for role, _ in entries})
    for role in roles:
        for expert in range(E):
            entry = entries.get((role, expert))
            if entry is None:
                raise _error(f"key '{full_key(role, expert, 'A')}' is missing: the {role} projection has adapters "
                             f"for some experts, and every one of the {E} experts needs one")
            for ab in ("A", "B"):
                if ab not in entry:
                    raise _error(f"key '{full_key(role, expert, ab)}' is missing")
            a, b = entry["A"], entry["B"]
            K, N = in_out[role]
            if a.dim() != 2 or a.shape[1] != K:
                raise _error(f"key '{full_key(role, expert, 'A')}' expected shape [r, {K}], got {list(a.shape)}")
            rank = a.shape[0]
            _check_rank(full_key(role, expert, "A"), rank, shape.max_rank)
            if b.dim() != 2 or tuple(b.shape) != (N, rank):
                raise _error(f"key '{full_key(role, expert, 'B')}' expected shape [{N}, {rank}], got {list(b.shape)}")
            pairs[(role, expert)] = (a, b)
    return pairs


def _flat_candidates(a, b, shape, roles):
    """[(role, layout)] that PEFT's flat packed tensors a [E*r, X], b [Y, r*E] fit."""
    H, I = shape.hidden_size, shape.intermediate_size
    dims = {("gate_up", "in_out"): (H, 2 * I), ("gate_up", "out_in"): (2 * I, H),
            ("down", "in_out"): (I, H), ("down", "out_in"): (H, I)}
    if a.dim() != 2 or b.dim() != 2:
        return []
    return [(role, layout) for (role, layout), xy in dims.items()
            if role in roles and (a.shape[1], b.shape[0]) == xy]


def _unflatten(key, a, b, layout, shape):
    """PEFT's flat packed pair -> stacked (A [E, r, K], B [E, N, r]) in nn.Linear orientation."""
    E = shape.num_experts
    if a.shape[0] % E != 0 or b.shape[1] != a.shape[0]:
        raise _error(f"key '{key}' expected lora_A [E*r, in] and lora_B [out, r*E] with E = {E} experts, got "
                     f"{list(a.shape)} and {list(b.shape)}")
    rank = a.shape[0] // E
    a3 = a.reshape(E, rank, a.shape[1])                  # [E, r, X]: row e*r + i
    b3 = b.reshape(b.shape[0], rank, E).permute(2, 0, 1)  # [E, Y, r]: column i*E + e
    if layout == "in_out":  # delta_e = (B_e A_e)^T of the [in, out] parameter: W_e += B_e A_e
        return a3, b3
    return b3.transpose(1, 2), a3.transpose(1, 2)         # W_e ([out, in]) += A_e^T B_e^T


def _packed_pairs(entries, shape, layout_hint, key_of):
    """entries: {name: {"A", "B", "role" (None: from the shapes)}} of the packed form ->
    {(role, expert): (A, B)} with gate_up split into gate and up."""
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
    resolved = {}  # name -> (role, stacked (A, B) or flat candidates)
    for name, entry in entries.items():
        for ab in ("A", "B"):
            if ab not in entry:
                raise _error(f"key '{key_of(name, ab)}' is missing")
        a, b, role = entry["A"], entry["B"], entry.get("role")
        if a.dim() == 3:  # stacked per expert, nn.Linear orientation
            K, N = {"gate_up": (H, 2 * I), "down": (I, H)}[role]
            if a.shape[0] != E or a.shape[2] != K:
                raise _error(f"key '{key_of(name, 'A')}' expected shape [{E}, r, {K}], got {list(a.shape)}")
            if b.dim() != 3 or tuple(b.shape) != (E, N, a.shape[1]):
                raise _error(f"key '{key_of(name, 'B')}' expected shape [{E}, {N}, {a.shape[1]}], got "
                             f"{list(b.shape)}")
            resolved[name] = (role, (a, b))
            continue
        roles = (role,) if role is not None else ("gate_up", "down")
        candidates = _flat_candidates(a, b, shape, roles)
        if not candidates:
            what = {"gate_up": f"in = {H}, out = {2 * I} (or transposed)", "down": f"in = {I}, out = {H} (or "
                    "transposed)"}
            raise _error(f"keys '{key_of(name, 'A')}' {list(a.shape)} and '{key_of(name, 'B')}' {list(b.shape)} "
                         f"fit no expert projection of this layer: expected lora_A [E*r, in], lora_B [out, r*E] "
                         f"with " + " or ".join(what[r] for r in roles))
        if len({r for r, _ in candidates}) > 1:  # cannot happen for I > 0; kept for clarity
            raise _error(f"keys '{key_of(name, 'A')}' fit both expert projections")
        resolved[name] = (candidates[0][0], candidates)
    roles = [role for role, _ in resolved.values()]
    if len(set(roles)) != len(roles):
        raise _error(f"the packed keys {sorted(entries)} adapt the same projection twice")
    # One parameter layout for the whole block: the hint, else what every flat pair allows.
    allowed = set(_LAYOUTS) if layout_hint is None else {layout_hint}
    for name, (role, value) in resolved.items():
        if isinstance(value, list):
            fits = {layout for _, layout in value}
            if layout_hint is not None and layout_hint not in fits:
                raise _error(f"keys '{key_of(name, 'A')}' do not fit expert_param_layout='{layout_hint}' (shapes "
                             f"{list(entries[name]['A'].shape)} and {list(entries[name]['B'].shape)})")
            allowed &= fits
    flat = [name for name, (_, value) in resolved.items() if isinstance(value, list)]
    if flat and not allowed:
        raise _error(f"the packed keys {sorted(flat)} disagree on the expert parameter layout (one reads as "
                     f"[E, in, out], the other as [E, out, in])")
    if flat and len(allowed) > 1:
        raise _error(f"cannot tell the expert parameter layout of '{key_of(flat[0], 'A')}' from its shapes "
                     f"(hidden_size {H}, intermediate_size {I}): pass expert_param_layout='in_out' ([E, in, out], "
                     f"gpt-oss) or 'out_in' ([E, out, in])")
    layout = next(iter(allowed)) if flat else None
    pairs = {}
    for name, (role, value) in resolved.items():
        a, b = value if not isinstance(value, list) else _unflatten(key_of(name, "A"), entries[name]["A"],
                                                                    entries[name]["B"], layout, shape)
        _check_rank(key_of(name, "A"), a.shape[1], shape.max_rank)
        if role == "gate_up":
            gate_b, up_b = ((b[:, 0::2], b[:, 1::2]) if shape.interleaved_gate_up else (b[:, :I], b[:, I:]))
            for expert in range(E):
                pairs[("gate", expert)] = (a[expert], gate_b[expert])
                pairs[("up", expert)] = (a[expert], up_b[expert])
        else:
            for expert in range(E):
                pairs[("down", expert)] = (a[expert], b[expert])
    return pairs


def parse_expert_lora(tensors, config, shape, prefix=None, scale=None, expert_param_layout=None):
    """The adapter of one MoE block from a name -> tensor mapping (see FusedMoE.load_adapter)."""
    if expert_param_layout is not None and expert_param_layout not in _LAYOUTS:
        raise _error(f"expert_param_layout expected one of {_LAYOUTS} or None, got {expert_param_layout!r}")
    if config is not None:
        _check_config(config)
    module_prefix, remainders = _select_prefix(tensors.keys(), prefix)
    base = f"{module_prefix}.experts" if module_prefix else "experts"
    per_expert, packed, unknown = collections.defaultdict(dict), collections.defaultdict(dict), []
    for key, rest in remainders.items():
        match = _PER_EXPERT_KEY.fullmatch(rest)
        if match:
            expert = int(match["expert"])
            if expert >= shape.num_experts:
                raise _error(f"key '{key}' names expert {expert}; the layer has {shape.num_experts} experts")
            slot = per_expert[(_ROLE_OF_PROJ[match["proj"]], expert)]
            if match["ab"] in slot:
                raise _error(f"key '{key}' adapts the same projection as another key (gate_proj/w1, up_proj/w3 "
                             f"and down_proj/w2 are one projection each)")
            slot[match["ab"]] = _as_float_tensor(key, tensors[key])
            slot.setdefault("names", {})[match["ab"]] = key
            continue
        match = _PACKED_KEY.fullmatch(rest)
        if match:
            entry = packed[match["proj"]]
            entry["role"] = "gate_up" if match["proj"] == "gate_up_proj" else "down"
            entry[match["ab"]] = _as_float_tensor(key, tensors[key])
            continue
        match = _WRAPPER_KEY.fullmatch(rest)
        if match:
            depth = match["nest"].count("base_layer.")
            if depth > 1:
                raise _error(f"key '{key}': more than two nested expert parameter adapters are not supported")
            packed[f"wrapper{depth}"][match["ab"]] = _as_float_tensor(key, tensors[key])
            continue
        unknown.append(key)
    if unknown:
        raise _error(f"unsupported key '{unknown[0]}' under '{base}' (LoRA A/B weights of gate/up/down "
                     f"projections only; no DoRA, biases or other adapter types)"
                     + (f", and {len(unknown) - 1} more" if len(unknown) > 1 else ""))
    if per_expert and packed:
        raise _error(f"'{base}' mixes per-expert keys ('{base}.<e>.<proj>.lora_A.weight') with packed 3-D keys")
    if any(name.startswith("wrapper") for name in packed) and any(not n.startswith("wrapper") for n in packed):
        raise _error(f"'{base}' mixes PEFT's nested keys ('{base}.lora_A.weight') with named packed keys "
                     f"('{base}.gate_up_proj.lora_A.weight')")

    def per_expert_key(role, expert, ab):
        names = per_expert.get((role, expert), {}).get("names", {})
        if ab in names:
            return names[ab]
        proj = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[role]
        return f"{base}.{expert}.{proj}.lora_{ab}.weight"

    def packed_key(name, ab):
        if name.startswith("wrapper"):
            return f"{base}.{'base_layer.' * int(name[len('wrapper'):])}lora_{ab}.weight"
        return f"{base}.{name}.lora_{ab}.weight"

    parsed = _ParsedAdapter()
    if per_expert:
        pairs = _per_expert_pairs(per_expert, shape, per_expert_key)
        module_names = {(role, e): per_expert_key(role, e, "A")[:-len(".lora_A.weight")] for role, e in pairs}
    else:
        pairs = _packed_pairs(packed, shape, expert_param_layout, packed_key)
        module_names = {}
        for name, entry in packed.items():
            module = packed_key(name, "A")[:-len(".lora_A.weight")]
            for role in (("gate", "up") if entry.get("role", "gate_up") == "gate_up" else ("down",)):
                for e in range(shape.num_experts):
                    module_names[(role, e)] = module
        if any(name.startswith("wrapper") for name in packed):
            # PEFT names both wrappers' module "<prefix>.experts" (patterns match that).
            module_names = {k: base for k in pairs}
    parsed.rank = max(a.shape[0] for a, _ in pairs.values())
    if scale is not None:
        parsed.scale = float(scale)
    elif config is None:
        parsed.scale = 1.0
    else:
        # One scale per slot: the most common module scale; other modules fold the ratio
        # into their B (alpha_pattern, or modules of different ranks).
        scales = {k: _module_scale(config, module_names[k], a.shape[0]) for k, (a, _) in pairs.items()}
        parsed.scale = collections.Counter(scales.values()).most_common(1)[0][0]
        if parsed.scale == 0.0:
            raise _error("the adapter's scale (lora_alpha) is 0")
        pairs = {k: (a, b * (scales[k] / parsed.scale) if scales[k] != parsed.scale else b)
                 for k, (a, b) in pairs.items()}
    parsed.pairs = pairs
    return parsed
