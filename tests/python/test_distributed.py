"""moelora.distributed (issue 32): ParallelFusedMoE over gloo process groups on the CPU,
2 and 4 processes: EP (all-reduce and all-to-all dispatch), TP, EP x TP, with and without
LoRA, uneven expert counts, a rank that receives no routed token, a rank without tokens,
the all-gather dispatch,
weight-only experts; each rank's output against the single-process layer on the same
weights. With MOELORA_DIST_BACKEND=nccl the same cases run over NCCL, rank r on cuda:r
(tools/distributed_report.sh; skipped where fewer GPUs than ranks)."""

import os
import socket
import tempfile
import traceback

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import moelora  # noqa: E402
from moelora import distributed as md  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

H, I, TOP_K = 64, 64, 2
RANK, ADAPTERS = 8, 2
BACKEND = os.environ.get("MOELORA_DIST_BACKEND", "gloo")
DEVICE = torch.device("cpu")  # the worker's: cuda:rank over NCCL


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _problem(num_experts, tokens, seed, dtype, no_route_to=()):
    """Whole-layer float weights, inputs, router logits (experts in no_route_to never
    chosen) and adapter stacks, identical on every rank (one seed)."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.rand(num_experts, 2 * I, H, generator=g) - 0.5) * 0.25
    w2 = (torch.rand(num_experts, H, I, generator=g) - 0.5) * 0.25
    x = (torch.rand(tokens, H, generator=g) - 0.5).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=g)
    for e in no_route_to:
        logits[:, e] = -1e9
    adapter = {}
    for e in range(num_experts):
        for proj, (fan_in, fan_out) in (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H))):
            key = f"model.layers.0.mlp.experts.{e}.{proj}"
            adapter[f"{key}.lora_A.weight"] = (torch.rand(RANK, fan_in, generator=g) - 0.5) * 0.5
            adapter[f"{key}.lora_B.weight"] = (torch.rand(fan_out, RANK, generator=g) - 0.5) * 0.5
    lora_ids = torch.randint(-1, ADAPTERS, (tokens,), generator=g, dtype=torch.int32)
    return w13, w2, x, logits, adapter, lora_ids


def _layer(cls, num_experts, dtype, lora, quant, hidden=H, intermediate=I, **kwargs):
    extra = dict(max_loras=ADAPTERS, max_lora_rank=RANK) if lora else {}
    if quant:
        extra["quant"] = moelora.quant_scheme(**quant)  # built here: a QuantScheme does not pickle
    return cls(num_experts, TOP_K, hidden, intermediate, dtype=dtype, device=DEVICE, **extra, **kwargs)


def _checkpoint(kind, num_experts, hidden, intermediate, seed):
    """A MoE block's quantized experts as a checkpoint holds them (the same on every rank):
    GPTQ 4-bit groups of 32 with zero points, or DeepSeek-V3's fp8 128 x 128 blocks."""
    from moelora import weight_only
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for e in range(num_experts):
        for proj, shape in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                            ("down_proj", (hidden, intermediate))):
            w = (torch.rand(shape, generator=g) - 0.5) * 0.2
            key = f"model.layers.0.mlp.experts.{e}.{proj}"
            if kind == "gptq":
                q, scale, zero = weight_only.quantize_weight_only(w, 4, 32, True, scale_dtype=torch.bfloat16)
                for name, value in weight_only.to_gptq(q, scale, zero, 4, 32).items():
                    tensors[f"{key}.{name}"] = value.contiguous()
            else:
                q, scale = moelora.quantize_weights(w[None].to(torch.bfloat16), "fp8_block")
                tensors[f"{key}.weight"], tensors[f"{key}.weight_scale_inv"] = q[0], scale[0]
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False}
    return tensors, config if kind == "gptq" else None


def _rel_err(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _check_case(case, rank, world):
    """One configuration on this rank: its ParallelFusedMoE output against the
    single-process layer's on the same tokens."""
    ep, tp, dispatch = case["ep"], case["tp"], case["dispatch"]
    E, dtype, lora, quant = case["experts"], case["dtype"], case["lora"], case.get("quant")
    tokens = case.get("tokens", 12)
    own_tokens = dispatch in ("all_to_all", "all_gather")  # each rank brings its own (data parallel)
    w13, w2, x, logits, adapter, lora_ids = _problem(E, tokens * (ep if own_tokens else 1),
                                                     case["seed"], dtype, case.get("no_route_to", ()))
    ep_group, tp_group, ep_rank, tp_rank = md.new_grid(ep, tp)
    act = {"activation": case["activation"]} if "activation" in case else {}
    padded = {"tokens_per_rank": tokens} if case.get("uneven") else {}
    layer = _layer(md.ParallelFusedMoE, E, dtype, lora, quant, ep_size=ep, ep_rank=ep_rank, tp_size=tp,
                   tp_rank=tp_rank, ep_group=ep_group, tp_group=tp_group, dispatch=dispatch, **act, **padded)
    whole = _layer(moelora.FusedMoE, E, dtype, lora, quant, **act)
    for target in (layer, whole):
        target.load_weights(w13, w2)
    if lora:
        for slot in range(ADAPTERS):
            layer.load_adapter(slot, adapter, scale=0.5 + slot)
            whole.load_adapter(slot, adapter, scale=0.5 + slot)
    x, logits, lora_ids = x.to(DEVICE), logits.to(DEVICE), lora_ids.to(DEVICE)
    if own_tokens:  # this rank's own tokens (the same on every TP rank of its row)
        own = slice(ep_rank * tokens, (ep_rank + 1) * tokens)
        if case.get("uneven"):  # rank r brings 5 r tokens fewer (tokens_per_rank pads them)
            own = slice(own.start, own.stop - 5 * ep_rank)
        if case.get("empty_rank") == ep_rank:
            own = slice(0, 0)
        x, logits, lora_ids = x[own], logits[own], lora_ids[own]
    ids = lora_ids if lora else None
    if case.get("bad_id"):  # every rank routes one slot past the experts: each refuses it, none hangs
        weights, topk = whole.route(logits)
        topk[0, 0] = E
        try:
            layer.forward_routed(x, weights, topk, ids)
        except ValueError as error:
            assert f"topk_ids expected values in [-1, {E})" in str(error), str(error)
            return
        raise AssertionError(f"{case['name']} rank {rank}: no error")
    if case.get("dropped"):  # every third slot routed to -1 (dropped), through forward_routed
        weights, topk = whole.route(logits)
        topk.view(-1)[::3] = -1
        out, ref = layer.forward_routed(x, weights, topk, ids), whole.forward_routed(x, weights, topk, ids)
    else:
        # torch.compile traces the all-reduce paths whole (the eager backend: no C++ build here).
        run = torch.compile(layer, fullgraph=True, backend="eager") if case.get("compile") else layer
        out = run(x, logits, ids)
        ref = whole(x, logits, ids)
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    if x.shape[0] == 0:
        return
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    err = _rel_err(out, ref)
    assert err <= bound, f"{case['name']} rank {rank}: rel_err {err:.3g} > {bound}"


def _float_checkpoint(kind, num_experts, hidden, intermediate, seed, rank):
    """bf16 experts as a checkpoint holds them: per expert in a .safetensors file of this
    rank's own (read by rows), or fused gate_up_proj / down_proj tensors in a dict."""
    g = torch.Generator().manual_seed(seed)
    w13 = ((torch.rand(num_experts, 2 * intermediate, hidden, generator=g) - 0.5) * 0.2).to(BF16)
    w2 = ((torch.rand(num_experts, hidden, intermediate, generator=g) - 0.5) * 0.2).to(BF16)
    prefix = "model.layers.0.mlp.experts"
    if kind == "float_fused":
        return {f"{prefix}.gate_up_proj": w13, f"{prefix}.down_proj": w2}
    from safetensors.torch import save_file
    tensors = {}
    for e in range(num_experts):
        tensors[f"{prefix}.{e}.gate_proj.weight"] = w13[e, :intermediate].contiguous()
        tensors[f"{prefix}.{e}.up_proj.weight"] = w13[e, intermediate:].contiguous()
        tensors[f"{prefix}.{e}.down_proj.weight"] = w2[e].contiguous()
    path = os.path.join(tempfile.mkdtemp(prefix=f"moelora-rank{rank}-"), "model.safetensors")
    save_file(tensors, path)
    return path


def _check_checkpoint_case(case, rank, world):
    """Quantized experts read from a checkpoint by each rank (its experts, cut to its shard)
    against the one-process layer reading the whole checkpoint."""
    ep, tp, E, kind = case["ep"], case["tp"], case["experts"], case["checkpoint"]
    hidden, intermediate = 128, 256  # fp8 blocks of 128: two TP shards of one block column each
    ep_group, tp_group, ep_rank, tp_rank = md.new_grid(ep, tp)
    if kind.startswith("float"):
        quant, source = None, _float_checkpoint(kind, E, hidden, intermediate, case["seed"], rank)
    else:
        quant = dict(name="w4a16", group_size=32, zero_points=True) if kind == "gptq" else dict(name="fp8_block")
        tensors, config = _checkpoint(kind, E, hidden, intermediate, case["seed"])
    layer = _layer(md.ParallelFusedMoE, E, BF16, False, quant, hidden, intermediate, ep_size=ep, ep_rank=ep_rank,
                   tp_size=tp, tp_rank=tp_rank, ep_group=ep_group, tp_group=tp_group)
    whole = _layer(moelora.FusedMoE, E, BF16, False, quant, hidden, intermediate)
    for target in (layer, whole):
        if quant is None:
            target.load_experts(source, "model.layers.0.mlp")
        else:
            target.load_quantized_experts(tensors, "model.layers.0.mlp", quant_config=config)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    x = (torch.rand(10, hidden, generator=g) - 0.5).to(BF16).to(DEVICE)
    logits = torch.randn(10, E, generator=g).to(DEVICE)
    err = _rel_err(layer(x, logits), whole(x, logits))
    assert err <= 1e-2, f"{case['name']} rank {rank}: rel_err {err:.3g}"


def _worker(rank, world, port, cases, failures):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    if BACKEND == "nccl":
        global DEVICE
        DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(BACKEND, rank=rank, world_size=world)
    try:
        for case in cases:
            try:
                (_check_checkpoint_case if "checkpoint" in case else _check_case)(case, rank, world)
            except Exception:  # noqa: BLE001 (reported to the parent with the case's name)
                failures.put(f"{case['name']} rank {rank}:\n{traceback.format_exc()}")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world, cases):
    if BACKEND == "nccl" and not (dist.is_nccl_available() and torch.cuda.device_count() >= world
                                  and moelora.cuda_available()):
        pytest.skip(f"NCCL over {world} GPUs: this machine has {torch.cuda.device_count()}")
    ctx = torch.multiprocessing.get_context("spawn")
    failures = ctx.SimpleQueue()
    torch.multiprocessing.spawn(_worker, args=(world, _free_port(), cases, failures), nprocs=world)
    found = []
    while not failures.empty():
        found.append(failures.get())
    assert not found, "\n".join(found)


F32, BF16 = torch.float32, torch.bfloat16


def _case(name, ep, tp, dispatch="all_reduce", experts=8, dtype=F32, lora=False, seed=1, **more):
    return dict(name=name, ep=ep, tp=tp, dispatch=dispatch, experts=experts, dtype=dtype, lora=lora, seed=seed,
                **more)


def test_two_processes():
    _run(2, [
        _case("ep2 all_reduce", 2, 1),
        _case("ep2 all_reduce under torch.compile(fullgraph=True)", 2, 1, lora=True, compile=True, seed=9),
        _case("ep2 all_to_all", 2, 1, "all_to_all", seed=2),
        _case("ep2 all_gather uneven (7 experts) lora", 2, 1, "all_gather", experts=7, lora=True, seed=23),
        _case("ep2 all_gather under torch.compile(fullgraph=True)", 2, 1, "all_gather", compile=True, seed=24),
        _case("ep2 all_gather with dropped slots (-1) bf16", 2, 1, "all_gather", dtype=BF16, seed=25, dropped=True),
        _case("ep2 all_gather, uneven counts padded to tokens_per_rank, lora", 2, 1, "all_gather", lora=True,
              seed=28, uneven=True),
        _case("ep2 all_gather, rank 1 without tokens (tokens_per_rank)", 2, 1, "all_gather", seed=29, uneven=True,
              empty_rank=1),
        _case("tp2", 1, 2, seed=3),
        _case("ep2 uneven (7 experts) all_to_all lora", 2, 1, "all_to_all", experts=7, lora=True, seed=4),
        _case("tp2 lora bf16", 1, 2, dtype=BF16, lora=True, seed=5),
        _case("ep2 all_to_all, rank 1 without tokens", 2, 1, "all_to_all", seed=6, empty_rank=1),
        _case("ep2 all_to_all with dropped slots (-1) and adapters", 2, 1, "all_to_all", lora=True, seed=10,
              dropped=True),
        _case("ep2 all_reduce with dropped slots (-1)", 2, 1, seed=19, dropped=True),
        _case("ep2 all_to_all refuses an id past the experts", 2, 1, "all_to_all", seed=22, bad_id=True),
        _case("tp2 w4a16 g32 bf16", 1, 2, dtype=BF16, quant=dict(name="w4a16", group_size=32), seed=7),
        _case("tp2 swiglu_oai (interleaved gate/up) lora", 1, 2, lora=True, activation="swiglu_oai", seed=8),
    ])


def test_four_processes():
    _run(4, [
        _case("ep2 x tp2 all_reduce lora", 2, 2, lora=True, seed=11),
        _case("ep2 x tp2 all_reduce under torch.compile(fullgraph=True)", 2, 2, compile=True, seed=18),
        _case("ep2 x tp2 all_to_all lora", 2, 2, "all_to_all", lora=True, seed=12),
        _case("ep2 x tp2 all_gather lora", 2, 2, "all_gather", lora=True, seed=26),
        _case("ep4 all_gather, rank 3 routed nothing", 4, 1, "all_gather", experts=7, seed=27, no_route_to=(6,)),
        _case("ep4 uneven (7 experts) all_to_all, rank 3 routed nothing", 4, 1, "all_to_all", experts=7,
              seed=13, no_route_to=(6,)),
        _case("ep4 all_reduce bf16", 4, 1, dtype=BF16, seed=14),
        _case("tp4", 1, 4, seed=15),
        _case("ep2 x tp2 GPTQ 4-bit g32 zero points checkpoint", 2, 2, checkpoint="gptq", seed=16),
        _case("ep2 x tp2 fp8 block checkpoint", 2, 2, checkpoint="fp8_block", seed=17),
        _case("ep2 x tp2 bf16 per-expert safetensors (shard rows read)", 2, 2, checkpoint="float_file", seed=20),
        _case("ep1 x tp4 bf16 fused gate_up_proj checkpoint", 1, 4, checkpoint="float_fused", seed=21),
    ])


def test_partition_and_shards():
    assert [md.expert_partition(7, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 1)]
    assert md.expert_map(7, 4, 3).tolist() == [-1] * 6 + [0]
    assert md.expert_owner(7, 4).tolist() == [0, 0, 1, 1, 2, 2, 3]
    assert md.intermediate_shard(64, 4, 1) == (16, 16)
    with pytest.raises(ValueError, match="intermediate_size 96 expected to split into 4 equal shards of a "
                                         "multiple of 32"):
        md.intermediate_shard(96, 4, 0, unit=32)
    with pytest.raises(ValueError, match="ep_size expected a value in"):
        md.expert_partition(4, 5, 0)
    with pytest.raises(ValueError, match="tokens_per_rank expected None, or a count >= 0 with dispatch 'all_gather'"):
        md.ParallelFusedMoE(8, 2, H, I, dispatch="all_to_all", tokens_per_rank=16)
    with pytest.raises(ValueError, match="dispatch expected one of"):
        md.ParallelFusedMoE(8, 2, H, I, dispatch="ring")
    with pytest.raises(ValueError, match="expert_map expected None"):
        md.ParallelFusedMoE(8, 2, H, I, expert_map=[0] * 8)


@pytest.mark.parametrize("dispatch", ["all_to_all", "all_reduce", "all_gather"])
def test_bench_launcher_under_torchrun(tmp_path, dispatch):
    """benchmarks/distributed_bench.py as the README runs it (torchrun, 2 processes, gloo):
    it checks against the one-process layer and writes its rows (--breakdown: where the time goes)."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           os.path.join(root, "benchmarks", "distributed_bench.py"), "--model", "tiny", "--device", "cpu",
           "--tokens", "8,32", "--iters", "2", "--dispatch", dispatch, "--breakdown", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "verdict: PASS" in run.stdout
    rows = json.loads(out.read_text())
    assert [r["M"] for r in rows] == [8, 32]
    assert all(r["op"] == "fused_experts_ep" and r["world_size"] == 2 and r["rel_err"] <= 1e-2 for r in rows)
    if dispatch == "all_reduce":
        assert all(0 < r["local_us_min"] <= r["local_us_max"] and r["collective_us"] > 0 for r in rows)
    else:
        assert all(r["dispatch_us"] > 0 and r["combine_us"] > 0 for r in rows)
