"""The MoE layer over several processes through torch.distributed (issue 32): expert
parallelism (EP: each rank holds a range of the experts) and tensor parallelism (TP: each
rank holds a shard of every expert's intermediate dimension), alone or together.

Ranks form an ep_size x tp_size grid; ep_group / tp_group are the process groups of a
rank's row and column (None: the default group, when the other size is 1; new_grid()
builds both from the default group). Every rank runs the same moelora.FusedMoE on its
experts and its shard, so every dtype, quantization scheme and LoRA feature of the layer
works unchanged; what differs is which weights it holds and how outputs combine:

- TP: w13's gate and up rows [start, start + I / tp_size) and w2's columns of the same
  range. The experts' outputs are partial sums over I: an all-reduce over tp_group.
  Adapters split the same way: gate/up lora_B by rows, down lora_A by columns (its
  shrink gives a partial sum, which the same all-reduce completes), gate/up lora_A and
  down lora_B whole on every rank. No collective of its own for the adapters.
- EP, dispatch="all_reduce": every rank takes the same tokens (replicated input, as
  after a TP attention block), computes the slots routed to its experts (expert_map:
  the others add zero) and an all-reduce over ep_group sums the ranks' outputs. One
  collective, no host synchronisation: CUDA-graph capturable.
- EP, dispatch="all_to_all": each rank brings its own tokens (data-parallel input),
  routes them, and sends each token once to every rank that holds one of its experts
  (all_to_all_single of the rows, their top-k ids and weights, adapter ids): a row a
  (token, rank) pair, not a row a slot, so top_k = 8 over 2 ranks moves ~4x fewer bytes.
  Each rank runs its local experts on the tokens it received (expert_map drops the
  others' slots) and a second all_to_all_single brings each token's partial sum back,
  summed over the ranks in fp32 (tokens routed only to -1 are not sent). The split sizes
  are exchanged first, a host synchronisation: not capturable in a CUDA graph.
- EP, dispatch="all_gather": each rank brings its own tokens, as with all_to_all, and
  every rank brings the SAME number, or at most tokens_per_rank (a constructor argument:
  each call is padded to it, the padding routed to -1 and costing no expert work). Counts
  are not exchanged: a rank past tokens_per_rank raises before the collective, and ranks
  whose counts differ without it leave the collective undefined (the others wait). An all-gather over ep_group gives every rank all
  ranks' tokens with their top-k ids, weights and adapter ids; each runs its experts on
  them (expert_map drops the other slots), and a reduce-scatter sums the partial outputs
  and hands each rank back its own rows. The bytes of the all_reduce path's collective
  plus the tokens' gather, fixed sizes: no host synchronisation, CUDA-graph capturable.
The all-reduce and all-gather paths are functional collectives: torch.compile(fullgraph=True)
traces the layer's forward without a graph break.

Experts are split in contiguous ranges, the first num_experts % ep_size ranks holding
one more (expert_partition). The intermediate size must split evenly into shards that
the scheme can cut: whole 4-bit bytes, weight-only groups, 128-wide fp8/int8 blocks.
"""

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import checkpoint
from .layer import FusedMoE

DISPATCHES = ("all_reduce", "all_to_all", "all_gather")


def expert_partition(num_experts, ep_size, ep_rank):
    """(first, count): the contiguous range of global experts rank ep_rank holds; the
    first num_experts % ep_size ranks hold one more."""
    if not 1 <= ep_size <= num_experts:
        raise ValueError(f"moelora.distributed: ep_size expected a value in [1, {num_experts}] (num_experts), "
                         f"got {ep_size}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"moelora.distributed: ep_rank expected a value in [0, {ep_size}), got {ep_rank}")
    base, extra = divmod(num_experts, ep_size)
    first = ep_rank * base + min(ep_rank, extra)
    return first, base + (1 if ep_rank < extra else 0)


def expert_map(num_experts, ep_size, ep_rank):
    """int32 [num_experts]: the local index of each global expert on rank ep_rank, -1 for
    the experts other ranks hold."""
    first, count = expert_partition(num_experts, ep_size, ep_rank)
    mapping = torch.full((num_experts,), -1, dtype=torch.int32)
    mapping[first:first + count] = torch.arange(count, dtype=torch.int32)
    return mapping


def expert_owner(num_experts, ep_size):
    """int64 [num_experts]: the EP rank that holds each global expert."""
    owner = torch.empty(num_experts, dtype=torch.int64)
    for rank in range(ep_size):
        first, count = expert_partition(num_experts, ep_size, rank)
        owner[first:first + count] = rank
    return owner


def _shard_unit(quant):
    """The intermediate sizes a shard must be a multiple of under `quant` (a name or a
    QuantScheme, None: bf16/fp16): whole bytes of 4-bit weights, whole weight-only groups,
    whole 128-wide blocks of the blockwise 8-bit schemes."""
    if quant is None:
        return 1
    from . import ops
    q = ops.quant_scheme(quant)
    if q.weight_only:
        return max(q.group_size, 2 if q.weight_bits == 4 else 1)
    return max(q.block_n, q.block_k) if q.weight_scales.name == "block" else 1


def intermediate_shard(intermediate_size, tp_size, tp_rank, unit=1):
    """(start, size) of rank tp_rank's shard of the intermediate dimension."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"moelora.distributed: tp_rank expected a value in [0, {tp_size}) (tp_size), got {tp_rank}")
    size, rest = divmod(intermediate_size, tp_size)
    if rest or size % unit:
        raise ValueError(f"moelora.distributed: intermediate_size {intermediate_size} expected to split into "
                         f"{tp_size} equal shards of a multiple of {unit} (the scheme's unit), got shards of "
                         f"{intermediate_size / tp_size:g}")
    return tp_rank * size, size


def new_grid(ep_size, tp_size):
    """(ep_group, tp_group, ep_rank, tp_rank) of this process in an ep_size x tp_size grid
    of the default group's ranks (rank = ep_rank * tp_size + tp_rank). Every process must
    call it (new_group is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size * tp_size != world:
        raise ValueError(f"moelora.distributed: ep_size x tp_size expected the world size {world}, "
                         f"got {ep_size} x {tp_size}")
    ep_group = tp_group = None
    for t in range(tp_size):  # rows of equal tp_rank: the EP groups
        group = dist.new_group([e * tp_size + t for e in range(ep_size)])
        if rank % tp_size == t:
            ep_group = group
    for e in range(ep_size):  # columns of equal ep_rank: the TP groups
        group = dist.new_group([e * tp_size + t for t in range(tp_size)])
        if rank // tp_size == e:
            tp_group = group
    return ep_group, tp_group, rank // tp_size, rank % tp_size


@dataclasses.dataclass
class CommTimes:
    """Wall time of the last forward's collectives (seconds, after a device sync each):
    measured while ParallelFusedMoE.time_comm is on (benchmarks), else left as it was."""
    dispatch: float = 0.0
    combine: float = 0.0


class ParallelFusedMoE(torch.nn.Module):
    """moelora.FusedMoE over an EP x TP grid of ranks (module docstring).

    Arguments are FusedMoE's (num_experts, top_k, hidden_size, intermediate_size: the
    whole layer's) plus ep_size / ep_rank / ep_group, tp_size / tp_rank / tp_group and
    dispatch ("all_reduce", "all_to_all" or "all_gather"; with "all_gather",
    tokens_per_rank pads every rank's call to that many tokens, so ranks may bring different
    counts up to it: an engine's per-rank batch limit). The local layer is `self.local` (its
    expert_map, weights [E_local, 2 I_shard, H] / [E_local, H, I_shard], adapter slots).
    """

    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, *, ep_size=1, ep_rank=0,
                 tp_size=1, tp_rank=0, ep_group=None, tp_group=None, dispatch="all_reduce", tokens_per_rank=None,
                 **layer_kwargs):
        super().__init__()
        if dispatch not in DISPATCHES:
            raise ValueError(f"moelora.distributed: dispatch expected one of {DISPATCHES}, got {dispatch!r}")
        if "expert_map" in layer_kwargs:
            raise ValueError("moelora.distributed: expert_map expected None (ParallelFusedMoE makes it from "
                             "ep_size and ep_rank)")
        for name, group, size in (("ep_group", ep_group, ep_size), ("tp_group", tp_group, tp_size)):
            if size > 1 and dist.is_initialized() and dist.get_world_size(group) != size:
                raise ValueError(f"moelora.distributed: {name} expected {size} ranks, got "
                                 f"{dist.get_world_size(group)}")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.ep_size, self.ep_rank, self.ep_group = ep_size, ep_rank, ep_group
        self.tp_size, self.tp_rank, self.tp_group = tp_size, tp_rank, tp_group
        self.dispatch = dispatch
        if tokens_per_rank is not None and (dispatch != "all_gather" or int(tokens_per_rank) < 0):
            raise ValueError(f"moelora.distributed: tokens_per_rank expected None, or a count >= 0 with dispatch "
                             f"'all_gather', got {tokens_per_rank!r} with dispatch {dispatch!r}")
        self.tokens_per_rank = None if tokens_per_rank is None else int(tokens_per_rank)
        self.first_expert, _ = expert_partition(num_experts, ep_size, ep_rank)
        start, size = intermediate_shard(intermediate_size, tp_size, tp_rank, _shard_unit(layer_kwargs.get("quant")))
        self.shard_start = start
        mapping = expert_map(num_experts, ep_size, ep_rank) if ep_size > 1 else None
        self.local = FusedMoE(num_experts, top_k, hidden_size, size, expert_map=mapping, **layer_kwargs)
        self.local.adapter_intermediate_size = intermediate_size
        self.local.adapter_intermediate_start = start
        self.register_buffer("expert_owner", expert_owner(num_experts, ep_size).to(layer_kwargs.get("device")),
                             persistent=False)
        self.time_comm = False
        self.comm_times = CommTimes()

    # ---- weights ------------------------------------------------------------------------

    def shard_of(self, w13, w2):
        """This rank's experts and intermediate shard of the whole layer's float weights
        w13 [E or E_local, 2I, H] / w2 [E or E_local, H, I] (views; one expert's as
        [1, 2I, H] / [1, H, I], e.g. to fill a large layer expert by expert)."""
        E_local = self.local.num_local_experts
        if w13.shape[0] == self.num_experts and E_local != self.num_experts:
            w13 = w13[self.first_expert:self.first_expert + E_local]
            w2 = w2[self.first_expert:self.first_expert + E_local]
        if self.local.intermediate_size == self.intermediate_size:
            return w13, w2
        return self._shard_rows(w13, 1), self._shard_columns(w2, 1)

    @torch.no_grad()
    def load_weights(self, w13, w2):
        """The whole layer's float weights w13 [E, 2I, H] and w2 [E, H, I] (or only this
        rank's experts, [E_local, ...]): this rank's experts and shard go to the local
        layer, quantized there under a quantized scheme."""
        w13, w2 = torch.as_tensor(w13), torch.as_tensor(w2)
        E_local, H, I = self.local.num_local_experts, self.hidden_size, self.intermediate_size
        for name, value, rows, cols in (("w13", w13, 2 * I, H), ("w2", w2, H, I)):
            if value.dim() != 3 or value.shape[0] not in (self.num_experts, E_local) or \
                    tuple(value.shape[1:]) != (rows, cols) or not value.is_floating_point():
                raise ValueError(f"ParallelFusedMoE.load_weights: {name} expected float [{self.num_experts} or "
                                 f"{E_local}, {rows}, {cols}], got {value.dtype} {list(value.shape)}")
        self.local.load_weights(*self.shard_of(w13, w2))

    @torch.no_grad()
    def load_experts(self, source, prefix):
        """This rank's experts and shard from a model checkpoint (FusedMoE.load_experts'
        sources and namings): only this rank's experts are read, and of per-expert
        gate/up tensors only this shard's rows."""
        reader = checkpoint.CheckpointReader(source)
        count = self.local.num_local_experts
        shard = (self.shard_start, self.shard_start + self.local.intermediate_size)
        experts = checkpoint.read_experts(reader, prefix, list(range(self.first_expert, self.first_expert + count)),
                                          self.num_experts, self.hidden_size, self.intermediate_size,
                                          shard if self.tp_size > 1 else None)
        if experts.w13_bias is not None:
            raise ValueError(f"ParallelFusedMoE.load_experts: '{prefix}.experts.' holds expert biases (gpt-oss), "
                             f"which the layer has no place for")
        if experts.interleaved != (self.local.activation == "swiglu_oai"):
            raise ValueError(f"ParallelFusedMoE.load_experts: '{prefix}.experts.' holds "
                             f"{'interleaved' if experts.interleaved else 'halved'} gate/up rows, activation "
                             f"{self.local.activation!r} expects the other")
        self.local.load_weights(experts.w13, experts.w2)

    def _shard_rows(self, t, per_row):
        """w13-like tensor t [E, 2I / per_row, ...]: this shard's gate and up rows (per_row:
        weight rows a row of t holds, 1, or the block scales' block_n)."""
        I, start, size = self.intermediate_size // per_row, self.shard_start // per_row, \
            self.local.intermediate_size // per_row
        if self.local.activation == "swiglu_oai":  # interleaved gate/up rows: (2j, 2j + 1)
            return t[:, 2 * start:2 * (start + size)]
        return torch.cat([t[:, start:start + size], t[:, I + start:I + start + size]], dim=1)

    def _shard_columns(self, t, per_column):
        """w2-like tensor t [E, H, I / per_column]: this shard's columns."""
        start, size = self.shard_start // per_column, self.local.intermediate_size // per_column
        return t[:, :, start:start + size]

    @torch.no_grad()
    def load_quantized_experts(self, source, prefix, quant_config=None):
        """FusedMoE.load_quantized_experts' checkpoints (DeepSeek-V3 fp8 blocks, per-tensor /
        per-channel 8-bit, GPTQ / AWQ weight-only): this rank's experts are read, then cut
        to its shard (the scheme's unit keeps packed bytes, groups and blocks whole)."""
        from . import quant_checkpoint
        q, local = self.local.quant_scheme, self.local
        if q is None:
            raise ValueError("ParallelFusedMoE.load_quantized_experts: the layer has no quantization scheme")
        tensors = checkpoint.CheckpointReader(source)
        experts = list(range(self.first_expert, self.first_expert + local.num_local_experts))
        H, I = self.hidden_size, self.intermediate_size
        if q.weight_only:
            w13, w2, s13, s2, z13, z2 = quant_checkpoint.read_weight_only_experts(tensors, prefix, q, experts, H, I,
                                                                                  quant_config)
            pack, group = 8 // q.weight_bits, q.group_size or I
            w13, w2 = self._shard_rows(w13, 1), self._shard_columns(w2, pack)
            s13 = self._shard_rows(s13, 1)
            s2 = self._shard_columns(s2, group) if s2.dim() == 3 else s2
            if z13 is not None:
                z13 = self._shard_rows(z13, 1)
                z2 = self._shard_columns(z2, group) if z2.dim() == 3 else z2
            dtype = local._weight_only_scale_dtype
            local.load_weights(w13, w2, s13.to(dtype), s2.to(dtype), w13_zero=z13, w2_zero=z2)
            return
        w13, w2, s13, s2, a13, a2 = quant_checkpoint.read_quantized_experts(tensors, prefix, q, experts, H, I)
        w13, w2 = self._shard_rows(w13, 1), self._shard_columns(w2, 1)
        if s13.dim() == 3:  # blocks [E, N / block_n, K / block_k]
            s13, s2 = self._shard_rows(s13, q.block_n), self._shard_columns(s2, q.block_k)
        elif s13.dim() == 2:  # channels [E, N]: w2's rows (H) are whole
            s13 = self._shard_rows(s13, 1)
        local.load_weights(w13, w2, s13, s2, a13, a2)

    def load_adapter(self, slot, source, **kwargs):
        """FusedMoE.load_adapter on this rank's experts and shard of the whole adapter."""
        return self.local.load_adapter(slot, source, **kwargs)

    def unload_adapter(self, slot):
        self.local.unload_adapter(slot)

    # ---- forward ------------------------------------------------------------------------

    def _all_reduce(self, out, group, size):
        # Functional collectives: torch.compile traces them without a graph break. Waited on
        # here, so eager calls complete as dist.all_reduce's would (a compiled graph may
        # still move the wait later).
        if size > 1:
            out = funcol.wait_tensor(funcol.all_reduce(out, "sum", group if group is not None else dist.group.WORLD))
        return out

    def _timed(self, field, fn):
        if not self.time_comm:
            return fn()
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        setattr(self.comm_times, field, getattr(self.comm_times, field) + time.perf_counter() - start)
        return result

    def forward(self, hidden_states, router_logits, token_lora_ids=None):
        """hidden_states [*, H], router_logits [*, num_experts] -> [*, H]: replicated over
        the grid with dispatch "all_reduce"; this rank's own tokens with "all_to_all" and
        "all_gather" (the same number on every rank of ep_group with "all_gather")."""
        topk_weights, topk_ids = self.local.route(router_logits.reshape(-1, self.num_experts))
        return self.forward_routed(hidden_states, topk_weights, topk_ids, token_lora_ids)

    def forward_routed(self, hidden_states, topk_weights, topk_ids, token_lora_ids=None):
        if self.time_comm:
            self.comm_times = CommTimes()
        if self.dispatch == "all_reduce" or self.ep_size == 1:
            out = self.local.forward_routed(hidden_states, topk_weights, topk_ids, token_lora_ids)
            out = self._timed("combine", lambda: self._all_reduce(out, self.tp_group, self.tp_size))
            return self._timed("combine", lambda: self._all_reduce(out, self.ep_group, self.ep_size))
        if self.dispatch == "all_gather":
            return self._forward_all_gather(hidden_states, topk_weights, topk_ids, token_lora_ids)
        return self._forward_all_to_all(hidden_states, topk_weights, topk_ids, token_lora_ids)

    def _token_rows(self, hidden_states, topk_weights, topk_ids, token_lora_ids):
        """What a data-parallel dispatch sends of each token: [x [M, H], topk_ids int32,
        topk_weights fp32, token_lora_ids int32 or None], and the tokens' leading dims."""
        x = hidden_states.reshape(-1, self.hidden_size)
        if topk_ids.shape[0] != x.shape[0]:
            raise ValueError(f"ParallelFusedMoE.forward: topk_ids expected {x.shape[0]} rows (the tokens), got "
                             f"{topk_ids.shape[0]}")
        lora = None if token_lora_ids is None else token_lora_ids.reshape(-1).to(torch.int32)
        return [x, topk_ids.to(torch.int32), topk_weights.float(), lora], hidden_states.shape[:-1]

    def _forward_all_gather(self, hidden_states, topk_weights, topk_ids, token_lora_ids):
        rows, leading = self._token_rows(hidden_states, topk_weights, topk_ids, token_lora_ids)
        group = self.ep_group if self.ep_group is not None else dist.group.WORLD
        M = rows[0].shape[0]
        if self.tokens_per_rank is not None:  # padded to the fixed count: ids -1, weights 0, no adapter
            if M > self.tokens_per_rank:
                raise ValueError(f"ParallelFusedMoE.forward: hidden_states expected at most tokens_per_rank = "
                                 f"{self.tokens_per_rank} tokens, got {M}")
            pad = self.tokens_per_rank - M
            rows = [None if t is None else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, pad), value=fill)
                    for t, fill in zip(rows, (0, -1, 0, -1))]

        def dispatch():  # each [ep * rows, ...] in rank order
            return [None if t is None else funcol.wait_tensor(funcol.all_gather_tensor(t.contiguous(), 0, group))
                    for t in rows]
        x_all, ids_all, weights_all, lora_all = self._timed("dispatch", dispatch)
        partial = self.local.forward_routed(x_all, weights_all, ids_all, lora_all)
        partial = self._timed("combine", lambda: self._all_reduce(partial, self.tp_group, self.tp_size))
        out = self._timed("combine", lambda: funcol.wait_tensor(
            funcol.reduce_scatter_tensor(partial, "sum", 0, group)))
        return out[:M].reshape(*leading, self.hidden_size)

    def _forward_all_to_all(self, hidden_states, topk_weights, topk_ids, token_lora_ids):
        rows, leading = self._token_rows(hidden_states, topk_weights, topk_ids, token_lora_ids)
        x, H = rows[0], self.hidden_size
        M = x.shape[0]
        ids = topk_ids.long()
        # The (token, rank) pairs to send: rank r gets token m when one of m's slots is on
        # one of r's experts; in rank order, token order within (a stable sort of the
        # [ep, M] need mask puts its set entries first). Slots routed to -1 need no rank
        # (column ep, never sent). Ids out of range are clamped for the lookup and refused
        # below, with the counts.
        owner = torch.where(ids >= 0, self.expert_owner[ids.clamp(0, self.num_experts - 1)], self.ep_size)
        need = torch.zeros(M, self.ep_size + 1, dtype=torch.bool, device=ids.device)
        need.scatter_(1, owner, True)
        need = need[:, :self.ep_size].t().reshape(-1)  # [ep * M]: entry r * M + m
        order = torch.argsort((~need).to(torch.int8), stable=True)
        send_counts = need.reshape(self.ep_size, M).sum(1)

        def exchange_counts():
            recv = torch.empty_like(send_counts)
            dist.all_to_all_single(recv, send_counts, group=self.ep_group)
            return recv
        recv_counts = self._timed("dispatch", exchange_counts)
        bounds = torch.stack([ids.min(), ids.max()]) if M else send_counts.new_tensor([0, 0])
        host = torch.cat([send_counts, recv_counts, bounds.to(send_counts.dtype)]).tolist()  # the one host sync
        send_splits, recv_splits = host[:self.ep_size], host[self.ep_size:2 * self.ep_size]
        if host[-2] < -1 or host[-1] >= self.num_experts:
            raise ValueError(f"ParallelFusedMoE.forward: topk_ids expected values in [-1, {self.num_experts}), got "
                             f"[{host[-2]}, {host[-1]}]")
        received = sum(recv_splits)
        pair_token = order[:sum(send_splits)] % max(M, 1)

        def all_to_all(values, splits_out, splits_in, rows):
            out = values.new_empty((rows,) + tuple(values.shape[1:]))
            dist.all_to_all_single(out, values.contiguous(), splits_out, splits_in, group=self.ep_group)
            return out

        def dispatch():
            return [None if t is None else all_to_all(t[pair_token], recv_splits, send_splits, received)
                    for t in rows]
        x_in, ids_in, weights_in, lora_in = self._timed("dispatch", dispatch)
        # The received tokens with all their top-k slots: the local layer's expert_map
        # drops those on other ranks, so each row comes back as this rank's partial sum.
        partial = self.local.forward_routed(x_in, weights_in, ids_in, lora_in)
        partial = self._timed("combine", lambda: self._all_reduce(partial, self.tp_group, self.tp_size))
        back = self._timed("combine", lambda: all_to_all(partial, send_splits, recv_splits, pair_token.numel()))
        out = torch.zeros(M, H, dtype=torch.float32, device=x.device)
        out.index_add_(0, pair_token, back.float())
        return out.to(hidden_states.dtype).reshape(*leading, H)
