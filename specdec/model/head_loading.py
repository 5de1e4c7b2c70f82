"""What the draft-head loaders (EAGLE, Medusa) share: config.json, fit with the target, pickle refusal."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.model.llama import LlamaModel
from specdec.model.loader import INDEX_FILE, checkpoint_files


def check_fits_target(hidden_size: int, vocab_size: int, target: LlamaModel, what: str) -> None:
    """Refuse a head whose ``hidden_size`` or ``vocab_size`` differs from the target's, naming the size."""
    for name, mine, theirs in (
        ("hidden_size", hidden_size, target.config.hidden_size),
        ("vocab_size", vocab_size, target.config.vocab_size),
    ):
        if mine != theirs:
            raise ValueError(f"{what} does not fit the target: its {name} is {mine}, the target's is {theirs}")


def read_config_json(path: Path) -> dict:
    file = path / "config.json"
    if not path.is_dir():
        raise ValueError(f"checkpoint path {path} is not a directory")
    if not file.is_file():
        raise ValueError(f"no config.json in {path}")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config


def head_checkpoint_files(path: Path, single_file: str, pickle_file: str) -> dict[str, Path]:
    """Tensor name -> safetensors file of a head's checkpoint; a pickle-only head is refused with how to convert it."""
    if not (path / single_file).is_file() and not (path / INDEX_FILE).is_file() and (path / pickle_file).is_file():
        raise ValueError(
            f"{path} holds only {pickle_file}, a pickle checkpoint; specdec loads safetensors only (unpickling runs "
            f'code). If you trust the file, convert it once:\n  python -c "import torch; '
            f"from safetensors.torch import save_file; sd = torch.load('{path / pickle_file}', map_location='cpu', "
            f"weights_only=True); save_file({{k: v.clone().contiguous() for k, v in sd.items()}}, "
            f"'{path / single_file}')\""
        )
    return checkpoint_files(path, single_file=single_file)
