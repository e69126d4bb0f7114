"""Tiny random Hugging Face MoE models of each family moelora patches (no downloads: built
from configs in code, random init with a fixed seed), for the integration and PEFT tests
and the GPU report."""
import torch
import transformers

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
VOCAB = 128


def tiny_config(family):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                  bos_token_id=2)
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                                           num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, **common)
    if family == "olmoe":
        # OLMoE does not renormalise its top-k weights (norm_topk_prob False).
        return transformers.OlmoeConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2, **common)
    if family == "deepseek_v3":
        # Layer 0 dense, layer 1 MoE: 16 experts in 4 groups, the best 2 groups, top 4, one
        # shared expert, routed_scaling_factor 2.5 (MLA attention: as many KV heads as heads).
        return transformers.DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16,
            q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            **{**common, "num_key_value_heads": 4})
    if family == "gpt_oss":
        return transformers.GptOssConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                                         sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                                         **common)
    raise ValueError(f"unknown family {family!r}")


def tiny_model(family, dtype=torch.float32, device="cpu", seed=0):
    """A random tiny model in eval mode. The experts, routers and expert biases get larger
    weights than the config's init (std 0.2), so that routing is decisive and a wrong
    expert or weight shows in the logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name or name.endswith((".gate.weight", ".router.weight", ".router.bias")):
                param.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model.to(dtype=dtype, device=device)


def synthetic_batch(batch, length, generator):
    """Token sequences of a fixed rule, next = (3 * token + 1) mod VOCAB, from random starts:
    a permutation of the vocabulary, which the embeddings and head alone cannot represent
    (VOCAB > hidden size), so a trained model leans on its MLPs, the experts."""
    seq = [torch.randint(3, VOCAB, (batch, 1), generator=generator)]
    for _ in range(length - 1):
        seq.append((3 * seq[-1] + 1) % VOCAB)
    return torch.cat(seq, dim=1)


def trained_tiny_model(family, device="cpu", steps=300, seed=0):
    """tiny_model trained `steps` Adam steps (fp32) on synthetic_batch, then in eval mode.
    Random tiny models are chaotic (near-tied routers and next tokens: their own bf16 run
    can be 0.3 of the logit scale from fp32); a trained one predicts decisively, so a bf16
    comparison measures the kernels rather than the chaos."""
    model = tiny_model(family, device=device, seed=seed).train()
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = synthetic_batch(32, 16, generator).to(device)
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()
