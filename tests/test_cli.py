"""``python -m specdec generate`` on the embedded pair: streams text, ends with a summary line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PAIR = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "pair"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdec", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@pytest.mark.parametrize(
    "strategy,label",
    [
        (["--draft", str(PAIR / "draft")], "[draft chain (K=3)]"),
        (["--draft", str(PAIR / "draft"), "--tree", "2,2"], "[draft tree (7 nodes, coupled)]"),
        (["--ngram", "3"], "[n-gram (K=3, n<=3)]"),
        (["--medusa", str(PAIR.parent / "medusa")], "[medusa (12 nodes)]"),
        (["--medusa", str(PAIR.parent / "medusa"), "--medusa-choices", "[[0], [1], [0, 0]]"], "[medusa (4 nodes)]"),
        ([], "[autoregressive]"),
        (["--eagle", str(PAIR.parent / "eagle"), "--tree-budget", "12", "--depth", "4", "--eagle-top-k", "2"],
         "[EAGLE-2 (budget 12, depth 4, top-k 2)]"),
        (["--eagle", str(PAIR.parent / "eagle"), "--static-tree", "--tree-budget", "8"], "[EAGLE-1 (8 nodes)]"),
        (["--eagle", str(PAIR.parent / "eagle3"), "--tree-budget", "12", "--depth", "4", "--eagle-top-k", "2"],
         "[EAGLE-2 (EAGLE-3 head, budget 12, depth 4, top-k 2)]"),
    ],
)  # fmt: skip
def test_generate_streams_and_summarises(strategy, label):
    result = run_cli(
        "generate", "--target", str(PAIR / "target"), *strategy, "-k", "3",
        "--prompt", "def add(a, b):", "--max-new-tokens", "12", "--threads", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith(label) and "12 tokens" in summary and "tau" in summary


def test_generate_refuses_a_tree_without_a_draft():
    result = run_cli("generate", "--target", str(PAIR / "target"), "--ngram", "2", "--tree", "2,2", "--prompt", "x")
    assert result.returncode == 2 and result.stderr == "error: --tree needs --draft (n-gram drafts are chains)\n"


def completion(*flags: str) -> tuple[str, str]:
    """(the streamed text, the summary line) of a greedy generate on the embedded target."""
    result = run_cli(
        "generate", "--target", str(PAIR / "target"), *flags, "--prompt", "def add(a, b):", "--max-new-tokens", "24",
        "--threads", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text, summary = result.stdout.rstrip("\n").rsplit("\n", 1)
    return text, summary


@pytest.fixture(scope="module")
def plain_text() -> str:
    return completion()[0]


@pytest.mark.parametrize(
    "flags,label",
    [
        (["-k", "4"], "[parallel draft chain (K=4)]"),
        (["-k", "8", "--draft-rule", "stochastic", "--no-adaptive"], "[parallel draft chain (K=8, stochastic)]"),
        (["--max-nodes", "16"], "[parallel draft tree (16 nodes, depth 8)]"),
        (["--max-nodes", "16", "--draft-rule", "deterministic", "--no-adaptive"], "[parallel draft tree (16 nodes,"),
    ],
)
def test_generate_with_a_parallel_draft_gives_target_greedy_text(plain_text, flags, label):
    text, summary = completion("--parallel-draft", str(PAIR.parent / "parallel"), *flags)
    assert text == plain_text and plain_text.strip()
    assert summary.startswith(label) and "24 tokens" in summary
    tau = float(summary.split(" tau ")[1].split(",")[0])
    assert tau > 1, f"the shipped parallel draft gets no token accepted: {summary}"


@pytest.mark.parametrize(
    "flags,label",
    [
        (["-k", "6"], "[parallel EAGLE chain (K=6)]"),
        (["--max-nodes", "16", "--confidence-temperature", "0.5", "--no-adaptive"], "[parallel EAGLE tree (16 nodes,"),
        (["--max-nodes", "12", "--draft-vocabulary", "FREQUENT"], "[parallel EAGLE tree (12 nodes, depth 8)]"),
    ],
)
def test_generate_with_a_parallel_eagle_head_gives_target_greedy_text(plain_text, flags, label, tmp_path):
    from specdec.testing import frequent_token_ids

    vocabulary = tmp_path / "frequent.json"
    vocabulary.write_text(json.dumps(frequent_token_ids().tolist()))
    flags = [str(vocabulary) if f == "FREQUENT" else f for f in flags]
    text, summary = completion("--parallel-eagle", str(PAIR.parent / "parallel_eagle"), *flags)
    assert text == plain_text and summary.startswith(label) and "24 tokens" in summary
    assert float(summary.split(" tau ")[1].split(",")[0]) > 1.5, summary


def test_generate_with_an_eagle_draft_vocabulary_gives_target_greedy_text(plain_text, tmp_path):
    from specdec.testing import frequent_token_ids

    vocabulary = tmp_path / "frequent.json"
    vocabulary.write_text(json.dumps(frequent_token_ids().tolist()))
    flags = ["--eagle-top-k", "1", "--tree-budget", "7", "--depth", "6", "--draft-vocabulary", str(vocabulary)]
    text, summary = completion("--eagle", str(PAIR.parent / "eagle"), *flags)
    assert text == plain_text and summary.startswith("[EAGLE-2 (budget 7, depth 6, top-k 1)]")
    assert float(summary.split(" tau ")[1].split(",")[0]) > 1
