"""The MoE layer over N ranks (issue 32): checks ParallelFusedMoE against the one-process
layer on the same weights and times it (per-layer time, the share in collectives, the
one-rank time for the scaling). Run under torchrun, one process a GPU (NCCL) or on the
CPU (gloo):

    torchrun --nproc-per-node 2 benchmarks/distributed_bench.py --model deepseek-v3 \\
        --tokens 16,256,4096 --ep 2 --json out.json
    torchrun --nproc-per-node 2 benchmarks/distributed_bench.py --model tiny --device cpu

Each rank makes only its experts' weights (expert e's from seed + e), so no rank holds
the whole layer except rank 0 for the check and the one-rank time (--no-check skips
both). With --dispatch all_to_all or all_gather, M is the global batch: each rank brings M / N tokens.
Rows (JSON, rank 0): {"op": "fused_experts_ep", "world_size", "ep", "tp", "dispatch",
"model", "M", "time_us", "comm_us", "one_gpu_us", "speedup", "rel_err"}; with --breakdown also,
all_reduce: "local_us_min"/"local_us_max" (each rank's own experts alone: their spread is the
ranks' imbalance, which comm_us includes as waiting), "collective_us" (the bare all-reduce
after a barrier: the transfer), "graph_us" and "one_gpu_graph_us" (CUDA-graph replays, as
moelora_bench times the layer); all_to_all and all_gather: "dispatch_us"/"combine_us" (comm_us's
phases), and all_gather's "graph_us"."""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import moelora
from moelora import distributed as md

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import time_graph  # noqa: E402

# num_experts, top_k, hidden, intermediate (the issue's: DeepSeek-V3 with all 256 experts).
MODELS = {
    "qwen3-235b-a22b": (128, 8, 4096, 1536),
    "deepseek-v3": (256, 8, 7168, 2048),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "tiny": (8, 2, 128, 128),
}


def expert_weights(seed, expert, H, I, dtype, device):
    """Expert `expert`'s w13 [2I, H] and w2 [H, I], the same on every rank."""
    g = torch.Generator(device=device).manual_seed(seed + expert)
    w13 = (torch.rand(2 * I, H, generator=g, device=device) - 0.5) * (2 * H ** -0.5)
    w2 = (torch.rand(H, I, generator=g, device=device) - 0.5) * (2 * I ** -0.5)
    return w13.to(dtype), w2.to(dtype)


@torch.no_grad()
def fill(w13, w2, experts, seed, H, I, shard_of=None):
    """The layer's w13 / w2 parameters [E_local, ...] filled expert by expert (DeepSeek-V3's
    256 experts are 22.5 GB in bf16: no stacked copy beside them); shard_of: the parallel
    layer's cut of one expert."""
    for local, e in enumerate(experts):
        a, b = expert_weights(seed, e, H, I, w13.dtype, w13.device)
        a, b = (a[None], b[None]) if shard_of is None else shard_of(a[None], b[None])
        w13[local].copy_(a[0])
        w2[local].copy_(b[0])


def median_us(fn, iters, sync):
    fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def graph_us(fn, iters):
    """Median of CUDA-graph replays of fn (graph_timing.time_graph, as moelora_bench times the
    layer: no host launch costs), or None where fn cannot be captured."""
    try:
        return time_graph([fn], iters)
    except Exception as error:  # noqa: BLE001 - reported, the run goes on
        print(f"graph capture failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}", flush=True)
        torch.cuda.synchronize()
        return None


def spread(value, device):
    """(min, max) of a per-rank float over the ranks."""
    both = torch.tensor([value, -value], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return -float(both[1]), float(both[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--tokens", default="16,256,4096")
    parser.add_argument("--ep", type=int, default=0, help="EP size (default: world size / tp)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dispatch", default="all_reduce", choices=md.DISPATCHES)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    parser.add_argument("--breakdown", action="store_true",
                        help="where the time goes: local_us_min/max, collective_us, graph_us (all_reduce), dispatch_us, "
                             "combine_us (all_to_all, all_gather; its graph_us too), one_gpu_graph_us")
    args = parser.parse_args()

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available() and moelora.cuda_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = getattr(torch, args.dtype)
    E, top_k, H, I = MODELS[args.model]
    tp = args.tp
    ep = args.ep or world // tp
    ep_group, tp_group, ep_rank, tp_rank = md.new_grid(ep, tp)

    layer = md.ParallelFusedMoE(E, top_k, H, I, ep_size=ep, ep_rank=ep_rank, tp_size=tp, tp_rank=tp_rank,
                                ep_group=ep_group, tp_group=tp_group, dispatch=args.dispatch, dtype=dtype,
                                device=device)
    first, count = md.expert_partition(E, ep, ep_rank)
    fill(layer.local.w13, layer.local.w2, range(first, first + count), args.seed, H, I, layer.shard_of)
    whole = None
    if rank == 0 and not args.no_check:
        whole = moelora.FusedMoE(E, top_k, H, I, dtype=dtype, device=device)
        fill(whole.w13, whole.w2, range(E), args.seed, H, I)

    rows = []
    for M in (int(t) for t in args.tokens.split(",")):
        own_tokens = args.dispatch in ("all_to_all", "all_gather")  # each rank brings M / ep (data parallel)
        per_rank = M // ep if own_tokens else M
        g = torch.Generator(device=device).manual_seed(args.seed + 1000 + M)
        x_all = (torch.rand(M, H, generator=g, device=device) - 0.5).to(dtype)
        logits_all = torch.randn(M, E, generator=g, device=device)
        own = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank) if own_tokens else slice(0, M)
        x, logits = x_all[own], logits_all[own]
        out = layer(x, logits)
        time_us = median_us(lambda: layer(x, logits), args.iters, sync)
        layer.time_comm = True
        phases = []  # (dispatch, combine) of each call, us
        for _ in range(max(3, args.iters // 4)):
            layer(x, logits)
            phases.append((layer.comm_times.dispatch * 1e6, layer.comm_times.combine * 1e6))
        layer.time_comm = False
        comm_us = statistics.median(d + c for d, c in phases)
        times = torch.tensor([time_us, comm_us], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's
        row = dict(op="fused_experts_ep", world_size=world, ep=ep, tp=tp, dispatch=args.dispatch, model=args.model,
                   M=M, dtype=args.dtype, device=device.type, time_us=round(float(times[0]), 2),
                   comm_us=round(float(times[1]), 2))
        # Where the time goes (--breakdown). all_reduce: each rank's own experts alone over the
        # tokens (their spread is the ranks' imbalance, which comm_us includes as waiting), the
        # bare collective after a barrier (the transfer), the layer as CUDA-graph replays (no
        # host launch costs). all_to_all and all_gather: their two phases (the slower rank's of
        # each), and all_gather's CUDA-graph replays (it is capturable; all_to_all is not).
        if args.breakdown and own_tokens:
            row["dispatch_us"] = round(spread(statistics.median(p[0] for p in phases), device)[1], 2)
            row["combine_us"] = round(spread(statistics.median(p[1] for p in phases), device)[1], 2)
            replay = graph_us(lambda: layer(x, logits), args.iters) if cuda and args.dispatch == "all_gather" else None
            if replay is not None:
                row["graph_us"] = round(spread(replay, device)[1], 2)
        elif args.breakdown:
            weights, ids = layer.local.route(logits)
            local = median_us(lambda: layer.local.forward_routed(x, weights, ids), args.iters, sync)
            row["local_us_min"], row["local_us_max"] = (round(v, 2) for v in spread(local, device))
            combined = torch.empty_like(out)

            def bare_collective():
                dist.barrier()
                sync()
                start = time.perf_counter()
                dist.all_reduce(combined, group=ep_group)
                sync()
                return (time.perf_counter() - start) * 1e6
            row["collective_us"] = round(spread(statistics.median(bare_collective() for _ in range(args.iters)),
                                                device)[1], 2)
            replay = graph_us(lambda: layer(x, logits), args.iters) if cuda else None
            if replay is not None:
                row["graph_us"] = round(spread(replay, device)[1], 2)
        if whole is not None:
            ref = whole(x, logits)
            row["rel_err"] = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
            row["one_gpu_us"] = round(median_us(lambda: whole(x_all, logits_all), args.iters, sync), 2)
            if args.breakdown and cuda:
                one_graph = graph_us(lambda: whole(x_all, logits_all), args.iters)
                if one_graph is not None:
                    row["one_gpu_graph_us"] = round(one_graph, 2)
            row["speedup"] = round(row["one_gpu_us"] / row["time_us"], 3)
        rows.append(row)
        if rank == 0:
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    ok = True
    if rank == 0:
        bound = 1e-5 if dtype == torch.float32 else 1e-2
        bad = [r for r in rows if r.get("rel_err", 0.0) > bound]
        ok = not bad
        print(f"verdict: {'PASS' if ok else 'FAIL'} ({len(rows)} rows, rel_err bound {bound:g})", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    dist.destroy_process_group()
    sys.exit(int(flag.item() > 0))


if __name__ == "__main__":
    main()
