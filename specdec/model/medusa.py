"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads").

K extra next-token heads on the target's last hidden state ``h_t`` (after the final norm:
the second output of ``LlamaModel.forward``). Head k (0-based) guesses the token k + 2
positions ahead, ``x_{t+k+2}``, where the target's own LM head gives ``x_{t+1}``:

    y = h_t;  y = y + SiLU(W_kl y + b_kl)  for l < L      (L residual blocks, hidden -> hidden)
    logits_k = P_k y                                      (P_k: hidden -> vocab, no bias)

The K heads run as batched matmuls over stacked weights (one launch per block and one for
the projections, whatever K is). Checkpoints load in the authors' layout
(``medusa_lm_head.safetensors``: per head i the blocks ``i.{l}.linear.weight/bias`` and the
projection ``i.{L}.weight``; ``config.json`` with ``medusa_num_heads`` and
``medusa_num_layers``) from safetensors only; ``medusa_lm_head.pt`` (pickle) is refused with
the command that converts it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from specdec.kernels._checks import check_tensor
from specdec.model.head_loading import check_fits_target, head_checkpoint_files, read_config_json
from specdec.model.llama import LlamaModel
from specdec.model.loader import load_tensors

HEADS_FILE = "medusa_lm_head.safetensors"
PICKLE_FILE = "medusa_lm_head.pt"


class MedusaHeads(nn.Module):
    """``num_heads`` Medusa heads of ``num_layers`` residual blocks each (see the module docstring).

    Parameters
    ----------
    hidden_size, vocab_size : the target's.
    num_heads : K, the number of heads (head k predicts k + 2 tokens ahead).
    num_layers : L, residual blocks per head (the authors use 1).

    Attributes
    ----------
    block_weight : ``[K, L, hidden, hidden]`` (out, in), zero at construction: each block starts as
        the identity, as the authors initialise it.
    block_bias : ``[K, L, hidden]``, zero at construction.
    proj_weight : ``[K, vocab, hidden]``; ``init_from_lm_head`` copies the target's LM head into
        every head, the authors' starting point for training.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1):
        super().__init__()
        for name, value, low in (
            ("hidden_size", hidden_size, 1),
            ("vocab_size", vocab_size, 1),
            ("num_heads", num_heads, 1),
            ("num_layers", num_layers, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.block_weight = nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size, hidden_size))
        self.block_bias = nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size))
        self.proj_weight = nn.Parameter(torch.empty(num_heads, vocab_size, hidden_size).normal_(std=0.02))

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_weight.device

    def init_from_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's ``[vocab, hidden]`` LM head into every head's projection (before training)."""
        check_tensor("lm_head_weight", lm_head_weight, shape=(self.vocab_size, self.hidden_size))
        with torch.no_grad():
            self.proj_weight.copy_(lm_head_weight.expand_as(self.proj_weight))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every head for every row.

        Parameters
        ----------
        hidden : ``[T, hidden]`` in the heads' dtype: the target's last hidden states (after the
            final norm), one row per position whose continuation is guessed.

        Returns
        -------
        ``[K, T, vocab]`` in the heads' dtype, head-major (the authors' order): ``out[k, t]`` scores
        the token ``k + 2`` positions after row t's token. A transposed view (``reshape``, not ``view``).

        Example
        -------
        >>> heads = MedusaHeads(hidden_size=8, vocab_size=32, num_heads=3)
        >>> guesses = heads(torch.randn(5, 8)).argmax(-1)   # [K, T]: tokens 2, 3, ..., K + 1 ahead of each row
        >>> guesses.shape
        torch.Size([3, 5])
        """
        check_tensor("hidden", hidden, dtype=self.dtype, ndim=2, device=self.device)
        if hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must have {self.hidden_size} columns, got shape {tuple(hidden.shape)}")
        y = hidden.unsqueeze(0).expand(self.num_heads, -1, -1)  # [K, T, H]
        for l in range(self.num_layers):
            # [K, T, H] @ [K, H_in, H_out] + [K, 1, H_out]
            z = torch.baddbmm(self.block_bias[:, l, None, :], y, self.block_weight[:, l].transpose(1, 2))
            y = y + F.silu(z)
        # [K, V, H] @ [K, H, T], seen as [K, T, V]: each head's projection streamed row by row (on one CPU thread
        # faster than y @ P^T for T = 1, where the heads' 4 x V x H weights make the step memory-bound).
        return torch.bmm(self.proj_weight, y.transpose(1, 2)).transpose(1, 2)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: LlamaModel) -> MedusaHeads:
        """Load heads in the Medusa authors' layout from a local directory, in eval mode.

        The heads take the target's dtype and device (they read its hidden states). Raises
        ValueError when ``config.json`` lacks or mis-states ``medusa_num_heads`` /
        ``medusa_num_layers``, when the heads do not fit the target (``hidden_size`` or
        ``vocab_size``), when a tensor is missing, extra or misshapen, or when the directory
        holds only ``medusa_lm_head.pt`` (with the command that converts it).

        Example
        -------
        >>> from specdec.testing import ASSETS                           # the embedded target and its heads
        >>> target = LlamaModel.from_pretrained(ASSETS / "target")
        >>> heads = MedusaHeads.from_pretrained(ASSETS.parent / "medusa", target)
        >>> heads.num_heads
        4
        """
        if not isinstance(target, LlamaModel):
            raise TypeError(f"target must be a LlamaModel, got {type(target).__name__}")
        path = Path(path)
        hf = read_config_json(path)
        num_heads, num_layers = _config_int(hf, "medusa_num_heads", 1), _config_int(hf, "medusa_num_layers", 0)
        files = head_checkpoint_files(path, HEADS_FILE, PICKLE_FILE)
        hidden, vocab = _stored_sizes(path, hf, files, num_layers)
        check_fits_target(hidden, vocab, target, f"Medusa heads {path}")
        with torch.device("meta"):
            heads = cls(hidden, vocab, num_heads, num_layers)
        state = medusa_state_dict(path, heads, dtype=target.dtype, device=target.device)
        heads.load_state_dict(state, assign=True, strict=True)
        return heads.requires_grad_(False).eval()

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``config.json`` and ``medusa_lm_head.safetensors`` in the authors' layout."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = self.state_dict()
        tensors = {name: state[param][index] for name, (param, index) in authors_layout(self).items()}
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path / HEADS_FILE))


def authors_layout(heads: MedusaHeads) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The authors' tensor name -> (stacked parameter, index into it): the one place that knows their names.

    Head i is ``nn.Sequential(ResBlock x L, Linear(hidden, vocab, bias=False))`` in their code,
    so its blocks are ``i.{l}.linear.*`` and its projection ``i.{L}.weight``.
    """
    L = heads.num_layers
    layout = {}
    for i in range(heads.num_heads):
        for l in range(L):
            layout[f"{i}.{l}.linear.weight"] = ("block_weight", (i, l))
            layout[f"{i}.{l}.linear.bias"] = ("block_bias", (i, l))
        layout[f"{i}.{L}.weight"] = ("proj_weight", (i,))
    return layout


def medusa_state_dict(path: Path, heads: MedusaHeads, *, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The stacked state dict of ``heads`` (shapes only, e.g. on "meta") from a checkpoint in the authors' layout."""
    shapes = {name: tuple(t.shape) for name, t in heads.state_dict().items()}
    layout = authors_layout(heads)
    expected = {name: shapes[param][len(index) :] for name, (param, index) in layout.items()}
    tensors = load_tensors(path, expected, dtype=dtype, device=device, single_file=HEADS_FILE)
    state = {param: torch.empty(shape, dtype=dtype, device=device) for param, shape in shapes.items()}
    for name, (param, index) in layout.items():
        state[param][index] = tensors[name]
    return state


def _config_int(hf: dict, key: str, low: int) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"config.json {key!r} must be an int >= {low}, got {value!r}")
    return value


def _stored_sizes(path: Path, hf: dict, files: dict[str, Path], num_layers: int) -> tuple[int, int]:
    """(hidden_size, vocab_size) of the stored heads, from head 0's projection; config.json must agree."""
    proj = f"0.{num_layers}.weight"
    if proj not in files:
        raise ValueError(
            f"{path / HEADS_FILE} lacks tensor {proj!r}, head 0's projection for medusa_num_layers={num_layers}"
        )
    try:
        with safe_open(files[proj], framework="pt", device="cpu") as f:
            vocab, hidden = f.get_slice(proj).get_shape()
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ValueError(f"could not read {files[proj]}: it is not a valid safetensors file ({exc})") from exc
    for key, stored in (("hidden_size", hidden), ("vocab_size", vocab)):
        if key in hf and hf[key] != stored:
            raise ValueError(f"config.json says {key} {hf[key]} but {proj!r} has shape {(vocab, hidden)}")
    return hidden, vocab
