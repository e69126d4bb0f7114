"""Top-k routing of the MoE families moelora serves (torch; CPU or CUDA, graph-capturable).

Each function takes the router's logits [M, num_experts] and returns (topk_weights [M, k]
float32, topk_ids [M, k] int32), the arguments of moelora.fused_experts. They follow the
reference implementations' order of operations (Hugging Face transformers' routers), so
the same logits pick the same experts, ties included:
    softmax_topk          Mixtral, Qwen2/3-MoE, OLMoE: softmax over the experts, top k,
                          optionally renormalised over the k.
    sigmoid_grouped_topk  DeepSeek-V3/R1: sigmoid scores, the choice biased by
                          e_score_correction_bias, experts limited to the topk_group best
                          of n_group groups (a group's score: its best two biased scores),
                          weights from the unbiased scores, optionally renormalised.
    topk_softmax          gpt-oss: top k of the logits, then a softmax over those k.
routed_scaling_factor is not applied here: pass it to fused_experts (or FusedMoE), which
applies it to the sum (the same product).
"""
import torch

__all__ = ["softmax_topk", "sigmoid_grouped_topk", "topk_softmax"]


def _check_logits(name, router_logits, top_k):
    if router_logits.dim() != 2:
        raise ValueError(f"{name}: router_logits expected [M, num_experts], got shape {list(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{name}: top_k expected an int in [1, {num_experts}], got {top_k!r}")


def softmax_topk(router_logits, top_k, renormalize):
    """softmax(logits) in float32 -> top k -> / their sum when renormalize."""
    _check_logits("softmax_topk", router_logits, top_k)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


def sigmoid_grouped_topk(router_logits, top_k, num_groups, topk_groups, correction_bias=None, renormalize=True):
    """DeepSeek-V3's routing (no routed_scaling_factor: see the module's doc).

    correction_bias [num_experts] (e_score_correction_bias) moves the choice only; the
    weights are the sigmoid scores of the chosen experts."""
    _check_logits("sigmoid_grouped_topk", router_logits, top_k)
    M, num_experts = router_logits.shape
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"sigmoid_grouped_topk: num_groups expected a divisor of num_experts ({num_experts}), "
                         f"got {num_groups}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"sigmoid_grouped_topk: topk_groups expected a value in [1, {num_groups}], got {topk_groups}")
    per_group = num_experts // num_groups
    if top_k > topk_groups * per_group:
        raise ValueError(f"sigmoid_grouped_topk: top_k ({top_k}) expected at most topk_groups x experts a group "
                         f"({topk_groups * per_group})")
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    group_scores = choice.view(M, num_groups, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(M, num_groups, per_group).reshape(M, num_experts)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights, topk_ids.to(torch.int32)


def topk_softmax(router_logits, top_k):
    """top k of the logits -> softmax over those k (in the logits' dtype, then float32)."""
    _check_logits("topk_softmax", router_logits, top_k)
    top_values, topk_ids = torch.topk(router_logits, top_k, dim=-1)
    topk_weights = torch.softmax(top_values, dim=-1, dtype=top_values.dtype).float()
    return topk_weights, topk_ids.to(torch.int32)
