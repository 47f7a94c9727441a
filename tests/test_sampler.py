from rl.sampler import TaskSampler


def test_each_epoch_is_a_permutation():
    s = TaskSampler(list(range(7)), seed=3)
    first, second = s.next(7), s.next(7)
    assert sorted(first) == sorted(second) == list(range(7))
    assert first != second


def test_resume_continues_the_same_stream():
    full = TaskSampler(list(range(5)), seed=1)
    expected = full.next(3) + full.next(9)
    a = TaskSampler(list(range(5)), seed=1)
    head = a.next(3)
    b = TaskSampler(list(range(5)), seed=1)
    b.load_state_dict(a.state_dict())
    assert head + b.next(9) == expected
