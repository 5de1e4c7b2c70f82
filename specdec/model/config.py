"""Model configuration read from a HuggingFace ``config.json`` of the LLaMA family.

Accepted: ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM``
checkpoints (same block: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP),
with the rope formats of transformers 4 (``rope_theta`` + ``rope_scaling``) and 5
(``rope_parameters``). Anything that would change the math and that the model
does not implement is refused with a ValueError naming the option, never
silently ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.validation import as_float, as_int

# architecture -> (q/k/v projections carry a bias, o_proj carries a bias); None: read ``attention_bias``.
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", None),
    "MistralForCausalLM": ("mistral", (False, False)),
    "Qwen2ForCausalLM": ("qwen2", (True, False)),
}
_MODEL_TYPES = {model_type: arch for arch, (model_type, _) in _ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is 'linear' (positions / factor) or 'llama3' (Llama 3.1 bands)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model needs; build it with ``from_hf`` / ``from_pretrained`` or by hand for tests."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projections have a bias (Qwen2; LLaMA with attention_bias)
    o_bias: bool = False  # o_proj has a bias (LLaMA with attention_bias)
    mlp_bias: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None  # Mistral: attention is exact only while a sequence fits the window
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"config head_dim must be a positive even int (RoPE rotates pairs), got {self.head_dim!r}")

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Translate a parsed HuggingFace ``config.json``; refuses what the model cannot run."""
        arch = _architecture(hf)
        model_type, fixed_bias = _ARCHITECTURES[arch]
        _refuse_unsupported(hf, model_type)
        hidden, heads = _int(hf, "hidden_size"), _int(hf, "num_attention_heads")
        head_dim = _int(hf, "head_dim", hidden // heads)
        if fixed_bias is None:
            attention_bias = _flag(hf, "attention_bias")
            qkv_bias, o_bias = attention_bias, attention_bias
        else:
            qkv_bias, o_bias = fixed_bias
        rope_theta, rope_scaling = _rope(hf)
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        sliding = _int(hf, "sliding_window", None) if model_type == "mistral" else None
        return cls(
            vocab_size=_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(hf, "intermediate_size"),
            num_layers=_int(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_int(hf, "num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=_float(hf, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=_flag(hf, "mlp_bias"),
            max_position_embeddings=_int(hf, "max_position_embeddings", 2048),
            sliding_window=sliding,
            bos_token_id=_int(hf, "bos_token_id", None, low=0),
            eos_token_ids=tuple(as_int(f"config.json eos_token_id[{i}]", e, low=0) for i, e in enumerate(eos)),
            architecture=arch,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a local checkpoint directory (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no config.json in {path}")
        try:
            hf = json.loads(file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file} is not valid JSON: {exc}") from exc
        if not isinstance(hf, dict):
            raise ValueError(f"{file} must hold a JSON object, got {type(hf).__name__}")
        return cls.from_hf(hf)

    def rope_inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """float32 ``[head_dim // 2]`` inverse frequencies, scaled as the config says.

        Computed in float32 the way transformers does, so positions map to the
        same angles bit for bit in the common cases.
        """
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        scaling = self.rope_scaling
        if scaling is None:
            return inv_freq
        if scaling.kind == "linear":
            return inv_freq / scaling.factor
        # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between the bands.
        old_len = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        slowed = torch.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * slowed / scaling.factor + smooth * slowed
        in_between = (wavelen >= old_len / scaling.high_freq_factor) & (wavelen <= old_len / scaling.low_freq_factor)
        return torch.where(in_between, blended, slowed)


_REQUIRED = object()


def _int(hf: dict, key: str, default=_REQUIRED, *, low: int = 1) -> int | None:
    """``hf[key]`` as an int >= ``low`` (errors name the key); ``default`` when absent or null."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"config.json lacks {key!r}")
        return default
    return as_int(f"config.json {key}", value, low=low)


def _float(hf: dict, key: str, default: float, name: str | None = None) -> float:
    """A positive finite float (an epsilon, a theta, a scaling factor); ``name`` for nested keys."""
    value = hf.get(key, default)
    return as_float(f"config.json {name or key}", value, low=0.0, low_open=True)


def _flag(hf: dict, key: str) -> bool:
    value = hf.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"config.json {key} must be true or false, got {value!r}")
    return value


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if archs:
        if len(archs) != 1 or archs[0] not in _ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs} in config.json; supported: {sorted(_ARCHITECTURES)}")
        return archs[0]
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} in config.json; supported: {sorted(_MODEL_TYPES)}")
    return _MODEL_TYPES[model_type]


def _refuse_unsupported(hf: dict, model_type: str) -> None:
    if hf.get("model_type") not in (None, model_type):
        raise ValueError(f"config.json model_type {hf['model_type']!r} does not match its architecture ({model_type})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: the SwiGLU MLP uses silu")
    if hf.get("quantization_config") is not None:
        raise ValueError("unsupported quantization_config: only unquantised checkpoints load")
    if hf.get("use_sliding_window"):
        raise ValueError("unsupported use_sliding_window=true (per-layer sliding-window attention)")
    partial = hf.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial}: RoPE rotates the whole head")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"unsupported layer_types {sorted(set(layer_types))}: every layer must be full_attention")


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4 wrote `rope_theta` + `rope_scaling`.
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json rope_parameters/rope_scaling must be an object, got {params!r}")
    theta = _float(params, "rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {kind!r}; supported: {list(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"rope scaling {kind!r} needs 'factor'")
    factor = _float(params, "factor", None, "rope scaling factor")
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"rope scaling 'llama3' needs {missing}")
    original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if original is None:
        raise ValueError("rope scaling 'llama3' needs 'original_max_position_embeddings'")
    return theta, RopeScaling(
        "llama3",
        factor,
        _float(params, "low_freq_factor", None, "rope scaling low_freq_factor"),
        _float(params, "high_freq_factor", None, "rope scaling high_freq_factor"),
        as_int("config.json rope scaling original_max_position_embeddings", original, low=1),
    )
