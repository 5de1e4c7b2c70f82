"""The README's API tour runs as written: the kernel block, the model-and-engine block, the Medusa, EAGLE,
parallel-draft and parallel EAGLE blocks."""

from pathlib import Path

from specdec import use_backend

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block(text: str, opening: str) -> str:
    start = text.index("```python\n" + opening)
    return text[start + len("```python\n") : text.index("```", start + 10)]


def test_kernel_tour_runs():
    code = python_block(README.read_text(), "import torch\nfrom specdec.kernels import")
    scope: dict = {}
    with use_backend("torch"):
        exec(compile(code, str(README), "exec"), scope)
    assert scope["meta"].depth.tolist() == [0, 1, 1, 2]
    assert scope["meta"].ancestor_mask.flatten().tolist() == [1, 3, 5, 11]
    assert tuple(scope["out"].shape) == (4, 8, 64)
    assert scope["result"].accepted_path[0, 0].item() == 0


def test_engine_tour_runs():
    code = python_block(README.read_text(), "from pathlib import Path\nimport specdec\n")
    scope: dict = {}
    with use_backend("torch"):
        exec(compile("import torch\n" + code, str(README), "exec"), scope)
        result = scope["result"]
        assert [len(t) for t in result.tokens] == [32, 32]
        plain = scope["SpeculativeDecoder"](scope["target"], scope["NoDraft"]())
        greedy = plain.generate([[1, 15, 27]], max_new_tokens=32, seed=0)
        # The tour's decoder adapts its draft lengths to measured times; with the full chain every step:
        strategy = scope["DraftModelStrategy"](scope["draft"], branching=(1,) * 5)
        fixed = scope["SpeculativeDecoder"](scope["target"], strategy, adaptive=False)
        fixed_result = fixed.generate([[1, 15, 27]], max_new_tokens=32, seed=0)
    assert result.tokens[0] == greedy.tokens[0], "the greedy request must equal plain greedy decoding"
    assert fixed_result.tokens[0] == greedy.tokens[0]
    assert fixed_result.stats[0].tau > 1, "the embedded draft gets tokens accepted"
    assert result.stats[0].drafted > 0, "the adaptive decoder's first step drafts the strategy's own size"
    assert len(result.stats[0].chosen_depths) == result.stats[0].target_forwards - 1


def test_eagle_tour_runs():
    text = README.read_text()
    code = python_block(text, "from pathlib import Path\nimport specdec\n")
    code += python_block(text, "from specdec.decoding import EagleStrategy\n")
    scope: dict = {}
    with use_backend("torch"):
        exec(compile("import torch\n" + code, str(README), "exec"), scope)
        plain = scope["SpeculativeDecoder"](scope["target"], scope["NoDraft"]())
        greedy = plain.generate([[1, 15, 27]], max_new_tokens=32)
    assert scope["result"].tokens == greedy.tokens
    assert scope["result"].stats[0].accepted > 0, "the shipped EAGLE head gets tokens accepted"


def test_medusa_tour_runs():
    opening = "from pathlib import Path\nimport specdec\nfrom specdec.model import LlamaModel\n"
    opening += "from specdec.decoding import MedusaStrategy"
    code = python_block(README.read_text(), opening)
    scope: dict = {}
    with use_backend("torch"):
        exec(compile("import torch\n" + code, str(README), "exec"), scope)
        result, target = scope["result"], scope["target"]
        greedy = scope["SpeculativeDecoder"](target).generate([[1, 15, 27]], max_new_tokens=32, seed=0)
    assert [len(t) for t in result.tokens] == [32, 32]
    assert result.tokens[0] == greedy.tokens[0], "the greedy request must equal plain greedy decoding"
    assert scope["medusa"].max_nodes == 12 and result.stats[0].tau > 1


def test_parallel_draft_tour_runs():
    text = README.read_text()
    code = python_block(text, "from pathlib import Path\nimport specdec\n")
    code += python_block(text, "from specdec.decoding import ParallelDraftStrategy\n")
    scope: dict = {}
    with use_backend("torch"):
        exec(compile("import torch\n" + code, str(README), "exec"), scope)
        decoder = scope["SpeculativeDecoder"]
        greedy = decoder(scope["target"], scope["NoDraft"]()).generate([[1, 15, 27]], max_new_tokens=32)
        chain = decoder(scope["target"], scope["chain"]).generate([[1, 15, 27]], max_new_tokens=32)
    assert scope["result"].tokens == greedy.tokens and chain.tokens == greedy.tokens
    assert scope["result"].stats[0].accepted > 0, "the shipped parallel draft gets tokens accepted"
    assert (scope["chain"].max_depth, scope["tree"].max_nodes) == (5, 8)


def test_parallel_eagle_tour_runs():
    text = README.read_text()
    code = python_block(text, "from pathlib import Path\nimport specdec\n")
    code += python_block(text, "from specdec.decoding import ParallelEagleStrategy\n")
    scope: dict = {}
    with use_backend("torch"):
        exec(compile("import torch\n" + code, str(README), "exec"), scope)
        greedy = scope["SpeculativeDecoder"](scope["target"], scope["NoDraft"]()).generate([[1, 15, 27]],
                                                                                         max_new_tokens=32)  # fmt: skip
    assert scope["result"].tokens == greedy.tokens
    assert scope["result"].stats[0].accepted > 0, "the shipped parallel EAGLE head gets tokens accepted"
