"""End-to-end decode throughput: specdec's model + autoregressive loop vs transformers' ``generate``.

Both run greedy decoding of the same random LLaMA checkpoint (built with transformers,
its weights copied into specdec's model) for B prompts of equal length, so neither
needs padding. Decode tokens/s = B * (N - 1) / (t(N new tokens) - t(1 new token)): the
one-token run is prefill plus the first sample, so the difference is the N - 1 decode
steps. The four runs interleave; CPU times are the thread's CPU time (``common.measure_many_us``).
The last column is the fraction of requests whose N greedy tokens are identical between the two
(all of them in float32; bf16 on a GPU may legitimately drift after a near-tie).

    python bench/bench_model.py --quick        # CPU: 4 layers, hidden 256, fp32, N = 32, one thread
    python bench/bench_model.py --dry-run      # the GPU check's rehearsal: N = 8, batch 1 and 2
    python bench/bench_model.py --out OUT      # GPU: 8 layers of TinyLlama-1.1B's shape, bf16, N = 64
"""

from __future__ import annotations

import torch
from common import Table, bench_args, cpu_threads, measure_many_us

from specdec.decoding.autoregressive import generate
from specdec.model import LlamaModel, ModelConfig

QUICK = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    vocab_size=2048,
)  # fmt: skip
FULL = dict(  # TinyLlama-1.1B's layer shape, 8 of its 22 layers so the run fits the GPU check's budget
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
    vocab_size=32000,
)  # fmt: skip


def build_models(shape: dict, dtype: torch.dtype, device: str):
    import transformers

    config = transformers.LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.copy_(1 + 0.2 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0, 0.05)
    with torch.device("meta"):  # shapes only: every value comes from the transformers model
        ours = LlamaModel(ModelConfig.from_hf(config.to_dict() | {"architectures": ["LlamaForCausalLM"]}))
    ours.load_hf_state_dict(hf.state_dict(), assign=True)
    ours.rope_inv_freq = ours.config.rope_inv_freq(device)
    return hf, ours.requires_grad_(False).eval()


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    device = args.device
    quick = args.quick or not device.startswith("cuda")
    shape, dtype, new_tokens, prompt_len = (QUICK, torch.float32, 32, 16) if quick else (FULL, torch.bfloat16, 64, 64)
    cpu_threads(device)
    if args.dry_run:
        new_tokens, prompt_len = 8, 8
    hf, ours = build_models(shape, dtype, device)
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    table = Table(
        f"Decode throughput, {layers} layers x hidden {hidden}, {str(dtype).replace('torch.', '')}, "
        f"prompt {prompt_len}, {new_tokens} new tokens, greedy ({device})",
        ["batch", "specdec tok/s", "transformers tok/s", "speedup", "specdec ms/step", "hf ms/step", "same tokens"],
        configs=True,
    )
    for batch in (1, 2) if args.dry_run else (1, 8):
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, shape["vocab_size"], (batch, prompt_len), generator=gen)
        ids = prompts.to(device)

        def run_ours(n, prompts=prompts):
            return generate(ours, list(prompts), max_new_tokens=n, eos_token_id=None)

        def run_hf(n, ids=ids):
            with torch.no_grad():
                return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[:, prompt_len:]

        same = sum(a == b for a, b in zip(run_ours(new_tokens), run_hf(new_tokens).tolist()))
        fns = [lambda run=run, n=n: run(n) for run in (run_ours, run_hf) for n in (new_tokens, 1)]  # interleaved
        (ours_full, *_), (ours_first, *_), (hf_full, *_), (hf_first, *_) = measure_many_us(fns, device, min_runs=3)
        step_ms = {
            "ours": (ours_full - ours_first) / (new_tokens - 1) / 1e3,
            "hf": (hf_full - hf_first) / (new_tokens - 1) / 1e3,
        }
        tok_s = {name: batch / (ms / 1e3) for name, ms in step_ms.items()}
        table.add(
            batch, tok_s["ours"], tok_s["hf"], f"{tok_s['ours'] / tok_s['hf']:.2f}x",
            f"{step_ms['ours']:.2f}", f"{step_ms['hf']:.2f}", f"{same}/{batch}",
        )  # fmt: skip
    table.write(args.out, "bench_model")


if __name__ == "__main__":
    main()
