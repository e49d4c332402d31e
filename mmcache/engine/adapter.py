"""The model-specific seam: where a model's embeddings, decoder and head live and what positions it takes.

The runner only talks to a ``ModelAdapter``: ``embed`` token ids, run ``forward`` on packed embeddings with
per-token positions and the step's ``PagedBatch``, get logits for the requested rows. ``CausalLMAdapter``
serves any transformers ``*ForCausalLM`` (and any ``*ForConditionalGeneration`` whose forward accepts
``inputs_embeds``: LLaVA routes them to its ``language_model``) whose attention goes through
``AttentionInterface``. ``MRopeAdapter`` is the same with 3-D rotary positions (Qwen2-VL style). What the
model computes with (packed linears, compiled kernels) is the compute path's business (``compute.ComputePath``).

Invariants:

* ``forward`` takes ``inputs_embeds`` of shape (T, hidden) and positions of shape (T,) or (3, T)
  (``position_dims``) and returns float logits of shape (len(logits_index), vocab) computed only at those rows.
* Model geometry (layers, KV heads, head size, vocabulary, context limit) comes from the text config, so a
  VLM's language model is described by the same fields.
* Every layer attends with the window its config gives it (``expected_windows``), and the paged backend
  applies a window only when the layer passes it as ``sliding_window``: a model that keeps a layer's window
  (or chunked attention) in transformers' mask alone, which the backend does not build, is refused.
* The context limit holds every position at rotary factors that do not depend on the forward's length: a
  ``longrope`` model (Phi-3 long-context) is served up to its ``original_max_position_embeddings``, because
  transformers picks short or long factors per forward from its longest position, so pages computed in one
  forward would not match the same tokens computed in another.
"""

from __future__ import annotations

import torch

from .attention import ATTENTION_BACKEND, BATCH_KWARG, PagedBatch, Segment, UnsupportedModel, WriteGroup, register

class CausalLMAdapter:
    position_dims = 1

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.config = model.config
        self.text_config = model.config.get_text_config()
        tc = self.text_config
        for attr in ("attn_logit_softcapping",):
            if getattr(tc, attr, None):
                raise UnsupportedModel(f"{type(model).__name__}: {attr} is not supported by {ATTENTION_BACKEND}")
        try:
            self.num_layers = int(tc.num_hidden_layers)
            self.num_heads = int(tc.num_attention_heads)
            self.num_kv_heads = int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads)
            self.head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
            self.hidden_size = int(tc.hidden_size)
            self.vocab_size = int(tc.vocab_size)
        except (AttributeError, TypeError, ValueError) as e:  # a state-space model (Mamba) has no attention heads
            raise UnsupportedModel(f"{type(model).__name__} is not an attention decoder the engine can serve: its "
                                   f"config lacks an attention shape ({e})") from None
        self.max_model_len = int(getattr(tc, "max_position_embeddings", 0) or 1 << 20)
        self.max_model_len_reason = "its max_position_embeddings"
        for factors_below in _longrope_limits(tc):
            if factors_below < self.max_model_len:
                self.max_model_len = factors_below
                self.max_model_len_reason = ("its longrope original_max_position_embeddings: transformers picks the "
                                             "rotary factors per forward beyond it")
        layer_types = getattr(tc, "layer_types", None) or ()
        if getattr(tc, "attention_chunk_size", None) or "chunked_attention" in layer_types:
            raise UnsupportedModel(f"{type(model).__name__}: chunked attention (attention_chunk_size) is not "
                                   f"implemented by {ATTENTION_BACKEND}")
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def decoder(self) -> torch.nn.Module:
        return self.model.get_decoder()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def attach(self) -> None:
        """Route the language model's attention through the paged backend, and check that it took: every
        decoder layer must attend through it, or the engine would compute without the layer's cache and return
        wrong logits without a word (``UnsupportedModel`` then)."""
        register()
        name = type(self.model).__name__
        try:
            self.model.set_attn_implementation(self._attention_plan())
        except (ValueError, TypeError, NotImplementedError) as e:  # transformers refusing the backend for this model
            raise UnsupportedModel(f"{name} cannot run its attention on {ATTENTION_BACKEND}: {e}") from e
        self.model.eval()
        if self.text_config._attn_implementation != ATTENTION_BACKEND:
            raise UnsupportedModel(f"{name} does not route its attention through transformers' AttentionInterface "
                                   f"(it kept {self.text_config._attn_implementation!r})")
        self._check_every_layer_attends()

    def _check_every_layer_attends(self) -> None:
        """Run one token through the model into a one-slot scratch pool and require every layer's key and value
        there: a layer that keeps recurrent or convolutional state (LFM2, Jamba, Qwen3-Next's linear attention),
        attends on its own, or does not pass the engine's keyword argument down writes nothing.

        The token is a seeded random embedding, not a token id: a model's pad row (``padding_idx``, often id 0)
        is zero, and a zero input gives zero keys and values in every layer without bias, which would refuse a
        model that attends correctly. Its own generator leaves the global random state alone."""
        kv = torch.zeros(self.num_layers, 2, self.num_kv_heads, 1, 1, self.head_dim, dtype=self.dtype,
                         device=self.device)
        write = WriteGroup(kv, slice(0, 1), torch.zeros(1, dtype=torch.int64, device=self.device))
        batch = PagedBatch([Segment(slice(0, 1), 0, 1, kv, None)], [], [write], page_size=1, windows={})
        positions = torch.zeros((self.position_dims, 1) if self.position_dims > 1 else (1,), dtype=torch.long,
                                device=self.device)
        token = torch.randn(1, self.hidden_size, generator=torch.Generator().manual_seed(0))
        name = type(self.model).__name__
        try:
            with torch.inference_mode():
                self.forward(token.to(self.device, self.dtype), positions,
                             torch.zeros(1, dtype=torch.long, device=self.device), batch)
        except UnsupportedModel as e:
            raise UnsupportedModel(f"{name}: {e}") from e
        except Exception as e:  # the model cannot run on the paged backend at all
            raise UnsupportedModel(f"{name}: a one-token forward through {ATTENTION_BACKEND} failed: "
                                   f"{type(e).__name__}: {e}") from e
        silent = [i for i in range(self.num_layers) if not bool(kv[i].ne(0).any())]
        expected = self.layer_windows
        unwindowed = [(i, expected[i], batch.windows.get(i)) for i in range(self.num_layers)
                      if i not in silent and batch.windows.get(i) != expected[i]]
        if unwindowed:
            shown = ", ".join(f"layer {i}: {want} in its config, {got} passed" for i, want, got in unwindowed[:4])
            raise UnsupportedModel(f"{name}: decoder layers do not pass their sliding window to the attention "
                                   f"function ({shown}); transformers applies such a window through its mask "
                                   f"alone, which {ATTENTION_BACKEND} does not build")
        if silent:
            raise UnsupportedModel(f"{name}: decoder layer(s) {silent} do not attend through {ATTENTION_BACKEND} "
                                   f"(recurrent, convolutional or linear-attention layers, or attention that ignores "
                                   f"the engine's keyword argument): the engine would compute them without their state")

    def _attention_plan(self) -> str | dict:
        """The paged backend for the text model; a VLM's other sub-models (its vision tower) keep their own
        attention, because they run outside the engine's forwards, where no ``PagedBatch`` is given."""
        cfg = self.config
        if self.text_config is cfg:
            return ATTENTION_BACKEND
        plan = {"": ATTENTION_BACKEND}
        for key in cfg.sub_configs:
            sub = getattr(cfg, key, None)
            if sub is not None:
                plan[key] = ATTENTION_BACKEND if sub is self.text_config else sub._attn_implementation
        return plan

    @property
    def layer_windows(self) -> list[int | None]:
        """The sliding window each decoder layer attends with by its config (``expected_windows``)."""
        return expected_windows(self.text_config, self.num_layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                batch: PagedBatch) -> torch.Tensor:
        position_ids = positions[None] if positions.dim() == 1 else positions[:, None, :]
        out = self.model(inputs_embeds=inputs_embeds[None], position_ids=position_ids, logits_to_keep=logits_index,
                         use_cache=False, **{BATCH_KWARG: batch})
        return out.logits[0]


class MRopeAdapter(CausalLMAdapter):
    """Models whose rotary positions are 3-D (temporal, height, width), e.g. Qwen2-VL's language model."""

    position_dims = 3


def expected_windows(tc, num_layers: int) -> list[int | None]:
    """The sliding window each decoder layer attends with by its config (None: full causal attention):
    ``sliding_window`` on the layers ``layer_types`` marks ``sliding_attention``; on every layer where the
    config has no ``layer_types`` and does not turn the window off (``use_sliding_window``)."""
    window = getattr(tc, "sliding_window", None) or None
    layer_types = getattr(tc, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window if getattr(tc, "use_sliding_window", True) else None] * num_layers


def _longrope_limits(tc) -> list[int]:
    """``original_max_position_embeddings`` of each ``longrope`` rotary parameter set of ``tc`` (one, or one
    per layer type), below which transformers always takes the short factors."""
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    sets = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    limits = []
    for params in sets:
        if (params.get("rope_type") or params.get("type")) == "longrope":
            original = params.get("original_max_position_embeddings") or getattr(
                tc, "original_max_position_embeddings", None)
            if not original:
                raise UnsupportedModel("a longrope rotary embedding without original_max_position_embeddings")
            limits.append(int(original))
    return limits


def adapter_for(model: torch.nn.Module) -> CausalLMAdapter:
    """The adapter for a loaded model: 3-D positions when its rotary config has an ``mrope_section``."""
    tc = model.config.get_text_config()
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("mrope_section"):
        return MRopeAdapter(model)
    return CausalLMAdapter(model)
