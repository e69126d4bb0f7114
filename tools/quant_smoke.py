"""Quick GPU timing of fused_experts on quantized experts against bf16 (not the report:
benchmarks/quant_bench.cpp is). One CUDA graph holds 4 calls over 4 routings (so L2 keeps
no weights from the call before); the median replay / 4 is the layer time."""
import sys

import torch

import moelora

MODELS = {
    "mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-235b-a22b": (128, 8, 4096, 1536), "deepseek-v3-tp8": (256, 8, 7168, 256),
    "olmoe-1b-7b": (64, 8, 2048, 1024), "gpt-oss-120b": (128, 4, 2880, 2880),
}


def time_layer(fn, reps=20):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps + 3):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / 4)
    return sorted(times[3:])[len(times[3:]) // 2]


def main():
    models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3-tp8", "mixtral-8x7b"]
    tokens = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 16, 256, 4096]
    schemes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["fp8_block", "fp8_channel", "fp8_tensor",
                                                                 "int8_channel"]
    print(f"{'model':16} {'M':>5} {'bf16 us':>9} " + " ".join(f"{s + ' us':>15}" for s in schemes))
    for name in models:
        E, k, H, I = MODELS[name]
        act = "swiglu_oai" if name.startswith("gpt-oss") else "silu"
        w13 = (torch.randn(E, 2 * I, H, device="cuda") * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(E, H, I, device="cuda") * 0.02).to(torch.bfloat16)
        quantized = {s: (moelora.quantize_weights(w13, s), moelora.quantize_weights(w2, s)) for s in schemes}
        for M in tokens:
            xs = [torch.randn(M, H, device="cuda").to(torch.bfloat16) for _ in range(4)]
            ids = [torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(M)]).int() for _ in range(4)]
            ws = [torch.rand(M, k, device="cuda") for _ in range(4)]
            row = [time_layer(lambda: [moelora.fused_experts(xs[i], w13, w2, ws[i], ids[i], activation=act)
                                       for i in range(4)])]
            for s in schemes:
                (q13, s13), (q2, s2) = quantized[s]
                quant = moelora.MoeQuant(s, s13, s2)
                row.append(time_layer(lambda: [moelora.fused_experts(xs[i], q13, q2, ws[i], ids[i], activation=act,
                                                                     quant=quant) for i in range(4)]))
            print(f"{name:16} {M:5} " + " ".join(f"{t:9.1f}" if i == 0 else f"{t:15.1f}" for i, t in enumerate(row)),
                  flush=True)
        del w13, w2, quantized
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
