"""scripts/train_parallel_draft.py: its quick mode writes a parallel draft that specdec loads, trained on what
one drafting forward computes."""

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from specdec._backend import use_backend
from specdec.model import AttentionMetadata, LlamaModel, causal_positions

ROOT = Path(__file__).resolve().parents[1]
PAIR_DRAFT = ROOT / "specdec" / "assets" / "pair" / "draft"


def test_quick_mode_writes_a_parallel_draft_that_specdec_runs_as_trained(tmp_path, monkeypatch):
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_parallel_draft.py"), "--quick", "--out", str(tmp_path)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    assert time.perf_counter() - start < 60, "the quick mode is meant for tests: well under a minute"
    assert {f.name for f in tmp_path.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "training_report.json",
    }
    config = json.loads((tmp_path / "config.json").read_text())
    pair = json.loads((PAIR_DRAFT / "config.json").read_text())
    assert config["vocab_size"] == pair["vocab_size"] + 1 and config["pard_token"] == pair["vocab_size"]
    assert config["pard_block_size"] == 8 and config["tie_word_embeddings"] is True
    with safe_open(tmp_path / "model.safetensors", "pt") as f, safe_open(PAIR_DRAFT / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())  # HuggingFace LLaMA names, as the AR draft's
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    assert (tmp_path / "tokenizer.json").read_bytes() == (PAIR_DRAFT.parent / "target" / "tokenizer.json").read_bytes()

    report = json.loads((tmp_path / "training_report.json").read_text())
    assert report["command"].endswith("--quick --out " + str(tmp_path))
    assert report["training"]["steps_run"] == report["training"]["steps_scheduled"] > 0
    assert report["specdec_forward_check"]["max_abs_logit_gap"] < 1e-3
    for drafter in ("parallel_draft", "ar_draft"):
        measured = report["heldout_agreement"][drafter]
        assert measured["anchors"] > 0
        assert list(measured["position"]) == [str(j) for j in range(1, 9)]
        assert all(0 <= p["top1"] <= p["top4"] <= 1 for p in measured["position"].values())
        assert 1 <= measured["chain_tau"]["5"] <= measured["chain_tau"]["8"] <= 9

    # Independently of the script's own check: the training module's blocks, two anchors in one pass, equal
    # specdec's causal prefill of [text up to the anchor, K-1 masks] -- the inference semantics.
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from train_parallel_draft import draft_logits, load_draft

    model = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.vocab_size == config["vocab_size"]
    trained = load_draft(tmp_path)
    mask, K = config["pard_token"], config["pard_block_size"]
    tokens = torch.randint(0, mask, (40,))
    anchors = [5, 30]
    ours, _, _ = draft_logits(trained, tokens[None, :31], anchors, K, mask)
    for i, a in enumerate(anchors):
        rows = torch.cat((tokens[: a + 1], torch.full((K - 1,), mask)))
        meta = AttentionMetadata(torch.tensor([0, rows.numel()], dtype=torch.int32))
        cache = model.new_cache(1, rows.numel())
        cache.reserve([rows.numel()])
        with use_backend("torch"):
            logits, _ = model(rows, causal_positions(meta.q_offsets, cache.seq_lens, rows.numel()), meta, cache)
        expected = torch.cat((ours[0, a : a + 1], ours[0, 31 + i * (K - 1) + torch.arange(K - 1)]))
        torch.testing.assert_close(logits[a:], expected, atol=1e-3, rtol=1e-3)
