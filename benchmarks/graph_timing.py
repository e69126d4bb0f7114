"""Time of launches replayed in one CUDA graph, shared by the Python benchmarks
(triton_fused_moe_compare.py, small_kernel_graph_times.py): the way moelora_bench times
the layer (median of graph replays, warm-up excluded, per launch).
"""
import statistics

import torch


def time_graph(launches, iters):
    """Median over `iters` replays of one graph holding all `launches`, per launch, in us."""
    for f in launches:  # warm-up: Triton compiles here, outside the capture
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in launches:
            f()
    for _ in range(2):
        g.replay()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / len(launches))
    del g
    return statistics.median(times)
