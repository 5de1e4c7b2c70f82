"""vLLM plugin: vLLM's speculative tokens verified by specdec's exact ``verify_chain``.

Enable it by installing ``specdec[vllm]``: the entry point ``specdec`` in vLLM's
``vllm.general_plugins`` group calls ``register()`` in every vLLM process before the
model runner is built. vLLM loads every installed general plugin unless ``VLLM_PLUGINS``
lists the ones to load (``VLLM_PLUGINS=specdec`` loads only this one; a list without it
leaves vLLM stock). ``register()`` can also be called directly before building an ``LLM``.

What it changes. vLLM's V1 model runner builds ``RejectionSampler`` and calls it with
``(spec_decode_metadata, draft_probs, logits, sampling_metadata)``; Model Runner V2 calls
its own ``RejectionSampler._verify`` per chunk of requests. ``register()`` swaps both
classes for subclasses that verify through ``verify_chain`` (n-gram, draft model, EAGLE,
Medusa, MTP: every method vLLM verifies as a chain), and wraps the V1 runner's constructor
so that its sampler gets the runner's token positions (seeded sampling is keyed on them).
The subclasses hand a batch back to vLLM's own sampler, counted in ``stats()`` and logged
once per reason, whenever it uses something the plugin does not reproduce (penalties, bad
words, allowed token ids, min_tokens, logit bias, min_p, thinking budgets, logprobs of
chosen token ids, processed-logprobs modes, a sampler other than vLLM's ``Sampler``,
synthetic acceptance, block verification, watermarking). Outside the tested vLLM range
(``TESTED_VLLM``) it refuses to patch, logs why and leaves vLLM as it was.

Every conversion between vLLM's conventions and specdec's is in ``verify_v1_batch`` (V1
model runner) or ``verify_v2_batch`` (Model Runner V2), which live with the counters in
``specdec.integrations._vllm_verify`` (imported by this module and by the vLLM subclasses
alike) and are re-exported here. Importing this module imports neither vLLM nor anything
that does.
"""

from __future__ import annotations

from specdec.integrations._vllm_verify import (
    chain_layout,
    first_positions,
    logger,
    note_fallback,
    request_seeds,
    reset_stats,
    stats,
    verify_v1_batch,
    verify_v2_batch,
)

__all__ = [
    "TESTED_VLLM",
    "chain_layout",
    "first_positions",
    "logger",
    "note_fallback",
    "register",
    "request_seeds",
    "reset_stats",
    "stats",
    "unregister",
    "verify_v1_batch",
    "verify_v2_batch",
    "version_refusal",
]

TESTED_VLLM = ((0, 32),)  # (major, minor) releases whose interfaces the plugin was written and tested against


# ----------------------------------------------------------------------------- version gate, patching


def version_refusal(version: str) -> str | None:
    """Why the plugin must not patch vLLM ``version`` (None when it is in ``TESTED_VLLM``)."""
    parts = version.split("+")[0].split(".")
    try:
        release = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return f"cannot read vLLM version {version!r}"
    if release not in TESTED_VLLM:
        tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_VLLM)
        return f"vLLM {version} is outside the tested range ({tested})"
    return None


_originals: dict[tuple[object, str], object] = {}  # (module or class, attribute) -> what register() replaced


def register() -> bool:
    """The plugin entry point: patch vLLM's rejection samplers (idempotent). Returns whether it patched."""
    import vllm

    refusal = version_refusal(vllm.__version__)
    if refusal is not None:
        logger.warning("specdec plugin not enabled: %s; vLLM left unchanged", refusal)
        return False
    from specdec.integrations import _vllm_samplers

    targets = _vllm_samplers.patch_targets()
    for (owner, name), replacement in targets.items():
        current = getattr(owner, name)
        if current is not replacement:
            _originals[(owner, name)] = current
            setattr(owner, name, replacement)
    logger.info("specdec plugin enabled: vLLM speculative tokens verified by specdec.kernels.verify_chain (%s)",
                ", ".join(f"{owner.__name__}.{name}" for owner, name in targets))  # fmt: skip
    return True


def unregister() -> None:
    """Put back what ``register()`` replaced (runners built before keep their samplers)."""
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()
