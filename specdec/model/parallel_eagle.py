"""Parallel EAGLE head: an EAGLE head that drafts several positions in one forward (P-EAGLE's idea).

An EAGLE head (``specdec.model.eagle``) predicts token t + 2 from row t = (the target's feature
``f_t``, token ``x_{t+1}``); drafting deeper feeds its own predicted features back, one forward
per level. This head adds one learned input row, ``mask_input``: a forward over the catch-up rows
followed by ``block_size - 1`` mask rows (token ``MASK``) at positions t + 1, t + 2, ... gives, in
one pass, the distribution of token t + 2 (the last catch-up row, as in EAGLE) and of tokens
t + 3, t + 4, ... (mask rows 1, 2, ...), each conditioned on the committed text and the target's
features only. A mask row's layer input is ``mask_input`` in place of ``fc``'s output; everything
else is the EAGLE head's, including its KV cache and the C++ forward on the CPU.

Checkpoint: the EAGLE authors' layout (``EagleHead``) plus the tensor ``mask_input`` ``[hidden]``
and the ``config.json`` field ``parallel_block_size`` (positions one forward drafts, >= 2).
``scripts/train_parallel_eagle_head.py`` trains one for the embedded target.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.model.config import ModelConfig
from specdec.model.eagle import PARALLEL_BLOCK_SIZE, EagleHead
from specdec.model.llama import LlamaModel

MASK = -1  # the token of a mask row in ``forward``'s ``tokens``


class ParallelEagleHead(EagleHead):
    """An ``EagleHead`` whose rows with token ``MASK`` read the learned ``mask_input`` (see the module docstring).

    Parameters
    ----------
    config, target, fc_bias, own_embedding : as for ``EagleHead``.
    block_size : positions one forward drafts (>= 2): the last real row's and ``block_size - 1`` mask rows'.

    Example
    -------
    >>> from specdec.testing import ASSETS
    >>> target = LlamaModel.from_pretrained(ASSETS / "target")
    >>> head = ParallelEagleHead.from_pretrained(ASSETS.parent / "parallel_eagle", target)
    >>> head.block_size, tuple(head.mask_input.shape)
    (8, (256,))
    """

    def __init__(
        self,
        config: ModelConfig,
        target: LlamaModel,
        *,
        fc_bias: bool = True,
        own_embedding: bool = False,
        block_size: int,
    ):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {block_size!r}")
        super().__init__(config, target, fc_bias=fc_bias, own_embedding=own_embedding)
        self.block_size = block_size
        self.mask_input = nn.Parameter(torch.zeros(config.hidden_size))

    def layer_inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``fc([embed(x_{t+1}), f_t])`` for real rows, ``mask_input`` for rows whose token is ``MASK``."""
        is_mask = tokens == MASK
        x = super().layer_inputs(features, tokens.masked_fill(is_mask, 0))
        return torch.where(is_mask[:, None], self.mask_input.to(x.dtype), x)

    @classmethod
    def config_options(cls, hf: dict) -> dict:
        block = hf.get(PARALLEL_BLOCK_SIZE)
        if block is None:
            raise ValueError(f"config.json has no '{PARALLEL_BLOCK_SIZE}': not a parallel EAGLE head (a plain EAGLE "
                             f"head loads with EagleHead.from_pretrained)")  # fmt: skip
        if not isinstance(block, int) or isinstance(block, bool) or block < 2:
            raise ValueError(f"config.json '{PARALLEL_BLOCK_SIZE}' must be an int >= 2, got {block!r}")
        return {"block_size": block}
