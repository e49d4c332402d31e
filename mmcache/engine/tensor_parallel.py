"""Tensor parallelism of the language model: each rank keeps a slice of every decoder layer (Megatron's split).

``shard(model, rank, size)`` cuts a transformers decoder (Llama, Qwen2, Mistral and the language models of LLaVA
and Qwen2-VL: attention through ``q_proj``/``k_proj``/``v_proj``/``o_proj``, a gated MLP through
``gate_proj``/``up_proj``/``down_proj``) down to rank ``rank``'s slice, in place; ``install_reductions`` then adds
the all-reduce after each row-parallel product. Invariants:

* Rank r keeps query heads ``[r*H/n, (r+1)*H/n)`` and KV heads ``[r*K/n, (r+1)*K/n)`` (grouped-query attention keeps
  its groups: query head h reads KV head ``h // (H/K)`` on every rank), the matching rows of ``q_proj``, ``k_proj``,
  ``v_proj`` (column-parallel) and columns of ``o_proj`` (row-parallel); MLP columns ``[r*I/n, (r+1)*I/n)`` of
  ``gate_proj``/``up_proj`` and the matching columns of ``down_proj``. Embeddings, norms and the head stay whole.
* The text config then gives the rank's own head counts (and its explicit ``head_dim``), so the engine's pool on
  each rank holds its KV heads only and everything the engine derives from the config describes the slice.
* After each layer's attention and MLP the rank's partial output is summed over the group (one all-reduce each);
  a bias of a row-parallel product is kept on rank 0 only, so it is added once. All ranks then hold the same
  hidden states, and the same logits.
* A model whose head counts or MLP width the group size does not divide, or whose layers have other parts, is
  refused (``UnsupportedModel``) before anything is cut.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import UnsupportedModel

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def head_slice(num_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The query heads ``[start, stop)`` rank ``rank`` of ``size`` keeps."""
    per = num_heads // size
    return rank * per, (rank + 1) * per


def check_shardable(model: nn.Module, size: int) -> None:
    """Raise ``UnsupportedModel`` where ``shard`` cannot cut ``model`` over ``size`` ranks."""
    name = type(model).__name__
    check_splits(model.config.get_text_config(), size, name)
    for i, layer in enumerate(_layers(model)):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(isinstance(getattr(attn, p, None), nn.Linear) for p in _ATTENTION) \
                or not all(isinstance(getattr(mlp, p, None), nn.Linear) for p in _MLP):
            raise UnsupportedModel(f"{name}: decoder layer {i} is not an attention layer with q/k/v/o projections "
                                   f"and a gated MLP (gate/up/down), which tensor parallelism splits")


def check_splits(tc, size: int, name: str) -> None:
    """Raise ``UnsupportedModel`` where a text config's head counts or MLP width do not divide by ``size`` (what a
    launcher can check before it builds any rank's model)."""
    heads, kv = int(tc.num_attention_heads), int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads)
    for what, n in (("attention heads", heads), ("KV heads", kv), ("MLP width (intermediate_size)",
                                                                     int(getattr(tc, "intermediate_size", 0) or 0))):
        if n <= 0 or n % size:
            raise UnsupportedModel(f"{name}: its {n} {what} do not split over {size} tensor-parallel ranks")


def shard(model: nn.Module, rank: int, size: int) -> tuple[int, int]:
    """Cut ``model``'s decoder down to rank ``rank``'s slice of ``size`` (see the module docstring); returns the
    query heads it keeps. Call before an engine sets the model up."""
    check_shardable(model, size)
    tc = model.config.get_text_config()
    heads = int(tc.num_attention_heads)
    kv = int(getattr(tc, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
    width = int(tc.intermediate_size)
    q, k, w = slice(*_part(heads * head_dim, rank, size)), slice(*_part(kv * head_dim, rank, size)), \
        slice(*_part(width, rank, size))
    with torch.no_grad():
        for layer in _layers(model):
            a, m = layer.self_attn, layer.mlp
            _keep_rows(a.q_proj, q)
            _keep_rows(a.k_proj, k)
            _keep_rows(a.v_proj, k)
            _keep_columns(a.o_proj, q, rank)
            _keep_rows(m.gate_proj, w)
            _keep_rows(m.up_proj, w)
            _keep_columns(m.down_proj, w, rank)
            for attr, n in (("num_heads", heads), ("num_key_value_heads", kv)):
                if isinstance(getattr(a, attr, None), int):
                    setattr(a, attr, n // size)
    tc.head_dim = head_dim
    tc.num_attention_heads = heads // size
    tc.num_key_value_heads = kv // size
    tc.intermediate_size = width // size
    return head_slice(heads, rank, size)


def install_reductions(model: nn.Module, group=None) -> list:
    """Sum each layer's attention and MLP outputs over ``group`` (forward hooks on the layer's ``self_attn`` and
    ``mlp`` as they are now: install after the compute path replaced any of them). Returns the hook handles."""
    import torch.distributed as dist

    def reduce(_module, _args, output):
        out = output[0] if isinstance(output, tuple) else output
        dist.all_reduce(out, group=group)
        return output

    handles = []
    for layer in _layers(model):
        handles.append(layer.self_attn.register_forward_hook(reduce))
        handles.append(layer.mlp.register_forward_hook(reduce))
    return handles


def _layers(model: nn.Module) -> nn.ModuleList:
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:  # a VLM whose get_decoder gives the wrapper of its language model
        layers = getattr(getattr(decoder, "language_model", None), "layers", None)
    if layers is None:
        raise UnsupportedModel(f"{type(model).__name__}: no decoder layers found to split")
    return layers


def _part(n: int, rank: int, size: int) -> tuple[int, int]:
    per = n // size
    return rank * per, (rank + 1) * per


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: nn.Linear, columns: slice, rank: int) -> None:
    linear.weight = nn.Parameter(linear.weight[:, columns].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
