"""chainer_tc.dali._order: the iterator logic without DALI (epochs, policies, shards, resume),
against Chainer's SerialIterator where their semantics coincide."""
import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer: CUDA libraries)
import chainer

from chainer_tc.dali import _order


def batches(order, n):
    """n batches as (list of indices, epoch, is_new_epoch)."""
    out = []
    for _ in range(n):
        b = order.next_batch()
        out.append((b.tolist(), order.position.epoch, order.position.is_new_epoch))
    return out


def test_the_documented_table_7_images_batch_2():
    # The table in _order's docstring and docs/dali.md, epochs 0 and 1.
    def run(policy, repeat, n):
        return [b for b, _, _ in batches(
            _order.EpochOrder(7, 2, repeat=repeat, shuffle=False, last_batch=policy), n)]
    assert run('fill', True, 6) == [[0, 1], [2, 3], [4, 5], [6, 0], [1, 2], [3, 4]]
    assert run('partial', True, 6) == [[0, 1], [2, 3], [4, 5], [6], [0, 1], [2, 3]]
    assert run('drop', True, 5) == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]
    for policy, last in (('partial', [[4, 5], [6]]), ('drop', [[4, 5]])):
        o = _order.EpochOrder(7, 2, repeat=False, shuffle=False, last_batch=policy)
        got = [o.next_batch().tolist() for _ in range(2 + len(last))]
        assert got == [[0, 1], [2, 3]] + last
        with pytest.raises(StopIteration):
            o.next_batch()
    # where is_new_epoch is True
    assert [new for _, _, new in batches(
        _order.EpochOrder(7, 2, shuffle=False, last_batch='fill'), 8)] == \
        [False, False, False, True, False, False, True, False]
    assert [new for _, _, new in batches(
        _order.EpochOrder(7, 2, shuffle=False, last_batch='drop'), 6)] == \
        [False, False, True, False, False, True]


@pytest.mark.parametrize('size,batch_size', [(7, 2), (29, 4), (5, 5), (3, 7), (10, 1)])
@pytest.mark.parametrize('repeat', [True, False])
def test_matches_serial_iterator(size, batch_size, repeat):
    """Unshuffled, 'fill' (repeat) and 'partial' (no repeat) are SerialIterator's semantics:
    the same batches, epoch, epoch_detail, previous_epoch_detail and is_new_epoch."""
    ref = chainer.iterators.SerialIterator(list(range(size)), batch_size, repeat=repeat,
                                           shuffle=False)
    o = _order.EpochOrder(size, batch_size, repeat=repeat, shuffle=False)
    steps = 4 * size // batch_size + 3 if repeat else -(-size // batch_size)
    for _ in range(steps):
        expected = next(ref)
        got = o.next_batch()
        assert got.tolist() == expected
        p = o.position
        assert (p.epoch, p.is_new_epoch) == (ref.epoch, ref.is_new_epoch)
        assert o.epoch_detail_of(p) == pytest.approx(ref.epoch_detail)
        assert p.previous_epoch_detail == pytest.approx(ref.previous_epoch_detail)
    if not repeat:
        with pytest.raises(StopIteration):
            next(ref)
        with pytest.raises(StopIteration):
            o.next_batch()


def test_shuffled_epochs_are_permutations_and_differ():
    o = _order.EpochOrder(29, 4, shuffle=True, seed=5)
    stream = numpy.concatenate([o.next_batch() for _ in range(29)])     # 116 = 4 epochs
    epochs = stream.reshape(4, 29)
    for e in epochs:
        assert sorted(e.tolist()) == list(range(29))
    assert len({tuple(e) for e in epochs}) == 4
    again = _order.EpochOrder(29, 4, shuffle=True, seed=5)
    assert numpy.array_equal(numpy.concatenate([again.next_batch() for _ in range(29)]), stream)
    other = _order.EpochOrder(29, 4, shuffle=True, seed=6)
    assert not numpy.array_equal(other.order(0), o.order(0))


@pytest.mark.parametrize('num_shards', [2, 3, 7])
@pytest.mark.parametrize('shuffle', [False, True])
def test_a_pass_partitions_the_data_set(num_shards, shuffle):
    """repeat=False (validation): every image exactly once over the shards."""
    parts = [_order.EpochOrder(29, 4, repeat=False, shuffle=shuffle, seed=1, shard_id=k,
                               num_shards=num_shards).order(0) for k in range(num_shards)]
    assert sorted(numpy.concatenate(parts).tolist()) == list(range(29))
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1


@pytest.mark.parametrize('num_shards', [2, 3, 7, 29])
@pytest.mark.parametrize('shuffle', [False, True])
def test_training_shards_cover_every_epoch_with_epochs_of_one_length(num_shards, shuffle):
    """repeat=True: the shards' epochs are as long as the longest slice (ranks reach
    is_new_epoch together); a shorter slice takes one other image, each a different one."""
    longest = -(-29 // num_shards)
    for epoch in range(3):
        parts = [_order.EpochOrder(29, 4, shuffle=shuffle, seed=1, shard_id=k,
                                   num_shards=num_shards).order(epoch)
                 for k in range(num_shards)]
        assert [len(p) for p in parts] == [longest] * num_shards
        joined = numpy.concatenate(parts).tolist()
        assert sorted(set(joined)) == list(range(29))
        repeated = [i for i in set(joined) if joined.count(i) > 1]
        assert len(joined) - 29 == len(repeated) == num_shards * longest - 29
        assert all(joined.count(i) == 2 for i in repeated)
        assert all(len(set(p)) == len(p) for p in parts)


@pytest.mark.parametrize('policy', ['fill', 'partial', 'drop'])
@pytest.mark.parametrize('size,num_shards,batch', [(29, 2, 4), (7, 2, 2), (1281167, 8, 256),
                                                   (1281167, 8, 128), (30, 7, 3)])
def test_every_training_shard_starts_its_epochs_at_the_same_iterations(policy, size, num_shards,
                                                                        batch):
    """The ranks of a multi-node run see is_new_epoch (and so epoch triggers and an epoch
    learning-rate schedule) at the same iterations: a shard one image short used to end its
    epochs earlier and earlier (ImageNet on 8 ranks: 15 of 90 epochs at batch 256)."""
    orders = [_order.EpochOrder(size, batch, shuffle=False, last_batch=policy, shard_id=k,
                                num_shards=num_shards) for k in range(num_shards)]
    assert len({o.epoch_size for o in orders}) == 1
    if size > 100:                       # ImageNet: the epoch ends, counted, not stepped through
        return
    for _ in range(40):
        news = {(len(o.next_batch()), o.position.is_new_epoch, o.position.epoch,
                 o.epoch_detail_of(o.position)) for o in orders}
        assert len(news) == 1, news


@pytest.mark.parametrize('policy', ['fill', 'partial', 'drop'])
def test_resume_from_a_position_continues_exactly(policy):
    a = _order.EpochOrder(29, 4, shuffle=True, seed=3, last_batch=policy)
    for _ in range(11):                     # into the second epoch
        a.next_batch()
    saved = a.position
    rest = [a.next_batch().tolist() for _ in range(12)]
    b = _order.EpochOrder(29, 4, shuffle=True, seed=3, last_batch=policy)
    b.set_position(tuple(saved))
    assert [b.next_batch().tolist() for _ in range(12)] == rest
    assert b.position == a.position


def test_drop_leaves_out_different_images_each_epoch_when_shuffled():
    o = _order.EpochOrder(10, 4, shuffle=True, seed=0, last_batch='drop')
    assert o.epoch_size == 8
    left_out = []
    for _ in range(4):
        got = numpy.concatenate([o.next_batch() for _ in range(2)])
        assert o.position.is_new_epoch and len(set(got.tolist())) == 8
        left_out.append(frozenset(range(10)) - set(got.tolist()))
    assert len(set(left_out)) > 1


def test_batch_larger_than_the_epoch_spans_epochs():
    o = _order.EpochOrder(3, 8, shuffle=False)
    assert o.next_batch().tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert (o.position.epoch, o.position.current_position) == (2, 2)
    o = _order.EpochOrder(3, 8, shuffle=False, last_batch='partial')
    assert o.next_batch().tolist() == [0, 1, 2]


def test_reset_restarts_the_first_epoch():
    o = _order.EpochOrder(29, 4, shuffle=True, seed=2)
    first = [o.next_batch().tolist() for _ in range(10)]
    o.reset()
    assert o.position == _order.START
    assert [o.next_batch().tolist() for _ in range(10)] == first


@pytest.mark.parametrize('kwargs,message', [
    (dict(size=0), 'size must be an integer >= 1'),
    (dict(batch_size=0), 'batch_size must be an integer >= 1'),
    (dict(last_batch='pad'), "last_batch must be one of"),
    (dict(repeat=False, last_batch='fill'), "'fill' needs repeat=True"),
    (dict(shard_id=2, num_shards=2), r'shard_id must be an integer in \[0, num_shards=2\)'),
    (dict(size=3, num_shards=4), 'a shard would be empty'),
    (dict(size=3, batch_size=4, last_batch='drop'), 'gives no batch at all'),
    (dict(seed=-1), 'seed must be an integer >= 0'),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    args = dict(size=29, batch_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        _order.EpochOrder(**args)


def test_bad_resume_position_is_refused():
    o = _order.EpochOrder(29, 4)
    with pytest.raises(ValueError, match=r'current_position must be an integer in \[0, 29\)'):
        o.set_position((1, 29, False, 0.5))
