"""A made-up third architecture, for tests only (spec: test_cache_any_model).

Three sections and three views whose shapes and token axes differ from the hybrid model's, so
a cache module that assumed ``gdn.S`` or a token axis of 2 would fail here:

- sections ``rnn.h`` [hidden] (a slowly decaying recurrent sum), ``mix.m`` [2, hidden, 3] (a
  running outer summary) and ``tail.x`` [2, hidden] (a short causal conv's last two inputs, as
  the hybrid's ``gdn.conv``), all fp32;
- views ``keys`` [window, hidden] (token axis 0), ``vals`` [heads, window, head_dim] (axis 1) and
  ``gate`` [4, window] (axis 1).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tandem.models.base import Cost, ModelState, View, digest_tensors
from tandem.models.rows import empty_rows


class ThirdModel:
    model_type = "third"

    def __init__(self, vocab_size: int = 97, hidden: int = 24, heads: int = 3, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.hidden, self.heads = hidden, heads
        self.head_dim = hidden // heads
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape, scale=0.3):
            return (torch.randn(*shape, generator=gen) * scale).to(dtype)

        self.w = {"emb": rand(vocab_size, hidden, scale=1.0), "wk": rand(hidden, hidden),
                  "wv": rand(hidden, hidden), "wq": rand(hidden, hidden), "wg": rand(4, hidden),
                  "wh": rand(hidden, hidden), "wm": rand(3, hidden), "out": rand(vocab_size, hidden)}

    def new_state(self, window: int) -> ModelState:
        d = self.hidden
        return ModelState(
            sections={"rnn.h": torch.zeros(d), "mix.m": torch.zeros(2, d, 3),
                      "tail.x": torch.zeros(2, d)},
            # Uninitialised as the hybrid's: rows are backed as a forward writes them.
            views={"keys": View(empty_rows((window, d), self.dtype), 0),
                   "vals": View(empty_rows((self.heads, window, self.head_dim), self.dtype), 1),
                   "gate": View(empty_rows((4, window), self.dtype), 1)})

    def forward(self, state: ModelState, token_ids: torch.Tensor, start: int,
                decode: bool = False,
                on_logits: Callable[[int, torch.Tensor], None] | None = None,
                logits: bool = True) -> torch.Tensor:
        h, m, tail = (state.sections[k] for k in ("rnn.h", "mix.m", "tail.x"))
        return self._run(state, token_ids, start, h, m, tail, None, on_logits)[-1]

    def forward_batch(self, states: list[ModelState], token_ids: list[int],
                      positions: list[int]) -> torch.Tensor:
        """Each sequence decoded alone, one after the other: the same bits by construction."""
        return torch.stack([self.forward(s, torch.tensor([t]), p, decode=True)
                            for s, t, p in zip(states, token_ids, positions)])

    def forward_verify(self, state: ModelState, token_ids: torch.Tensor,
                       start: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Every position's logits and sections; the sections in ``state`` stay as they were."""
        steps: dict[str, list[torch.Tensor]] = {"rnn.h": [], "mix.m": [], "tail.x": []}
        h, m, tail = (state.sections[k].clone() for k in ("rnn.h", "mix.m", "tail.x"))
        logits = self._run(state, token_ids, start, h, m, tail, steps)
        return logits, {name: torch.stack(v) for name, v in steps.items()}

    def _run(self, state: ModelState, token_ids: torch.Tensor, start: int, h: torch.Tensor,
             m: torch.Tensor, tail: torch.Tensor,
             steps: dict[str, list[torch.Tensor]] | None,
             on_logits: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        w = self.w
        n = token_ids.shape[0]
        end = start + n
        x = F.embedding(token_ids, w["emb"])
        keys, vals, gate = (state.views[k].tensor for k in ("keys", "vals", "gate"))
        keys[start:end] = torch.tanh(F.linear(x, w["wk"]))
        vals[:, start:end] = F.linear(x, w["wv"]).view(n, self.heads, self.head_dim).transpose(0, 1)
        gate[:, start:end] = torch.sigmoid(F.linear(x, w["wg"])).T
        q = F.linear(x, w["wq"])
        scores = (q @ keys[:end].T) * gate[0, :end]
        mask = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
        probs = torch.softmax(scores.float().masked_fill(mask, float("-inf")), dim=-1)
        attn = torch.einsum("ts,hsd->thd", probs.to(self.dtype), vals[:, :end]).reshape(n, -1)
        drive = F.linear(x, w["wh"]).float()
        mix = F.linear(x, w["wm"]).float()
        # Only the positions asked for are read out: the last one, or every one in a verify.
        read = range(n) if steps is not None or on_logits is not None else range(n - 1, n)
        lasts = []
        # Decays near 1 (0.99, 0.98): the state remembers a few hundred tokens, so a restore
        # that loses or perturbs it changes what follows (issue 12, part 7).
        for t in range(n):  # the recurrence, token by token
            conv = drive[t] + 0.6 * tail[1] - 0.4 * tail[0]
            tail[0].copy_(tail[1])
            tail[1].copy_(drive[t])
            h.mul_(0.99).add_(torch.tanh(conv), alpha=0.1)
            m[0].mul_(0.98).add_(torch.outer(torch.tanh(h), torch.tanh(mix[t])) * 0.02)
            m[1].copy_(torch.tanh(m[0] + m[1] * 0.5))
            if steps is not None:
                steps["rnn.h"].append(h.clone())
                steps["mix.m"].append(m.clone())
                steps["tail.x"].append(tail.clone())
            if t in read:
                lasts.append(attn[t].float() + torch.tanh(conv) + h + m[1].sum(-1))
        if on_logits is not None:
            # The others apart, so that the last position's logits are the ones without.
            if n > 1:
                on_logits(0, F.linear(torch.stack(lasts[:-1]).to(self.dtype), w["out"]).float())
            lasts = lasts[-1:]
        return F.linear(torch.stack(lasts).to(self.dtype), w["out"]).float()

    def cost(self, window: int, prefix_chunk: int = 1024) -> Cost:
        el = torch.tensor([], dtype=self.dtype).element_size()
        row = (self.hidden + self.hidden + 4) * el
        state = (self.hidden + 2 * self.hidden * 3 + 2 * self.hidden) * 4
        return Cost(state, row, 1 << 20, 16 * self.hidden * 4, (1 << 20) + 4 * prefix_chunk * window)

    def manifest(self) -> dict[str, str]:
        return {"model_type": self.model_type, "weights": digest_tensors(self.w)}
