"""End-to-end speculative decoding with the embedded pair: specdec vs HuggingFace, one run, same prompts.

One run prints these tables, in this order, each from its own module:

* greedy and temperature-1 rows, specdec's strategies against HuggingFace, then host syncs and kernel launches
  per step (``e2e_greedy``);
* the Medusa heads' trees and EAGLE against the draft chain (``e2e_heads``);
* the parallel draft's chains and best-first trees against the draft chain and EAGLE-2 (``e2e_parallel``);
* engine peers: specdec's engine, vLLM stock and vLLM with specdec's plugin at batch 1 and 6 (``e2e_peers``);
* each kernel's last configuration, then the batch sweep of adaptive speculation (``e2e_sweep``).

Methods run interleaved prompt by prompt, ``--repeats`` times, each (method, prompt) keeping its fastest run, so
drifting background load on a shared machine hits them all alike (``e2e_runs``).

    python bench/bench_e2e.py --quick            # CPU smoke run: 2 prompts, 32 tokens
    python bench/bench_e2e.py --dry-run          # the GPU check's rehearsal: 1 prompt, 8 tokens
    python bench/bench_e2e.py --out OUT          # 6 prompts, 96 tokens, 3 repeats (CPU: one thread)
    python bench/bench_e2e.py --eagle-only       # only the EAGLE table
    python bench/bench_e2e.py --parallel-only    # only the parallel-drafting tables (batch 1 and 8)
    python bench/bench_e2e.py --vllm-only        # only the engine-peer table
    python bench/bench_e2e.py --sweep-only       # only the batch sweep (--batches, --sweep-decoders N)
"""

from __future__ import annotations

from common import bench_args, cpu_threads
from e2e_greedy import greedy_and_sampled, kernel_configs, step_counts
from e2e_heads import eagle_table, medusa_table
from e2e_parallel import parallel_tables
from e2e_peers import vllm_peer_rows
from e2e_sweep import batch_sweep

from specdec.testing import ASSETS, heldout_token_ids, load_pair


def main() -> None:
    def extra(parser):
        parser.add_argument("--repeats", type=int, default=None, help="runs per (method, prompt); fastest kept")
        parser.add_argument("--eagle-only", action="store_true", help="only the EAGLE table")
        parser.add_argument("--parallel-only", action="store_true", help="only the parallel-drafting tables")
        parser.add_argument("--vllm-only", action="store_true", help="only the engine-peer table (vLLM rows)")
        parser.add_argument("--sweep-only", action="store_true", help="only the adaptive batch sweep")
        parser.add_argument("--batches", type=int, nargs="+", help="the sweep's batch sizes (default: all six)")
        parser.add_argument("--sweep-decoders", type=int, default=1, help="independent adaptive decoders per batch "
                            "size in the sweep (their mean is reported)")  # fmt: skip

    args = bench_args(__doc__.splitlines()[0], extra)
    device = args.device
    cpu_threads(device)
    num_prompts, new_tokens = (1, 8) if args.dry_run else (2, 32) if args.quick else (6, 96)
    repeats = args.repeats or (1 if args.quick or device.startswith("cuda") else 3)
    target, draft, tokenizer = load_pair(device, assets=ASSETS)
    prompts = heldout_token_ids(tokenizer)[:num_prompts]
    if args.eagle_only:
        eagle_table(target, draft, prompts, new_tokens, device, repeats).write(args.out, "e2e_eagle")
        return
    batch_prompts = heldout_token_ids(tokenizer)[: 2 if args.dry_run else 8]
    if args.parallel_only:
        for table, name in parallel_tables(target, draft, prompts, batch_prompts, new_tokens, device, repeats):
            table.write(args.out, name)
        return
    if args.vllm_only:
        table = vllm_peer_rows(target, draft, prompts, new_tokens, repeats, device)
        if table is not None:
            table.write(args.out, "e2e_vllm")
        return
    if args.sweep_only:
        pool = heldout_token_ids(tokenizer)
        if args.sweep_decoders < 1:
            raise SystemExit(f"--sweep-decoders must be >= 1, got {args.sweep_decoders}")
        batch_sweep(target, draft, pool, device, args.quick, repeats, args.out, args.batches, args.sweep_decoders)
        return
    greedy_and_sampled(target, draft, prompts, num_prompts, new_tokens, device, repeats, args.out)
    if device.startswith("cuda") or args.dry_run:  # counted on the CPU's path, through the interpreter: minutes
        print("\nHost syncs and launches per step: counted by a CPU run (bench/count_launches.py), not here")
    else:
        step_counts(target, draft, prompts, args.quick).write(args.out, "e2e_step_counts")
    medusa_table(target, draft, prompts, new_tokens, device, repeats).write(args.out, "e2e_medusa")
    eagle_table(target, draft, prompts, new_tokens, device, repeats).write(args.out, "e2e_eagle")
    for table, name in parallel_tables(target, draft, prompts, batch_prompts, new_tokens, device, repeats):
        table.write(args.out, name)
    if args.dry_run:  # a vLLM engine per configuration takes minutes to start
        print("\nvLLM peer rows: not in a dry run (bench/bench_e2e.py --vllm-only)")
    else:
        peers = vllm_peer_rows(target, draft, prompts, new_tokens, repeats, device)
        if peers is not None:
            peers.write(args.out, "e2e_vllm")
    kernel_configs(args.out)
    if args.dry_run:  # the sweep decodes every batch size with eight decoders: a run of its own
        print("\nAdaptive batch sweep: not in a dry run (bench/bench_e2e.py --sweep-only)")
    else:
        pool = heldout_token_ids(tokenizer)
        batch_sweep(target, draft, pool, device, args.quick, repeats, args.out)


if __name__ == "__main__":
    main()
