"""The engine's side of speculative decoding: `verify`, the accept/reject rule (the lossless
tests of whole rollouts with drafters: tests/speculation/test_speculator.py)."""

from __future__ import annotations

import torch

from leantrain.generation import SamplingParams
from leantrain.generation.speculative import Draft, verify


def test_verify_greedy_accepts_the_matching_prefix():
    # Argmax at each of the k+1 = 4 positions is 2, 0, 1, 3; rows draft 3 tokens each.
    logits = torch.full((3, 4, 5), -1.0)
    for j, t in enumerate([2, 0, 1, 3]):
        logits[:, j, t] = 1.0
    drafts = torch.tensor([[2, 0, 1], [2, 4, 1], [3, 0, 1]])
    draft = Draft(drafts, torch.tensor([3, 3, 2]))
    v = verify(logits, draft, SamplingParams(temperature=0), torch.Generator().manual_seed(0))
    assert v.accepted.tolist() == [3, 1, 0]
    # All accepted: no forced token, the next comes from position 3; rejected: the argmax there.
    assert v.forced.tolist() == [-1, 0, 2]
    assert torch.equal(v.next_logits[0], logits[0, 3])
