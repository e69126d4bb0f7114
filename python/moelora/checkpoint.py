"""Expert weights from model checkpoints (FusedMoE.load_experts), read lazily.

CheckpointReader(source) opens a .safetensors file, a folder of shards (with or without
model.safetensors.index.json) or a dict name -> tensor, and reads a tensor's bytes only
when asked: a rank under expert parallelism reads its own experts and nothing else, rows
of a fused [E, ...] tensor included (read_rows), and a tensor-parallel rank only its shard's
columns (read_slice: no more than the result is held, where a whole read would hold every
expert's full down_proj to cut it).

read_experts(reader, prefix, local_experts, hidden_size, intermediate_size) finds a MoE
block's experts under `prefix` in any of these namings:
- per expert, nn.Linear orientation: <prefix>.experts.<e>.{gate_proj,up_proj,down_proj}.weight
  (Qwen2/3-MoE, OLMoE, DeepSeek-V3 bf16) or Mixtral's <prefix>.experts.<e>.{w1,w3,w2}.weight;
- fused, transformers 5.x's modules: <prefix>.experts.gate_up_proj [E, 2I, H] (gate rows,
  then up rows) and <prefix>.experts.down_proj [E, H, I];
- gpt-oss: <prefix>.experts.gate_up_proj [E, H, 2I] (gate and up columns interleaved),
  gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H] (told from the
  5.x layout by its bias keys).
Quantized checkpoints (weight_scale_inv, weight_scale) go through quant_checkpoint.
Every error is a ValueError naming the key.
"""
import collections.abc
import glob
import json
import os

import numpy as np
import torch

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}

__all__ = ["CheckpointReader", "read_experts", "Experts"]

# The experts of one block, in the layer's layouts: w13 [E_local, 2I, H] (interleaved gate /
# up rows when the checkpoint interleaves them), w2 [E_local, H, I]; the biases (gpt-oss)
# [E_local, 2I] and [E_local, H], or None.
Experts = collections.namedtuple("Experts", "w13 w2 w13_bias w2_bias interleaved")


def _error(message):
    return ValueError(f"moelora checkpoint: {message}")


def _row_runs(name, shape, rows):
    """[first, last) of each run of consecutive rows in `rows` (in their order), each row
    checked against the tensor's dim 0, so a run is read or copied at once."""
    for row in rows:
        if not 0 <= row < shape[0]:
            raise _error(f"row {row} of tensor '{name}' [{shape[0]}, ...] is out of range")
    runs, first = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append((rows[first], rows[i - 1] + 1))
            first = i
    return runs


class _SafetensorsFile:
    """One .safetensors file: its header read at once, each tensor's bytes on demand."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _error(f"'{path}' is not a safetensors file (shorter than its header)")
            length = int.from_bytes(head, "little")
            try:
                header = json.loads(f.read(length))
            except ValueError:
                raise _error(f"'{path}' is not a safetensors file (its header is not JSON)") from None
        self.base = 8 + length
        self.entries = {name: info for name, info in header.items() if name != "__metadata__"}

    def _dtype(self, name):
        dtype = _SAFETENSORS_DTYPES.get(self.entries[name].get("dtype"))
        if dtype is None:
            raise _error(f"tensor '{name}' of '{self.path}' has an unsupported dtype "
                         f"{self.entries[name].get('dtype')!r}")
        return dtype

    def shape(self, name):
        return [int(d) for d in self.entries[name]["shape"]]

    def read(self, name, rows=None):
        """The tensor (CPU), or only its rows `rows` (indices along dim 0)."""
        dtype, shape = self._dtype(name), self.shape(name)
        begin, end = self.entries[name]["data_offsets"]
        out_shape = shape if rows is None else [len(rows)] + shape[1:]
        if begin == end or (rows is not None and not rows):
            return torch.empty(out_shape, dtype=dtype)
        with open(self.path, "rb") as f:
            if rows is None:
                f.seek(self.base + begin)
                return torch.frombuffer(bytearray(f.read(end - begin)), dtype=dtype).reshape(shape)
            row_bytes = (end - begin) // shape[0]
            # One read a run of consecutive rows (a rank's experts, a shard's rows).
            parts = []
            for first, last in _row_runs(name, shape, rows):
                f.seek(self.base + begin + first * row_bytes)
                data = bytearray(f.read((last - first) * row_bytes))
                parts.append(torch.frombuffer(data, dtype=dtype).reshape([last - first] + shape[1:]))
            return torch.cat(parts)

    def read_slice(self, name, rows, dim, start, stop):
        """Rows `rows` (indices along dim 0; None: all) of tensor `name`, of them only
        [start, stop) along `dim` (>= 1), copied out of a memory map of the file: the pages
        the slice touches are read, and no more than the result is held."""
        dtype, shape = self._dtype(name), self.shape(name)
        begin, end = self.entries[name]["data_offsets"]
        rows = list(range(shape[0])) if rows is None else list(rows)
        runs = _row_runs(name, shape, rows)
        if not 1 <= dim < len(shape) or not 0 <= start <= stop <= shape[dim]:
            raise _error(f"slice [{start}, {stop}) of dim {dim} is outside tensor '{name}' {shape}")
        out_shape = [len(rows)] + shape[1:]
        out_shape[dim] = stop - start
        if begin == end or not rows or start == stop:
            return torch.empty(out_shape, dtype=dtype)
        # Bytes, not elements: numpy has no bfloat16 or float8; the last dim counts bytes.
        elem = torch.empty((), dtype=dtype).element_size()
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.base + begin, shape=(end - begin,))
        view = mapped.reshape(shape[:-1] + [shape[-1] * elem])
        index = [slice(None)] * (len(shape) - 1)
        index[dim - 1] = slice(start * elem, stop * elem) if dim == len(shape) - 1 else slice(start, stop)
        out = np.empty(out_shape[:-1] + [out_shape[-1] * elem], dtype=np.uint8)
        at = 0  # one copy a run of consecutive rows
        for first, last in runs:
            out[at:at + last - first] = view[(slice(first, last), *index)]
            at += last - first
        del view, mapped
        return torch.from_numpy(out).view(dtype).reshape(out_shape)


class CheckpointReader(collections.abc.Mapping):
    """name -> tensor over a checkpoint, read on access (a Mapping: `in`, [], keys()).

    source: a .safetensors file, a folder of *.safetensors shards (model.safetensors.index.json's
    weight_map when present), a torch file (.bin / .pt, read whole), a dict name -> tensor,
    or a CheckpointReader."""

    def __init__(self, source):
        self._dict, self._files = None, {}
        if isinstance(source, CheckpointReader):
            self._dict, self._files = source._dict, source._files
            return
        if isinstance(source, collections.abc.Mapping):
            self._dict = dict(source)
            return
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"moelora checkpoint: source expected a path or a dict name -> tensor, "
                            f"got {type(source).__name__}")
        path = os.fspath(source)
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
                paths = [os.path.join(path, shard) for shard in shards]
            else:
                paths = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
            if not paths:
                raise _error(f"'{path}' holds no .safetensors file")
        elif os.path.isfile(path) and not path.endswith(".safetensors"):  # a torch file (.bin, .pt)
            self._dict = torch.load(path, map_location="cpu", weights_only=True)
            return
        elif os.path.isfile(path):
            paths = [path]
        else:
            raise _error(f"source '{path}' is neither a directory nor a file")
        for file in map(_SafetensorsFile, paths):
            for name in file.entries:
                self._files[name] = file

    def __getitem__(self, name):
        if self._dict is not None:
            return torch.as_tensor(self._dict[name])
        return self._files[name].read(name)

    def __iter__(self):
        return iter(self._dict if self._dict is not None else self._files)

    def __contains__(self, name):
        return name in (self._dict if self._dict is not None else self._files)

    def __len__(self):
        return len(self._dict if self._dict is not None else self._files)

    def shape(self, name):
        if self._dict is not None:
            return list(torch.as_tensor(self._dict[name]).shape)
        return self._files[name].shape(name)

    def read_rows(self, name, rows):
        """Rows `rows` (indices along dim 0) of tensor `name`, reading only their bytes."""
        if self._dict is not None:
            return torch.as_tensor(self._dict[name])[list(rows)]
        return self._files[name].read(name, list(rows))

    def read_slice(self, name, rows, dim, start, stop):
        """Rows `rows` (dim 0; None: all) of tensor `name`, only [start, stop) along `dim`
        (>= 1): a tensor-parallel shard of every expert without holding the whole tensor."""
        if self._dict is not None:
            value = torch.as_tensor(self._dict[name])
            if rows is not None:
                value = value[list(rows)]
            return value.narrow(dim, start, stop - start).contiguous()
        return self._files[name].read_slice(name, rows, dim, start, stop)


_PER_EXPERT = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _check_shape(reader, key, shape):
    if key not in reader:
        raise _error(f"key '{key}' is missing")
    if reader.shape(key) != list(shape):
        raise _error(f"key '{key}' expected shape {list(shape)}, got {reader.shape(key)}")


def _read_rows(reader, key, rows, shape):
    """Rows `rows` (dim 0) of tensor `key` of shape `shape`: a fused tensor's local experts,
    or a shard of an expert's rows; only their bytes are read from a file."""
    _check_shape(reader, key, shape)
    return reader.read_rows(key, rows)


def _read_slice(reader, key, rows, shape, dim, start, stop):
    """_read_rows (rows None: all), of each row only [start, stop) along dim (>= 1)."""
    _check_shape(reader, key, shape)
    return reader.read_slice(key, rows, dim, start, stop)


def read_experts(reader, prefix, local_experts, num_experts, hidden_size, intermediate_size, shard=None):
    """Experts(w13, w2, w13_bias, w2_bias, interleaved) of the global experts `local_experts`
    (in local order) of the block under `prefix`, in the checkpoint's dtype (CPU).
    shard (start, stop): only the intermediate rows [start, stop) (tensor parallelism):
    gate/up rows and down columns; per-expert tensors read only those gate/up rows."""
    H, I, E = hidden_size, intermediate_size, num_experts
    start, stop = shard if shard is not None else (0, I)
    base = f"{prefix}.experts"
    for gate, up, down in _PER_EXPERT:
        if f"{base}.0.{gate}.weight" not in reader:
            continue
        w13, w2 = [], []
        for e in local_experts:
            w13.append(torch.cat([_read_rows(reader, f"{base}.{e}.{name}.weight", range(start, stop), (I, H))
                                  for name in (gate, up)], dim=0))
            w2.append(_read_slice(reader, f"{base}.{e}.{down}.weight", None, (H, I), 1, start, stop))
        return Experts(torch.stack(w13), torch.stack(w2), None, None, False)
    if f"{base}.gate_up_proj" in reader:
        if f"{base}.gate_up_proj_bias" in reader:  # gpt-oss: [E, H, 2I] interleaved, biases
            w13 = _read_slice(reader, f"{base}.gate_up_proj", local_experts, (E, H, 2 * I), 2, 2 * start, 2 * stop)
            w2 = _read_slice(reader, f"{base}.down_proj", local_experts, (E, I, H), 1, start, stop)
            b13 = _read_slice(reader, f"{base}.gate_up_proj_bias", local_experts, (E, 2 * I), 1, 2 * start, 2 * stop)
            b2 = _read_rows(reader, f"{base}.down_proj_bias", local_experts, (E, H))
            return Experts(w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous(), b13, b2, True)
        key = f"{base}.gate_up_proj"
        w13 = torch.cat([_read_slice(reader, key, local_experts, (E, 2 * I, H), 1, first + start, first + stop)
                         for first in (0, I)], dim=1)
        w2 = _read_slice(reader, f"{base}.down_proj", local_experts, (E, H, I), 2, start, stop)
        return Experts(w13, w2, None, None, False)
    raise _error(f"no expert weights under '{base}.' (expected <e>.gate_proj/up_proj/down_proj.weight, "
                 f"<e>.w1/w3/w2.weight, or the fused gate_up_proj / down_proj)")
