"""What the draft-head training scripts share: corpus, frozen target, greedy continuations, features, held-out set.

The corpus, its train/held-out split (by path hash) and the tokenizer are those of the
embedded pair (``train_embedded_pair.py``); the tokenizer is read from the target's
``tokenizer.json`` instead of being retrained. Heads learn what they will face at
inference: the target's own greedy continuations of code prompts (prompts ending right
after a ``def ...:`` line, as in the demo), plus plain corpus windows for variety. The
held-out set is greedy continuations of held-out prompts, generated and featurised with
specdec's own model in float32, exactly as the engine will see them.
"""

from __future__ import annotations

import math
import platform
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from train_embedded_pair import EOS, command_line, corpus_files, encode_stream, read_text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's specdec, whichever one is installed
TARGET_DIR = ROOT / "specdec" / "assets" / "pair" / "target"


@dataclass
class Corpus:
    train_texts: list[str]
    heldout: list[tuple[str, str]]  # (path relative to the stdlib, text)
    tokenizer: object
    eos_id: int
    train_stream: torch.Tensor  # int32, every training file followed by EOS

    def summary(self) -> dict:
        return {
            "python": platform.python_version(),
            "stdlib_files_train": len(self.train_texts),
            "stdlib_files_heldout": len(self.heldout),
            "train_tokens": self.train_stream.numel(),
        }


def load_corpus(target_dir: Path = TARGET_DIR, max_files: int | None = None) -> Corpus:
    """The embedded pair's corpus and split; ``max_files`` keeps the first training files only (quick runs)."""
    from tokenizers import Tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_files, heldout_files = corpus_files(stdlib)
    train_texts = [t for t in map(read_text, train_files[:max_files]) if t]
    heldout = [(p.relative_to(stdlib).as_posix(), t) for p in heldout_files if (t := read_text(p))]
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return Corpus(train_texts, heldout, tokenizer, tokenizer.token_to_id(EOS), encode_stream(tokenizer, train_texts))


def load_targets(target_dir: Path = TARGET_DIR):
    """(specdec ``LlamaModel``, transformers ``LlamaForCausalLM``) of the frozen target, both float32.

    specdec's model generates and featurises the held-out set (what the engine sees); the
    transformers one featurises training batches (several times faster on the CPU in bf16 autocast).
    """
    from transformers import LlamaForCausalLM

    from specdec.model import LlamaModel

    target = LlamaModel.from_pretrained(target_dir, dtype=torch.float32)
    hf = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    return target, hf


def def_prompts(texts: list[str], tokenizer, per_file: int, min_tokens: int, max_tokens: int) -> list[list[int]]:
    """Token ids of up to ``per_file`` prompts per text, each ending right after a ``def ...:`` line."""
    prompts = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        ends = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and line.rstrip().endswith(":")]
        taken = 0
        for i in ends[:: max(1, len(ends) // per_file)]:
            ids = tokenizer.encode("".join(lines[max(0, i - 40) : i + 1])).ids[-max_tokens:]
            if len(ids) >= min_tokens:
                prompts.append(ids)
                taken += 1
            if taken == per_file:
                break
    return prompts


def greedy_sequences(target, prompts: list[list[int]], new_tokens: int, batch: int = 64) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation (float32, specdec's engine; stops at EOS)."""
    from specdec import use_backend
    from specdec.decoding.autoregressive import generate

    out = []
    with use_backend("torch"), torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            for prompt, cont in zip(chunk, generate(target, chunk, max_new_tokens=new_tokens)):
                out.append(prompt + cont)
    return out


@torch.no_grad()
def hf_features(hf, tokens: torch.Tensor, bf16: bool = True) -> torch.Tensor:
    """float32 ``[B, T, H]``: the target's last hidden states (after the final norm) for ``tokens [B, T]``."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return hf.model(input_ids=tokens).last_hidden_state.float()


@torch.no_grad()
def specdec_features(target, sequence: list[int]) -> torch.Tensor:
    """float32 ``[T, H]`` hidden states of one sequence from specdec's model (one prefill)."""
    from specdec import use_backend
    from specdec.model import AttentionMetadata, causal_positions

    tokens = torch.tensor(sequence)
    cache = target.new_cache(1, len(sequence))
    meta = AttentionMetadata(torch.tensor([0, len(sequence)], dtype=torch.int32))
    with use_backend("torch"):
        _, hidden = target(tokens, causal_positions(meta.q_offsets, cache.seq_lens, len(sequence)), meta, cache,
                           logits_rows=torch.tensor([0]))  # fmt: skip
    return hidden


@dataclass
class HeldOut:
    """Greedy continuations of held-out prompts with their float32 features (specdec's model)."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    features: list[torch.Tensor]

    @property
    def generated_tokens(self) -> int:
        return sum(len(s) - p for s, p in zip(self.sequences, self.prompt_lens))


def heldout_set(corpus: Corpus, target, per_file: int, new_tokens: int, max_prompt: int = 96) -> HeldOut:
    prompts = def_prompts([t for _, t in corpus.heldout], corpus.tokenizer, per_file, max_prompt // 2, max_prompt)
    sequences = greedy_sequences(target, prompts, new_tokens)
    return HeldOut(sequences, [len(p) for p in prompts], [specdec_features(target, s) for s in sequences])


def prepare_data(corpus: Corpus, target, args, cache_dir: str | None) -> tuple[list[list[int]], list[int], HeldOut]:
    """(greedy training sequences, their prompt lengths, held-out set), or the same read from ``cache_dir``.

    The data depend only on the corpus, the target and the prompt settings, so runs that share
    them (experiments, the EAGLE and Medusa scripts) can share one generation.
    """
    key = f"greedy{args.greedy_per_file}x{args.greedy_tokens}_heldout{args.heldout_per_file}x{args.heldout_tokens}"
    file = None if cache_dir is None else Path(cache_dir) / f"{key}_{len(corpus.train_texts)}files.pt"
    if file is not None and file.is_file():
        data = torch.load(file)
        return data["greedy"], data["prompt_lens"], HeldOut(**data["heldout"])
    prompts = def_prompts(corpus.train_texts, corpus.tokenizer, args.greedy_per_file, 48, 96)
    greedy = greedy_sequences(target, prompts, args.greedy_tokens)
    heldout = heldout_set(corpus, target, args.heldout_per_file, args.heldout_tokens)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"greedy": greedy, "prompt_lens": [len(p) for p in prompts], "heldout": vars(heldout)}, file)
    return greedy, [len(p) for p in prompts], heldout


class TrainingData:
    """Random training batches ``[B, T+1]`` mixing greedy sequences (prompt + continuation) and corpus windows.

    A greedy sequence shorter than ``T + 1`` follows a random corpus window and an EOS (an
    earlier file), so every row is real text and the sequence starts like a fresh one.
    """

    def __init__(self, corpus: Corpus, greedy: list[list[int]], seq_len: int, greedy_share: float, seed: int):
        self.stream, self.greedy, self.seq_len, self.greedy_share = corpus.train_stream, greedy, seq_len, greedy_share
        self.eos = corpus.eos_id
        self.rng = random.Random(seed)

    def window(self) -> list[int]:
        start = self.rng.randrange(0, self.stream.numel() - self.seq_len - 1)
        return self.stream[start : start + self.seq_len + 1].tolist()

    def batch(self, size: int) -> torch.Tensor:
        rows = []
        for _ in range(size):
            if self.greedy and self.rng.random() < self.greedy_share:
                seq = self.rng.choice(self.greedy)[-self.seq_len :]
                seq = self.window()[: self.seq_len - len(seq)] + [self.eos] + seq
            else:
                seq = self.window()
            rows.append(seq)
        return torch.tensor(rows, dtype=torch.long)


def add_data_arguments(parser, *, greedy_per_file: int, threads: int) -> None:
    """The options every head script shares: its greedy training data and held-out set (``prepare_data``), where to
    cache them, the seed and the intra-op threads."""
    parser.add_argument("--greedy-per-file", type=int, default=greedy_per_file, help="training prompts per file")
    parser.add_argument("--greedy-tokens", type=int, default=128, help="greedy continuation length")
    parser.add_argument("--greedy-share", type=float, default=0.75, help="share of batch rows from greedy text")
    parser.add_argument("--heldout-per-file", type=int, default=2)
    parser.add_argument("--heldout-tokens", type=int, default=128, help="held-out continuation length")
    parser.add_argument("--data-cache", default=None, help="directory to reuse (or keep) the generated data in")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=threads, help="intra-op threads (1 on a busy 2-core machine)")


def report_header(script: str, argv, args, corpus: Corpus, greedy, prompt_lens, heldout: HeldOut) -> dict:
    """The fields every training report opens with: the command, seed, threads, torch, corpus, training data and
    held-out set (a script adds its own fields after them)."""
    return {
        "command": command_line(script, argv),
        "seed": args.seed,
        "threads": args.threads,
        "torch": torch.__version__,
        "corpus": corpus.summary(),
        "training_data": {
            "greedy_sequences": len(greedy),
            "greedy_tokens_generated": sum(len(s) - p for s, p in zip(greedy, prompt_lens)),
            "greedy_share_of_rows": args.greedy_share,
            "seq_len": args.seq_len,
            "batch": args.batch,
        },
        "heldout": {"sequences": len(heldout.sequences), "generated_tokens": heldout.generated_tokens},
    }


def minutes_report(start: float, step_times: list[float], **phases: float) -> dict:
    """A training report's "minutes": each phase's (data, training, ...), the total since ``start``
    (``time.perf_counter``) and the training's estimate on an unshared machine (every step at the 10th-percentile
    step time)."""
    steps = len(step_times)
    return phases | {
        "total": (time.perf_counter() - start) / 60,
        "unshared_training_estimate": sorted(step_times)[math.ceil(0.1 * steps) - 1] * steps / 60,
    }
