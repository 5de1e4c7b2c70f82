"""A parallel draft model (PARD): a LLaMA-style draft that predicts a block of next tokens in one forward.

Fed the committed text followed by ``block_size - 1`` copies of a mask token (causal rows at
consecutive positions), its row of the last real token predicts the next token and mask row j
the token j places after it, each from the true prefix alone (An et al. 2025, "PARD: Accelerating
LLM Inference with Low-Cost PARallel Draft Model Adaptation").

The checkpoint is a HuggingFace LLaMA-family directory (config.json + safetensors) whose
config adds two fields:

    pard_token        the mask token's id (the key vLLM reads for PARD drafts)
    pard_block_size   positions one forward predicts: the last real row plus the mask rows

The mask id may extend the target's vocabulary by one row (``vocab_size`` = the target's + 1,
``pard_token`` = the target's vocabulary size) or reuse an id inside it; either way the draft
proposes target tokens only (``target_logits`` drops or masks the mask id).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.model.head_loading import read_config_json
from specdec.model.llama import LlamaModel
from specdec.validation import as_int

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class ParallelDraft:
    """A loaded parallel draft: its ``model`` (a ``LlamaModel``), ``mask_token`` and ``block_size``, and
    ``vocab_size``, the target vocabulary it drafts from."""

    model: LlamaModel
    mask_token: int
    block_size: int
    vocab_size: int

    def __post_init__(self):
        rows = self.model.config.vocab_size
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"pard_block_size must be an int >= 2 (a real row, a mask row), got {self.block_size!r}")
        if not isinstance(self.mask_token, int) or not 0 <= self.mask_token < rows:
            raise ValueError(f"pard_token must be a token id in [0, {rows}) (draft rows), got {self.mask_token!r}")
        if self.vocab_size not in (rows, rows - 1) or (self.vocab_size == rows - 1 and self.mask_token != rows - 1):
            raise ValueError(
                f"a parallel draft with vocab_size {rows} and pard_token {self.mask_token} cannot draft for a target "
                f"of {self.vocab_size} tokens: its vocabulary must be the target's, or the target's plus the mask "
                "token as the last id"
            )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        target: LlamaModel,
        *,
        target_path: str | Path | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> ParallelDraft:
        """Load a parallel draft for ``target`` from a checkpoint directory (safetensors only).

        Refused, by name: a config without ``pard_token`` / ``pard_block_size``, a vocabulary that is
        not the target's (plus the mask row), and -- given ``target_path``, the target's checkpoint
        directory -- a ``tokenizer.json`` that differs from the target's (when both ship one).
        """
        path = Path(path)
        config = read_config_json(path)
        for key in ("pard_token", "pard_block_size"):
            if key not in config:
                raise ValueError(f"{path / 'config.json'} has no {key!r}: not a parallel draft (PARD) checkpoint")
        mask_token = as_int("config.json pard_token", config["pard_token"], low=0)
        block_size = as_int("config.json pard_block_size", config["pard_block_size"], low=2)
        model = LlamaModel.from_pretrained(path, dtype=dtype, device=device)
        draft = cls(model, mask_token, block_size, target.config.vocab_size)
        check_same_tokenizer(path, target_path)
        return draft

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [..., draft rows]`` -> ``[..., vocab_size]``: the target's tokens only (never the mask id)."""
        logits = logits[..., : self.vocab_size]
        if self.mask_token < self.vocab_size:
            logits = logits.clone()
            logits[..., self.mask_token] = float("-inf")
        return logits


def check_same_tokenizer(draft_dir: Path, target_dir: str | Path | None) -> None:
    """Refuse a draft whose ``tokenizer.json`` maps tokens to other ids than the target's (when both have one)."""
    if target_dir is None:
        return
    files = [Path(d) / TOKENIZER_FILE for d in (draft_dir, target_dir)]
    if not all(f.is_file() for f in files):
        return
    vocabularies = [_token_ids(f) for f in files]
    if vocabularies[0] != vocabularies[1]:
        raise ValueError(f"{files[0]} and {files[1]} differ (their token-to-id maps are not the same)")


def _token_ids(file: Path) -> dict:
    try:
        return json.loads(file.read_text())["model"]["vocab"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{file} is not a tokenizers JSON file with a model vocabulary: {exc}") from exc
