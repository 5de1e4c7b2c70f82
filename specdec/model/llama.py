"""A LLaMA-style decoder whose attention is specdec's tree-attention op and whose K/V live in a KVCache.

Block (Touvron et al. 2023): x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x)), with rotary
position embeddings (Su et al. 2021; "llama3" and "linear" frequency scaling),
grouped-query attention (Ainslie et al. 2023) and a SwiGLU MLP (Shazeer 2020).
Parameter names are HuggingFace's, except that q/k/v and gate/up are fused into one
projection each (``qkv_proj``, ``gate_up_proj``: one GEMM each); ``hf_layout`` maps a
LLaMA/Mistral/Qwen2 checkpoint's tensors onto them and back.

One forward serves prefill, decode and tree verification (see attention_metadata). It
is planned once and run layer by layer (``forward_plan``): ``forward`` checks its inputs
and builds the plan, ``run`` calls the op bodies the plan chose -- per layer (add +)
RMSNorm, the fused QKV GEMM, RoPE, the K/V write into ``cache``, tree attention over the
cache, o_proj, add + RMSNorm, the fused gate/up GEMM, SwiGLU, down -- with no checks and
no per-layer dispatch. The modules below only hold the parameters. The forward never
advances the cache -- the caller commits (``advance`` after prefill/decode, ``compact``
after verification) -- and never reads a device value back to the host.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec._backend import select_backend
from specdec.kernels._checks import check_tensor
from specdec.model import hf_layout
from specdec.model.attention_metadata import AttentionMetadata
from specdec.model.block import RotaryRows, layer_params, run_layers
from specdec.model.config import ModelConfig
from specdec.model.cpu_linear import linear_for
from specdec.model.cuda_graphs import BUCKETS, CudaGraphs
from specdec.model.forward_plan import ForwardPlan, plan_forward
from specdec.model.loader import load_tensors
from specdec.validation import as_device


class RMSNorm(nn.Module):
    """The weight of an RMSNorm (``specdec.kernels.rms_norm`` computes it)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)  # rows: q, k, v
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=bias)  # rows: gate, up
        self.down_proj = nn.Linear(inner, hidden, bias=bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nn.Module):
    """The ``model.`` part of a HuggingFace causal LM: embedding, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


RECOMPILE_LIMIT = 64  # graphs one compiled forward may hold (see compile_run)


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
        self._layer_params = layer_params(self.model.layers)
        self._rotary = RotaryRows()
        self._compiled_run = None  # see compile_run
        self.cuda_graphs: CudaGraphs | None = None  # see use_cuda_graphs
        self.feature_layers: tuple[int, ...] | None = None  # see output_layer_features

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def linear_weights(self) -> list[torch.Tensor]:
        """Every linear layer's weight, layer by layer (qkv, o, gate/up, down), then the LM head's."""
        weights = [getattr(p, name)["weight"] for p in self._layer_params for name in ("qkv", "o", "gate_up", "down")]
        return [*weights, self.lm_head_weight]

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
        metadata : ``AttentionMetadata`` (``q_offsets [B+1]`` int32, ``tree_mask [Tq, W]`` int64 or None,
            ``tree_start [B]`` int32 or None).
        cache : ``KVCache`` with B requests; row i of request b is written at ``seq_lens[b] + i``.
            Not advanced here. Call ``cache.reserve(rows per request)`` first: the sizes are host
            data to the caller, while the cache would otherwise read ``q_offsets`` back (a sync on
            a GPU); the reservation also gives the attention plan its host bounds.
        logits_rows : optional ``[R]`` int64 row indices to compute logits for (e.g. each
            request's last prefill row); default all rows.

        Returns
        -------
        logits ``[R or Tq, vocab]`` and hidden ``[Tq, hidden_size]`` (after the final norm, the
        features LM heads and draft heads read; the chosen layers' streams after
        ``output_layer_features``), both in the model dtype.

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
        if logits_rows is not None:
            check_tensor("logits_rows", logits_rows, dtype=(torch.int32, torch.int64), ndim=1, device=self.device)
        if self.cuda_graphs is not None:
            replayed = self.cuda_graphs.forward(tokens, positions, metadata, cache, logits_rows)
            if replayed is not None:
                return replayed
        plan = plan_forward(self, tokens, positions, metadata, cache)
        return (self._compiled_run or self.run)(tokens, plan, logits_rows)

    def output_layer_features(self, layers) -> None:
        """Make ``forward``'s second output the residual streams entering ``layers`` (EAGLE-3 reads the target's low,
        middle and high layers), concatenated: ``[Tq, len(layers) * hidden_size]`` in place of the final-norm
        hidden state; None restores that. Copied out inside the layer loop (no extra pass, no host sync); the
        logits stay the model's. CUDA graphs captured so far are dropped (they return the old output)."""
        if layers is not None:
            layers = tuple(layers)
            depth = self.config.num_layers
            if not layers or any(isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < depth for l in layers):
                raise ValueError(f"layers must be layer indices in [0, {depth}) (None: the final norm), got {layers}")
        if layers != self.feature_layers and self.cuda_graphs is not None:
            self.cuda_graphs = CudaGraphs(self, self.cuda_graphs.buckets)
        self.feature_layers = layers

    def use_cuda_graphs(self, buckets: tuple[int, ...] = BUCKETS) -> None:
        """Replay later CUDA forwards of up to ``max(buckets)`` rows from CUDA graphs (``cuda_graphs``):
        one replay per forward, captured on first use per (cache, row bucket, mask width, logits rows)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {self.device}")
        if select_backend(self.rope_inv_freq) != "triton":
            raise ValueError("CUDA graphs need the Triton path (its K/V write drops the padding rows), not in use")
        self.cuda_graphs = CudaGraphs(self, buckets)

    def compile_run(self, **options) -> None:
        """Run every later forward's planned part (``run``) through ``torch.compile(fullgraph=True, dynamic=True)``.

        The plan stays eager (host bookkeeping); the layers, the K/V writes and the logits form one graph.
        Shapes are dynamic so prefill, decode, tree verification and caches of any size share a handful
        of graphs (the first forwards of each kind pay the compilation). ``options`` go to
        ``torch.compile`` (e.g. ``backend="aot_eager"``, ``mode=...``).
        """
        compiled = torch.compile(self.run, fullgraph=True, dynamic=True, **options)

        def run(tokens, plan, logits_rows=None):
            # a decoder's forwards come in a dozen kinds (prefill, decode, chain, tree, draft levels, sizes 1
            # or more): let them all have their graph rather than fail at Dynamo's default of 8
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return compiled(tokens, plan, logits_rows)

        self._compiled_run = run

    def rotary_rows(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` of ``positions`` (all below the host bound ``max_position``, e.g. the KV
        cache's capacity), gathered from a table this model keeps (``block.RotaryRows``)."""
        return self._rotary(positions, max_position, self.rope_inv_freq, self.model.embed_tokens.weight.dtype)

    def plan(self, tokens, positions, metadata: AttentionMetadata, cache) -> ForwardPlan:
        """Check a forward's inputs and build its plan (``forward_plan.plan_forward``); ``run`` executes it."""
        return plan_forward(self, tokens, positions, metadata, cache)

    def run(
        self, tokens: torch.Tensor, plan: ForwardPlan, logits_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The planned forward: ``forward``'s results for the inputs ``plan`` was built from. No checks."""
        residual = F.embedding(tokens, self.model.embed_tokens.weight)  # [T, hidden]: the residual stream
        taps = self.feature_layers or ()
        tapped = residual.new_empty(residual.shape[0], len(taps) * residual.shape[1]) if taps else None
        hidden = run_layers(
            self._layer_params, residual, plan, self.config, self.rope_inv_freq, final_norm=self.model.norm._parameters,
            taps=taps, tapped=tapped,
        )  # fmt: skip
        rows = hidden if logits_rows is None else hidden.index_select(0, logits_rows)
        return linear_for(rows)(rows, self.lm_head_weight), hidden if tapped is None else tapped

    def new_cache(self, batch_size: int, max_len: int, **layout):
        """A ``KVCache`` shaped for this model (``layout``: layout=, block_size=, num_blocks=)."""
        window = self.config.sliding_window
        if window is not None and max_len > window:
            raise ValueError(
                f"max_len {max_len} exceeds the model's sliding_window {window}; sliding-window "
                "attention is not implemented, so sequences must fit in the window"
            )
        return config_cache(self.config, batch_size, max_len, self.dtype, self.device, **layout)

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


def config_cache(config: ModelConfig, batch_size: int, max_len: int, dtype, device, **layout):
    """A ``KVCache`` for a model of ``config`` (its layers, KV heads and head dim), the target's or a draft head's."""
    from specdec.model.kv_cache import KVCache

    c = config
    return KVCache(c.num_layers, batch_size, c.num_kv_heads, c.head_dim, max_len=max_len, dtype=dtype, device=device,
                   **layout)  # fmt: skip
