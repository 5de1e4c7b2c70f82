"""The trained EAGLE head and Medusa heads of the embedded target: shipped files, and the scripts that make them."""

import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec import testing
from specdec._backend import use_backend
from specdec.decoding.autoregressive import generate
from specdec.model import AttentionMetadata, EagleHead, LlamaModel, MedusaHeads, causal_positions

ROOT = Path(__file__).resolve().parents[1]
EAGLE_DIR = ROOT / "specdec" / "assets" / "eagle"
MEDUSA_DIR = ROOT / "specdec" / "assets" / "medusa"
PARALLEL_EAGLE_DIR = ROOT / "specdec" / "assets" / "parallel_eagle"

pytestmark = pytest.mark.usefixtures("torch_backend")


@pytest.fixture(scope="module")
def target():
    return LlamaModel.from_pretrained(testing.pair_dirs()[0])


@pytest.fixture(scope="module")
def greedy_text(target):
    """A held-out prompt and the target's greedy continuation, with the target's features for every token."""
    tokenizer = testing.load_pair("cpu")[2]
    prompt = testing.heldout_token_ids(tokenizer)[0]
    with use_backend("torch"):
        tokens = prompt + generate(target, [prompt], max_new_tokens=48, eos_token_id=None)[0]
        cache = target.new_cache(1, len(tokens))
        meta = AttentionMetadata(torch.tensor([0, len(tokens)], dtype=torch.int32))
        positions = causal_positions(meta.q_offsets, cache.seq_lens, len(tokens))
        _, hidden = target(torch.tensor(tokens), positions, meta, cache)
    return torch.tensor(tokens), len(prompt), hidden


def test_asset_files_sizes_and_reports():
    # The Medusa heads also ship the search that chose their default tree (specdec.decoding.medusa.presets).
    for directory, files in (
        (EAGLE_DIR, {"model.safetensors"}),
        (MEDUSA_DIR, {"medusa_lm_head.safetensors", "tree_search.json"}),
        (PARALLEL_EAGLE_DIR, {"model.safetensors"}),
    ):
        names = {f.name for f in directory.iterdir()}
        assert names == {"config.json", "training_report.json", *files}, directory
        assert sum(f.stat().st_size for f in directory.iterdir()) <= 10 * 2**20
    eagle = json.loads((EAGLE_DIR / "training_report.json").read_text())
    depth = eagle["agreement_by_depth"]["depth"]
    assert len(depth) >= 2 and [int(d) for d in depth] == list(range(1, len(depth) + 1))
    assert all(0 <= v["top1"] <= v["top2"] <= v["top4"] <= 1 for v in depth.values())
    medusa = json.loads((MEDUSA_DIR / "training_report.json").read_text())
    assert (
        len(medusa["agreement_by_head"]["head"])
        == json.loads((MEDUSA_DIR / "config.json").read_text())["medusa_num_heads"]
    )


def test_assets_ship_as_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["specdec"]
    for directory in (EAGLE_DIR, MEDUSA_DIR, PARALLEL_EAGLE_DIR):
        for file in directory.iterdir():
            relative = file.relative_to(ROOT / "specdec").as_posix()
            assert any(fnmatch.fnmatch(relative, g) for g in globs), f"{relative} is not package data"


def test_eagle_head_predicts_the_targets_greedy_tokens(target, greedy_text):
    tokens, prompt, hidden = greedy_text
    head = EagleHead.from_pretrained(EAGLE_DIR, target)
    assert head.lm_head_weight is target.lm_head_weight
    n = len(tokens) - 1
    meta = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32))
    with use_backend("torch"):
        _, logits = head(hidden[:n], tokens[1:], torch.arange(n), meta, head.new_cache(1, n))
    rows = torch.arange(prompt - 1, n - 1)  # row t guesses x_{t+2}; score the generated stretch
    top1 = (logits[rows].argmax(-1) == tokens[rows + 2]).float().mean().item()
    reported = json.loads((EAGLE_DIR / "training_report.json").read_text())["agreement_by_depth"]["depth"]["1"]["top1"]
    assert top1 >= reported - 0.2, f"top-1 agreement {top1:.2f} on one continuation, {reported:.2f} reported"


def test_medusa_heads_predict_the_targets_greedy_tokens(target, greedy_text):
    tokens, prompt, hidden = greedy_text
    heads = MedusaHeads.from_pretrained(MEDUSA_DIR, target)
    K = heads.num_heads
    rows = torch.arange(prompt - 1, len(tokens) - K - 1)
    guesses = heads(hidden[rows]).argmax(-1)  # [K, R]
    reported = json.loads((MEDUSA_DIR / "training_report.json").read_text())["agreement_by_head"]["head"]
    top1 = (guesses[0] == tokens[rows + 2]).float().mean().item()
    assert top1 >= reported["0"]["top1"] - 0.2, f"head 0 top-1 {top1:.2f} on one continuation"


@pytest.mark.parametrize(
    "script, loader, weights",
    [
        ("train_eagle_head.py", EagleHead, "model.safetensors"),
        ("train_medusa_heads.py", MedusaHeads, "medusa_lm_head.safetensors"),
    ],
)
def test_training_script_quick_mode_writes_a_loadable_head(tmp_path, target, script, loader, weights):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--quick", "--out", str(tmp_path)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    assert {f.name for f in tmp_path.iterdir()} == {"config.json", weights, "training_report.json"}
    loader.from_pretrained(tmp_path, target)
    report = json.loads((tmp_path / "training_report.json").read_text())
    assert report["training"]["steps_run"] == report["training"]["steps_scheduled"] > 0
    assert report["command"].endswith("--quick --out " + str(tmp_path))
