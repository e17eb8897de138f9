import pytest

from megatron_rl.data.sampler import PromptSampler


def test_epochs_cover_every_row_once_and_order_is_seeded():
    s = PromptSampler(10, seed=3)
    first = s.next_indices(10)
    assert sorted(first) == list(range(10)) and first != list(range(10))
    assert PromptSampler(10, seed=3).next_indices(10) == first
    assert PromptSampler(10, seed=4).next_indices(10) != first
    second = s.next_indices(10)
    assert sorted(second) == list(range(10)) and second != first


def test_resume_continues_the_same_sequence():
    a = PromptSampler(7, seed=1)
    a.next_indices(5)
    state = a.state_dict()
    want = a.next_indices(9)  # crosses an epoch boundary
    b = PromptSampler(7, seed=1)
    b.load_state_dict(state)
    assert b.next_indices(9) == want


def test_unshuffled_is_file_order_and_changed_data_is_refused():
    assert PromptSampler(4, seed=0, shuffle=False).next_indices(6) == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="7 rows but the training data now has 8"):
        PromptSampler(8, seed=1).load_state_dict(PromptSampler(7, seed=1).state_dict())
