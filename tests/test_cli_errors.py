"""The command line's failures: one ``error:`` line naming the flag or file, exit 2 (usage) or 1 (runtime).

Each case of issue 13 runs in-process through ``main([...])``; one subprocess run shows that no
traceback reaches the terminal unless ``SPECDEC_DEBUG=1`` asks for it.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdec import validation
from specdec.cli import main
from specdec.model import LlamaModel, MedusaHeads, ModelConfig

PAIR = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "pair"
TARGET = str(PAIR / "target")
PROMPT = "def add(a, b):"


def save_checkpoint(path: Path, hf: dict, *, nan: bool = False, tokenizer: bool = True) -> str:
    """config.json + model.safetensors (random weights, or NaN everywhere) + the pair's tokenizer."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf))
    model = LlamaModel(ModelConfig.from_hf(hf))
    tensors = {name: t.detach().clone().contiguous() for name, t in model.hf_state_dict().items()}
    if nan:
        tensors = {name: torch.full_like(t, float("nan")) for name, t in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"))
    if tokenizer:
        shutil.copy(PAIR / "target" / "tokenizer.json", path / "tokenizer.json")
    return str(path)


def tiny_hf(vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": 0,
    }  # fmt: skip


def save_medusa_heads(path: Path, hidden_size: int, *, pickle: bool = False) -> str:
    """Two random heads in the authors' layout for a 4096-token vocabulary; ``pickle``: as medusa_lm_head.pt only."""
    MedusaHeads(hidden_size, 4096, num_heads=2).save_pretrained(path)
    if pickle:
        torch.save({"0.1.weight": torch.zeros(4096, hidden_size)}, path / "medusa_lm_head.pt")
        (path / "medusa_lm_head.safetensors").unlink()
    return str(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    (root / "empty").mkdir()
    return {
        "medusa": str(PAIR.parent / "medusa"),
        "medusa_other_hidden": save_medusa_heads(root / "medusa_other_hidden", 32),
        "medusa_pickle": save_medusa_heads(root / "medusa_pickle", 256, pickle=True),
        "target": TARGET,
        "draft": str(PAIR / "draft"),
        "other_vocab": save_checkpoint(root / "other_vocab", tiny_hf(100), tokenizer=False),
        "nan": save_checkpoint(root / "nan", tiny_hf(4096), nan=True),
        "no_weights": str(root / "empty"),
        "eagle": str(PAIR.parent / "eagle"),
        "eagle_pickle": eagle_pickle(root / "eagle_pickle"),
        "eagle3": str(PAIR.parent / "eagle3"),
        "ids_repeated": write_text(root / "repeated.json", "[5, 9, 5]"),
        "ids_not_json": write_text(root / "not.json", "5, 9"),
        "parallel": str(PAIR.parent / "parallel"),
        "parallel_eagle": str(PAIR.parent / "parallel_eagle"),
        "parallel_other_tokenizer": parallel_other_tokenizer(root / "parallel_other_tokenizer"),
    }


def parallel_other_tokenizer(path: Path) -> str:
    """The shipped parallel draft with a tokenizer.json whose first two tokens swap ids."""
    shutil.copytree(PAIR.parent / "parallel", path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(path)


def write_text(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def eagle_pickle(path: Path) -> str:
    """An EAGLE head directory as the authors publish it: config.json and pytorch_model.bin only."""
    path.mkdir()
    shutil.copy(PAIR.parent / "eagle" / "config.json", path / "config.json")
    (path / "pytorch_model.bin").write_bytes(b"not read")
    return str(path)


def run(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["generate", *args])
    out, err = capsys.readouterr()
    return status, out, err


def error_line(err: str) -> str:
    """The one line a failure prints (asserting that it is one line and has no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def prompt_of_700_tokens() -> tuple[str, int]:
    from specdec.cli.generate import load_tokenizer

    text = " ".join(f"x{i}" for i in range(300))
    return text, len(load_tokenizer(TARGET).encode(text).ids)


CASES = {
    # name: (flags after "generate", exit status, the error line as a regex)
    "threads 0": (["--threads", "0"], 2, r"argument --threads: must be an int >= 1, got 0$"),
    "threads not an int": (["--threads", "two"], 2, r"argument --threads: must be an int, got 'two'$"),
    "missing checkpoint": (
        ["--target", "/no/such/checkpoint"], 2,
        r"argument --target: '/no/such/checkpoint' is not a directory \(a local checkpoint directory is expected\)$",
    ),
    "checkpoint without files": (["--target", "{no_weights}"], 1, r"--target .*empty: .*tokenizer.json not found"),
    "draft with another vocabulary": (
        ["--draft", "{other_vocab}"], 1,
        r"--draft .*other_vocab: draft and target must share a vocabulary: target has 4096 tokens, draft has 100$",
    ),
    "temperature 1e-40": (
        ["--temperature", "1e-40"], 2, r"argument --temperature: must be 0 \(greedy\) or a finite float >= 1e-30 \(",
    ),
    "temperature nan": (["--temperature", "nan"], 2, r"argument --temperature: must be 0 \(greedy\) .* got nan$"),
    "top-k 10000000000": (
        ["--top-k", "10000000000"], 2, r"--top-k must be an int in \[0, 4096\] \(0 = off\), got 10000000000$",
    ),
    "top-p 0": (["--top-p", "0"], 2, r"argument --top-p: must be a finite number in \(0.0, 1.0\], got 0.0$"),
    "seed 2**70": (
        ["--seed", str(2**70)], 2,
        r"argument --seed: must be an int in \[-9223372036854775808, 9223372036854775807\], "
        r"got 1180591620717411303424$",
    ),
    "tree a,b": (
        ["--draft", "{draft}", "--tree", "a,b"], 2,
        r"argument --tree: must be positive ints, one per depth, like 4,2,2,1; got 'a,b'$",
    ),
    "tree empty": (["--draft", "{draft}", "--tree", ""], 2, r"argument --tree: must be positive ints, .* got ''$"),
    "tree 2,0": (["--draft", "{draft}", "--tree", "2,0"], 2, r"argument --tree: must be positive ints, .* got '2,0'$"),
    "tree without a draft": (["--ngram", "2", "--tree", "2,2"], 2, r"--tree needs --draft \(n-gram drafts are chains"),
    "eagle-top-k beyond the vocabulary": (
        ["--eagle", "{eagle}", "--eagle-top-k", "5000"], 2,
        r"--eagle-top-k must be at most the vocabulary \(4096\), got 5000$",
    ),
    "tree-budget 0": (
        ["--eagle", "{eagle}", "--tree-budget", "0"], 2, r"argument --tree-budget: must be an int >= 1, got 0$",
    ),
    "depth 0": (["--eagle", "{eagle}", "--depth", "0"], 2, r"argument --depth: must be an int >= 1, got 0$"),
    "draft vocabulary without eagle": (
        ["--draft-vocabulary", "{ids_repeated}"], 2, r"--draft-vocabulary needs --eagle or --parallel-eagle$",
    ),
    "draft vocabulary with repeated ids": (
        ["--eagle", "{eagle}", "--draft-vocabulary", "{ids_repeated}"], 2,
        r"^error: --draft-vocabulary .*repeated.json: its ids must be distinct, got 5 more than once$",
    ),
    "draft vocabulary not json": (
        ["--eagle", "{eagle}", "--draft-vocabulary", "{ids_not_json}"], 2,
        r"^error: --draft-vocabulary .*not.json: Extra data",
    ),
    "draft vocabulary missing": (
        ["--eagle", "{eagle}", "--draft-vocabulary", "{no_weights}/ids.json"], 2,
        r"^error: --draft-vocabulary .*ids.json: \[Errno 2\] No such file or directory",
    ),
    "draft vocabulary for an eagle-3 head": (
        ["--eagle", "{eagle3}", "--draft-vocabulary", "{ids_repeated}"], 2,
        r"--draft-vocabulary is for EAGLE-1/2 heads: an EAGLE-3 head has its own \(d2t\)$",
    ),
    "eagle head for another target": (
        ["--eagle", "{draft}"], 1,
        r"--eagle .*draft: EAGLE head .* does not fit the target: its hidden_size is 128, the target's is 256$",
    ),
    "eagle pickle": (
        ["--eagle", "{eagle_pickle}"], 1,
        r"--eagle .*eagle_pickle: .* holds only pytorch_model.bin, a pickle checkpoint",
    ),
    "medusa heads for another hidden size": (
        ["--medusa", "{medusa_other_hidden}"], 1,
        r"--medusa .*medusa_other_hidden: Medusa heads .* does not fit the target: its hidden_size is 32, the "
        r"target's is 256$",
    ),
    "medusa pickle": (
        ["--medusa", "{medusa_pickle}"], 1,
        r"--medusa .*medusa_pickle: .* holds only medusa_lm_head.pt, a pickle checkpoint; specdec loads safetensors "
        r"only .* convert it once: python -c",
    ),
    "medusa choices not JSON": (
        ["--medusa", "{medusa}", "--medusa-choices", "[[0], [1]"], 2,
        r"argument --medusa-choices: must be a preset name or a JSON list of paths like \[\[0\],\[1\],\[0,0\]\]; "
        r"got '\[\[0\], \[1\]'$",
    ),
    "medusa choices without a prefix": (
        ["--medusa", "{medusa}", "--medusa-choices", "[[0], [1, 0], [1]]"], 2,
        r"--medusa-choices\[1\] = \[1, 0\]: its prefix \[1\] is listed after it \(every path must come after",
    ),
    "medusa choices beyond top-k": (
        ["--medusa", "{medusa}", "--medusa-choices", "[[0], [3]]", "--medusa-top-k", "3"], 2,
        r"--medusa-choices\[1\] = \[3\] takes candidate 3; --medusa-top-k is 3$",
    ),
    "medusa choices over the node budget": (
        ["--medusa", "{medusa}", "--medusa-choices", "tree-16", "--max-nodes", "8"], 2,
        r"--medusa-choices has 15 paths: with the root that is 16 nodes, more than the budget of 8 \(--max-nodes\)$",
    ),
    "medusa choices deeper than the heads": (
        ["--medusa", "{medusa}", "--medusa-choices", "[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]"], 2,
        r"--medusa-choices\[4\] = \[0, 0, 0, 0, 0\] is 5 deep; at most 4 allowed",
    ),
    "medusa choices not a preset": (
        ["--medusa", "{medusa}", "--medusa-choices", "tree-9"], 2,
        r"--medusa-choices 'tree-9' is not a preset; the presets are \['chain', 'default', 'tree-8', 'tree-12'",
    ),
    "medusa choices without medusa": (["--medusa-choices", "chain"], 2, r"--medusa-choices needs --medusa$"),
    "medusa with a draft": (
        ["--medusa", "{medusa}", "--draft", "{draft}"], 2, r"argument --draft: not allowed with argument --medusa$",
    ),
    "tree with medusa": (
        ["--medusa", "{medusa}", "--tree", "2,2"], 2, r"--tree needs --draft \(a Medusa tree is --medusa-choices\)$",
    ),
    "parallel draft -k beyond its block": (
        ["--parallel-draft", "{parallel}", "-k", "9"], 2,
        r"^error: -k must be an int in \[1, 8\] \(the draft's block_size\), got 9$",
    ),
    "parallel draft tree with the stochastic rule": (
        ["--parallel-draft", "{parallel}", "--max-nodes", "16", "--draft-rule", "stochastic"], 2,
        r"^error: trees from a parallel draft are verified by the deterministic rule; got --draft-rule 'stochastic'$",
    ),
    "parallel draft not a PARD checkpoint": (
        ["--parallel-draft", "{draft}"], 1,
        r"^error: --parallel-draft .*/pair/draft: .*/pair/draft/config.json has no 'pard_token': not a parallel draft "
        r"\(PARD\) checkpoint$",
    ),
    "parallel draft with another tokenizer": (
        ["--parallel-draft", "{parallel_other_tokenizer}"], 1,
        r"^error: --parallel-draft .*parallel_other_tokenizer: .*tokenizer.json and .*/pair/target/tokenizer.json "
        r"differ \(their token-to-id maps are not the same\)$",
    ),
    "tree with a parallel draft": (
        ["--parallel-draft", "{parallel}", "--tree", "2,2"], 2,
        r"^error: --tree needs --draft \(a parallel draft's tree is --max-nodes\)$",
    ),
    "parallel EAGLE -k beyond its block": (
        ["--parallel-eagle", "{parallel_eagle}", "-k", "9"], 2,
        r"^error: -k must be an int in \[1, 8\] \(the head's block_size\), got 9$",
    ),
    "parallel EAGLE not a parallel head": (
        ["--parallel-eagle", "{eagle}"], 1,
        r"^error: --parallel-eagle .*/eagle: config.json has no 'parallel_block_size': not a parallel EAGLE head",
    ),
    "parallel EAGLE head as an EAGLE head": (
        ["--eagle", "{parallel_eagle}"], 1,
        r"^error: --eagle .*/parallel_eagle: config.json has 'parallel_block_size': a parallel EAGLE head, which loads "
        r"with ParallelEagleHead.from_pretrained$",
    ),
    "parallel EAGLE with a bad draft vocabulary": (
        ["--parallel-eagle", "{parallel_eagle}", "--draft-vocabulary", "{ids_repeated}"], 2,
        r"^error: --draft-vocabulary .*repeated.json: its ids must be distinct, got 5 more than once$",
    ),
    "tree with a parallel EAGLE head": (
        ["--parallel-eagle", "{parallel_eagle}", "--tree", "2,2"], 2,
        r"^error: --tree needs --draft \(a parallel draft's tree is --max-nodes\)$",
    ),
    "parallel draft with a draft": (
        ["--parallel-draft", "{parallel}", "--draft", "{draft}"], 2,
        r"argument --draft: not allowed with argument --parallel-draft$",
    ),
    "device tpu9": (["--device", "tpu9"], 2, r"argument --device: 'tpu9' is not a device torch knows"),
    "max-new-tokens 1e9 beyond positions": (
        ["--max-new-tokens", "1000000000"], 2,
        r"--prompt\[0\] \(7 tokens\) \+ --max-new-tokens \(1000000000\) = 1000000007 tokens, beyond the model's "
        r"max_position_embeddings \(512\); .* or pass --allow-beyond-max-positions to run past",
    ),
    "max-new-tokens 1e9 beyond memory": (
        ["--max-new-tokens", "1000000000", "--allow-beyond-max-positions"], 1,
        r"KV cache \(9, 2, 1, 1000000006, 4, 32\) needs 8.4 TiB, more than 90% of the .* available on cpu; "
        r"lower --max-new-tokens \(1000000000; caches hold prompt \+ --max-new-tokens\) or the batch \(1\)$",
    ),
    "max-new-tokens negative": (["--max-new-tokens", "-1"], 2, r"argument --max-new-tokens: must be an int in \[0, "),
    "empty prompt": (["--prompt", ""], 2, r"--prompt\[1\] is empty; every prompt needs at least one token$"),
    "missing --prompt": (["--target", "{target}"], 2, r"the following arguments are required: --prompt$"),
    "unknown flag": (["--top_k", "3"], 2, r"unrecognized arguments: --top_k 3$"),
    "num-blocks 0": (["--num-blocks", "0"], 2, r"argument --num-blocks: must be an int >= 1, got 0$"),
    "block-size 1.5": (["--num-blocks", "4", "--block-size", "1.5"], 2, r"argument --block-size: must be an int"),
    "num-blocks below the prompt": (
        ["--num-blocks", "1", "--block-size", "4"], 2,
        r"--num-blocks \(1\) is too small: every prompt and its first token must fit at once, 2 blocks of 4 tokens "
        r"in all; raise --num-blocks or send a smaller batch$",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_each_user_error_prints_one_line_and_the_right_status(case, paths, capsys):
    flags, status, pattern = CASES[case]
    flags = [f.format(**paths) for f in flags]
    base = [] if "--target" in flags else ["--target", TARGET]
    base += [] if case == "missing --prompt" else ["--prompt", PROMPT]
    got, _, err = run(capsys, *base, "--max-new-tokens", "4", *flags)
    assert re.search(pattern, error_line(err)), error_line(err)
    assert got == status


def test_a_700_token_prompt_on_the_512_position_pair(capsys):
    text, count = prompt_of_700_tokens()
    assert count >= 700
    status, _, err = run(capsys, "--target", TARGET, "--prompt", text, "--max-new-tokens", "8")
    assert status == 2
    assert re.search(rf"--prompt\[0\] \({count} tokens\) \+ --max-new-tokens \(8\) = {count + 8} tokens, beyond the "
                     r"model's max_position_embeddings \(512\)", error_line(err))  # fmt: skip


def test_about_two_million_new_tokens_are_refused_for_memory_not_killed(capsys, monkeypatch):
    monkeypatch.setattr(validation, "available_memory", lambda device: 8 * 2**30)
    args = ["--target", TARGET, "--prompt", PROMPT, "--max-new-tokens", "2000000", "--allow-beyond-max-positions"]
    status, _, err = run(capsys, *args)
    assert status == 1
    # 9 layers x K/V x 4 KV heads x 32 x 4 bytes = 9 KiB per token, for 7 + 2000000 - 2 + 1 tokens.
    assert re.search(r"^error: KV cache \(9, 2, 1, 2000006, 4, 32\) needs 17.2 GiB, more than 90% of the 8.0 GiB "
                     r"available on cpu; lower --max-new-tokens \(2000000;", error_line(err))  # fmt: skip


def test_nan_weights_report_the_invalid_request_and_fail(paths, capsys):
    status, out, err = run(capsys, "--target", paths["nan"], "--prompt", PROMPT, "--max-new-tokens", "4")
    assert status == 1
    assert "[autoregressive] 0 tokens" in out
    assert re.search(r"^error: --prompt 'def add\(a, b\):' ended 'invalid' after 0 tokens: the target's logits held "
                     r"no valid token \(NaN or all -inf", error_line(err))  # fmt: skip


def test_a_request_the_bounded_cache_cannot_hold_is_reported_and_fails(capsys):
    # 7 prompt tokens in a pool of 2 x 8 slots: the 10th new token is the last the pool can take.
    args = ["--target", TARGET, "--prompt", PROMPT, "--max-new-tokens", "40", "--num-blocks", "2", "--block-size", "8"]
    status, out, err = run(capsys, *args)
    assert status == 1
    assert "[autoregressive] 10 tokens" in out
    assert re.search(r"^error: --prompt 'def add\(a, b\):' ended 'cache' after 10 tokens: the paged KV cache's pool "
                     r"\(--num-blocks\) could not hold it", error_line(err))  # fmt: skip
    status, out, err = run(capsys, *args[:5], "10", *args[6:])  # 10 new tokens fit: a clean run
    assert status == 0 and err == "" and "[autoregressive] 10 tokens" in out


def test_a_good_run_exits_0_and_prints_no_error(capsys):
    status, out, err = run(capsys, "--target", TARGET, "--ngram", "2", "--prompt", PROMPT, "--max-new-tokens", "6")
    assert status == 0 and err == ""
    assert out.strip().splitlines()[-1].startswith("[n-gram (K=5, n<=2)] 6 tokens")


def test_demo_and_info_flags(capsys):
    assert main(["demo", "--device", "tpu9"]) == 2
    assert re.search(r"^error: argument --device: 'tpu9' is not a device", error_line(capsys.readouterr().err))
    assert main(["frobnicate"]) == 2
    assert re.search(r"^error: argument command: invalid choice: 'frobnicate'", error_line(capsys.readouterr().err))


def test_unexpected_errors_are_one_line_unless_debug_is_asked_for(capsys, monkeypatch):
    import specdec.cli.generate

    def broken(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(specdec.cli.generate, "main", broken)
    args = ["--target", TARGET, "--prompt", PROMPT]
    status, _, err = run(capsys, *args)
    assert status == 1
    hint = "(run with --debug or SPECDEC_DEBUG=1 for the traceback)"
    assert error_line(err) == f"error: unexpected RuntimeError: boom {hint}"
    for debug_args, env in ((["--debug"], None), ([], "1")):
        if env:
            monkeypatch.setenv("SPECDEC_DEBUG", env)
        status, _, err = run(capsys, *args, *debug_args)
        assert status == 1 and err.startswith("Traceback (most recent call last):")
        assert err.strip().splitlines()[-1] == "error: unexpected RuntimeError: boom"


def test_no_traceback_reaches_the_terminal(paths):
    """A real process: a runtime failure deep in loading prints one line; SPECDEC_DEBUG=1 adds the traceback."""
    command = [sys.executable, "-m", "specdec", "generate", "--target", TARGET, "--draft", paths["other_vocab"],
               "--prompt", PROMPT]  # fmt: skip
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    env.pop("SPECDEC_DEBUG", None)
    quiet = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert quiet.returncode == 1 and quiet.stdout == ""
    assert "Traceback" not in quiet.stderr
    assert re.search(r"^error: --draft .*: draft and target must share a vocabulary", error_line(quiet.stderr))
    loud = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**env, "SPECDEC_DEBUG": "1"})
    assert loud.returncode == 1 and "Traceback (most recent call last):" in loud.stderr
    assert loud.stderr.strip().splitlines()[-1] == error_line(quiet.stderr)
