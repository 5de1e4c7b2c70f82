"""The model against HuggingFace transformers on small random checkpoints that transformers itself saved.

Variants (``helpers.HF_VARIANTS``, built by the ``hf_checkpoints`` fixture): GQA with an explicit
head_dim (saved sharded), tied embeddings, llama3 rope scaling, attention + MLP biases, and a
Qwen2 checkpoint (q/k/v bias only). All in float32, PyTorch path; test_model_triton.py runs a
tiny model through the Triton kernels.
"""

import pytest
import torch
from helpers import HF_VARIANTS, rel_err

from specdec.kernels import build_tree_metadata
from specdec.model.attention_metadata import AttentionMetadata, causal_positions, tree_positions
from specdec.model.llama import LlamaModel

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4


# The PyTorch path of every op (test_model_triton.py covers the Triton kernels on a tiny model).
pytestmark = pytest.mark.usefixtures("torch_backend")


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.as_tensor(ids)[None]).logits[0]


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_checkpoint_tensors_load_unchanged(hf_checkpoints, variant):
    path, hf = hf_checkpoints(variant)
    model = LlamaModel.from_pretrained(path)
    if variant == "gqa":
        assert len(list(path.glob("model-*.safetensors"))) > 1 and (path / "model.safetensors.index.json").is_file()
        assert model.config.head_dim == 32 and model.config.num_kv_heads == 2
    if variant == "tied":
        assert model.lm_head is None
    if variant == "qwen2":
        assert model.model.layers[0].self_attn.qkv_proj.bias is not None
        assert model.model.layers[0].self_attn.o_proj.bias is None
    hf_state = hf.state_dict()
    ours = model.hf_state_dict()  # q/k/v and gate/up split back out of the fused projections
    assert set(ours) == set(model.expected_tensors())
    assert set(ours) == set(hf_state) - ({"lm_head.weight"} if variant == "tied" else set())
    for name, t in ours.items():
        assert torch.equal(t, hf_state[name]), name


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_prefill_logits_match_hf(hf_checkpoints, variant):
    """One ragged prefill of three prompts; every row's logits against transformers on each prompt alone."""
    path, hf = hf_checkpoints(variant)
    model = LlamaModel.from_pretrained(path)
    prompts = [torch.randint(0, 256, (n,)) for n in (7, 1, 23)]
    cache = model.new_cache(3, 32)
    q_offsets = torch.tensor([0, 7, 8, 31], dtype=torch.int32)
    positions = causal_positions(q_offsets, cache.seq_lens, 31)
    logits, hidden = model(torch.cat(prompts), positions, AttentionMetadata(q_offsets), cache)
    assert logits.shape == (31, 256) and hidden.shape == (31, 64)
    for b, prompt in enumerate(prompts):
        got = logits[q_offsets[b] : q_offsets[b + 1]]
        err = rel_err(got, hf_logits(hf, prompt))
        assert err <= REL_TOL, f"prompt {b}: relative error {err:.2e}"
    # logits_rows computes the chosen rows only (the same values up to GEMM rounding); hidden is unchanged
    rows = torch.tensor([6, 7, 30])
    cache = model.new_cache(3, 32)
    picked, same_hidden = model(torch.cat(prompts), positions, AttentionMetadata(q_offsets), cache, logits_rows=rows)
    assert picked.shape == (3, 256)
    assert rel_err(picked, logits[rows]) <= 1e-6
    torch.testing.assert_close(same_hidden, hidden, rtol=0, atol=0)


@pytest.mark.parametrize(
    "variant, layout", [(v, "contiguous") for v in HF_VARIANTS] + [("gqa", "paged"), ("llama3", "paged")]
)
def test_decode_step_by_step_matches_hf(hf_checkpoints, variant, layout):
    """Prefill, then teacher-forced decode steps (request 1 stops early and sends no rows after)."""
    path, hf = hf_checkpoints(variant)
    model = LlamaModel.from_pretrained(path)
    steps, stop_1 = 12, 5
    seqs = [torch.randint(0, 256, (n + steps,)) for n in (3, 9)]
    prompt_lens = [3, 9]
    cache = model.new_cache(2, 40, layout=layout, block_size=4)
    q_offsets = torch.tensor([0, 3, 12], dtype=torch.int32)
    tokens = torch.cat([seqs[0][:3], seqs[1][:9]])
    model(tokens, causal_positions(q_offsets, cache.seq_lens, 12), AttentionMetadata(q_offsets), cache)
    cache.advance([3, 9])
    refs = [hf_logits(hf, s) for s in seqs]
    for step in range(steps):
        running = [0] if step >= stop_1 else [0, 1]
        counts = [1 if b in running else 0 for b in range(2)]
        q_offsets = torch.tensor([0, counts[0], sum(counts)], dtype=torch.int32)
        tokens = torch.stack([seqs[b][prompt_lens[b] + step] for b in running])
        positions = causal_positions(q_offsets, cache.seq_lens, len(running))
        assert positions.tolist() == [prompt_lens[b] + step for b in running]
        logits, _ = model(tokens, positions, AttentionMetadata(q_offsets), cache)
        cache.advance(counts)
        for row, b in enumerate(running):
            err = rel_err(logits[row], refs[b][prompt_lens[b] + step])
            assert err <= REL_TOL, f"request {b}, decode step {step}: relative error {err:.2e}"
    assert cache.seq_lens.tolist() == [3 + steps, 9 + stop_1]


# Two trees of different shapes (parents before children, node 0 = root = the next token to feed).
TREE_PARENTS = [[-1, 0, 0, 1, 1, 2, 3, 6], [-1, 0, 1, 0, 3]]


@pytest.mark.parametrize("variant, layout", [("gqa", "paged"), ("llama3", "contiguous"), ("bias", "paged")])
def test_tree_forward_matches_sequential_paths(hf_checkpoints, variant, layout):
    """Each node's logits from one tree forward equal decoding its root-to-node path one token at a time."""
    path, hf = hf_checkpoints(variant)
    model = LlamaModel.from_pretrained(path)
    prompts = [torch.randint(0, 256, (n,)) for n in (6, 13)]
    sizes = [len(p) for p in TREE_PARENTS]
    trees = [torch.randint(0, 256, (n,)) for n in sizes]
    parents = torch.tensor([p for tree in TREE_PARENTS for p in tree], dtype=torch.int32)
    node_offsets = torch.tensor([0, sizes[0], sum(sizes)], dtype=torch.int32)
    meta = build_tree_metadata(parents, node_offsets)

    cache = model.new_cache(2, 32, layout=layout, block_size=4)
    q_offsets = torch.tensor([0, 6, 19], dtype=torch.int32)
    model(torch.cat(prompts), causal_positions(q_offsets, cache.seq_lens, 19), AttentionMetadata(q_offsets), cache)
    cache.advance([6, 13])
    positions = tree_positions(node_offsets, cache.seq_lens, meta.depth)
    logits, hidden = model(torch.cat(trees), positions, AttentionMetadata(node_offsets, meta.ancestor_mask), cache)
    assert positions.tolist() == [6 + d for d in meta.depth[: sizes[0]].tolist()] + [
        13 + d for d in meta.depth[sizes[0] :].tolist()
    ]

    for b, tree_parents in enumerate(TREE_PARENTS):
        for node in range(sizes[b]):
            path_nodes = [node]
            while tree_parents[path_nodes[-1]] >= 0:
                path_nodes.append(tree_parents[path_nodes[-1]])
            path_tokens = trees[b][path_nodes[::-1]]
            # sequential: prefill the prompt alone, then decode the path token by token
            single = model.new_cache(1, 32, layout=layout, block_size=4)
            one = torch.tensor([0, len(prompts[b])], dtype=torch.int32)
            model(prompts[b], causal_positions(one, single.seq_lens, len(prompts[b])), AttentionMetadata(one), single)
            single.advance([len(prompts[b])])
            step = torch.tensor([0, 1], dtype=torch.int32)
            for token in path_tokens:
                out, _ = model(token[None], single.seq_lens.long(), AttentionMetadata(step), single)
                single.advance([1])
            row = node_offsets[b] + node
            err = rel_err(logits[row], out[0])
            assert err <= REL_TOL, f"tree {b} node {node}: relative error {err:.2e} against its sequential path"
            err = rel_err(logits[row], hf_logits(hf, torch.cat([prompts[b], path_tokens]))[-1])
            assert err <= REL_TOL, f"tree {b} node {node}: relative error {err:.2e} against transformers"


@pytest.mark.parametrize("variant, layout", [("gqa", "paged"), ("bias", "contiguous")])
def test_chunked_prefill_matches_hf(hf_checkpoints, variant, layout):
    """Prompts prefilled in ragged chunks (a later chunk attends to the cached earlier ones)."""
    path, hf = hf_checkpoints(variant)
    model = LlamaModel.from_pretrained(path)
    prompts = [torch.randint(0, 256, (n,)) for n in (23, 9)]
    chunks = [(10, 4), (0, 5), (13, 0)]  # rows per request in each forward; request 1 sits out the last
    cache = model.new_cache(2, 32, layout=layout, block_size=4)
    done, rows = [0, 0], [[], []]
    for counts in chunks:
        q_offsets = torch.tensor([0, counts[0], sum(counts)], dtype=torch.int32)
        tokens = torch.cat([prompts[b][done[b] : done[b] + counts[b]] for b in range(2)])
        logits, _ = model(
            tokens, causal_positions(q_offsets, cache.seq_lens, len(tokens)), AttentionMetadata(q_offsets), cache
        )
        cache.advance(list(counts))
        for b in range(2):
            rows[b].append(logits[q_offsets[b] : q_offsets[b + 1]])
            done[b] += counts[b]
    for b in range(2):
        err = rel_err(torch.cat(rows[b]), hf_logits(hf, prompts[b]))
        assert err <= REL_TOL, f"request {b}: relative error {err:.2e}"
