"""``MatrixAgreement``: the planner's token question (``prefill_core.TokenAgreement``) answered from a call's
token matrix.

The core plans shared spans from geometry and one token fact: how many
positions from ``start`` on two rows hold the same tokens
(``prefill_core.planning.shared_spans``). The shell keeps the tokens, so it
answers, one vectorised comparison per asking row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["MatrixAgreement"]


class MatrixAgreement:
    """``TokenAgreement`` over the caller's right-padded ``[rows, width]`` tokens and each row's length."""

    def __init__(self, matrix: torch.Tensor, lengths: Sequence[int]):
        self.matrix = matrix
        self.lengths = torch.tensor(list(lengths), dtype=torch.int64)

    def agreement(self, row: int, others: Sequence[int], start: int) -> list[int]:
        """For each of ``others``, the positions from ``start`` on where it and ``row`` hold the same token,
        up to the first difference or the end of either prompt (padding past a prompt never counts)."""
        rows = torch.tensor(list(others), dtype=torch.int64)
        differ = self.matrix[rows, start:] != self.matrix[row, start:]
        width = differ.shape[1]
        first = torch.where(differ.any(dim=1), differ.to(torch.int8).argmax(dim=1), width)
        ends = torch.minimum(self.lengths[rows], self.lengths[row]) - start
        return torch.minimum(first, ends).clamp(min=0).tolist()
