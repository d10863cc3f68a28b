"""Tensor-parallel layers and pipeline stages in torch over one rank's loaded shards.

The math is HF's eager float32 forward (the numpy executor in tests/executor is the model):
RMSNorm, default RoPE (`rotate_half`), causal attention with grouped KV heads, the gated SiLU
MLP, and the softmax-top-k routed experts of Qwen3-MoE and Mixtral. The parallel parts:

- a column-parallel projection yields the features its rows hold, with their global indices;
- a row-parallel projection multiplies the local features with the columns holding the same
  global indices, and its partial sums meet in an `all_reduce` over the TP group (skipped when
  the weight is held whole: a replicated layer computes the whole result on every rank);
- the vocabulary-parallel embedding looks up the ids inside the rank's placement offsets, zeroes
  the others, and sums over the TP group (each id must be held by exactly one rank);
- the vocabulary-parallel lm_head computes the rank's logit columns; an `all_gather` of the
  padded columns and of each rank's global vocabulary indices assembles the full logits, so
  uneven splits (131 over 2: 66 and 65 rows) and any order of ranges work;
- a q head attends with the KV head `q // (H / K)`, looked up among the rank's KV rows by global
  index: with KV replication (T > K) a rank's k/v rows are the one KV head of its q heads.

A missing index (a q head whose KV head is not local, an o_proj column the rank lacks) raises
`ShardingError`, so a wrong shard cannot pass silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"}
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


class ShardingError(ValueError):
    """The rank's shards do not hold what a layer needs, or the ranks do not partition a dim."""


@dataclass(frozen=True)
class TensorParallel:
    """The TP process group of this rank (None: T = 1, no collectives)."""

    group: Any
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the TP group, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's `x` (same shape on every rank), in TP-rank order."""
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts


class Local:
    """One rank's loaded tensors (float32 torch) and the global indices of their split axis."""

    def __init__(self, state: Any) -> None:
        self.tensors = {name: torch.from_numpy(np.asarray(array, dtype=np.float32))
                        for name, array in state.tensors.items()}
        self.selections = {name: state.layout[name].selection for name in state.tensors}

    def has(self, name: str) -> bool:
        """Whether the rank holds `name`."""
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        """The local tensor."""
        if name not in self.tensors:
            raise ShardingError(f"this rank lacks tensor {name}")
        return self.tensors[name]

    def split(self, name: str, axis: int) -> bool:
        """Whether `name` is split (on `axis`; any other split axis is refused)."""
        got, _ = self.selections[name]
        if got is not None and got != axis:
            raise ShardingError(f"{name} is split on axis {got}; this layer needs axis {axis}")
        return got is not None

    def indices(self, name: str, axis: int) -> torch.Tensor:
        """Global indices the local tensor covers along `axis`, in local order."""
        got, ranges = self.selections[name]
        if got is None or got != axis:
            return torch.arange(self.get(name).shape[axis])
        index = torch.cat([torch.arange(a, b) for a, b in ranges])
        if len(index) != self.get(name).shape[axis]:
            raise ShardingError(f"{name}: ranges {ranges} hold {len(index)} rows, the local "
                                f"tensor {self.get(name).shape[axis]}")
        return index


def positions(wanted: torch.Tensor, held: torch.Tensor, what: str) -> torch.Tensor:
    """Local positions of the global indices `wanted` among `held`; all must be held."""
    lookup = {int(g): i for i, g in enumerate(held.tolist())}
    missing = [int(g) for g in wanted.tolist() if int(g) not in lookup]
    if missing:
        raise ShardingError(f"{what}: global indices {missing[:8]} are not on this rank")
    return torch.tensor([lookup[int(g)] for g in wanted.tolist()], dtype=torch.long)


# --------------------------------------------------------------------------- layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm in float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(config: Mapping[str, Any], dim: int, seq: int) -> tuple[torch.Tensor, ...]:
    """Default RoPE `(cos, sin)` of shape [seq, dim]."""
    params = dict(config.get("rope_parameters") or {})
    if params.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope_type {params['rope_type']!r}")
    base = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF `rotate_half` RoPE on the last dim of [B, heads, S, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def column(local: Local, name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-parallel `x @ W.T`: the local output features and their global indices."""
    weight = f"{name}.weight"
    local.split(weight, 0)
    y = x @ local.get(weight).T
    if local.has(f"{name}.bias"):
        y = y + local.get(f"{name}.bias")
    return y, local.indices(weight, 0)


def row(local: Local, name: str, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Row-parallel `x @ W.T` of the local `features` (global indices): a partial sum."""
    weight = f"{name}.weight"
    local.split(weight, 1)
    columns = positions(features, local.indices(weight, 1), f"{weight} input columns")
    return x @ local.get(weight)[:, columns].T


def heads(index: torch.Tensor, head_dim: int, what: str) -> torch.Tensor:
    """The global head ids of features `index`, which must be whole heads in order."""
    if len(index) % head_dim:
        raise ShardingError(f"{what}: {len(index)} features are not whole heads of {head_dim}")
    grid = index.view(-1, head_dim)
    ids = grid[:, 0] // head_dim
    if not torch.equal(grid, ids[:, None] * head_dim + torch.arange(head_dim)):
        raise ShardingError(f"{what}: a head is split across ranks")
    return ids


def embed(config: Mapping[str, Any], local: Local, tp: TensorParallel,
          ids: torch.Tensor) -> torch.Tensor:
    """Vocabulary-parallel embedding: ids outside the rank's rows are masked, then summed."""
    weight = local.get(EMBED)
    if not local.split(EMBED, 0):
        return F.embedding(ids, weight)
    vocab = int(config["vocab_size"])
    lookup = torch.full((vocab,), -1, dtype=torch.long)
    lookup[local.indices(EMBED, 0)] = torch.arange(weight.shape[0])
    where = lookup[ids]
    held = where >= 0
    out = F.embedding(where.clamp(min=0), weight) * held[..., None]
    holders = tp.all_reduce(held.to(torch.int64))
    if not torch.all(holders == 1):
        raise ShardingError(f"{EMBED}: token ids held by {sorted(set(holders.view(-1).tolist()))} "
                            "ranks; each must be held by exactly one")
    return tp.all_reduce(out)


def attention(config: Mapping[str, Any], local: Local, tp: TensorParallel, prefix: str,
              x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The rank's q heads attend with their KV heads; o_proj partial sums are all-reduced."""
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    hd = int(config.get("head_dim") or int(config["hidden_size"]) // n_heads)
    eps = float(config.get("rms_norm_eps", 1e-6))
    batch, seq, _ = x.shape
    q, q_idx = column(local, f"{prefix}.q_proj", x)
    k, k_idx = column(local, f"{prefix}.k_proj", x)
    v, v_idx = column(local, f"{prefix}.v_proj", x)
    q_heads = heads(q_idx, hd, f"{prefix}.q_proj")
    k_heads = heads(k_idx, hd, f"{prefix}.k_proj")
    v_heads = heads(v_idx, hd, f"{prefix}.v_proj")

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, -1, hd).transpose(1, 2)

    q, k, v = split(q), split(k), split(v)
    v = v[:, positions(k_heads, v_heads, f"{prefix}.v_proj heads")]
    if local.has(f"{prefix}.q_norm.weight"):  # Qwen3: RMSNorm of every head before RoPE
        q = rms_norm(q, local.get(f"{prefix}.q_norm.weight"), eps)
        k = rms_norm(k, local.get(f"{prefix}.k_norm.weight"), eps)
    cos, sin = rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv = positions(q_heads // (n_heads // n_kv), k_heads, f"{prefix}: KV heads of the q heads")
    out = F.scaled_dot_product_attention(q, k[:, kv], v[:, kv], is_causal=True,
                                         scale=hd ** -0.5)
    merged = out.transpose(1, 2).reshape(batch, seq, -1)
    partial = row(local, f"{prefix}.o_proj", merged, q_idx)
    if local.split(f"{prefix}.o_proj.weight", 1):
        tp.all_reduce(partial)
    return partial


def gated_partial(local: Local, names: tuple[str, str, str], x: torch.Tensor) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))` over the rank's intermediate slice: a partial sum."""
    gate_name, up_name, down_name = names
    gate, gate_idx = column(local, gate_name, x)
    up, up_idx = column(local, up_name, x)
    up = up[..., positions(gate_idx, up_idx, f"{up_name} rows")]
    return row(local, down_name, F.silu(gate) * up, gate_idx)


def feed_forward(config: Mapping[str, Any], local: Local, tp: TensorParallel, layer: int,
                 x: torch.Tensor) -> torch.Tensor:
    """Dense gated MLP or routed experts; the partial sums meet in one all_reduce."""
    p = f"model.layers.{layer}."
    model_type = config["model_type"]
    if model_type == "mixtral":
        router = f"{p}block_sparse_moe.gate.weight"
        experts = [(f"{p}block_sparse_moe.experts.{e}.w1", f"{p}block_sparse_moe.experts.{e}.w3",
                    f"{p}block_sparse_moe.experts.{e}.w2")
                   for e in range(int(config["num_local_experts"]))]
        normalize = True
    elif model_type == "qwen3_moe" and layer not in (config.get("mlp_only_layers") or []) \
            and (layer + 1) % int(config.get("decoder_sparse_step", 1)) == 0:
        router = f"{p}mlp.gate.weight"
        count = int(config.get("num_experts") or config["num_local_experts"])
        experts = [tuple(f"{p}mlp.experts.{e}.{n}" for n in ("gate_proj", "up_proj", "down_proj"))
                   for e in range(count)]
        normalize = bool(config.get("norm_topk_prob", False))
    else:
        names = (f"{p}mlp.gate_proj", f"{p}mlp.up_proj", f"{p}mlp.down_proj")
        partial = gated_partial(local, names, x)
        return tp.all_reduce(partial) if local.split(f"{names[2]}.weight", 1) else partial
    shape = x.shape
    x2d = x.reshape(-1, shape[-1])
    probs = torch.softmax(x2d @ local.get(router).T, dim=-1, dtype=torch.float32)
    weight, index = torch.topk(probs, int(config["num_experts_per_tok"]), dim=-1)
    if normalize:
        weight = weight / weight.sum(-1, keepdim=True)
    out = torch.zeros_like(x2d)
    split = {local.split(f"{down}.weight", 1) for _, _, down in experts}
    if len(split) != 1:
        raise ShardingError(f"layer {layer}: some experts are split and some are whole")
    for e, names in enumerate(experts):
        tokens, slot = torch.nonzero(index == e, as_tuple=True)
        if len(tokens):
            out[tokens] += weight[tokens, slot, None] * gated_partial(local, names, x2d[tokens])
    if split.pop():
        tp.all_reduce(out)
    return out.view(shape)


def lm_head(config: Mapping[str, Any], local: Local, tp: TensorParallel,
            normed: torch.Tensor) -> torch.Tensor:
    """Vocabulary-parallel logits: local columns, then an all_gather of padded columns."""
    name = LM_HEAD if local.has(LM_HEAD) else EMBED  # tied embeddings serve as the lm_head
    weight = local.get(name)
    logits = normed @ weight.T
    if not local.split(name, 0):
        return logits
    vocab = int(config["vocab_size"])
    mine = local.indices(name, 0)
    width = int(max(t.item() for t in tp.all_gather(torch.tensor([len(mine)]))))
    padded = torch.zeros(*logits.shape[:-1], width)
    padded[..., :len(mine)] = logits
    index = torch.full((width,), -1, dtype=torch.long)
    index[:len(mine)] = mine
    full = torch.zeros(*logits.shape[:-1], vocab)
    count = torch.zeros(vocab, dtype=torch.long)
    for part, held in zip(tp.all_gather(padded), tp.all_gather(index), strict=True):
        keep = held >= 0
        full[..., held[keep]] = part[..., keep]
        count[held[keep]] += 1
    if not torch.all(count == 1):
        raise ShardingError(f"{name}: the TP ranks hold vocabulary rows "
                            f"{sorted(set(count.tolist()))} times; each must be held once")
    return full


# --------------------------------------------------------------------------- stages


@dataclass
class StageResult:
    """What one process computed: its layers, what it received and sent, and its logits."""

    layers: range
    received: torch.Tensor | None
    sent: torch.Tensor | None
    logits: torch.Tensor | None


TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "int32": torch.int32, "uint32": torch.uint32}


def decoder_layers(module: Any) -> range:
    """The decoder layers a rank module's pipeline stage runs."""
    spans = {g.group: g.unit_range for g in module.partition().groups}
    start, stop = spans.get("decoder", (0, 0))
    return range(start, stop)


def run_stage(config: Mapping[str, Any], module: Any, state: Any, tp: TensorParallel,
              previous: int | None, following: int | None,
              input_ids: torch.Tensor) -> StageResult:
    """Run this rank's pipeline stage: embed or receive, its decoder layers, then logits or send.

    `module` is the generated rank module whose rank `state` was loaded; `previous` and
    `following` are the global ranks of the neighbouring stages' peers (None at the ends).
    """
    if config["model_type"] not in SUPPORTED:
        raise NotImplementedError(f"model_type {config['model_type']!r}")
    local = Local(state)
    ownership = module.partition().ownership
    boundary = module.boundary()
    batch, seq = input_ids.shape
    received = None
    if ownership.owns_input:
        hidden = embed(config, local, tp, input_ids)
    else:
        if previous is None:
            raise ShardingError("a stage that does not embed needs a previous stage")
        wire = boundary.resolve(batch, seq)
        buffers = [torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.numpy_dtype.name])
                   for spec in wire.tensors]
        for buffer in buffers:
            dist.recv(buffer, src=previous)
        decoded = boundary.decode_tensors(buffers)  # checks count, dtypes and shapes
        received = decoded[boundary.schema.primary.role]
        hidden = received.to(torch.float32)
    eps = float(config.get("rms_norm_eps", 1e-6))
    hd = int(config.get("head_dim")
             or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    rope = rope_tables(config, hd, seq)
    layers = decoder_layers(module)
    for layer in layers:
        p = f"model.layers.{layer}."
        x = rms_norm(hidden, local.get(p + "input_layernorm.weight"), eps)
        hidden = hidden + attention(config, local, tp, p + "self_attn", x, rope)
        x = rms_norm(hidden, local.get(p + "post_attention_layernorm.weight"), eps)
        hidden = hidden + feed_forward(config, local, tp, layer, x)
    if ownership.owns_output:
        normed = rms_norm(hidden, local.get(FINAL_NORM), eps)
        return StageResult(layers, received, None, lm_head(config, local, tp, normed))
    if following is None:
        raise ShardingError("a stage without the output needs a following stage")
    wire_dtype = TORCH_DTYPES[module.ACTIVATION_DTYPE]
    values = boundary.encode(hidden.to(wire_dtype).contiguous())  # checks dtype and shape
    for value in values:
        dist.send(value.tensor.contiguous(), dst=following)
    return StageResult(layers, received, values[0].tensor, None)


def serve(package: Any, checkpoint: str, topology: Any, groups: Any, config: Mapping[str, Any],
          input_ids: torch.Tensor) -> tuple[Any, StageResult]:
    """Load this process's rank (from torchrun's RANK) and run its stage; returns both."""
    me = dist.get_rank()
    state = package.load(checkpoint)
    module = package.rank_module(topology.build_rank(me))
    tp = TensorParallel(groups.tensor_parallel, topology.tensor_parallel_size)
    result = run_stage(config, module, state, tp, topology.previous_stage_peer(me),
                       topology.next_stage_peer(me), input_ids)
    return state, result
