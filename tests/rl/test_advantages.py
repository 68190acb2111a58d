import math

import pytest
import torch
from torch.testing import assert_close

from leantrain.rl.advantages import group_advantages

# Six trajectories in three groups with arbitrary, non-contiguous ids:
#   group 7: indices 0, 1, 3 -> rewards 1, 0, 1   mean 2/3  centred  1/3, -2/3, 1/3
#   group 3: indices 2, 4    -> rewards 0, 1      mean 1/2  centred -1/2,  1/2
#   group 9: index 5         -> reward 0.5        a group of one, centred 0
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
GROUP_IDS = torch.tensor([7, 7, 3, 7, 3, 9])
CENTRED = torch.tensor([1 / 3, -2 / 3, -1 / 2, 1 / 3, 1 / 2, 0.0])
EPS = 1e-4


def test_scale_none_only_centres():
    """Dr. GRPO: A_i = r_i - mean_group(r), no std and no eps."""
    assert_close(group_advantages(REWARDS, GROUP_IDS, scale="none"), CENTRED)


def test_scale_group_divides_by_unbiased_group_std():
    """A_i = (r_i - mean_g) / (std_g + eps) with std_g = sqrt(sum (r - mean_g)^2 / (n_g - 1)):

    group 7: sum of squares 1/9 + 4/9 + 1/9 = 2/3, over n - 1 = 2 -> std = sqrt(1/3)
    group 3: 1/4 + 1/4 = 1/2, over 1 -> std = sqrt(1/2)
    group 9: one member -> advantage 0
    """
    s7, s3 = math.sqrt(1 / 3), math.sqrt(1 / 2)
    expected = torch.tensor(
        [
            (1 / 3) / (s7 + EPS),
            (-2 / 3) / (s7 + EPS),
            (-1 / 2) / (s3 + EPS),
            (1 / 3) / (s7 + EPS),
            (1 / 2) / (s3 + EPS),
            0.0,
        ]
    )
    assert_close(group_advantages(REWARDS, GROUP_IDS, scale="group", eps=EPS), expected)


def test_group_std_is_torch_std_convention():
    """The group std is torch.std (Bessel-corrected), as TRL's nanstd."""
    advantages = group_advantages(REWARDS, GROUP_IDS, scale="group", eps=EPS)
    group = REWARDS[[0, 1, 3]]
    assert_close(advantages[[0, 1, 3]], (group - group.mean()) / (group.std() + EPS))


def test_scale_batch_divides_by_unbiased_batch_std():
    """A_i = (r_i - mean_g) / (std_batch + eps), std over all six raw rewards:

    batch mean 7/12; deviations in twelfths 5, -7, -7, 5, 5, -1; squares sum 174/144;
    variance = 174/144 / 5 = 29/120.
    """
    std = math.sqrt(29 / 120)
    expected = CENTRED / (std + EPS)
    assert_close(group_advantages(REWARDS, GROUP_IDS, scale="batch", eps=EPS), expected)
    assert_close(REWARDS.std(), torch.tensor(std))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_groups_of_one_get_zero(scale):
    """Every trajectory alone in its group: nothing to compare with, all advantages 0."""
    advantages = group_advantages(torch.tensor([3.0, -1.0, 2.0]), torch.arange(3), scale=scale)
    assert_close(advantages, torch.zeros(3))


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_equal_rewards_give_zero_not_nan(scale):
    """A group whose rewards are all equal has std 0; eps keeps its advantage at 0."""
    advantages = group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), scale=scale)
    assert_close(advantages, torch.zeros(4))


def test_integer_rewards_become_float():
    advantages = group_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), scale="none")
    assert_close(advantages, torch.tensor([0.5, -0.5]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale": "global"}, "scale"),
        ({"eps": 0.0}, "eps"),
        ({"group_ids": torch.zeros(5, dtype=torch.long)}, "shape"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    args = {"rewards": REWARDS, "group_ids": GROUP_IDS, **kwargs}
    with pytest.raises(ValueError, match=match):
        group_advantages(**args)
