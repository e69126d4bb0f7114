"""The Hugging Face integration on a GPU, for the report: each family's tiny model (tests/
python/hf_tiny_models.py) patched with moelora against the eager transformers model, in
bf16: max |logit difference| / max |logit|, greedy tokens identical of 32, and the PEFT
adapters' error in a mixed batch (three adapters and the base, ‖ours − PEFT‖/‖PEFT‖, the
worst sequence). Writes JSON rows {"op": "hf_model", ...}; exits 1 when a family misses the
bounds (logits 2e-2, at least 30 of 32 tokens, PEFT 2e-2).

    python3 benchmarks/hf_models_report.py --json reports/gpu/<name>.json"""
import argparse
import copy
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import hf_tiny_models  # noqa: E402
import peft  # noqa: E402
import transformers  # noqa: E402

from moelora.integrations import transformers as mt  # noqa: E402

PROMPT, NEW = 12, 32
BOUNDS = dict(max_rel_logit_diff=2e-2, greedy_match=30, peft_rel_err=2e-2)


def greedy(model, ids):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False)
    return out[:, PROMPT:]


def peft_error(family, dtype, device):
    base = hf_tiny_models.tiny_model(family)  # fp32 on the CPU: the adapters are made there
    folders, peft_models = [], []
    for i, (rank, alpha) in enumerate(((8, 16), (16, 8), (64, 32))):
        torch.manual_seed(100 + i)
        lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=[],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
        with torch.no_grad():
            for name, param in lora.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.1)
        folders.append(tempfile.mkdtemp())
        lora.save_pretrained(folders[-1])
        peft_models.append(lora.to(device=device, dtype=dtype).eval())
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    mt.patch_moe_blocks(model, max_loras=4, max_lora_rank=64)
    for slot, folder in enumerate(folders):
        mt.load_adapter(model, slot, folder)
    ref_base = base.to(device=device, dtype=dtype)
    ids = torch.randint(3, hf_tiny_models.VOCAB, (4, PROMPT), generator=torch.Generator().manual_seed(5)).to(device)
    slots = [2, -1, 0, 1]
    worst = 0.0
    with torch.no_grad():
        with mt.adapters(model, torch.tensor(slots)):
            got = model(ids).logits.float()
        for row, slot in enumerate(slots):
            expected = (ref_base if slot < 0 else peft_models[slot])(ids[row:row + 1]).logits[0].float()
            worst = max(worst, ((got[row] - expected).norm() / expected.norm()).item())
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows, ok = [], True
    print(f"transformers {transformers.__version__} peft {peft.__version__} torch {torch.__version__} on "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'} ({dtype})")
    for family in hf_tiny_models.FAMILIES:
        reference = hf_tiny_models.tiny_model(family, dtype=dtype, device=args.device)
        patched = copy.deepcopy(reference)
        mt.patch_moe_blocks(patched)
        ids = torch.randint(3, hf_tiny_models.VOCAB, (2, PROMPT),
                            generator=torch.Generator().manual_seed(1)).to(args.device)
        with torch.no_grad():
            expected, got = reference(ids).logits.float(), patched(ids).logits.float()
            rel = ((expected - got).abs().max() / expected.abs().max()).item()
            matched = int((greedy(reference, ids) == greedy(patched, ids)).all(dim=0).sum())
        peft_rel = None if family == "gpt_oss" else peft_error(family, dtype, args.device)
        row = {"op": "hf_model", "model": f"{family}-tiny", "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
               "device": args.device, "max_rel_logit_diff": rel, "greedy_match": matched, "greedy_tokens": NEW,
               "peft_rel_err": peft_rel}
        row_ok = (rel <= BOUNDS["max_rel_logit_diff"] and matched >= BOUNDS["greedy_match"]
                  and (peft_rel is None or peft_rel <= BOUNDS["peft_rel_err"]))
        ok = ok and row_ok
        rows.append(row)
        print(f"{family:12s} logits {rel:.2e}  greedy {matched}/{NEW}  peft "
              f"{'n/a (biased experts)' if peft_rel is None else f'{peft_rel:.2e}'}  {'ok' if row_ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__,
                       "bounds": BOUNDS, "rows": rows}, f, indent=1)
    print("verdict:", "ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
