"""vLLM-side classes of the specdec plugin (imports vLLM: loaded only by ``register()``).

Each subclass keeps vLLM's constructor and outputs, decides per batch whether the plugin
reproduces everything the batch asks for, and either verifies through
``specdec.integrations._vllm_verify`` or hands the batch to vLLM's own implementation.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys

import torch
from vllm.triton_utils import HAS_TRITON
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample import rejection_sampler as v1_rejection_sampler
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker import gpu_model_runner as v1_model_runner

from specdec.integrations import _vllm_verify

# vLLM's built-in logits processors are loaded for every batch; each is idle unless a request uses it.
_BUILTIN_ACTIVE = {
    MinPLogitsProcessor: ("min_p", lambda p: bool(p.min_p_count)),
    LogitBiasLogitsProcessor: ("logit_bias", lambda p: bool(p.biases)),
    MinTokensLogitsProcessor: ("min_tokens", lambda p: bool(p.min_toks)),
}


def _v1_unsupported(sampler, sampling_metadata) -> str | None:
    """Why this V1 batch goes to vLLM's own sampler (None: specdec reproduces all of it)."""
    m = sampling_metadata
    if type(sampler.sampler) is not Sampler:  # the bonus token is the handed sampler's to draw
        return f"sampler {type(sampler.sampler).__name__}"
    if sampler.synthetic_mode:
        return "synthetic acceptance rates"
    if sampler.is_processed_logprobs_mode:
        return "processed logprobs mode"
    if not m.no_penalties:
        return "penalties"
    if m.bad_words_token_ids:
        return "bad words"
    if m.allowed_token_ids_mask is not None:
        return "allowed token ids"
    if m.logprob_token_ids:
        return "logprobs of chosen token ids"
    if m.thinking_budget_state_holder is not None and m.thinking_budget_state_holder.has_tracked_requests():
        return "thinking token budget"
    for processor in m.logitsprocs.all:
        name, active = _BUILTIN_ACTIVE.get(type(processor), (f"logits processor {type(processor).__name__}", None))
        if active is None or active(processor):
            return name
    return None


class SpecdecRejectionSampler(v1_rejection_sampler.RejectionSampler):
    """V1 model runner's rejection sampler, verifying with specdec's ``verify_chain``.

    ``token_positions`` is the runner's ``positions`` buffer (the position of each input token
    of the step, which ``SpecDecodeMetadata.logits_indices`` index), set when the runner is built
    (``_bind_token_positions``): sampled batches key their random numbers on it.
    """

    token_positions: torch.Tensor | None = None

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        reason = _v1_unsupported(self, sampling_metadata)
        if reason is not None:
            _vllm_verify.note_fallback(reason)
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        step = _vllm_verify.verify_v1_batch(
            logits,
            metadata.draft_token_ids,
            metadata.cu_num_draft_tokens,
            metadata.max_spec_len,
            draft_probs,
            target_logits_indices=metadata.target_logits_indices,
            bonus_logits_indices=metadata.bonus_logits_indices,
            logits_indices=metadata.logits_indices,
            token_positions=self.token_positions,
            temperature=sampling_metadata.temperature,
            top_k=sampling_metadata.top_k,
            top_p=sampling_metadata.top_p,
            generators=sampling_metadata.generators,
            all_greedy=sampling_metadata.all_greedy,
        )
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            # vLLM's own code on the raw logits it would use, handed in verify_chain's order: vLLM's reads
            # request b's j-th row at cu_num_sampled_tokens[b - 1] + j, which is that order
            rows, layout = step.logits, step.layout
            chain = dataclasses.replace(metadata, target_logits_indices=layout.target_rows,
                                        bonus_logits_indices=layout.bonus_rows)  # fmt: skip
            logprobs = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs,
                chain,
                rows,
                rows.index_select(0, layout.target_rows).to(torch.float32),
                rows.index_select(0, layout.bonus_rows).to(torch.float32),
                step.output_token_ids,
            )
        return SamplerOutput(sampled_token_ids=step.output_token_ids, logprobs_tensors=logprobs)


_stock_runner_init = v1_model_runner.GPUModelRunner.__init__


@functools.wraps(_stock_runner_init)
def _bind_token_positions(runner, *args, **kwargs) -> None:
    """vLLM's V1 model runner constructor, then its specdec sampler (if it built one) bound to its positions.

    The runner allocates ``positions`` once and refills it every step before the forward, so the
    sampler reads the current step's positions without any per-step hand-over.
    """
    _stock_runner_init(runner, *args, **kwargs)
    sampler = getattr(runner, "rejection_sampler", None)
    if isinstance(sampler, SpecdecRejectionSampler):
        sampler.token_positions = runner.positions


def _v2_classes():
    """Model Runner V2's rejection-sampler module and its specdec subclass; None where MRV2 cannot run.

    MRV2's model runner takes the class from ``vllm.v1.worker.gpu.spec_decode.rejection_sampler``
    when it is imported, so that module is patched (and the runner's module too if already
    imported). Without Triton vLLM never picks MRV2, and importing it there only costs time.
    """
    if not HAS_TRITON:
        _vllm_verify.logger.info("specdec: Model Runner V2 not patched (no Triton: vLLM runs the V1 model runner)")
        return None
    module = importlib.import_module("vllm.v1.worker.gpu.spec_decode.rejection_sampler")

    class SpecdecRejectionSamplerV2(module.RejectionSampler):
        """Model Runner V2's rejection sampler, verifying each chunk with specdec's ``verify_chain``."""

        def _unsupported(self) -> str | None:
            if self.synthetic_conditional_rates is not None:
                return "synthetic acceptance rates"
            if self.use_block_verification:
                return "block verification"
            if self.watermark_key is not None:
                return "watermarking"
            if self.enable_adaptive_verification:  # compacts the logits rows: a layout not written for yet
                return "adaptive verification"
            return None

        def _verify(self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping, idx_mapping_np,
                    expanded_idx_mapping, expanded_local_pos, seq_lens_upper_bound_np,
                    verify_draft_sampled):  # fmt: skip
            reason = self._unsupported()
            if reason is not None:
                _vllm_verify.note_fallback(reason)
                return super()._verify(logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping,
                                       idx_mapping_np, expanded_idx_mapping, expanded_local_pos,
                                       seq_lens_upper_bound_np, verify_draft_sampled)  # fmt: skip
            processed = self.sampler.apply_sampling_params(
                logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, draft_sampled,
                expanded_local_pos, seq_lens_upper_bound_np,
            )  # fmt: skip
            states = self.sampler.sampling_states
            sampled, num_sampled = _vllm_verify.verify_v2_batch(
                processed, verify_draft_sampled, cu_num_logits, pos, idx_mapping,
                temperature=states.temperature.gpu, seeds=states.seeds.gpu, draft_logits=draft_logits,
                num_speculative_steps=self.num_speculative_steps,
                all_greedy=not states.temperature.np[idx_mapping_np].any(),  # host copy: no device read
            )  # fmt: skip
            return processed, sampled, num_sampled

    return module, SpecdecRejectionSamplerV2


def patch_targets() -> dict:
    """{(module or class, attribute): replacement} for every model runner this vLLM can build."""
    targets = {
        (v1_model_runner, "RejectionSampler"): SpecdecRejectionSampler,
        (v1_model_runner.GPUModelRunner, "__init__"): _bind_token_positions,
    }
    v2 = _v2_classes()
    if v2 is not None:
        targets[(v2[0], "RejectionSampler")] = v2[1]
        runner = sys.modules.get("vllm.v1.worker.gpu.model_runner")
        if runner is not None:
            targets[(runner, "RejectionSampler")] = v2[1]
    return targets
