"""The README's kernel tour runs as written."""

from pathlib import Path

from specdec import use_backend

README = Path(__file__).resolve().parents[1] / "README.md"


def test_kernel_tour_runs():
    text = README.read_text()
    start = text.index("```python\nimport torch\nfrom specdec.kernels import")
    code = text[start + len("```python\n") : text.index("```", start + 10)]
    scope: dict = {}
    with use_backend("torch"):
        exec(compile(code, str(README), "exec"), scope)
    assert scope["meta"].depth.tolist() == [0, 1, 1, 2]
    assert scope["meta"].ancestor_mask.flatten().tolist() == [1, 3, 5, 11]
    assert tuple(scope["out"].shape) == (4, 8, 64)
    assert scope["result"].accepted_path[0, 0].item() == 0
