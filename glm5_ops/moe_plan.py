"""MoEPlan: the permutation moe_dispatch returns and moe_combine consumes.

Its own module so that the MoE wrappers (glm5_ops/moe.py) and the oracles
(glm5_ops/reference.py) share one type without importing each other."""
from __future__ import annotations

from typing import NamedTuple

import torch


class MoEPlan(NamedTuple):
    """The permutation moe_dispatch builds (the schema's last three outputs).

    expert_offsets int32 [E+1]: expert e owns sorted rows
                   [expert_offsets[e], expert_offsets[e+1]); each segment holds
                   count_e real rows then zero padding up to a multiple of align;
                   expert_offsets[E] = N, the number of sorted rows.
    slot_token     int32 [N]: the source token of each sorted row, -1 for padding.
    token_slot     int32 [T,k]: the sorted row holding (token t, slot j)."""
    expert_offsets: torch.Tensor
    slot_token: torch.Tensor
    token_slot: torch.Tensor
