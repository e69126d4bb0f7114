"""moelora inside Hugging Face transformers models: each MoE block replaced, in place, by a
moelora block with the family's own routing.

    from moelora.integrations import transformers as mt
    names = mt.patch_moe_blocks(model, max_loras=4, max_lora_rank=64)
    mt.load_adapter(model, 0, "path/to/peft_adapter")          # slot 0, every patched block
    with mt.adapters(model, torch.tensor([0, -1])):              # sequence 0 on slot 0, 1 base
        model.generate(input_ids, ...)

Families (transformers 5.x, whose experts are fused 3-D tensors):
    Mixtral, Qwen3-MoE, OLMoE  softmax -> top k (renormalised when the config says so)
    DeepSeek-V3                sigmoid scores + e_score_correction_bias, grouped top-k over
                               n_group / topk_group, routed_scaling_factor; the shared
                               experts kept (the transformers module, run beside the layer)
    gpt-oss                    router bias, top k -> softmax, interleaved swiglu with its
                               clamp, expert biases (below)
The expert tensors move into the moelora layer (FusedMoE(experts=...)): Mixtral's,
Qwen3's, OLMoE's and DeepSeek-V3's gate_up_proj [E, 2I, H] and down_proj [E, H, I] are
already w13 / w2 and are taken as they are; gpt-oss's [E, H, 2I] / [E, I, H] are
transposed once. The replaced block is dropped, so no second copy stays behind.

gpt-oss's expert biases: the kernels have no bias term. The gate_up bias rides in w13 as
one more input column, against a column of ones appended to x (exact: a product by 1,
its columns padded to a multiple of 16; w2 gets as many zero rows, whose output columns
are dropped); the down bias is added after the layer as
sum_k w_k * down_bias[e_k] (the routed weights' sum of the per-expert bias). Adapters of a
biased block are zero-padded over the extra columns (FusedMoE.adapter_hidden_size), so
the bias column gets no LoRA delta, as in PEFT.
"""
import contextlib

import torch
import torch.nn.functional as F

from .. import routing
from ..adapter_files import ReadAdapter, read_adapter
from ..checkpoint import CheckpointReader, read_experts
from ..layer import FusedMoE

__all__ = ["MoeloraMoeBlock", "patch_moe_blocks", "patched_blocks", "load_experts", "load_adapter", "unload_adapter",
           "adapters",
           "SUPPORTED_BLOCKS"]

# The transformers block classes this module replaces, by class name (no import of
# transformers here: the model brings its own classes).
SUPPORTED_BLOCKS = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock",
                    "OlmoeSparseMoeBlock", "DeepseekV3MoE", "GptOssMLP")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}


class MoeloraMoeBlock(torch.nn.Module):
    """A MoE block on moelora: router logits, the family's top-k routing
    (moelora.routing), the experts on moelora.FusedMoE (LoRA slots included), and the
    family's extras (shared experts, expert biases). Built by patch_moe_blocks.

    forward(hidden_states [*, H]) -> [*, H] (gpt-oss: a pair, the output and the routed
    weights, as its transformers block returns). Each token's adapter slot comes from
    adapters(model, ids) (none: the base layer)."""

    def __init__(self, *, routing_kind, moe, router_weight, router_bias=None, correction_bias=None,
                 renormalize=True, num_groups=1, topk_groups=1, router_fp32=False, shared_experts=None,
                 gate_up_bias=False, down_bias=None, returns_router_weights=False):
        super().__init__()
        if routing_kind not in ("softmax_topk", "sigmoid_grouped_topk", "topk_softmax"):
            raise ValueError(f"MoeloraMoeBlock: routing_kind expected softmax_topk, sigmoid_grouped_topk or "
                             f"topk_softmax, got {routing_kind!r}")
        self.routing_kind = routing_kind
        self.moe = moe
        self.router_weight = torch.nn.Parameter(router_weight.detach(), requires_grad=False)
        self.router_bias = None if router_bias is None else torch.nn.Parameter(router_bias.detach(),
                                                                             requires_grad=False)
        self.register_buffer("correction_bias", None if correction_bias is None else correction_bias.detach())
        self.renormalize = renormalize
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.router_fp32 = router_fp32
        self.shared_experts = shared_experts
        # gpt-oss: the gate_up bias rides in w13 against a ones column appended to x (module doc).
        self.gate_up_bias = gate_up_bias
        self.down_bias = None if down_bias is None else torch.nn.Parameter(down_bias.detach(), requires_grad=False)
        self.returns_router_weights = returns_router_weights
        self.hidden_size = router_weight.shape[1]
        # Set by adapters(): a slot per sequence [B] or per token [B, S] / [M]; None: base.
        self.token_lora_ids = None

    def extra_repr(self):
        return (f"routing={self.routing_kind}, renormalize={self.renormalize}, num_groups={self.num_groups}, "
                f"topk_groups={self.topk_groups}, gate_up_bias={self.gate_up_bias}, "
                f"down_bias={self.down_bias is not None}")

    @torch.no_grad()
    def load_experts(self, reader, prefix):
        """This block's experts (and gpt-oss's biases) from a checkpoint reader
        (moelora.checkpoint.CheckpointReader) under `prefix`."""
        if not self.gate_up_bias:
            return self.moe.load_experts(reader, prefix)
        H, E = self.hidden_size, self.moe.num_experts
        experts = read_experts(reader, prefix, list(range(E)), E, H, self.moe.intermediate_size)
        if experts.w13_bias is None:
            raise ValueError(f"MoeloraMoeBlock.load_experts: '{prefix}.experts.' holds no gate_up_proj_bias / "
                             f"down_proj_bias, which this (gpt-oss) block expects")
        w13, w2 = _with_bias_column(experts, self.moe.hidden_size - H)
        self.moe.load_weights(w13, w2)
        self.down_bias.copy_(experts.w2_bias)

    def route(self, x):
        """x [M, H] -> (topk_weights [M, k] float32, topk_ids [M, k] int32)."""
        if self.router_fp32:
            logits = F.linear(x.float(), self.router_weight.float(),
                              None if self.router_bias is None else self.router_bias.float())
        else:
            logits = F.linear(x, self.router_weight, self.router_bias)
        k = self.moe.top_k
        if self.routing_kind == "softmax_topk":
            return routing.softmax_topk(logits, k, self.renormalize)
        if self.routing_kind == "topk_softmax":
            return routing.topk_softmax(logits, k)
        return routing.sigmoid_grouped_topk(logits, k, self.num_groups, self.topk_groups, self.correction_bias,
                                            self.renormalize)

    def _lora_ids(self, leading):
        ids = self.token_lora_ids
        if ids is None:
            return None
        ids = ids.to(device=self.router_weight.device)
        if len(leading) == 2 and ids.dim() == 1 and ids.shape[0] == leading[0]:
            ids = ids[:, None].expand(*leading)  # a slot per sequence, to each of its tokens
        if ids.numel() != leading.numel():
            raise ValueError(f"MoeloraMoeBlock: adapter ids expected a slot per sequence ([{leading[0]}]) or per "
                             f"token ({list(leading)}), got shape {list(ids.shape)}")
        return ids.reshape(-1).to(torch.int32)

    def forward(self, hidden_states):
        leading = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, self.hidden_size)
        topk_weights, topk_ids = self.route(x)
        x_in = x
        if self.gate_up_bias:
            extra = self.moe.hidden_size - self.hidden_size
            x_in = torch.cat([x, torch.ones_like(x[:, :1]), x.new_zeros(x.shape[0], extra - 1)], dim=1)
        out = self.moe.forward_routed(x_in, topk_weights, topk_ids, self._lora_ids(leading))
        if self.gate_up_bias:
            out = out[:, :self.hidden_size]
        if self.down_bias is not None:
            bias = (topk_weights.unsqueeze(-1) * self.down_bias[topk_ids.long()].float()).sum(dim=1)
            out = (out.float() + self.moe.routed_scaling_factor * bias).to(out.dtype)
        out = out.reshape(*leading, self.hidden_size)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        if self.returns_router_weights:
            return out, topk_weights.to(hidden_states.dtype)
        return out


def _activation(config):
    name = getattr(config, "hidden_act", "silu")
    if name not in _ACTIVATIONS:
        raise ValueError(f"moelora.integrations.transformers: the experts' hidden_act expected one of "
                         f"{sorted(_ACTIVATIONS)}, got {name!r}")
    return _ACTIVATIONS[name]


def _with_bias_column(experts, extra):
    """gpt-oss's (w13, w2) for the layer: w13 [E, 2I, H + extra] with the gate_up bias in
    column H (against x's ones column) and zeros after it; w2 [E, H + extra, I] with zero
    rows for the extra output columns (dropped)."""
    w13, w2 = experts.w13, experts.w2
    E = w13.shape[0]
    w13 = torch.cat([w13, experts.w13_bias.unsqueeze(-1), w13.new_zeros(E, w13.shape[1], extra - 1)], dim=2)
    w2 = torch.cat([w2, w2.new_zeros(E, extra, w2.shape[2])], dim=1)
    return w13.contiguous(), w2.contiguous()


def _build_block(block, config, max_loras, max_lora_rank, quant, chunk_size):
    name = type(block).__name__
    options = dict(max_loras=max_loras, max_lora_rank=max_lora_rank, chunk_size=chunk_size)
    if name == "GptOssMLP":
        experts, router = block.experts, block.router
        E, H, two_i = experts.gate_up_proj.shape
        # NOTE: 16, not 8: 8-bit experts on CUDA need H a multiple of 16 (16-byte rows).
        extra = 16 - H % 16
        with torch.no_grad():  # the module's tensors read as a checkpoint's: one layout conversion
            module = {f"x.experts.{n}": p.data for n, p in experts.named_parameters()}
            w13, w2 = _with_bias_column(read_experts(CheckpointReader(module), "x", list(range(E)), E, H, two_i // 2),
                                         extra)
        moe = FusedMoE(E, router.top_k, H + extra, two_i // 2, activation="swiglu_oai",
                       swiglu_alpha=float(experts.alpha), swiglu_limit=float(experts.limit), quant=quant,
                       experts=(w13, w2) if quant is None else None,
                       dtype=w13.dtype if quant is None else experts.gate_up_proj.dtype, device=w13.device,
                       **options)
        if quant is not None:
            moe.load_weights(w13, w2)
        moe.adapter_hidden_size = H  # adapters see the model's H; the ones column's A / B stay zero
        return MoeloraMoeBlock(routing_kind="topk_softmax", moe=moe, router_weight=router.weight,
                               router_bias=router.bias, gate_up_bias=True, down_bias=experts.down_proj_bias,
                               returns_router_weights=True)

    experts, gate = block.experts, block.gate
    E, two_i, H = experts.gate_up_proj.shape
    deepseek = name == "DeepseekV3MoE"
    renormalize = True if name == "MixtralSparseMoeBlock" else bool(getattr(gate, "norm_topk_prob", False))
    weights = dict(experts=(experts.gate_up_proj.data, experts.down_proj.data)) if quant is None else {}
    moe = FusedMoE(E, gate.top_k, H, two_i // 2, activation=_activation(config), renormalize=renormalize,
                   routed_scaling_factor=float(gate.routed_scaling_factor) if deepseek else 1.0, quant=quant,
                   dtype=experts.gate_up_proj.dtype, device=experts.gate_up_proj.device, **weights, **options)
    if quant is not None:
        moe.load_weights(experts.gate_up_proj.data, experts.down_proj.data)
    if deepseek:
        return MoeloraMoeBlock(routing_kind="sigmoid_grouped_topk", moe=moe, router_weight=gate.weight,
                               correction_bias=gate.e_score_correction_bias, renormalize=renormalize,
                               num_groups=gate.num_group, topk_groups=gate.topk_group, router_fp32=True,
                               shared_experts=block.shared_experts)
    return MoeloraMoeBlock(routing_kind="softmax_topk", moe=moe, router_weight=gate.weight, renormalize=renormalize)


def patch_moe_blocks(model, *, max_loras=0, max_lora_rank=0, quant=None, chunk_size=65536):
    """Replace every supported MoE block of `model` (SUPPORTED_BLOCKS) with a
    MoeloraMoeBlock, in place; returns the replaced modules' names.

    max_loras / max_lora_rank: each block's adapter slots (load_adapter). quant: a moelora
    scheme name ('fp8_block', ...) to quantize the experts on load (float weights; the
    block then holds the 8-bit copy only). Raises ValueError when the model has no
    supported block, or on a block this module cannot take (nothing is replaced then)."""
    config = getattr(model, "config", None)
    targets = [(name, module) for name, module in model.named_modules() if type(module).__name__ in SUPPORTED_BLOCKS]
    if not targets:
        raise ValueError(f"moelora.integrations.transformers.patch_moe_blocks: no MoE block of a supported family "
                         f"({', '.join(SUPPORTED_BLOCKS)}) in {type(model).__name__}")
    built = [(name, _build_block(module, getattr(config, "get_text_config", lambda: config)(), max_loras,
                                 max_lora_rank, quant, chunk_size)) for name, module in targets]
    for name, block in built:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, block)
    return [name for name, _ in built]


def patched_blocks(model):
    """[(name, MoeloraMoeBlock)] of the model, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoeloraMoeBlock)]


def _blocks_or_fail(model, method):
    blocks = patched_blocks(model)
    if not blocks:
        raise ValueError(f"moelora.integrations.transformers.{method}: the model has no moelora block "
                         f"(run patch_moe_blocks first)")
    return blocks


def load_adapter(model, slot, source, scale=None):
    """Load a LoRA adapter (a PEFT adapter directory, a .safetensors file or a dict of
    tensors; see FusedMoE.load_adapter) into `slot` of every patched block, each reading
    the keys under its own module path. Returns the adapter's rank. On an error (a
    ValueError naming the key or argument) the slot is empty in every block."""
    blocks = _blocks_or_fail(model, "load_adapter")
    read = ReadAdapter(*read_adapter(source))  # the files read once, parsed per block
    rank = 0
    try:
        for name, block in blocks:
            rank = block.moe.load_adapter(slot, read, prefix=name, scale=scale)
    except Exception:
        # NOTE: a block refused it after others took it: the slot is emptied everywhere
        # rather than left holding the adapter in some blocks only.
        for _, block in blocks:
            block.moe.unload_adapter(slot)
        raise
    return rank


def load_experts(model, source):
    """Load every patched block's experts from a checkpoint (a .safetensors file, a folder
    of shards or a dict; moelora.checkpoint's namings), each under its module path or,
    for Mixtral's original checkpoints, '...block_sparse_moe'. Tensors are read lazily:
    only the experts' own."""
    reader = CheckpointReader(source)
    names = set(reader)
    for name, block in _blocks_or_fail(model, "load_experts"):
        candidates = [name] + ([name[:-len(".mlp")] + ".block_sparse_moe"] if name.endswith(".mlp") else [])
        prefix = next((p for p in candidates if any(k.startswith(p + ".experts.") for k in names)), None)
        if prefix is None:
            raise ValueError(f"moelora.integrations.transformers.load_experts: no expert weights under "
                             f"{' or '.join(repr(p + '.experts.') for p in candidates)} in the checkpoint")
        block.load_experts(reader, prefix)


def unload_adapter(model, slot):
    """Empty `slot` in every patched block (its tokens then run the base layer)."""
    for _, block in _blocks_or_fail(model, "unload_adapter"):
        block.moe.unload_adapter(slot)


@contextlib.contextmanager
def adapters(model, lora_ids):
    """Within the block, every patched block runs each token with its adapter slot:
    lora_ids [B] (a slot per sequence, -1 none; each step of generate) or [B, S] (per
    token). The previous ids are restored on exit."""
    blocks = _blocks_or_fail(model, "adapters")
    ids = torch.as_tensor(lora_ids)
    if ids.is_floating_point() or ids.is_complex() or ids.dim() not in (1, 2):
        raise ValueError(f"moelora.integrations.transformers.adapters: lora_ids expected an integer tensor [B] or "
                         f"[B, S], got {ids.dtype} of shape {list(ids.shape)}")
    ids = ids.to(blocks[0][1].router_weight.device)  # once here, not per block and step
    previous = [block.token_lora_ids for _, block in blocks]
    for _, block in blocks:
        block.token_lora_ids = ids
    try:
        yield
    finally:
        for (_, block), old in zip(blocks, previous):
            block.token_lora_ids = old
