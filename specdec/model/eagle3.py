"""EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test").

EAGLE-3 reads three of the target's layers instead of its last hidden state, and predicts tokens over a
reduced vocabulary. Row t of a forward pairs the target's features of token t with the token after it:

    g_t = fc([h_a, h_b, h_c])                     the residual streams entering target layers a, b, c
                                                  (``feature_layers``), 3 * target_hidden -> hidden, no bias
    r   = g_t                                     (``norm_before_residual``: hidden_norm(g_t))
    x   = [input_layernorm(embed(x_{t+1})), hidden_norm(g_t)]          [T, 2 * hidden]: q/k/v read both
    r  += o_proj(attention(x));  r += mlp(post_attention_layernorm(r))  the midlayer; K/V in the head's cache
    predicted feature = r                         (pre-norm) fed back in place of g when drafting deeper
    logits for x_{t+2} = lm_head(norm(r))         over ``draft_vocab_size`` draft ids

A draft id i is the target id ``i + d2t[i]``; ``t2d [vocab]`` marks the target ids that have one. The
head's own embedding is over the target's vocabulary (the authors' checkpoints may carry it; without it the
target's is shared). ``fc`` is applied where the target's features enter (``features_from_target``), so the
forward has ``EagleHead.forward``'s shape and ``EagleStrategy`` drives both heads.

Checkpoints load in the authors' layout, as vLLM and SGLang read it: ``config.json`` of a one-layer LLaMA
(architecture ``LlamaForCausalLMEagle3``) with ``draft_vocab_size``, optionally ``target_hidden_size`` and the
feature layers (``eagle_aux_hidden_state_layer_ids``, at the top or in ``eagle_config``; default: the
authors' low/middle/high choice ``default_feature_layers``); tensors ``fc.weight``, ``midlayer.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` and optionally ``embed_tokens.weight``, from safetensors
only (a ``pytorch_model.bin`` is refused with the command that converts it).
"""

from __future__ import annotations

from collections.abc import Sequence
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
from specdec.model.forward_plan import LAYER_OPS, plan_forward
from specdec.model.head_loading import check_fits_target, head_checkpoint_files, read_config_json
from specdec.model.hf_layout import checkpoint_shapes, fuse
from specdec.model.kv_cache import KVCache
from specdec.model.llama import DecoderLayer, LlamaModel, RMSNorm
from specdec.model.loader import SINGLE_FILE, load_tensors

ARCHITECTURES = ("LlamaForCausalLMEagle3", "LlamaForCausalLM")
EMBEDDING = "embed_tokens.weight"
VOCABULARY_MAP = ("d2t", "t2d")


def is_eagle3_checkpoint(path: str | Path) -> bool:
    """Whether the head checkpoint at ``path`` is an EAGLE-3 head (its config names the EAGLE-3 architecture or a
    draft vocabulary): how ``--eagle DIR`` tells EAGLE-3 from EAGLE-1/2 heads."""
    hf = read_config_json(Path(path))
    return hf.get("architectures") == ["LlamaForCausalLMEagle3"] or "draft_vocab_size" in hf


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The authors' feature layers of a target of ``num_layers`` layers: the streams entering layers 2, L // 2
    and L - 3 (low, middle, high)."""
    return 2, num_layers // 2, num_layers - 3


def vocabulary_map(target_ids, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t [n]`` int64 and ``t2d [vocab_size]`` bool of a draft vocabulary made of the distinct ``target_ids``
    (draft ids follow their ascending order, as the authors number them)."""
    ids = torch.as_tensor(target_ids, dtype=torch.int64).unique(sorted=True)
    if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"target_ids must be a non-empty set of ids in [0, {vocab_size})")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


class Eagle3Head(DraftHead):
    """EAGLE-3 draft head over a target ``LlamaModel`` (see the module docstring).

    Parameters
    ----------
    config : the head's ``ModelConfig`` (one decoder layer; ``vocab_size`` the target's).
    target : the model whose layers the head reads (its embedding is shared unless ``own_embedding``).
    draft_vocab_size : tokens the LM head scores (1 .. ``config.vocab_size``).
    target_hidden_size : the target's hidden size (default ``config.hidden_size``); ``fc`` reads three times it.
    feature_layers : the three target layers whose incoming residual streams ``fc`` reads (default:
        ``default_feature_layers`` of the target's depth).
    own_embedding : give the head its own ``embed_tokens``.
    norm_before_residual : the midlayer's residual starts from ``hidden_norm(g)`` instead of ``g``.

    The vocabulary map starts as the first ``draft_vocab_size`` target ids; ``set_vocabulary_map`` replaces it.
    """

    def __init__(
        self,
        config: ModelConfig,
        target: LlamaModel,
        *,
        draft_vocab_size: int,
        target_hidden_size: int | None = None,
        feature_layers: Sequence[int] | None = None,
        own_embedding: bool = False,
        norm_before_residual: bool = False,
    ):
        super().__init__()
        target_hidden = config.hidden_size if target_hidden_size is None else target_hidden_size
        check_fits(target_hidden, config.vocab_size, target, "EAGLE-3 head")
        if config.num_layers != 1:
            raise ValueError(f"an EAGLE-3 head has one decoder layer, its config has {config.num_layers}")
        if not own_embedding and config.hidden_size != target_hidden:
            raise ValueError(
                f"an EAGLE-3 head of hidden_size {config.hidden_size} for a target of {target_hidden} needs its own "
                "embed_tokens (the target's embedding is the wrong width)"
            )
        vocab = config.vocab_size
        if isinstance(draft_vocab_size, bool) or not isinstance(draft_vocab_size, int):
            raise TypeError(f"draft_vocab_size must be an int, got {draft_vocab_size!r}")
        if not 1 <= draft_vocab_size <= vocab:
            raise ValueError(
                f"draft_vocab_size must be in [1, {vocab}] (the target's vocabulary), got {draft_vocab_size}"
            )
        layers = default_feature_layers(target.config.num_layers) if feature_layers is None else tuple(feature_layers)
        depth = target.config.num_layers
        if len(layers) != 3 or any(isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < depth for l in layers):
            raise ValueError(
                f"feature_layers must be 3 layer indices of the target, in [0, {depth}), got {layers}"
                + (" (the default for its depth; name them in config.json eagle_aux_hidden_state_layer_ids)"
                   if feature_layers is None else "")
            )  # fmt: skip
        self.config, self.draft_vocab_size, self.target_hidden_size = config, draft_vocab_size, target_hidden
        self.feature_layers, self.norm_before_residual = layers, norm_before_residual
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(vocab, hidden) if own_embedding else None
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = DecoderLayer(config)
        q_kv = self.midlayer.self_attn.qkv_proj.out_features
        self.midlayer.self_attn.qkv_proj = nn.Linear(2 * hidden, q_kv, bias=config.qkv_bias)  # [embed, feature]
        self.midlayer.hidden_norm = RMSNorm(hidden, eps)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(vocab) < draft_vocab_size)
        self.register_buffer("draft_to_target", torch.arange(draft_vocab_size), persistent=False)
        self.register_buffer("rope_inv_freq", config.rope_inv_freq(), persistent=False)
        self._layer_params = layer_params([self.midlayer])  # the block runs it under a plan (``block.run_layers``)
        self._rotary = RotaryRows()
        object.__setattr__(self, "target", target)  # not a submodule: the target's weights stay the target's

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.target.model.embed_tokens.weight if self.embed_tokens is None else self.embed_tokens.weight

    def set_vocabulary_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Use ``d2t [draft_vocab_size]`` (draft id i -> target id ``i + d2t[i]``) and ``t2d [vocab]`` (bool: the
        target ids with a draft id); refused unless d2t maps the draft ids one to one onto the ids t2d marks."""
        check_vocabulary_map(d2t, t2d, self.draft_vocab_size, self.config.vocab_size)
        self.d2t = d2t.to(device=self.device, dtype=torch.int64)
        self.t2d = t2d.to(device=self.device, dtype=torch.bool)
        self.draft_to_target = torch.arange(self.draft_vocab_size, device=self.device) + self.d2t

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """The target ids of ``draft_ids`` (any shape, int64), gathered on the device."""
        return self.draft_to_target[draft_ids]

    def features_from_target(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input features ``[N, hidden]`` from the target's hidden output ``[N, 3 * target_hidden]``
        (its feature layers' streams, ``LlamaModel.output_layer_features``): ``fc``."""
        width = 3 * self.target_hidden_size
        if hidden.ndim != 2 or hidden.shape[1] != width:
            raise ValueError(
                f"the target's hidden states have shape {tuple(hidden.shape)}; this EAGLE-3 head reads its layers "
                f"{self.feature_layers} concatenated ({width} wide): call "
                "target.output_layer_features(head.feature_layers) first (the engine does before its steps)"
            )
        return linear_for(hidden)(hidden, self.fc.weight)

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        cache: KVCache,
        logits_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Predict one feature and the draft logits per row, writing the rows' K/V into the head's ``cache``.

        Parameters
        ----------
        features : ``[Tq, hidden]`` in the head's dtype: ``features_from_target`` of token t's target features,
            or a feature this head predicted at an earlier level.
        tokens : ``[Tq]`` int32/int64 target ids: the token that follows each feature (``x_{t+1}``).
        positions, metadata, cache, logits_rows : as ``EagleHead.forward``.

        Returns
        -------
        features ``[Tq, hidden]`` (the pre-norm prediction, fed back when drafting deeper) and logits
        ``[R or Tq, draft_vocab_size]`` over draft ids (``target_ids`` maps them), both in the head's dtype.
        """
        num_rows = self.check_forward(features, tokens, positions, metadata, logits_rows)
        fused = head_rows(self, metadata, cache, num_rows, logits_rows)  # C++ on the CPU where it can
        plan = None if fused else plan_forward(self, tokens, positions, metadata, cache)  # checks the rest, once
        layer = self.midlayer
        backend, eps = "torch" if fused else plan.backend, self.config.rms_norm_eps
        ops = LAYER_OPS[backend, torch.compiler.is_compiling()]
        normed = features.new_empty(2, num_rows, self.config.hidden_size)  # [embedding, feature], each normalised
        ops.rms_norm(F.embedding(tokens, self.embedding_weight), layer.input_layernorm.weight, eps, normed[0])
        ops.rms_norm(features.contiguous(), layer.hidden_norm.weight, eps, normed[1])
        residual = (normed[1] if self.norm_before_residual else features).clone()  # run_layers adds to it in place
        first_input = torch.cat((normed[0], normed[1]), dim=-1)  # [T, 2 * hidden]: what q/k/v read
        if fused:
            logits = head_forward(self, fused, residual, positions, metadata, cache, lm_head=self.lm_head.weight,
                                  first_input=first_input, final_norm=self.norm.weight)  # fmt: skip
            return residual, logits
        x = run_layers(self._layer_params, residual, plan, self.config, self.rope_inv_freq, first_input=first_input,
                       final_norm=self.norm._parameters)  # fmt: skip
        rows = x if logits_rows is None else x.index_select(0, logits_rows)
        return residual, linear_for(rows)(rows, self.lm_head.weight)

    def chain_greedy(self, features, logits, slots, num_drafts: int, cache: KVCache) -> torch.Tensor:
        """A greedy chain of ``num_drafts`` drafts per request (target ids) in one C++ call (``head_chain_greedy``,
        where ``head_chain_available``): from each root's predicted feature ``features [R, H]`` and draft logits."""
        layer = self.midlayer
        norms = (layer.input_layernorm.weight, layer.hidden_norm.weight, self.norm_before_residual)
        return head_chain_greedy(
            self, cache, features, logits, slots, num_drafts, lm_head=self.lm_head.weight, norms=norms,
            final_norm=self.norm.weight, draft_to_target=self.draft_to_target,
        )  # fmt: skip

    @classmethod
    def from_pretrained(cls, path: str | Path, target: LlamaModel) -> Eagle3Head:
        """Load a head in the EAGLE-3 authors' layout from a local directory, in eval mode, on the target's dtype
        and device.

        Raises ValueError when the head does not fit the target (``target_hidden_size``, ``vocab_size``, feature
        layers beyond its depth), when a tensor is missing, extra or misshapen, when ``d2t`` / ``t2d`` are not a
        one-to-one map into the target's vocabulary, or when the directory holds only a pickle checkpoint (with
        the command that converts it).
        """
        if not isinstance(target, LlamaModel):
            raise TypeError(f"target must be a LlamaModel, got {type(target).__name__}")
        path = Path(path)
        hf = read_config_json(path)
        archs = hf.get("architectures") or ["LlamaForCausalLMEagle3"]
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ValueError(f"{path}: config.json architectures {archs} are not an EAGLE-3 head's {ARCHITECTURES}")
        config = ModelConfig.from_hf({**hf, "architectures": ["LlamaForCausalLM"]})
        if "qkv_bias" in hf:
            config = replace(config, qkv_bias=bool(hf["qkv_bias"]))
        options = _head_options(hf, config, target, path)
        names = head_checkpoint_files(path, SINGLE_FILE, "pytorch_model.bin")  # name -> file
        with torch.device("meta"):  # shapes only: the checkpoint provides every value
            head = cls(config, target, own_embedding=EMBEDDING in names, **options)
        shapes = {name: tuple(t.shape) for name, t in head.state_dict().items() if name not in VOCABULARY_MAP}
        state = fuse(load_tensors(path, checkpoint_shapes(shapes, config), dtype=target.dtype, device=target.device,
                                  ignore=VOCABULARY_MAP))  # fmt: skip
        sizes = {"d2t": (head.draft_vocab_size, torch.int64), "t2d": (config.vocab_size, torch.bool)}
        d2t, t2d = (
            load_tensors(path, {name: (size,)}, dtype=dtype, device="cpu", ignore=set(names) - {name})[name]
            for name, (size, dtype) in sizes.items()
        )
        check_vocabulary_map(d2t, t2d, head.draft_vocab_size, config.vocab_size, f"{path}: ")
        state.update(d2t=d2t.to(target.device), t2d=t2d.to(target.device))
        head.load_state_dict(state, assign=True, strict=True)
        head.draft_to_target = torch.arange(head.draft_vocab_size, device=target.device) + head.d2t
        head.rope_inv_freq = config.rope_inv_freq(target.device)
        return head.requires_grad_(False).eval()


def check_fits(target_hidden_size: int, vocab_size: int, target: LlamaModel, what: str) -> None:
    """Refuse a head built for another target: its ``target_hidden_size`` or ``vocab_size`` differs, named."""
    if target_hidden_size != target.config.hidden_size:
        raise ValueError(
            f"{what} does not fit the target: its target_hidden_size is {target_hidden_size}, the target's "
            f"hidden_size is {target.config.hidden_size}"
        )
    check_fits_target(target.config.hidden_size, vocab_size, target, what)


def check_vocabulary_map(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab: int, vocab: int, where: str = "") -> None:
    """Refuse a ``d2t`` / ``t2d`` pair that is not a one-to-one map of ``draft_vocab`` draft ids onto the target
    ids ``t2d`` marks (reads the values: a load-time check)."""
    if not isinstance(d2t, torch.Tensor) or d2t.shape != (draft_vocab,) or d2t.dtype.is_floating_point:
        raise ValueError(f"{where}d2t must be an integer tensor of shape ({draft_vocab},)")
    if not isinstance(t2d, torch.Tensor) or t2d.shape != (vocab,) or t2d.dtype != torch.bool:
        raise ValueError(f"{where}t2d must be a bool tensor of shape ({vocab},)")
    ids = torch.arange(draft_vocab) + d2t.cpu().long()
    outside = ((ids < 0) | (ids >= vocab)).nonzero()
    if outside.numel():
        i = int(outside[0])
        raise ValueError(f"{where}d2t maps draft id {i} to target id {int(ids[i])}, outside the vocabulary of {vocab}")
    if ids.unique().numel() != draft_vocab:
        raise ValueError(f"{where}d2t maps two draft ids to the same target id")
    marked = t2d.cpu()
    if int(marked.sum()) != draft_vocab or not bool(marked[ids].all()):
        raise ValueError(f"{where}t2d marks {int(marked.sum())} target ids, not the {draft_vocab} that d2t maps onto")


def _head_options(hf: dict, config: ModelConfig, target: LlamaModel, path: Path) -> dict:
    """The ``Eagle3Head`` arguments that config.json gives beyond the ``ModelConfig``."""
    eagle = hf.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ValueError(f"config.json eagle_config must be an object, got {eagle!r}")
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise ValueError("config.json eagle_config.use_aux_hidden_state must be true (the head reads 3 target layers)")
    layers = hf.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
    if layers is not None and not isinstance(layers, list):
        raise ValueError(f"config.json eagle_aux_hidden_state_layer_ids must be a list, got {layers!r}")
    flag = hf.get("norm_before_residual", False)
    if not isinstance(flag, bool):
        raise ValueError(f"config.json norm_before_residual must be true or false, got {flag!r}")
    draft_vocab = hf.get("draft_vocab_size", config.vocab_size)
    target_hidden = hf.get("target_hidden_size", config.hidden_size)
    for key, value in (("draft_vocab_size", draft_vocab), ("target_hidden_size", target_hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json {key} must be a positive int, got {value!r}")
    check_fits(target_hidden, config.vocab_size, target, f"EAGLE-3 head {path}")
    return dict(draft_vocab_size=draft_vocab, target_hidden_size=target_hidden, feature_layers=layers,
                norm_before_residual=flag)  # fmt: skip
