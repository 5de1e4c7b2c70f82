"""Attention metadata, RoPE position helpers and the model forward's argument checks."""

import pytest
import torch
from helpers import i32, tiny_config

from specdec import use_backend
from specdec.model import AttentionMetadata, LlamaModel, causal_positions, tree_positions
from specdec.model.attention_metadata import request_index

CONFIG = tiny_config(vocab_size=40, num_layers=1)


def test_positions_with_empty_requests():
    q_offsets = i32(0, 3, 3, 4, 6)  # request 1 sends no rows
    seq_lens = i32(10, 7, 0, 5)
    assert request_index(q_offsets, 6).tolist() == [0, 0, 0, 2, 3, 3]
    assert causal_positions(q_offsets, seq_lens, 6).tolist() == [10, 11, 12, 0, 5, 6]
    depth = i32(0, 1, 1, 0, 0, 1)
    assert tree_positions(q_offsets, seq_lens, depth).tolist() == [10, 11, 11, 0, 5, 6]


def test_metadata_validation():
    meta = AttentionMetadata(i32(0, 2, 5), torch.zeros(5, 1, dtype=torch.int64))
    assert not meta.causal and meta.batch_size == 2
    assert AttentionMetadata(i32(0, 1)).causal
    with pytest.raises(TypeError, match="q_offsets must have dtype int32"):
        AttentionMetadata(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="q_offsets must hold B\\+1 >= 2 entries"):
        AttentionMetadata(i32(0))
    with pytest.raises(TypeError, match="tree_mask must have dtype int64"):
        AttentionMetadata(i32(0, 2), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="tree_mask must have 2 dimensions"):
        AttentionMetadata(i32(0, 2), torch.zeros(2, dtype=torch.int64))


def test_forward_argument_checks():
    model = LlamaModel(CONFIG).requires_grad_(False)
    cache = model.new_cache(1, 8)
    meta = AttentionMetadata(i32(0, 3))
    tokens, positions = torch.tensor([1, 2, 3]), torch.arange(3)
    with use_backend("torch"):
        logits, hidden = model(tokens, positions, meta, cache)
        assert logits.shape == (3, 40) and hidden.shape == (3, 32) and torch.isfinite(logits).all()
        with pytest.raises(TypeError, match="tokens must have dtype int32 or int64"):
            model(tokens.float(), positions, meta, cache)
        with pytest.raises(ValueError, match=r"positions must have shape \(3,\)"):
            model(tokens, torch.arange(4), meta, cache)
        with pytest.raises(TypeError, match="metadata must be an AttentionMetadata"):
            model(tokens, positions, i32(0, 3), cache)
        with pytest.raises(TypeError, match="logits_rows must have dtype int32 or int64"):
            model(tokens, positions, meta, cache, logits_rows=torch.tensor([0.0]))
        with pytest.raises(ValueError, match="q_offsets\\[-1\\] must equal the number of rows"):
            model(tokens, positions, AttentionMetadata(i32(0, 2)), cache)
