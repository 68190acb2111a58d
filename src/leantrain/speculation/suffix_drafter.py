"""A model-free drafter: continue each sequence the way an earlier text that ends with the same
tokens continued (prompt-lookup / suffix decoding, as verl's suffix-tree recipe and SuffixDecoding
do over the responses of the same prompt group and of recent steps).

GRPO samples a group of responses per prompt; they share phrasing with each other, with the
prompt (arith copies its numbers) and with earlier steps' responses, and a looping response
repeats itself. An n-gram index finds the most recent occurrence of a sequence's last n tokens
(longest n first) and drafts the tokens that followed it. A draft costs a few dictionary lookups
and no model call, which is what matters where per-call overhead dominates (small models, CPU).
Drafts are deterministic (q one-hot), so verification accepts each with probability p(token).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from leantrain.generation.config import SamplingParams
from leantrain.generation.speculative import Draft, SeqView


class NgramIndex:
    """Maps each n-gram (min_n <= n <= max_n) of the indexed texts to where its latest
    occurrence was followed: (text, index of the next token)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.table: dict[tuple[int, ...], tuple[list[int], int]] = {}

    def add(self, text: list[int], start: int = 1) -> None:
        """Index the n-grams of `text` that end before position p, for every p >= `start` (so
        each has at least one following token). Call again with `start` = the old length after
        `text` grew."""
        for p in range(max(start, 1), len(text)):
            for n in range(self.min_n, min(self.max_n, p) + 1):
                self.table[tuple(text[p - n : p])] = (text, p)

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest indexed suffix of `context` ([] if none)."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            hit = self.table.get(tuple(context[-n:]))
            if hit is not None:
                text, p = hit
                return text[p : p + k]
        return []


class SuffixDrafter:
    """Drafts from n-gram matches in the sequence's prompt group, then in recent calls.

    Args:
        min_match: shortest suffix that may match (1 drafts from single-token matches: cheap
            but often wrong).
        max_match: longest suffix tried first.
        recent_calls: earlier `generate` calls (RL steps) whose texts stay indexed.
    """

    needs_hidden = False

    def __init__(self, min_match: int = 2, max_match: int = 8, recent_calls: int = 2) -> None:
        self.min_match, self.max_match = min_match, max_match
        self.history: deque[list[list[int]]] = deque(maxlen=recent_calls)
        self.recent = NgramIndex(min_match, max_match)
        self._texts: dict[int, list[int]] = {}  # id(seq) -> prompt + response so far
        self._groups: dict[tuple[int, ...], NgramIndex] = {}
        self._group_of: dict[int, NgramIndex] = {}
        self._seqs: list[SeqView] = []

    def begin(self, seqs: Sequence[SeqView]) -> None:
        """Index every prompt; sequences with the same prompt share one index (their group)."""
        self._seqs = list(seqs)
        self._texts, self._groups, self._group_of = {}, {}, {}
        for seq in self._seqs:
            key = tuple(seq.prompt_ids)
            if key not in self._groups:
                self._groups[key] = NgramIndex(self.min_match, self.max_match)
                self._groups[key].add(list(seq.prompt_ids))
            self._group_of[id(seq)] = self._groups[key]
            self._texts[id(seq)] = list(seq.prompt_ids)

    def _catch_up(self) -> None:
        """Index the tokens every sequence of the call gained since the last draft."""
        for seq in self._seqs:
            text = self._texts[id(seq)]
            old = len(text)
            new = seq.response_ids[old - len(seq.prompt_ids) :]
            if new:
                text.extend(new)
                self._group_of[id(seq)].add(text, start=old)

    def propose(
        self,
        seqs: Sequence[SeqView],
        hidden: torch.Tensor | None,
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        """Up to k tokens per row from its group's index, else from recent calls' texts."""
        self._catch_up()
        tokens = torch.zeros(len(seqs), k, dtype=torch.long)
        lengths = torch.zeros(len(seqs), dtype=torch.long)
        for i, seq in enumerate(seqs):
            context = self._texts[id(seq)]
            draft = self._group_of[id(seq)].lookup(context, k) or self.recent.lookup(context, k)
            tokens[i, : len(draft)] = torch.tensor(draft, dtype=torch.long)
            lengths[i] = len(draft)
        return Draft(tokens, lengths)

    def end(self) -> None:
        """Keep this call's texts for the next calls (the recent steps), rebuild that index."""
        self._catch_up()
        self.history.append(list(self._texts.values()))
        self.recent = NgramIndex(self.min_match, self.max_match)
        for texts in self.history:
            for text in texts:
                self.recent.add(text)
        self._seqs, self._texts, self._group_of, self._groups = [], {}, {}, {}
