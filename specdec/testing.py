"""The embedded model pair and its held-out prompts, for the demo, the benchmarks, the tests and the examples.

The pair (``specdec/assets/pair``) is a small LLaMA target and a one-layer draft distilled from it, both
trained on the Python standard library by ``scripts/train_embedded_pair.py``; the EAGLE head and the Medusa
heads trained for the target sit beside it (``ASSETS.parent / "eagle"``, ``ASSETS.parent / "medusa"``).
The held-out prompts are code the pair never saw in training. Nothing in the library imports this module.

Example
-------
>>> from specdec.testing import heldout_token_ids, load_pair
>>> target, draft, tokenizer = load_pair()
>>> prompts = heldout_token_ids(tokenizer)
>>> len(prompts) >= 3, max(max(ids) for ids in prompts) < target.config.vocab_size
(True, True)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent / "assets" / "pair"


def pair_dirs(assets: str | Path = ASSETS) -> tuple[Path, Path]:
    """(target directory, draft directory) of the embedded pair; FileNotFoundError naming what is missing."""
    assets = Path(assets)
    dirs = (assets / "target", assets / "draft")
    for d in dirs:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            if not (d / name).is_file():
                raise FileNotFoundError(
                    f"{d / name} is missing: the embedded pair is not installed "
                    "(rebuild it with python scripts/train_embedded_pair.py)"
                )
    return dirs


def load_pair(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, assets: str | Path = ASSETS):
    """(target, draft, tokenizer): the embedded pair as specdec ``LlamaModel``s and its ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    from specdec.model.llama import LlamaModel

    target_dir, draft_dir = pair_dirs(assets)
    target = LlamaModel.from_pretrained(target_dir, dtype=dtype, device=device)
    draft = LlamaModel.from_pretrained(draft_dir, dtype=dtype, device=device)
    return target, draft, Tokenizer.from_file(str(target_dir / "tokenizer.json"))


def heldout_prompts(assets: str | Path = ASSETS) -> list[dict]:
    """The held-out prompts saved by the training script: dicts with 'file', 'line' and 'text'."""
    return json.loads((Path(assets) / "eval" / "prompts.json").read_text())


def heldout_token_ids(tokenizer, assets: str | Path = ASSETS) -> list[list[int]]:
    """The held-out prompts as ``tokenizer``'s token ids: the prompt pool of the benchmarks and tests."""
    return [tokenizer.encode(p["text"]).ids for p in heldout_prompts(assets)]


def frequent_token_ids(assets: str | Path = ASSETS) -> torch.Tensor:
    """The embedded target's 1024 most frequent tokens (ids, ascending): the EAGLE-3 head's draft vocabulary
    (``ASSETS.parent / "eagle3"``; ``scripts/train_eagle3_head.py`` ranked its training rows' tokens), for an
    EAGLE-1/2 head's ``set_draft_vocabulary``."""
    from safetensors import safe_open

    with safe_open(str(Path(assets).parent / "eagle3" / "model.safetensors"), framework="pt") as f:
        d2t = f.get_tensor("d2t")
    return torch.arange(d2t.numel()) + d2t  # draft id i is target id i + d2t[i]
