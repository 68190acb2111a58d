"""The suffix drafter drafts what followed the latest match in its prompt group, then in recent
calls."""

from __future__ import annotations

import torch

from leantrain.generation import SamplingParams
from leantrain.speculation.suffix_drafter import NgramIndex, SuffixDrafter


def test_ngram_index_drafts_what_followed_the_latest_match():
    index = NgramIndex(min_n=2, max_n=3)
    index.add([7, 1, 2, 3, 4, 1, 2, 5])
    assert index.lookup([9, 1, 2], k=3) == [5]  # the latest (1, 2) is followed by 5 only
    assert index.lookup([4, 1, 2], k=3) == [5]
    assert index.lookup([7, 1], k=4) == [2, 3, 4, 1]
    assert index.lookup([3, 3], k=2) == []


class View:
    def __init__(self, prompt_ids, response_ids):
        self.prompt_ids, self.response_ids = prompt_ids, response_ids


def test_suffix_drafter_shares_a_prompt_group_and_recent_calls():
    drafter = SuffixDrafter(min_match=2, max_match=4)
    a, b, other = View([1, 2], [5, 6, 7, 8, 9]), View([1, 2], [5, 6]), View([3], [6, 7])
    drafter.begin([a, b, other])
    draft = drafter.propose([b, other], None, 3, SamplingParams(temperature=1.0), torch.Generator())
    assert draft.tokens[0].tolist() == [7, 8, 9]  # b continues like its sibling a
    assert draft.lengths.tolist() == [3, 0]  # `other` has its own group: nothing to copy
    drafter.end()
    later = View([4], [6, 7])
    drafter.begin([later])
    draft = drafter.propose([later], None, 2, SamplingParams(temperature=1.0), torch.Generator())
    assert draft.tokens[0].tolist() == [8, 9]  # from the previous call's texts
