"""The Hugging Face integration on a GPU, for the report: each family's tiny model (tests/
python/hf_tiny_models.py) patched with moelora against the eager transformers model, in
bf16, trained first (--train-steps, 300: a few hundred Adam steps on a synthetic task, so that
they predict decisively; random tiny models are chaotic, see hf_tiny_models.trained_tiny_model):
max |logit difference| / max |logit|, greedy tokens identical of 32, and the PEFT
adapters' error in a mixed batch (three adapters and the base, ‖ours − PEFT‖/‖PEFT‖, the
worst sequence); each also against the fp32 transformers model, for ours and for the
eager bf16 model. Writes JSON rows {"op": "hf_model", ...}; exits 1 when a family misses
the bounds (logits 2e-2, at least 30 of 32 tokens, PEFT 2e-2 against the eager bf16 model)
unless ours is no further from the fp32 model than the eager bf16 model is.

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


def peft_errors(model32, dtype, device):
    """Worst sequence of a mixed batch (three adapters and the base): (ours in `dtype` against
    PEFT in `dtype`, ours against PEFT in fp32, PEFT in `dtype` against PEFT in fp32)."""
    base = copy.deepcopy(model32).cpu()  # fp32 on the CPU: the adapters are made there
    folders, peft32 = [], []
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
        peft32.append(lora.to(device=device).eval())
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    mt.patch_moe_blocks(model, max_loras=4, max_lora_rank=64)
    for slot, folder in enumerate(folders):
        mt.load_adapter(model, slot, folder)
    base32 = base.to(device=device)
    ids = torch.randint(3, hf_tiny_models.VOCAB, (4, PROMPT), generator=torch.Generator().manual_seed(5)).to(device)
    slots = [2, -1, 0, 1]
    worst = [0.0, 0.0, 0.0]
    with torch.no_grad():
        with mt.adapters(model, torch.tensor(slots)):
            got = model(ids).logits.float()
        for row, slot in enumerate(slots):
            ref32 = base32 if slot < 0 else peft32[slot]
            expected32 = ref32(ids[row:row + 1]).logits[0].float()
            expected = copy.deepcopy(ref32).to(dtype)(ids[row:row + 1]).logits[0].float()
            errors = (rel_norm(got[row], expected), rel_norm(got[row], expected32), rel_norm(expected, expected32))
            worst = [max(w, e) for w, e in zip(worst, errors)]
    return worst


def rel_norm(got, expected):
    return ((got - expected).norm() / expected.norm()).item()


def rel_max(got, expected):
    return ((got - expected).abs().max() / expected.abs().max()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pytest-junit", help="a pytest --junitxml file of this machine's run: its counts go "
                                               "into the report's 'tests'")
    parser.add_argument("--train-steps", type=int, default=300,
                        help="train each tiny model this many steps on a synthetic task first (0: random weights)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows, ok = [], True
    print(f"transformers {transformers.__version__} peft {peft.__version__} torch {torch.__version__} on "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'} ({dtype})")
    models32 = {}
    for family in hf_tiny_models.FAMILIES:
        torch.manual_seed(0)
        models32[family] = (hf_tiny_models.trained_tiny_model(family, device=args.device, steps=args.train_steps)
                            if args.train_steps else hf_tiny_models.tiny_model(family, device=args.device))
    for family in hf_tiny_models.FAMILIES:
        # The transformers model in fp32 is the yardstick of both bf16 runs (tiny random
        # models are chaotic: the eager bf16 model alone can be far from its own fp32 logits).
        model32 = models32[family]
        reference = copy.deepcopy(model32).to(dtype)
        patched = copy.deepcopy(reference)
        mt.patch_moe_blocks(patched)
        silent = copy.deepcopy(patched)  # the experts' share of the logits: their output dropped
        for _, block in mt.patched_blocks(silent):
            block.moe.w2.data.zero_()
        ids = torch.randint(3, hf_tiny_models.VOCAB, (2, PROMPT),
                            generator=torch.Generator().manual_seed(1)).to(args.device)
        with torch.no_grad():
            logits32 = model32(ids).logits.float()
            expected, got = reference(ids).logits.float(), patched(ids).logits.float()
            experts_effect = rel_max(silent(ids).logits.float(), got)
            tokens32, tokens_ref, tokens_ours = greedy(model32, ids), greedy(reference, ids), greedy(patched, ids)
        match = lambda a, b: int((a == b).all(dim=0).sum())  # noqa: E731
        row = {"op": "hf_model", "model": f"{family}-tiny", "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
               "device": args.device, "max_rel_logit_diff": rel_max(got, expected), "greedy_match": match(
                   tokens_ours, tokens_ref), "greedy_tokens": NEW,
               "fp32_ref": {"ours_max_rel_logit_diff": rel_max(got, logits32),
                            "transformers_max_rel_logit_diff": rel_max(expected, logits32),
                            "ours_greedy_match": match(tokens_ours, tokens32),
                            "transformers_greedy_match": match(tokens_ref, tokens32)},
               "peft_rel_err": None, "trained_steps": args.train_steps, "experts_effect": experts_effect}
        ours_vs_peft, ours_vs_peft32, peft_vs_peft32 = peft_errors(model32, dtype, args.device)
        row["peft_rel_err"] = ours_vs_peft
        row["fp32_ref"].update(ours_peft_rel_err=ours_vs_peft32, peft_rel_err=peft_vs_peft32)
        # Met: the issue's bounds against the eager bf16 model, or (where that model is
        # itself further from fp32) ours no further from the fp32 model than it.
        ref = row["fp32_ref"]
        logits_ok = (row["max_rel_logit_diff"] <= BOUNDS["max_rel_logit_diff"]
                     or ref["ours_max_rel_logit_diff"] <= max(BOUNDS["max_rel_logit_diff"],
                                                              ref["transformers_max_rel_logit_diff"]))
        greedy_ok = (row["greedy_match"] >= BOUNDS["greedy_match"]
                     or ref["ours_greedy_match"] >= ref["transformers_greedy_match"])
        peft_ok = row["peft_rel_err"] is None or row["peft_rel_err"] <= BOUNDS["peft_rel_err"] or \
            ref["ours_peft_rel_err"] <= max(BOUNDS["peft_rel_err"], ref["peft_rel_err"])
        row["verdict"] = {"logits": logits_ok, "greedy": greedy_ok, "peft": peft_ok}
        ok = ok and logits_ok and greedy_ok and peft_ok
        rows.append(row)
        peft_text = (f"{row['peft_rel_err']:.2e} (vs fp32: ours {ref['ours_peft_rel_err']:.2e}, "
                     f"peft {ref['peft_rel_err']:.2e})")
        print(f"{family:12s} experts {experts_effect:.2f}  logits {row['max_rel_logit_diff']:.2e} (vs fp32: ours {ref['ours_max_rel_logit_diff']:.2e}, "
              f"transformers {ref['transformers_max_rel_logit_diff']:.2e})  greedy {row['greedy_match']}/{NEW} "
              f"(vs fp32: ours {ref['ours_greedy_match']}, transformers {ref['transformers_greedy_match']})  "
              f"peft {peft_text}  {'ok' if logits_ok and greedy_ok and peft_ok else 'FAIL'}")
    # 8-bit experts on the same models: the logits' distance from our bf16 model and from
    # the fp32 model (the quantization error, stated, not bounded: per-channel weight scales
    # and per-token activation scales; block scales need H and I multiples of 128).
    for family in hf_tiny_models.FAMILIES:
        model32 = models32[family]
        bf16 = copy.deepcopy(model32).to(torch.bfloat16)  # 8-bit experts take bf16/fp16 activations
        mt.patch_moe_blocks(bf16)
        ids = torch.randint(3, hf_tiny_models.VOCAB, (2, PROMPT),
                            generator=torch.Generator().manual_seed(1)).to(args.device)
        with torch.no_grad():
            logits32, logits16 = model32(ids).logits.float(), bf16(ids).logits.float()
            tokens16 = greedy(bf16, ids)
        for scheme in ("fp8_channel", "int8_channel"):
            quantized = copy.deepcopy(model32).to(torch.bfloat16)
            mt.patch_moe_blocks(quantized, quant=scheme)
            with torch.no_grad():
                logits = quantized(ids).logits.float()
                matched = int((greedy(quantized, ids) == tokens16).all(dim=0).sum())
            row = {"op": "hf_model_quant", "model": f"{family}-tiny", "dtype": "bf16", "scheme": scheme,
                   "device": args.device, "rel_logit_diff_vs_bf16": rel_max(logits, logits16),
                   "rel_logit_diff_vs_fp32": rel_max(logits, logits32), "bf16_rel_logit_diff_vs_fp32":
                   rel_max(logits16, logits32), "greedy_match_vs_bf16": matched, "greedy_tokens": NEW}
            rows.append(row)
            print(f"{family:12s} {scheme:12s} logits vs our bf16 {row['rel_logit_diff_vs_bf16']:.2e}, vs fp32 "
                  f"{row['rel_logit_diff_vs_fp32']:.2e} (bf16 vs fp32 {row['bf16_rel_logit_diff_vs_fp32']:.2e})  "
                  f"greedy vs bf16 {matched}/{NEW}")
    if args.json:
        report = {"transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__,
                  "bounds": BOUNDS, "rows": rows}
        if args.pytest_junit:
            import xml.etree.ElementTree as ElementTree
            suite = ElementTree.parse(args.pytest_junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
            report["tests"] = {"pytest": counts, "device": args.device}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print("verdict:", "ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
