"""FusedMoE: an inference Mixture-of-Experts layer (torch.nn.Module) on moelora."""

import torch

from . import torch_ops  # noqa: F401  (registers torch.ops.moelora.*)

__all__ = ["FusedMoE"]

_ACTIVATIONS = ("silu", "gelu", "swiglu_oai")


class FusedMoE(torch.nn.Module):
    """A Mixture-of-Experts MLP: softmax top-k routing, then moelora.fused_experts.

    Weights (inference only: they do not require grad):
        w13 [E_local, 2I, H]: gate rows then up rows (interleaved gate/up for swiglu_oai).
        w2  [E_local, H, I].
    Expert parallelism: expert_map [num_experts] int32 maps a global expert id to its
    local index in w13/w2, or -1 for an expert held by another rank (those slots
    contribute zero here and the ranks' outputs are summed by the caller).
    """

    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, activation="silu",
                 renormalize=True, routed_scaling_factor=1.0, expert_map=None, chunk_size=65536,
                 swiglu_alpha=1.702, swiglu_limit=7.0, dtype=None, device=None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"FusedMoE: activation expected one of {_ACTIVATIONS}, got {activation!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"FusedMoE: top_k expected a value in [1, {num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.renormalize = renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.chunk_size = chunk_size
        self.swiglu_alpha = swiglu_alpha
        self.swiglu_limit = swiglu_limit

        if expert_map is None:
            self.num_local_experts = num_experts
            self.register_buffer("expert_map", None)
        else:
            expert_map = torch.as_tensor(expert_map, dtype=torch.int32, device=device)
            if expert_map.shape != (num_experts,):
                raise ValueError(f"FusedMoE: expert_map expected shape [{num_experts}], "
                                 f"got {list(expert_map.shape)}")
            self.num_local_experts = int((expert_map >= 0).sum().item())
            self.register_buffer("expert_map", expert_map)

        factory = dict(dtype=dtype, device=device)
        self.w13 = torch.nn.Parameter(
            torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size, **factory),
            requires_grad=False)
        self.w2 = torch.nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, intermediate_size, **factory),
            requires_grad=False)

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, num_local_experts={self.num_local_experts}, "
                f"top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, activation={self.activation}, "
                f"renormalize={self.renormalize}, routed_scaling_factor={self.routed_scaling_factor}")

    @torch.no_grad()
    def load_weights(self, w13, w2):
        """Copy w13 [E_local, 2I, H] and w2 [E_local, H, I] (any dtype/device) into the layer."""
        for name, param, value in (("w13", self.w13, w13), ("w2", self.w2, w2)):
            value = torch.as_tensor(value)
            if value.shape != param.shape:
                raise ValueError(f"FusedMoE.load_weights: {name} expected shape {list(param.shape)}, "
                                 f"got {list(value.shape)}")
            param.copy_(value)

    def route(self, router_logits):
        """router_logits [M, num_experts] -> (topk_weights [M, top_k] float32,
        topk_ids [M, top_k] int32): softmax over experts, top-k, optionally renormalised."""
        probs = torch.softmax(router_logits.float(), dim=-1)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights, topk_ids.to(torch.int32)

    def forward(self, hidden_states, router_logits):
        """hidden_states [*, H], router_logits [*, num_experts] -> [*, H]."""
        topk_weights, topk_ids = self.route(router_logits.reshape(-1, self.num_experts))
        return self.forward_routed(hidden_states, topk_weights, topk_ids)

    def forward_routed(self, hidden_states, topk_weights, topk_ids):
        """hidden_states [*, H], topk_weights [M, top_k] float32, topk_ids [M, top_k]
        int32|int64 (M = the product of the leading dims) -> [*, H]."""
        leading = hidden_states.shape[:-1]
        out = torch.ops.moelora.fused_experts(
            hidden_states.reshape(-1, self.hidden_size), self.w13, self.w2,
            topk_weights.float(), topk_ids, activation=self.activation,
            routed_scaling_factor=self.routed_scaling_factor, expert_map=self.expert_map,
            chunk_size=self.chunk_size, swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit)
        return out.reshape(*leading, self.hidden_size)
