"""Local safetensors checkpoint loading: one ``model.safetensors`` or a sharded set with its index.

safetensors only: pickle-based ``.bin``/``.pt`` files are refused (unpickling runs
code), and nothing here touches the network. Every expected tensor is checked for
presence and shape, and every unexpected one is refused, each error naming the
tensor: a checkpoint whose tensors disagree with its config (say, attention biases
the config does not mention) must not load into a silently different model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str | Path, *, single_file: str = SINGLE_FILE) -> dict[str, Path]:
    """Map each tensor name to the file holding it, from the index or the single file's header.

    ``single_file`` names the one-file form (draft heads ship e.g. ``medusa_lm_head.safetensors``).
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint path {path} is not a directory")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map' object): {exc}") from exc
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
        files = {}
        for name, file in weight_map.items():
            shard = path / file
            if Path(file).name != file or not shard.is_file():
                raise ValueError(f"{index} puts tensor {name!r} in {file!r}, which is not a file in {path}")
            files[name] = shard
        return files
    single = path / single_file
    if single.is_file():
        return dict.fromkeys(_read_names(single), single)
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ValueError(
            f"{path} holds only pickle checkpoints (.bin/.pt); specdec loads safetensors only, never pickle. "
            "Convert the checkpoint to safetensors first."
        )
    raise ValueError(f"{path} has neither {single_file} nor {INDEX_FILE}")


def load_tensors(
    path: str | Path,
    expected: Mapping[str, tuple[int, ...]],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    ignore: Iterable[str] = (),
    single_file: str = SINGLE_FILE,
) -> dict[str, torch.Tensor]:
    """Load exactly the ``expected`` tensors (name -> shape), cast to ``dtype`` on ``device``.

    Names in ``ignore`` may be present and are skipped (e.g. ``lm_head.weight`` of a
    checkpoint with tied embeddings, or stale rotary buffers); any other name the
    checkpoint holds beyond ``expected`` is an error.
    """
    files = checkpoint_files(path, single_file=single_file)
    ignore = set(ignore)
    missing = [name for name in expected if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"checkpoint {path} lacks tensor {missing[0]!r} (expected shape {tuple(expected[missing[0]])}){more}"
        )
    unexpected = sorted(
        n for n in files if n not in expected and n not in ignore and not n.endswith("rotary_emb.inv_freq")
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {path} holds tensor {unexpected[0]!r} that this config does not use "
            f"({len(unexpected)} unexpected in all); is config.json from the same model?"
        )
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise ValueError(f"{file.name} lacks tensor {name!r}, although the index puts it there")
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(expected[name]):
                        raise ValueError(
                            f"tensor {name!r} in {file.name} has shape {shape}, expected {tuple(expected[name])}"
                        )
                    out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"could not read {file}: it is not a valid safetensors file ({exc})") from exc
    return out


def _read_names(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            return list(f.keys())
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ValueError(f"could not read {file}: it is not a valid safetensors file ({exc})") from exc
