"""scripts/train_parallel_eagle_head.py: its quick mode writes a parallel EAGLE head that specdec loads, trained on
what one drafting forward computes."""

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from specdec._backend import use_backend
from specdec.model import AttentionMetadata, LlamaModel, ParallelEagleHead, causal_positions
from specdec.model.parallel_eagle import MASK
from specdec.testing import pair_dirs

ROOT = Path(__file__).resolve().parents[1]
EAGLE_DIR = ROOT / "specdec" / "assets" / "eagle"


def test_quick_mode_writes_a_head_that_specdec_runs_as_trained(tmp_path, monkeypatch):
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_parallel_eagle_head.py"), "--quick", "--out", str(tmp_path)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    assert time.perf_counter() - start < 90, "the quick mode is meant for tests: about a minute at most"
    assert {f.name for f in tmp_path.iterdir()} == {"config.json", "model.safetensors", "training_report.json"}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["parallel_block_size"] == 8 and config["num_hidden_layers"] == 1
    with safe_open(tmp_path / "model.safetensors", "pt") as f, safe_open(EAGLE_DIR / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys()) | {"mask_input"}  # the EAGLE authors' names, and the mask row
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())

    report = json.loads((tmp_path / "training_report.json").read_text())
    assert report["command"].endswith("--quick --out " + str(tmp_path))
    assert report["training"]["steps_run"] == report["training"]["steps_scheduled"] > 0
    assert report["specdec_forward_check"]["max_abs_logit_gap"] < 1e-3
    measured = report["heldout_agreement"]["parallel_eagle"]
    assert measured["anchors"] > 0 and list(measured["position"]) == [str(j) for j in range(1, 9)]
    assert all(0 <= p["top1"] <= p["top4"] <= 1 for p in measured["position"].values())
    assert 1 <= measured["chain_tau"]["5"] <= measured["chain_tau"]["8"] <= 9
    sequential = report["heldout_agreement"]["eagle2_sequential_chain_tau"]
    assert sequential["anchors"] > 0 and 1 <= sequential["5"] <= sequential["8"] <= 9

    # Independently of the script's own check: the training module's blocks, two anchors in one pass, equal specdec's
    # head run as the strategy runs it -- rows before the anchor already in the head cache, then one forward of the
    # anchor's row and K-1 mask rows.
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from train_parallel_eagle_head import block_logits, initial_head, saved_tensors

    target = LlamaModel.from_pretrained(pair_dirs()[0], dtype=torch.float32)
    head = ParallelEagleHead.from_pretrained(tmp_path, target)
    trained, _ = initial_head(json.loads((pair_dirs()[0] / "config.json").read_text()))
    trained.load_state_dict(saved_tensors(tmp_path), strict=False)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4096, (41,), generator=gen)
    feats = torch.randn(41, 256, generator=gen)
    K, anchors = config["parallel_block_size"], [5, 30]
    lm_head, embed = target.lm_head_weight, target.model.embed_tokens.weight
    with torch.no_grad():
        ours, _, _ = block_logits(trained.eval(), feats[None, :32], tokens[None, :32], embed, lm_head, anchors, K)
    for i, a in enumerate(anchors):
        cache = head.new_cache(1, a + K)
        with use_backend("torch"), torch.no_grad():
            before = AttentionMetadata(torch.tensor([0, a], dtype=torch.int32))
            cache.reserve([a])
            head(feats[:a], tokens[1 : a + 1], causal_positions(before.q_offsets, cache.seq_lens, a), before, cache)
            cache.advance([a])
            step = AttentionMetadata(torch.tensor([0, K], dtype=torch.int32))
            cache.reserve([K])
            rows_features = torch.cat((feats[a : a + 1], torch.zeros(K - 1, 256)))
            rows_tokens = torch.cat((tokens[a + 1 : a + 2], torch.full((K - 1,), MASK)))
            _, logits = head(rows_features, rows_tokens, causal_positions(step.q_offsets, cache.seq_lens, K), step,
                             cache)  # fmt: skip
        expected = torch.cat((ours[0, a : a + 1], ours[0, 31 + i * (K - 1) + torch.arange(K - 1)]))
        torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-3)
