"""Which position of its caller's batch each token of a model call is, for hooks on the layers.

A hook on a layer (a mixture of experts' router: fitrl/models/moe_routing.py) sees its input
flattened to ``rows x width`` tokens and nothing of where each came from: the log-prob forwards
trim padding, pack sequences end to end or run a shared prompt once (fitrl/ops/logprob.py), and
a decode step runs only the rows still decoding (fitrl/rollout/decode.py, fitrl/rollout/hf.py).
So each of those, just before its model calls, *feeds* :data:`ORIGINS` one tensor per call: the
flat index, into the caller's own grid (a micro-batch's ``(B, P+R)`` positions, a generation's
``(B, max_tokens)`` response slots), of every token the call runs, in the order the call runs
them; ``-1`` for a slot that is no position (packing's filler). What a grid is, the listener
knows. A shared prompt's token, run once for the rows of its group, also says how many positions
it stands for (``copies``), so that a listener's per-token sums can equal the padded forward's.
Nothing is computed while nobody listens (:attr:`TokenOrigins.listening`).

Per thread: a rollout worker in the trainer's process generates on a thread of its own
(fitrl/roles/rollout_worker.py) while the trainer's forwards run.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

from fitrl.core.packing import PackedLayout
from fitrl.core.padding import trim_padding
from fitrl.ops.shared_prompt import PromptGroups


class TokenOrigins(threading.local):
    def __init__(self) -> None:
        self.listeners = 0
        self.calls: tuple[torch.Tensor, ...] = ()  # the next model calls' origins, one per call
        self.copies: tuple[Optional[torch.Tensor], ...] = ()  # per call: positions each token stands for (None: 1)
        self.version = 0  # bumped by every feed: a listener counts its calls since the last one

    @property
    def listening(self) -> bool:
        return self.listeners > 0

    def feed(self, *calls: torch.Tensor, copies: Optional[tuple[Optional[torch.Tensor], ...]] = None) -> None:
        """The origins of the next model calls, one ``(rows, width)`` tensor per call (none: the
        next calls run tokens of no recorded position, a generation's prompt); ``copies``: per call,
        a tensor of the same shape, or None where each token is one position."""
        self.calls = calls
        self.copies = copies if copies is not None else (None,) * len(calls)
        self.version += 1

    @contextlib.contextmanager
    def listen(self) -> Iterator["TokenOrigins"]:
        self.listeners += 1
        self.feed()
        try:
            yield self
        finally:
            self.listeners -= 1
            self.feed()

    # -- the log-prob forwards (fitrl/ops/logprob.py, ``response_logprobs``)
    def columns(self, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                response_length: int) -> Optional[torch.Tensor]:
        """(B, T') flat indices into the micro-batch's (B, T) positions of the columns its forward
        keeps once padding is trimmed (as ``trim_padding`` trims them); None while nobody listens."""
        if not self.listening:
            return None
        B, T = attention_mask.shape
        grid = torch.arange(B * T, device=attention_mask.device).view(B, T)
        return trim_padding(grid, attention_mask, position_ids, response_length)[0]

    def feed_layout(self, origin: Optional[torch.Tensor], layout, response_length: int) -> None:
        """Feed the calls of the forward ``layout`` runs (``fitrl.ops.logprob.choose_layout``'s
        answer) over the trimmed ``origin``: packed, one call of the packed slots; shared prompts,
        the distinct prompts then every row's responses; padded (None), the trimmed grid."""
        if origin is None:
            return
        if isinstance(layout, PackedLayout):
            self.feed(torch.where(layout.filler, -1, layout.gather(origin)))
        elif isinstance(layout, PromptGroups):
            P = origin.shape[1] - response_length
            rows = torch.bincount(layout.inverse, minlength=layout.rows.numel())  # (G,) rows sharing each prompt
            self.feed(origin[layout.rows, :P], origin[:, P:], copies=(rows[:, None].expand(-1, P), None))
        else:
            self.feed(origin)


ORIGINS = TokenOrigins()
