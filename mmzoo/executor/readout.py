"""The readout half of the runner: the steps that read a head's or decode step's logits, or a
prompt's, without touching the KV cache.

* **logprobs** (per row bucket): the picked tokens' log-probabilities and the likeliest
  alternatives, run only when a request asks;
* **constrain** (per row bucket and head): a structured-output request's token mask applied to
  the logits and its token drawn again (:mod:`mmzoo.structured`), run only when a row has a grammar;
* **score** (per prefill bucket): every prompt token's log-probability (``prompt_logprobs``).
"""

from __future__ import annotations

import numpy as np
import torch

from mmzoo.executor.steps import PrefillInputs, Sampling, StepOut, constrain_step, logprobs_step, score_step
from mmzoo.types import Prepared


class ReadoutSteps:
    """The readout steps of :class:`~mmzoo.executor.base.Executor` (which holds ``model``,
    ``buckets``, ``media`` and ``run_step``)."""

    @torch.no_grad()
    def logprobs(self, out: StepOut) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The log-probabilities of a head or decode step's rows (:func:`~mmzoo.executor.steps.logprobs_step`,
        a graph per rows and token count): the picked tokens' ``[r]``, and the ``max_logprobs``
        most likely ids ``[r, k]`` with theirs ``[r, k]``, read back to the host."""
        rows, k = out.logits.shape[0], self.max_logprobs

        def step(logits, tokens):
            return logprobs_step(k, logits, tokens)

        result = self.run_step(("logprobs", rows, out.tokens.shape[0], k), step, [out.logits, out.tokens], None)
        self._step_done()
        return tuple(t.cpu().numpy() for t in result)

    @torch.no_grad()
    def constrain(self, out: StepOut, bitmask: np.ndarray, sampling: Sampling) -> StepOut:
        """``out``'s rows drawn again from their logits masked by ``bitmask`` (int32 ``[r, words]``,
        bit ``t % 32`` of word ``t // 32`` allowing token ``t``), with the same ``sampling`` (its
        uniform draws too) as the step that made ``out``; rows whose ``sampling.constrained`` is
        off keep their token. A graph per rows, token count and head
        (:func:`~mmzoo.executor.steps.constrain_step`); launched, not read back."""
        rows = out.logits.shape[0]
        ints = np.stack([sampling.constrained, sampling.top_k]).astype(np.int64)
        extra = [] if sampling.greedy else [self._tensor(sampling.floats())]

        def step(logits, tokens, bitmask, ints, *floats):
            return (constrain_step(logits, tokens, bitmask, ints, *floats),)

        (tokens,) = self.run_step(("constrain", rows, out.tokens.shape[0], sampling.greedy), step,
                                  [out.logits, out.tokens, self._tensor(bitmask), self._tensor(ints)] + extra, None)
        self._step_done()
        return StepOut(tokens, out.logits)

    @torch.no_grad()
    def score(self, prepared: Prepared) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each prompt token's log-probability given the ones before it (``[n - 1]``: the first has
        none) and the ``max_logprobs`` likeliest at each position (``[n - 1, k]`` ids and theirs),
        one step at the prompt's prefill bucket (:func:`~mmzoo.executor.steps.score_step`), read
        back. Its media are encoded into the buffer first."""
        p, k = self._alone(prepared), self.max_logprobs

        def step(tokens, media):
            return score_step(self.model, k, tokens, media)

        result = self.run_step(("score", len(p.input_ids), k), step, [self._tensor(p.token_rows()), self.media], None)
        self._step_done()
        return tuple(t.cpu().numpy()[: len(prepared.input_ids) - 1] for t in result)

    @torch.no_grad()
    def prompt_logits(self, prepared: Prepared) -> np.ndarray:
        """``[n, vocab]`` float32 logits at every prompt position (no cache; for scoring and tests)."""
        self._check_positions(prepared)
        p = self._alone(prepared)
        self._step_begin()
        logits = self.model(self._tensor(p.input_ids[None]), self._tensor(p.positions[:, None]), mm_embeds=self.media,
                            mm_index=self._tensor(p.mm_index[None]))
        self._step_done()
        return logits[0].cpu().numpy()[: len(prepared.input_ids)]

    def _alone(self, prepared: Prepared) -> PrefillInputs:
        """One prompt in its prefill bucket, its media encoded into the buffer from row 0 (a
        whole-prompt step without the cache: :meth:`score`, :meth:`prompt_logits`)."""
        index, _ = self.encode_prompt(prepared, 0)
        return PrefillInputs.pack(self.buckets.prefill_len(len(prepared.input_ids)), 1, self.max_model_len,
                                  [(prepared.input_ids, prepared.positions, index, 0)])
