"""EAGLE draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty").

The head extrapolates the target's features instead of re-reading the text. Row t of a
forward pairs the target's last hidden state ``f_t`` (after the final norm: the second
output of ``LlamaModel.forward``) with the token that follows it, ``x_{t+1}``:

    x = fc([embed(x_{t+1}), f_t])              fc: 2*hidden -> hidden (bias per config "bias")
    x = DecoderLayer(x) ...                    layer 0 skips its input RMSNorm (fc's output goes straight in)
    predicted feature  f^_{t+1} = x            no final norm
    logits for x_{t+2} = lm_head(x)            the target's LM head, shared (not a copy)

Drafting further feeds ``(f^_{t+1}, x_{t+2})`` back in. The embedding is the head's own when
its checkpoint has one (the authors' checkpoints usually carry a copy of the target's) and
the target's otherwise. The head keeps its own KV cache (``new_cache``), written and
committed like the target's: ``forward`` never advances it.

A draft vocabulary (``set_draft_vocabulary``, FR-Spec's frequency-ranked drafting; SGLang's token map): the head
drafts over a subset of the target's ids, usually its most frequent tokens, and its logits come from those rows of
the LM head only, a fraction of its bytes per draft level. Draft ids map back to target ids before verification, so
greedy output stays the target's and sampling stays exact; a token outside the subset is never drafted.

Checkpoints load in the authors' layout (``config.json`` of a one-layer LLaMA plus an
optional ``"bias"`` flag for ``fc``, default true; tensors ``fc.weight``, ``fc.bias``,
``layers.0.*`` without ``input_layernorm``, optionally ``embed_tokens.weight``) from
safetensors only. The authors publish ``pytorch_model.bin`` (pickle), which is refused with
the command that converts it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.model.attention_metadata import AttentionMetadata
from specdec.model.block import RotaryRows, layer_params, run_layers
from specdec.model.config import ModelConfig
from specdec.model.cpu_linear import linear_for
from specdec.model.draft_forward_cpu import head_chain_greedy, head_forward, head_rows
from specdec.model.draft_head import DraftHead
from specdec.model.forward_plan import plan_forward
from specdec.model.head_loading import check_fits_target, head_checkpoint_files, read_config_json
from specdec.model.hf_layout import checkpoint_shapes, fuse
from specdec.model.kv_cache import KVCache
from specdec.model.llama import DecoderLayer, LlamaModel
from specdec.model.loader import SINGLE_FILE, load_tensors

EMBEDDING = "embed_tokens.weight"
PARALLEL_BLOCK_SIZE = "parallel_block_size"  # config.json: a ParallelEagleHead's positions per forward


class EagleHead(DraftHead):
    """EAGLE-1 draft head over a target ``LlamaModel`` (see the module docstring).

    Parameters
    ----------
    config : the head's ``ModelConfig`` (``num_layers`` decoder layers, usually 1); its
        ``hidden_size`` and ``vocab_size`` must equal the target's.
    target : the model whose features the head extrapolates; its LM head (and, without
        ``own_embedding``, its embedding) is used in place, never copied.
    fc_bias : whether ``fc`` has a bias (the authors' config key ``"bias"``, default true).
    own_embedding : give the head its own ``embed_tokens`` (as the authors' checkpoints do).

    The head's parameters take the dtype and device they are created with; ``from_pretrained``
    puts them on the target's.
    """

    def __init__(self, config: ModelConfig, target: LlamaModel, *, fc_bias: bool = True, own_embedding: bool = False):
        super().__init__()
        check_fits_target(config.hidden_size, config.vocab_size, target, "EAGLE head")
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.layers[0].input_layernorm = nn.Identity()  # the authors' layer 0 has no input norm
        self.register_buffer("rope_inv_freq", config.rope_inv_freq(), persistent=False)
        self._layer_params = layer_params(self.layers)  # the block runs them under a plan (``block.run_layers``)
        self._rotary = RotaryRows()
        # A plain attribute, not a submodule: the target's weights stay the target's (no copy, not in state_dict).
        object.__setattr__(self, "target", target)
        self.register_buffer("draft_ids", None, persistent=False)  # the draft vocabulary; None: the target's
        self._draft_rows = None  # (stamp, the LM head's rows of draft_ids)

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.target.model.embed_tokens.weight if self.embed_tokens is None else self.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The target's LM head, or its rows of the draft vocabulary (a copy, made again when the LM head changed)."""
        weight = self.target.lm_head_weight
        if self.draft_ids is None:
            return weight
        stamp = (None if weight.is_inference() else weight._version, weight.data_ptr(), self.draft_ids.data_ptr())
        if self._draft_rows is None or self._draft_rows[0] != stamp:
            with torch.inference_mode(False):  # an ordinary tensor, so it can keep a skinny-kernel pack
                self._draft_rows = (stamp, weight.index_select(0, self.draft_ids))
        return self._draft_rows[1]

    feature_layers = None  # the target's hidden output it reads: the final norm's (``Eagle3Head`` reads layers)

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size if self.draft_ids is None else self.draft_ids.numel()

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_ids is None else self.draft_ids[draft_ids]

    def set_draft_vocabulary(self, token_ids) -> EagleHead:
        """Draft over ``token_ids`` only (distinct target ids: a 1-D integer tensor or sequence), or over the whole
        vocabulary again with None; returns the head. Set it before building a strategy over the head (the
        strategy checks its ``top_k`` against the vocabulary). Raises ValueError naming ``token_ids``.

        Example
        -------
        >>> from specdec.testing import ASSETS                          # the embedded target and its head
        >>> target = LlamaModel.from_pretrained(ASSETS / "target")
        >>> head = EagleHead.from_pretrained(ASSETS.parent / "eagle", target).set_draft_vocabulary(range(1024))
        >>> head.draft_vocab_size, head.lm_head_weight.shape, head.target_ids(torch.tensor([0, 1023])).tolist()
        (1024, torch.Size([1024, 256]), [0, 1023])
        """
        self._draft_rows = None
        if token_ids is None:
            self.draft_ids = None
            return self
        try:
            ids = torch.as_tensor(token_ids if isinstance(token_ids, torch.Tensor) else list(token_ids))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"token_ids must be a 1-D sequence of integer target ids, got {token_ids!r:.60}") from exc
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence of integer target ids, got shape "
                             f"{tuple(ids.shape)} of {ids.dtype}")  # fmt: skip
        if ids.dtype == torch.bool:
            raise ValueError("token_ids must be integer target ids, got a bool mask")
        ids, vocab = ids.long().cpu().sort().values, self.config.vocab_size
        if ids[0] < 0 or ids[-1] >= vocab:
            raise ValueError(f"token_ids must be target ids in [0, {vocab}), got {ids[0]} .. {ids[-1]}")
        repeated = ids[1:][ids[1:] == ids[:-1]]
        if repeated.numel():
            raise ValueError(f"token_ids must be distinct, got {int(repeated[0])} more than once")
        self.draft_ids = ids.to(self.device)
        return self

    def features_from_target(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # the target's final-norm hidden states, read as they are

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        cache: KVCache,
        logits_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Extrapolate one feature per row, writing the rows' K/V into the head's ``cache``.

        Parameters
        ----------
        features : ``[Tq, hidden]`` in the head's dtype: the target's last hidden state of token t
            (after the final norm), or a feature this head predicted at an earlier level.
        tokens : ``[Tq]`` int32/int64: the token that follows each feature (``x_{t+1}``).
        positions : ``[Tq]`` int32/int64 RoPE positions of the rows (the authors place row t at t).
        metadata : ``AttentionMetadata`` of the rows (causal prefill/chain, or a tree mask).
        cache : the head's ``KVCache`` (``new_cache``); written at ``seq_lens[b] + i``, not advanced.
        logits_rows : optional ``[R]`` int64 rows to compute logits for; default all rows.

        Returns
        -------
        features ``[Tq, hidden]`` (the predicted ``f_{t+1}``, fed back when drafting deeper) and
        logits ``[R or Tq, vocab]`` for ``x_{t+2}``, both in the head's dtype.

        Example
        -------
        >>> from specdec.testing import ASSETS                          # the embedded target and its head
        >>> from specdec.model import causal_positions
        >>> target = LlamaModel.from_pretrained(ASSETS / "target")
        >>> head = EagleHead.from_pretrained(ASSETS.parent / "eagle", target)
        >>> prompt = torch.tensor([1, 15, 27, 4, 9, 33, 2])
        >>> whole = AttentionMetadata(torch.tensor([0, 7], dtype=torch.int32))
        >>> target_cache = target.new_cache(batch_size=1, max_len=16)
        >>> _, hidden = target(prompt, causal_positions(whole.q_offsets, target_cache.seq_lens, 7), whole, target_cache)
        >>> cache = head.new_cache(batch_size=1, max_len=16)
        >>> meta = AttentionMetadata(torch.tensor([0, 5], dtype=torch.int32))       # 5 rows of one request
        >>> feats, logits = head(hidden[:5], prompt[1:6], causal_positions(meta.q_offsets, cache.seq_lens, 5),
        ...                      meta, cache)
        >>> cache.advance([5])
        >>> feats.shape, logits.shape                                  # logits of x_{t+2} for t = 0..4
        (torch.Size([5, 256]), torch.Size([5, 4096]))
        """
        num_rows = self.check_forward(features, tokens, positions, metadata, logits_rows)
        fused = head_rows(self, metadata, cache, num_rows, logits_rows)  # C++ on the CPU where it can
        plan = None if fused else plan_forward(self, tokens, positions, metadata, cache)  # checks the rest, once
        x = self.layer_inputs(features, tokens)  # [Tq, H]
        if fused:
            return x, head_forward(self, fused, x, positions, metadata, cache, lm_head=self.lm_head_weight)
        x = run_layers(self._layer_params, x, plan, self.config, self.rope_inv_freq, first_norm=False)
        rows = x if logits_rows is None else x.index_select(0, logits_rows)
        return x, linear_for(rows)(rows, self.lm_head_weight)

    def layer_inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input rows, ``fc([embed(x_{t+1}), f_t])``."""
        return self.fc(torch.cat((F.embedding(tokens, self.embedding_weight), features), dim=-1))

    def chain_greedy(self, features, logits, slots, num_drafts: int, cache: KVCache) -> torch.Tensor:
        """A greedy chain of ``num_drafts`` drafts per request in one C++ call (``head_chain_greedy``, where
        ``head_chain_available``): from each root's predicted feature ``features [R, H]`` and logits ``[R, V]``."""
        return head_chain_greedy(self, cache, features, logits, slots, num_drafts, lm_head=self.lm_head_weight,
                                 fc=self.fc, draft_to_target=self.draft_ids)  # fmt: skip

    @classmethod
    def config_options(cls, hf: dict) -> dict:
        """Constructor options a subclass reads from ``config.json`` (none here)."""
        if PARALLEL_BLOCK_SIZE in hf:
            raise ValueError(f"config.json has '{PARALLEL_BLOCK_SIZE}': a parallel EAGLE head, which loads with "
                             f"ParallelEagleHead.from_pretrained")  # fmt: skip
        return {}

    @classmethod
    def from_pretrained(cls, path: str | Path, target: LlamaModel) -> EagleHead:
        """Load a head in the EAGLE authors' layout from a local directory, in eval mode.

        The head takes the target's dtype and device (it runs on the target's features and LM
        head). Raises ValueError when the head does not fit the target (``hidden_size`` or
        ``vocab_size``), when a tensor is missing, extra or misshapen, or when the directory
        holds only a pickle checkpoint (with the command that converts it).

        Example
        -------
        >>> from specdec.testing import ASSETS                          # the embedded target and its head
        >>> target = LlamaModel.from_pretrained(ASSETS / "target")
        >>> head = EagleHead.from_pretrained(ASSETS.parent / "eagle", target)
        >>> head.config.num_layers, head.lm_head_weight is target.lm_head_weight
        (1, True)
        """
        if not isinstance(target, LlamaModel):
            raise TypeError(f"target must be a LlamaModel, got {type(target).__name__}")
        path = Path(path)
        hf = read_config_json(path)
        config = ModelConfig.from_hf(hf)
        if "qkv_bias" in hf:  # the authors' key for heads of targets with q/k/v biases
            config = replace(config, qkv_bias=bool(hf["qkv_bias"]))
        fc_bias = hf.get("bias", True)
        if not isinstance(fc_bias, bool):
            raise ValueError(f"config.json 'bias' must be true or false, got {fc_bias!r}")
        check_fits_target(config.hidden_size, config.vocab_size, target, f"EAGLE head {path}")
        names = head_checkpoint_files(path, SINGLE_FILE, "pytorch_model.bin")  # name -> file
        with torch.device("meta"):  # shapes only: the checkpoint provides every value
            head = cls(config, target, fc_bias=fc_bias, own_embedding=EMBEDDING in names, **cls.config_options(hf))
        state = eagle_state_dict(path, head, dtype=target.dtype, device=target.device)
        head.load_state_dict(state, assign=True, strict=True)
        head.rope_inv_freq = config.rope_inv_freq(target.device)
        return head.requires_grad_(False).eval()


def eagle_state_dict(path: Path, head: EagleHead, *, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The head's state dict from a checkpoint in the authors' layout: the one place that knows their names.

    The module's names are the authors' (``fc.*``, ``layers.{i}.*``, ``embed_tokens.weight``) except
    for the fused projections of its decoder layer, which ``hf_layout`` converts to and from.
    """
    model_shapes = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    expected = checkpoint_shapes(model_shapes, head.config)
    return fuse(load_tensors(path, expected, dtype=dtype, device=device))
