"""Patch a tiny Qwen3-MoE model with moelora, load two PEFT adapters of its experts, and
generate for a batch whose sequences use adapter 0, adapter 1 and none.

    python3 examples/hf_mixed_adapters.py        # after `bash tools/build.sh` (CPU or GPU)

No download: the model is built from a config with random weights, the adapters are made
with peft and saved to a temporary folder first, as a trained adapter would be."""
import copy
import tempfile

import peft
import torch
import transformers

from moelora.integrations import transformers as mt

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)
config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                     num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=1)
base = transformers.AutoModelForCausalLM.from_config(config).eval()

# Two adapters of the experts' fused parameters (ranks 8 and 16), saved as PEFT saves them.
folders = []
for rank in (8, 16):
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)  # a trained adapter's B is not zero
    folders.append(tempfile.mkdtemp(prefix=f"adapter_r{rank}_"))
    lora.save_pretrained(folders[-1])

model = base.to(device=device, dtype=dtype)
print("moelora blocks:", mt.patch_moe_blocks(model, max_loras=2, max_lora_rank=16))
for slot, folder in enumerate(folders):
    print(f"slot {slot}: rank {mt.load_adapter(model, slot, folder)} from {folder}")

prompts = torch.randint(3, 128, (3, 8), device=device)
with torch.no_grad(), mt.adapters(model, torch.tensor([0, 1, -1])):  # a slot per sequence, -1 none
    tokens = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12,
                            min_new_tokens=12, do_sample=False)
for row, slot in enumerate((0, 1, -1)):
    print(f"sequence {row} (adapter {slot if slot >= 0 else 'none'}):", tokens[row, 8:].tolist())
