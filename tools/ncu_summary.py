"""Summarises `ncu --csv --page raw --metrics gpu__time_duration.sum` output of one layer
cell (tools/profile_layer.sh): the kernels of one layer call in launch order, each with
its median duration over the profiled calls and its share of their sum.

A layer call is the shortest period of kernel names that the last launches repeat (the
bench's setup kernels, such as the weights' quantization, come before and are left out);
the bench's own output lines before the CSV header are skipped."""

import csv
import io
import statistics
import sys


def rows_of(text):
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    table = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    # The row after the header holds the units.
    unit = table[0].get("gpu__time_duration.sum", "")
    # NOTE: ncu 2025.3 writes "ns" here (the first device run read nanoseconds as microseconds).
    scales = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    if unit not in scales:
        print(f"warning: unknown duration unit {unit!r}; printing raw values", file=sys.stderr)
    scale = scales.get(unit, 1.0)
    out = []
    for row in table[1:]:
        value = row.get("gpu__time_duration.sum", "").replace(",", "")
        if value:
            out.append((row["Kernel Name"], float(value) * scale))
    return out


def layer_calls(launches, max_period=64):
    """The last launches cut into layer calls: the shortest period p of names that the
    last three periods follow, then every whole period from the end that has the same names."""
    names = [name for name, _ in launches]
    period = next((p for p in range(1, max_period + 1) if 3 * p <= len(names)
                   and all(names[-k] == names[-k - p] for k in range(1, 2 * p + 1))), None)
    if period is None:
        sys.exit("no repeating layer call in the profile (profile one cell, with a few replays)")
    shape = names[-period:]
    calls = []
    end = len(launches)
    while end - period >= 0 and names[end - period:end] == shape:
        calls.append(launches[end - period:end])
        end -= period
    return calls[::-1]


def main():
    with open(sys.argv[1]) as f:
        launches = rows_of(f.read())
    if not launches:
        sys.exit("no kernel in the profile")
    calls = layer_calls(launches)
    shape = [name for name, _ in calls[0]]
    medians = [statistics.median(call[i][1] for call in calls) for i in range(len(shape))]
    total = sum(medians)
    print(f"{len(calls)} layer calls of {len(shape)} kernels ({len(launches)} launches profiled); sum {total:.1f} us")
    for i, (name, us) in enumerate(zip(shape, medians)):
        print(f"{i:>3} {us:>10.1f} us {100 * us / total:>5.1f}%  {name[:100]}")


if __name__ == "__main__":
    main()
