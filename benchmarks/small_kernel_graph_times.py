#!/usr/bin/env python3
"""In-graph time of the layer's small kernels, one call at a time.

ncu profiles each kernel alone (cold launch, serialised), which overstates the short
ones; the layer runs them back to back in a CUDA graph with programmatic dependent
launch. This captures 50 calls of one op in a graph, replays it 20 times and prints the
median time a call, next to a trivial torch kernel's for scale. The ops: the alignment
(moe_align_block_size, int32 ids, block 16 or 64) at decode and large-M shapes of the
brief's models, the per-token-group quantize, moe_sum_reduce.

On the GPU machine, after tools/build.sh (BUILD_DIR: /tmp/bg there):
  MOELORA_EXT_DIR=BUILD_DIR PYTHONPATH=python python3 benchmarks/small_kernel_graph_times.py
"""
import torch

import moelora
from graph_timing import time_graph

DEVICE = "cuda"


def graph_time_us(fn, calls=50, replays=20):
    """One call's time: `calls` calls of fn in one graph, the median of `replays` replays."""
    return time_graph([fn] * calls, replays)


def main():
    tiny = torch.zeros(16, device=DEVICE)
    print(f"{'trivial torch add':40s} {graph_time_us(lambda: tiny.add_(1)):7.2f} us")
    # (name, tokens, top_k, experts, block size)
    for name, M, top_k, E, block in [("olmoe M64", 64, 8, 64, 16), ("qwen3-30b M32", 32, 8, 128, 16),
                                     ("qwen3-30b M256", 256, 8, 128, 16), ("deepseek M64", 64, 8, 256, 16),
                                     ("mixtral M64", 64, 2, 8, 64), ("deepseek M8192", 8192, 8, 256, 16)]:
        ids = torch.stack([torch.randperm(E, device=DEVICE)[:top_k] for _ in range(M)]).to(torch.int32)
        t = graph_time_us(lambda: moelora.ops.moe_align_block_size(ids, block, E))
        print(f"{'align ' + name:40s} {t:7.2f} us")
    for name, rows, cols in [("x olmoe M64", 64, 2048), ("act olmoe M64 (512 slots)", 512, 1024), ("x qwen M1", 1, 2048)]:
        x = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16)
        t = graph_time_us(lambda: moelora.ops.per_token_group_quant(x, 128))
        print(f"{'quant ' + name:40s} {t:7.2f} us")
    for name, M, top_k, H in [("olmoe M64", 64, 8, 2048), ("qwen M1", 1, 8, 2048)]:
        x = torch.randn(M, top_k, H, device=DEVICE, dtype=torch.bfloat16)
        out = torch.empty(M, H, device=DEVICE, dtype=torch.bfloat16)
        t = graph_time_us(lambda: moelora.ops.moe_sum_reduce(x, out))
        print(f"{'reduce ' + name:40s} {t:7.2f} us")


if __name__ == "__main__":
    main()
