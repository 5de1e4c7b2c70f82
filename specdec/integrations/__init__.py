"""Adapters that let serving engines use specdec's ops with their own conventions.

- ``specdec.integrations.vllm``: a vLLM plugin that verifies vLLM's speculative tokens
  with ``specdec.kernels.verify_chain`` (entry point ``specdec`` in the
  ``vllm.general_plugins`` group; install ``specdec[vllm]``).
- ``specdec.integrations.converters``: SGLang's tree layout and FlashInfer's packed tree
  masks to specdec's ``parents`` and int64 mask rows.

Nothing here is imported by ``import specdec``, and no engine is imported until an
adapter that needs it runs: a missing engine never breaks specdec.
"""
