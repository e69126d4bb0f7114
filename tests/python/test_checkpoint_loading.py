"""Expert weights from checkpoints (moelora.checkpoint, FusedMoE.load_experts,
moelora.integrations.transformers.load_experts): each family's checkpoint as transformers
saves it (sharded), the per-expert and fused namings, a rank under expert parallelism
reading only its own experts, a quantized layer, and errors naming the key."""
import copy
import glob
import json

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")

import moelora  # noqa: E402
from moelora import checkpoint  # noqa: E402
from moelora.integrations import transformers as mt  # noqa: E402

from hf_tiny_models import FAMILIES, VOCAB, tiny_model  # noqa: E402


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_its_experts_from_transformers_shards(family, tmp_path):
    reference = tiny_model(family)
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(glob.glob(str(tmp_path / "*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    model = tiny_model(family, seed=7)
    with torch.no_grad():  # all but the experts from the reference: only the experts differ
        for (name, param), (_, source) in zip(model.named_parameters(), reference.named_parameters()):
            if ".experts." not in name:
                param.copy_(source)
        for (_, buffer), (_, source) in zip(model.named_buffers(), reference.named_buffers()):
            buffer.copy_(source)
    mt.patch_moe_blocks(model)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(ids).logits
        assert (model(ids).logits - expected).abs().max() > 1e-2 * expected.abs().max()  # the experts matter
        mt.load_experts(model, tmp_path)
        assert (model(ids).logits - expected).abs().max() <= 1e-5 * expected.abs().max()


def _per_expert_tensors(prefix, names, E, H, I, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_name, up_name, down_name = names
    tensors = {}
    for e in range(E):
        tensors[f"{prefix}.experts.{e}.{gate_name}.weight"] = torch.randn(I, H, generator=gen)
        tensors[f"{prefix}.experts.{e}.{up_name}.weight"] = torch.randn(I, H, generator=gen)
        tensors[f"{prefix}.experts.{e}.{down_name}.weight"] = torch.randn(H, I, generator=gen)
    return tensors


def _write_shards(tensors, folder, shards=2):
    """tensors over `shards` .safetensors files with an index, as transformers writes them."""
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        safetensors_torch.save_file(part, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_expert_parallel_rank_reads_only_its_experts(names, tmp_path):
    E, H, I = 6, 32, 16
    tensors = _per_expert_tensors("model.layers.0.mlp", names, E, H, I)
    # The experts of the other rank are unreadable (wrong shapes): reading one would raise.
    local = [1, 4]
    for e in set(range(E)) - set(local):
        for name in names:
            tensors[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = torch.zeros(1, 1)
    _write_shards(tensors, tmp_path)
    expert_map = [-1] * E
    for i, e in enumerate(local):
        expert_map[e] = i
    layer = moelora.FusedMoE(E, 2, H, I, dtype=torch.float32, expert_map=expert_map)
    layer.load_experts(tmp_path, "model.layers.0.mlp")
    gate, up, down = names
    for i, e in enumerate(local):
        base = f"model.layers.0.mlp.experts.{e}"
        assert torch.equal(layer.w13[i], torch.cat([tensors[f"{base}.{gate}.weight"], tensors[f"{base}.{up}.weight"]]))
        assert torch.equal(layer.w2[i], tensors[f"{base}.{down}.weight"])
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.0.gate_proj.weight' expected shape \[16, 32\]"
                       if names[0] == "gate_proj" else r"experts.0.w1.weight' expected shape \[16, 32\]"):
        moelora.FusedMoE(E, 2, H, I, dtype=torch.float32).load_experts(tmp_path, "model.layers.0.mlp")


def test_fused_rows_are_read_alone(tmp_path):
    E, H, I = 5, 16, 8
    gen = torch.Generator().manual_seed(1)
    fused = {"blk.experts.gate_up_proj": torch.randn(E, 2 * I, H, generator=gen),
             "blk.experts.down_proj": torch.randn(E, H, I, generator=gen)}
    safetensors_torch.save_file(fused, str(tmp_path / "model.safetensors"))
    reader = checkpoint.CheckpointReader(tmp_path / "model.safetensors")
    assert torch.equal(reader.read_rows("blk.experts.down_proj", [3, 0]), fused["blk.experts.down_proj"][[3, 0]])
    # Runs of consecutive rows are read at once: runs, repeats and descending rows mixed.
    rows = [1, 2, 3, 3, 0, 4, 2, 3]
    assert torch.equal(reader.read_rows("blk.experts.gate_up_proj", rows), fused["blk.experts.gate_up_proj"][rows])
    assert torch.equal(reader.read_rows("blk.experts.gate_up_proj", range(E)), fused["blk.experts.gate_up_proj"])
    layer = moelora.FusedMoE(E, 2, H, I, dtype=torch.float32, expert_map=[-1, -1, 0, -1, 1])
    layer.load_experts(tmp_path / "model.safetensors", "blk")
    assert torch.equal(layer.w13, fused["blk.experts.gate_up_proj"][[2, 4]])
    assert torch.equal(layer.w2, fused["blk.experts.down_proj"][[2, 4]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_shard_slices_match_the_whole_tensor_cut(dtype, tmp_path):
    # A tensor-parallel rank reads only its shard's columns / rows of every expert
    # (read_slice, out of a memory map): each dim, row runs and repeats, the file and the
    # dict reader alike; bfloat16 and float8 have no numpy dtype (the map is bytes).
    E, H, I = 5, 6, 12
    whole = torch.randn(E, H, I, generator=torch.Generator().manual_seed(3)).to(dtype)
    safetensors_torch.save_file({"w": whole, "v": whole[0].clone()}, str(tmp_path / "model.safetensors"))
    for reader in (checkpoint.CheckpointReader(tmp_path / "model.safetensors"), checkpoint.CheckpointReader({"w": whole})):
        for rows in (None, [4, 0], [1, 2, 3, 3, 0]):
            picked = whole if rows is None else whole[rows]
            for dim, start, stop in ((2, 3, 9), (1, 2, 5), (2, 0, I), (2, 4, 4)):
                got = reader.read_slice("w", rows, dim, start, stop)
                assert got.dtype == dtype and torch.equal(got.view(torch.uint8), picked.narrow(dim, start, stop - start)
                                                          .contiguous().view(torch.uint8))
    reader = checkpoint.CheckpointReader(tmp_path / "model.safetensors")
    assert torch.equal(reader.read_slice("v", None, 1, 6, 12).view(torch.uint8), whole[0, :, 6:].contiguous().view(torch.uint8))
    with pytest.raises(ValueError, match=r"slice \[8, 13\) of dim 2 is outside tensor 'w' \[5, 6, 12\]"):
        reader.read_slice("w", None, 2, 8, 13)
    with pytest.raises(ValueError, match=r"row 5 of tensor 'w'"):
        reader.read_slice("w", [5], 2, 0, 1)


@pytest.mark.parametrize("naming", ["per_expert", "fused", "gpt_oss"])
def test_a_tensor_parallel_shard_reads_what_the_whole_read_cuts(naming, tmp_path):
    E, H, I, start, stop = 4, 8, 12, 4, 8
    gen = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    b13, b2 = torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)
    blk = "blk.experts"
    if naming == "per_expert":
        tensors = {f"{blk}.{e}.{name}.weight": t.contiguous() for e in range(E)
                   for name, t in (("gate_proj", w13[e, :I]), ("up_proj", w13[e, I:]), ("down_proj", w2[e]))}
    elif naming == "fused":
        tensors = {f"{blk}.gate_up_proj": w13, f"{blk}.down_proj": w2}
    else:  # [E, H, 2I] with gate and up columns interleaved, [E, I, H], biases
        tensors = {f"{blk}.gate_up_proj": w13.transpose(1, 2).contiguous(), f"{blk}.down_proj": w2.transpose(1, 2).contiguous(),
                   f"{blk}.gate_up_proj_bias": b13, f"{blk}.down_proj_bias": b2}
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = checkpoint.CheckpointReader(tmp_path / "model.safetensors")
    local = [3, 1]
    whole = checkpoint.read_experts(reader, "blk", local, E, H, I)
    shard = checkpoint.read_experts(reader, "blk", local, E, H, I, shard=(start, stop))
    rows = (slice(2 * start, 2 * stop) if whole.interleaved else
            torch.cat([torch.arange(start, stop), torch.arange(I + start, I + stop)]))
    assert shard.interleaved == whole.interleaved == (naming == "gpt_oss")
    assert torch.equal(shard.w13, whole.w13[:, rows]) and shard.w13.is_contiguous()
    assert torch.equal(shard.w2, whole.w2[:, :, start:stop]) and shard.w2.is_contiguous()
    if naming == "gpt_oss":
        assert torch.equal(shard.w13_bias, whole.w13_bias[:, 2 * start:2 * stop]) and torch.equal(shard.w2_bias, b2[local])
    assert torch.equal(whole.w2, w2[local])


def test_quantized_layer_loads_float_or_8bit_checkpoints(tmp_path):
    E, H, I = 4, 256, 128
    tensors = _per_expert_tensors("m", ("gate_proj", "up_proj", "down_proj"), E, H, I)
    _write_shards(tensors, tmp_path)
    from_float = moelora.FusedMoE(E, 2, H, I, dtype=torch.bfloat16, quant="fp8_block")
    from_float.load_experts(tmp_path, "m")  # float weights: quantized on load
    w13 = torch.stack([torch.cat([tensors[f"m.experts.{e}.gate_proj.weight"], tensors[f"m.experts.{e}.up_proj.weight"]])
                       for e in range(E)])
    q13, s13 = moelora.quantize_weights(w13, "fp8_block")
    assert torch.equal(from_float.w13.view(torch.uint8), q13.view(torch.uint8))
    torch.testing.assert_close(from_float.w13_weight_scale, s13)

    # DeepSeek-V3's layout: fp8 weights with weight_scale_inv per 128 x 128 block.
    fp8 = {}
    for e in range(E):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            q, s = moelora.quantize_weights(tensors[f"m.experts.{e}.{proj}.weight"][None], "fp8_block")
            fp8[f"m.experts.{e}.{proj}.weight"], fp8[f"m.experts.{e}.{proj}.weight_scale_inv"] = q[0], s[0]
    (tmp_path / "fp8").mkdir()
    _write_shards(fp8, tmp_path / "fp8")
    from_fp8 = moelora.FusedMoE(E, 2, H, I, dtype=torch.bfloat16, quant="fp8_block")
    from_fp8.load_experts(tmp_path / "fp8", "m")
    assert torch.equal(from_fp8.w13.view(torch.uint8), q13.view(torch.uint8))
    torch.testing.assert_close(from_fp8.w13_weight_scale, s13)


def test_errors_name_the_key(tmp_path):
    E, H, I = 2, 16, 8
    tensors = _per_expert_tensors("m", ("gate_proj", "up_proj", "down_proj"), E, H, I)
    del tensors["m.experts.1.down_proj.weight"]
    layer = moelora.FusedMoE(E, 1, H, I, dtype=torch.float32)
    before = layer.w13.clone()
    with pytest.raises(ValueError, match=r"key 'm.experts.1.down_proj.weight' is missing"):
        layer.load_experts(tensors, "m")
    assert torch.equal(layer.w13, before)  # nothing written
    with pytest.raises(ValueError, match=r"no expert weights under 'x.experts.'"):
        layer.load_experts(tensors, "x")
    biased = {"m.experts.gate_up_proj": torch.zeros(E, H, 2 * I), "m.experts.gate_up_proj_bias": torch.zeros(E, 2 * I),
              "m.experts.down_proj": torch.zeros(E, I, H), "m.experts.down_proj_bias": torch.zeros(E, H)}
    with pytest.raises(ValueError, match="holds expert biases"):
        moelora.FusedMoE(E, 1, H, I, dtype=torch.float32, activation="swiglu_oai").load_experts(biased, "m")
    with pytest.raises(ValueError, match="neither a directory nor a file"):
        layer.load_experts(tmp_path / "missing", "m")
    model = tiny_model("mixtral")
    mt.patch_moe_blocks(model)
    with pytest.raises(ValueError, match=r"no expert weights under 'model.layers.0.mlp.experts.' or "
                                         r"'model.layers.0.block_sparse_moe.experts.'"):
        mt.load_experts(model, copy.deepcopy(tensors))
