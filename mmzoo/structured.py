"""Structured output: a request's grammar (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark or GBNF grammar) followed token by token as a mask over the vocabulary.

`llguidance <https://github.com/guidance-ai/llguidance>`_ compiles the grammar against the
tokenizer and, per sequence, says which tokens may come next: one ``LLMatcher`` per sequence
follows its tokens on the host and writes the next step's allowed set as a bitmask row (32 tokens
per int32). The executor's constrain step (:func:`mmzoo.executor.steps.constrain_step`) unpacks
it on the device and samples again from the masked logits, so the graphs keep their shapes and a
request with a grammar compiles nothing new. llguidance over xgrammar: on this project's 2-core
machine it computes a 32k-vocabulary mask in 52-58 us against 126-140 us and compiles a schema in
1-2 ms against 5-6 ms (docs/benchmarks.md); both are maintained and both back vLLM's structured
outputs.

The request field is vLLM's ``structured_outputs`` (:class:`~mmzoo.types.StructuredOutputs`);
the server maps OpenAI's ``response_format`` and vLLM's older ``guided_*`` fields onto it.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from mmzoo.errors import MmzooError

def words(vocab_size: int) -> int:
    """int32 words of one bitmask row over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class Grammars:
    """One engine's grammar compiler: llguidance's view of its tokenizer (built on first use, a
    few milliseconds to a second by vocabulary) and the per-sequence matchers.

    Args:
        tokenizer: the engine's transformers fast tokenizer.
        vocab_size: the LM's rows (the mask's width; ids past the tokenizer's are never allowed).
        eos_token_ids: the ids that end a sequence: what a complete grammar allows next.
    """

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._ll = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                try:
                    self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                            eos_token=self.eos or None)
                except ValueError as e:  # a slow (Python) tokenizer
                    raise MmzooError(f"structured_outputs needs a fast tokenizer: {e}") from None
            return self._ll

    def compile(self, spec) -> str:
        """``spec`` (a :class:`~mmzoo.types.StructuredOutputs`) as an llguidance grammar, checked
        against the tokenizer; :class:`MmzooError` naming the field and llguidance's message."""
        from llguidance import LLMatcher, grammar_from

        kind = spec.kind
        value = getattr(spec, kind)
        where = f"structured_outputs.{kind}"
        options = {"whitespace_flexible": not spec.disable_any_whitespace}
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else value
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
                grammar = LLMatcher.grammar_from_json_schema(schema, defaults=options)
            elif kind == "choice":
                grammar = grammar_from("choice", list(value))
            else:
                grammar = grammar_from(kind, value)
        except ValueError as e:  # json.JSONDecodeError too
            raise MmzooError(f"{where}: {e}") from None
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if failed:  # warnings alone (a schema keyword llguidance ignores) do not refuse the request
            raise MmzooError(f"{where}: {messages[0].strip()}")
        return grammar

    def matcher(self, grammar: str) -> "Guide":
        return Guide(self.ll_tokenizer, grammar)


class Guide:
    """One sequence's place in its grammar: the tokens allowed next, and each token it takes."""

    def __init__(self, ll_tokenizer, grammar: str):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)

    def fill(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into ``row`` (int32 ``[words]``, C-contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> None:
        """Advance past ``token``; :class:`MmzooError` when the grammar refuses it (the mask let it through)."""
        if not self.matcher.consume_token(token):
            raise MmzooError(f"structured output: token {token} is outside the grammar ({self.matcher.get_error()})")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and its end was taken: no token can follow."""
        return self.matcher.is_stopped()
