"""A LLaMA-style decoder whose attention is specdec's tree-attention op and whose K/V live in a KVCache.

Block (Touvron et al. 2023): x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x)), with rotary
position embeddings (Su et al. 2021; "llama3" and "linear" frequency scaling),
grouped-query attention (Ainslie et al. 2023) and a SwiGLU MLP (Shazeer 2020).
Parameter names are HuggingFace's, except that q/k/v and gate/up are fused into one
projection each (``qkv_proj``, ``gate_up_proj``: one GEMM each); ``hf_layout`` maps a
LLaMA/Mistral/Qwen2 checkpoint's tensors onto them and back.

One forward serves prefill, decode and tree verification (see attention_metadata):
every layer writes its K/V for the query rows through ``cache.write`` and attends
with ``tree_attention`` over ``cache.layer(l)`` with ``prefix_lens = cache.seq_lens``.
The forward never advances the cache -- the caller commits (``advance`` after
prefill/decode, ``compact`` after verification) -- and never reads a device value
back to the host.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels import tree_attention
from specdec.kernels._checks import check_tensor
from specdec.model import hf_layout
from specdec.model.attention_metadata import AttentionMetadata
from specdec.model.config import ModelConfig
from specdec.model.loader import load_tensors
from specdec.validation import as_device

INDEX_DTYPES = (torch.int32, torch.int64)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, then scale in the model dtype (as LLaMA does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos, sin ``[T, D]`` for int ``positions [T]``; angles in float32, the two halves repeated."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]``: pairs are (i, i + D/2), HuggingFace's layout of the q/k weights."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.num_heads, self.num_kv_heads = layer, config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(hidden, q_size + 2 * kv_size, bias=config.qkv_bias)  # rows: q, k, v
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias)

    def forward(self, x, cos, sin, metadata: AttentionMetadata, cache) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # strided views of one GEMM's output
        q = q.view(tokens, self.num_heads, self.head_dim)  # [Tq, Hq, D]
        k = k.view(tokens, self.num_kv_heads, self.head_dim)  # [Tq, Hkv, D]
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(self.layer, k, v, metadata.q_offsets)
        k_cache, v_cache = cache.layer(self.layer)
        out = tree_attention(
            q,
            k_cache,
            v_cache,
            metadata.q_offsets,
            cache.seq_lens,
            tree_mask=metadata.tree_mask,
            causal=metadata.causal,
            block_table=cache.block_tables,
        )
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=bias)  # rows: gate, up
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, metadata, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, metadata, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The ``model.`` part of a HuggingFace causal LM: embedding, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """LLaMA-family causal LM: ``forward(tokens, positions, metadata, cache) -> (logits, hidden)``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        # Tied checkpoints reuse the embedding; keeping no lm_head module keeps the tie through loading.
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.register_buffer("rope_inv_freq", config.rope_inv_freq(), persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        cache,
        logits_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the query rows of a batch through the model, writing their K/V into ``cache``.

        Parameters
        ----------
        tokens : ``[Tq]`` int32/int64 token ids, flattened over requests (``metadata.q_offsets``).
        positions : ``[Tq]`` int32/int64 RoPE positions: ``cache.seq_lens[b] + i`` for causal rows,
            ``cache.seq_lens[b] + depth`` for tree nodes (``causal_positions`` / ``tree_positions``).
        metadata : ``AttentionMetadata`` (``q_offsets [B+1]`` int32, ``tree_mask [Tq, W]`` int64 or None).
        cache : ``KVCache`` with B requests; row i of request b is written at ``seq_lens[b] + i``.
            Not advanced here. On a GPU call ``cache.reserve(rows per request)`` first: the sizes
            are host data to the caller, while the cache would otherwise read ``q_offsets`` back.
        logits_rows : optional ``[R]`` int64 row indices to compute logits for (e.g. each
            request's last prefill row); default all rows.

        Returns
        -------
        logits ``[R or Tq, vocab]`` and hidden ``[Tq, hidden_size]`` (after the final norm, the
        features LM heads and draft heads read), both in the model dtype.

        Example
        -------
        >>> from specdec.model import causal_positions
        >>> config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
        ...                      num_heads=2, num_kv_heads=1, head_dim=16)
        >>> model = LlamaModel(config).requires_grad_(False)                  # random weights
        >>> cache = model.new_cache(batch_size=1, max_len=8)
        >>> prompt = torch.tensor([1, 5, 9, 2, 7])
        >>> meta = AttentionMetadata(torch.tensor([0, 5], dtype=torch.int32))  # one 5-token prompt
        >>> cache.reserve([5])                                                # rows per request (host sizes)
        >>> positions = causal_positions(meta.q_offsets, cache.seq_lens, 5)
        >>> logits, hidden = model(prompt, positions, meta, cache, logits_rows=torch.tensor([4]))
        >>> cache.advance([5])                                                # commit the prompt's K/V
        >>> logits.shape, hidden.shape, cache.seq_lens.tolist()
        (torch.Size([1, 32]), torch.Size([5, 32]), [5])
        """
        device = self.device
        check_tensor("tokens", tokens, dtype=INDEX_DTYPES, ndim=1, device=device)
        num_tokens = tokens.shape[0]
        check_tensor("positions", positions, dtype=INDEX_DTYPES, shape=(num_tokens,), device=device)
        if not isinstance(metadata, AttentionMetadata):
            raise TypeError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
        check_tensor("metadata.q_offsets", metadata.q_offsets, device=device)
        if logits_rows is not None:
            check_tensor("logits_rows", logits_rows, dtype=INDEX_DTYPES, ndim=1, device=device)
        x = self.model.embed_tokens(tokens)  # [Tq, H]
        cos, sin = rope_cos_sin(positions, self.rope_inv_freq, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, metadata, cache)
        hidden = self.model.norm(x)
        rows = hidden if logits_rows is None else hidden.index_select(0, logits_rows)
        return F.linear(rows, self.lm_head_weight), hidden

    def new_cache(self, batch_size: int, max_len: int, **layout):
        """A ``KVCache`` shaped for this model (``layout``: layout=, block_size=, num_blocks=)."""
        from specdec.model.kv_cache import KVCache

        window = self.config.sliding_window
        if window is not None and max_len > window:
            raise ValueError(
                f"max_len {max_len} exceeds the model's sliding_window {window}; sliding-window "
                "attention is not implemented, so sequences must fit in the window"
            )
        c = self.config
        return KVCache(
            c.num_layers,
            batch_size,
            c.num_kv_heads,
            c.head_dim,
            max_len=max_len,
            dtype=self.dtype,
            device=self.device,
            **layout,
        )

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor name -> shape that this config needs (HuggingFace names: q/k/v, gate/up apart)."""
        return hf_layout.checkpoint_shapes({n: tuple(t.shape) for n, t in self.state_dict().items()}, self.config)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters under their checkpoint (HuggingFace) names; the fused ones split into views."""
        return hf_layout.split(self.state_dict(), self.config)

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor], *, assign: bool = False) -> None:
        """Load HuggingFace-named tensors (fusing q/k/v and gate/up); every parameter must be given."""
        self.load_state_dict(hf_layout.fuse(tensors), assign=assign, strict=True)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> LlamaModel:
        """Load a local HuggingFace checkpoint directory (config.json + safetensors), in eval mode.

        Example
        -------
        >>> from pathlib import Path
        >>> import specdec
        >>> path = Path(specdec.__file__).parent / "assets" / "pair" / "target"   # the demo's embedded target
        >>> model = LlamaModel.from_pretrained(path, dtype=torch.float32)
        >>> model.config.num_layers, model.dtype, model.training
        (9, torch.float32, False)
        """
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        device = as_device("device", device)
        config = ModelConfig.from_pretrained(path)
        with torch.device("meta"):  # shapes only: the checkpoint provides every value
            model = cls(config)
        ignore = ("lm_head.weight",) if config.tie_word_embeddings else ()
        tensors = load_tensors(path, model.expected_tensors(), dtype=dtype, device=device, ignore=ignore)
        model.load_hf_state_dict(tensors, assign=True)
        model.rope_inv_freq = config.rope_inv_freq(device)
        return model.requires_grad_(False).eval()
