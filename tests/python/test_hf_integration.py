"""moelora inside Hugging Face models (moelora.integrations.transformers): each family's
patched model against the eager transformers model (logits and 32 greedy tokens), the
expert tensors moved without a copy, PEFT adapters served in a mixed batch, and errors.
fp32 on the CPU (CI); bf16 on CUDA when present."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import moelora  # noqa: E402
from moelora import routing  # noqa: E402
from moelora.integrations import transformers as mt  # noqa: E402

from hf_tiny_models import FAMILIES, VOCAB, tiny_model, trained_tiny_model  # noqa: E402

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and moelora.cuda_available()),
                                   reason="needs torch with CUDA and moelora's CUDA backend")
# The experts taken as they are (gpt-oss's are transposed once, then the originals dropped).
NO_COPY_FAMILIES = tuple(f for f in FAMILIES if f != "gpt_oss")
PROMPT_LEN, NEW_TOKENS = 12, 32


def _prompt(batch=2, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=gen).to(device)


def _greedy(model, ids):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, PROMPT_LEN:]


def _compare(family, dtype, device):
    """(max |logit diff| / max |logit|, greedy tokens equal in every sequence)."""
    reference = tiny_model(family, dtype=dtype, device=device)
    patched = copy.deepcopy(reference)
    names = mt.patch_moe_blocks(patched)
    assert names and all(isinstance(patched.get_submodule(n), mt.MoeloraMoeBlock) for n in names)
    ids = _prompt(device=device)
    with torch.no_grad():
        expected, got = reference(ids).logits.float(), patched(ids).logits.float()
        rel = ((expected - got).abs().max() / expected.abs().max()).item()
        matched = int((_greedy(reference, ids) == _greedy(patched, ids)).all(dim=0).sum())
    return rel, matched


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_transformers_fp32(family):
    rel, matched = _compare(family, torch.float32, "cpu")
    assert rel <= 1e-4, f"{family}: max logit difference {rel:.3g} of the logit scale"
    assert matched == NEW_TOKENS, f"{family}: {matched} of {NEW_TOKENS} greedy tokens identical"


@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_transformers_bf16_cuda(family):
    """bf16 on the GPU, the issue's bounds: logits within 2e-2 of the eager bf16 model's, at
    least 30 of 32 greedy tokens identical. On a trained tiny model (trained_tiny_model):
    random ones are chaotic (OLMoE's eager bf16 logits were 0.32 of the scale from its own
    fp32 ones on an H100), so their bf16 runs disagree with any implementation."""
    torch.manual_seed(0)
    reference = trained_tiny_model(family, device="cuda").to(torch.bfloat16)
    patched = copy.deepcopy(reference)
    mt.patch_moe_blocks(patched)
    ids = _prompt(device="cuda")
    with torch.no_grad():
        expected, got = reference(ids).logits.float(), patched(ids).logits.float()
        rel = ((expected - got).abs().max() / expected.abs().max()).item()
        matched = int((_greedy(reference, ids) == _greedy(patched, ids)).all(dim=0).sum())
    assert rel <= 2e-2, f"{family}: max logit difference {rel:.3g} of the logit scale"
    assert matched >= 30, f"{family}: {matched} of {NEW_TOKENS} greedy tokens identical"


@pytest.mark.parametrize("family", NO_COPY_FAMILIES)
def test_expert_tensors_move_without_a_copy(family):
    model = tiny_model(family)
    names = [n for n, m in model.named_modules() if type(m).__name__ in mt.SUPPORTED_BLOCKS]
    storages = {n: (model.get_submodule(n).experts.gate_up_proj.data_ptr(),
                    model.get_submodule(n).experts.down_proj.data_ptr()) for n in names}
    assert mt.patch_moe_blocks(model) == names
    for name, (w13_ptr, w2_ptr) in storages.items():
        moe = model.get_submodule(name).moe
        assert (moe.w13.data_ptr(), moe.w2.data_ptr()) == (w13_ptr, w2_ptr)
    assert not any(type(m).__name__.endswith("Experts") for m in model.modules())


def test_routing_matches_the_transformers_routers():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=gen)
    for family in ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"):
        block = next(m for m in tiny_model(family).modules() if type(m).__name__ in mt.SUPPORTED_BLOCKS)
        router = block.router if family == "gpt_oss" else block.gate
        _, expected_weights, expected_ids = router(x)
        logits = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))
        if family == "gpt_oss":
            weights, ids = routing.topk_softmax(logits, router.top_k)
        elif family == "deepseek_v3":
            weights, ids = routing.sigmoid_grouped_topk(logits, router.top_k, router.num_group, router.topk_group,
                                                        router.e_score_correction_bias, router.norm_topk_prob)
            weights = weights * router.routed_scaling_factor
        else:
            weights, ids = routing.softmax_topk(logits, router.top_k,
                                                family == "mixtral" or bool(router.norm_topk_prob))
        # Same experts (in any order within a token), same weights.
        order, expected_order = ids.argsort(dim=-1), expected_ids.argsort(dim=-1)
        assert torch.equal(ids.long().gather(1, order), expected_ids.gather(1, expected_order)), family
        torch.testing.assert_close(weights.gather(1, order), expected_weights.float().gather(1, expected_order),
                                   rtol=1e-6, atol=1e-7)


# ---- PEFT adapters -------------------------------------------------------------------

ADAPTERS = ((8, 16), (16, 8), (64, 32))  # (rank, lora_alpha)


def _peft_adapters(base, tmp_path):
    """Three PEFT LoRA adapters of the experts' fused parameters (LoraConfig.target_parameters),
    B initialised away from zero, saved with save_pretrained: [(directory, PEFT model)]."""
    adapters = []
    for i, (rank, alpha) in enumerate(ADAPTERS):
        torch.manual_seed(100 + i)
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=[],
                                 target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        model = peft.get_peft_model(copy.deepcopy(base), config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.1)
        folder = tmp_path / f"adapter{i}"
        model.save_pretrained(folder)
        adapters.append((folder, model.eval()))
    return adapters


def _rel(got, expected):
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapters_serve_a_mixed_batch(family, tmp_path):
    base = tiny_model(family)
    adapters = _peft_adapters(base, tmp_path)
    model = copy.deepcopy(base)
    mt.patch_moe_blocks(model, max_loras=4, max_lora_rank=64)
    for slot, (folder, _) in enumerate(adapters):
        assert mt.load_adapter(model, slot, folder) == ADAPTERS[slot][0]
    ids = _prompt(batch=4, seed=5)
    slots = torch.tensor([2, -1, 0, 1])
    with torch.no_grad():
        with mt.adapters(model, slots):
            got = model(ids).logits
        for row, slot in enumerate(slots.tolist()):
            expected = (base if slot < 0 else adapters[slot][1])(ids[row:row + 1]).logits
            assert _rel(got[row], expected[0]) <= 1e-5, (family, row, slot)
            if slot >= 0:  # the adapter changes the output: the check above could fail
                assert _rel(base(ids[row:row + 1]).logits, expected) > 1e-2

    # Slots unload and reload in place: the buffers keep their storage.
    blocks = mt.patched_blocks(model)
    pointers = [b.moe.w13_lora_a.data_ptr() for _, b in blocks]
    mt.unload_adapter(model, 2)
    with torch.no_grad(), mt.adapters(model, torch.tensor([2])):
        unloaded = model(ids[:1]).logits  # slot 2 emptied: the base model
    assert _rel(unloaded[0], base(ids[:1]).logits[0]) <= 1e-5
    mt.load_adapter(model, 2, adapters[0][0])  # another adapter into the freed slot
    with torch.no_grad(), mt.adapters(model, torch.tensor([2])):
        swapped = model(ids[:1]).logits
    assert _rel(swapped[0], adapters[0][1](ids[:1]).logits[0]) <= 1e-5
    assert [b.moe.w13_lora_a.data_ptr() for _, b in blocks] == pointers


def test_generate_with_adapters_per_sequence(tmp_path):
    base = tiny_model("qwen3_moe")
    adapters = _peft_adapters(base, tmp_path)[:2]
    model = copy.deepcopy(base)
    mt.patch_moe_blocks(model, max_loras=2, max_lora_rank=16)
    for slot, (folder, _) in enumerate(adapters):
        mt.load_adapter(model, slot, folder)
    ids = _prompt(batch=3, seed=9)
    with torch.no_grad(), mt.adapters(model, torch.tensor([1, -1, 0])):
        got = _greedy(model, ids)
    with torch.no_grad():
        expected = [_greedy(adapters[1][1], ids[0:1]), _greedy(base, ids[1:2]), _greedy(adapters[0][1], ids[2:3])]
    assert torch.equal(got, torch.cat(expected))


# ---- errors --------------------------------------------------------------------------

def test_errors_name_the_argument(tmp_path):
    dense = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(ValueError, match="no MoE block"):
        mt.patch_moe_blocks(dense)
    with pytest.raises(ValueError, match="run patch_moe_blocks first"):
        mt.load_adapter(dense, 0, {})

    model = tiny_model("mixtral")
    mt.patch_moe_blocks(model, max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match="lora_ids expected an integer tensor"):
        with mt.adapters(model, torch.tensor([0.5])):
            pass
    ids = _prompt(batch=2)
    with pytest.raises(ValueError, match=r"adapter ids expected a slot per sequence \(\[2\]\)"):
        with torch.no_grad(), mt.adapters(model, torch.tensor([0, 0, 0])):
            model(ids)
    # An adapter of rank 16 does not fit slots of rank 8: refused, the slot left empty.
    (folder, _), = _peft_adapters(tiny_model("mixtral"), tmp_path)[1:2]
    with pytest.raises(ValueError, match="rank"):
        mt.load_adapter(model, 0, folder)
    assert all(int(b.moe.adapter_enabled[0]) == 0 for _, b in mt.patched_blocks(model))
