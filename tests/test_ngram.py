"""Prompt-lookup drafts against a plain-Python search."""

import pytest
import torch

from specdec.decoding.ngram import propose_ngram


def python_lookup(text: list[int], k: int, max_n: int, min_n: int) -> tuple[list[int], bool]:
    for n in range(max_n, min_n - 1, -1):
        if len(text) <= n:
            continue
        suffix = text[-n:]
        for s in range(len(text) - n - 1, -1, -1):  # latest first, followed by a known token
            if text[s : s + n] == suffix:
                start = s + n
                return [text[min(start + i, len(text) - 1)] for i in range(k)], True
    return [text[-1]] * k, False


@pytest.mark.parametrize("max_n,min_n,k", [(3, 1, 4), (2, 2, 1), (4, 2, 6)])
def test_matches_python_search_on_random_histories(max_n, min_n, k):
    batch, width = 16, 40
    history = torch.randint(0, 5, (batch, width), dtype=torch.int32)  # small vocab: many matches
    lengths = torch.randint(1, width + 1, (batch,), dtype=torch.int32)
    drafts, matched = propose_ngram(history, lengths, k, max_n, min_n)
    for b in range(batch):
        text = history[b, : lengths[b]].tolist()
        want, found = python_lookup(text, k, max_n, min_n)
        assert drafts[b].tolist() == want, (b, text)
        assert bool(matched[b]) == found


def test_repetitive_text_is_continued():
    text = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    drafts, matched = propose_ngram(torch.tensor([text]), torch.tensor([len(text)]), 3, max_ngram=3)
    assert matched.tolist() == [True] and drafts.tolist() == [[3, 4, 1]]


def test_bad_arguments_are_named():
    h = torch.zeros(2, 5, dtype=torch.int32)
    with pytest.raises(TypeError, match="history must have dtype"):
        propose_ngram(h.float(), torch.ones(2, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="lengths must have shape"):
        propose_ngram(h, torch.ones(3, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="num_draft must be a positive int"):
        propose_ngram(h, torch.ones(2, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        propose_ngram(h, torch.ones(2, dtype=torch.int32), 2, max_ngram=1, min_ngram=2)
