"""One rank of the multi-node BatchNormalization tests: run by tests/test_multinode_batchnorm.py
under ``mpiexec -n 2`` (ChainerMN's naive communicator, MPI on the host).

    mpiexec -n 2 python tests/multinode_batchnorm_worker.py OUTDIR

Every case in one run (one MPI start-up): the functions on this rank's shard of each case's
global batch (NumPy path and emulated kernels), ChainerMN's own link on the same data (for the
accuracy comparison), channel counts that differ between the ranks, and a few training steps of
a small NHWC network converted by ``multinode.create_mnbn_model``, through ChainerMN's
optimizer wrapper and through ``multinode.TrainStep``. Writes ``rank{R}.npz`` to OUTDIR.
"""
import contextlib
import os
import sys
import warnings

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chainer_tc  # noqa: E402,F401  (before chainer)
import chainer  # noqa: E402
import chainermn  # noqa: E402

import multinode_batchnorm_common as common  # noqa: E402
from chainer_tc import multinode  # noqa: E402
from chainer_tc.multinode import collectives  # noqa: E402


def function_case(comm, name, path, dtype, pdtype, relu, with_z, images, out):
    os.environ['CHAINER_TC_EMULATE'] = '1' if path == 'emulator' else '0'
    d = common.global_data(name, dtype, pdtype, images)
    mine = {k: common.shard(d[k], comm.rank, images) for k in ('x', 'z', 'gy')}
    x, z = chainer.Variable(mine['x']), chainer.Variable(mine['z'])
    gamma, beta = chainer.Variable(d['gamma'].copy()), chainer.Variable(d['beta'].copy())
    rm, rv = d['rm'].copy(), d['rv'].copy()
    if relu:
        y = multinode.multi_node_batch_normalization_add_relu(
            x, z if with_z else None, gamma, beta, comm, common.EPS, rm, rv, common.DECAY)
    else:
        y = multinode.multi_node_batch_normalization(x, gamma, beta, comm, common.EPS, rm, rv,
                                                     common.DECAY)
    y.grad = mine['gy']
    y.backward()
    got = dict(y=y.array, rm=rm, rv=rv, gx=x.grad, ggamma=gamma.grad, gbeta=beta.grad)
    if with_z:
        got['gz'] = z.grad
    for k, v in got.items():
        out['{}/{}'.format(name, k)] = v


def chainermn_accuracy(comm, out):
    """ours and ChainerMN's link (NCHW data) on float32 data with an offset of 1000, unit spread
    and unequal batches (1 and 7 images)."""
    os.environ['CHAINER_TC_EMULATE'] = '0'
    images = (1, 7)
    r = numpy.random.RandomState(11)
    x = (1000 + r.randn(sum(images), 2, 2, 4)).astype(numpy.float32)
    mine = common.shard(x, comm.rank, images)
    ours = multinode.MultiNodeBatchNormalization(4, comm, eps=common.EPS)
    out['accuracy/ours'] = ours(mine).array
    theirs = chainermn.links.MultiNodeBatchNormalization(4, comm, eps=common.EPS)
    out['accuracy/chainermn'] = theirs(mine.transpose(0, 3, 1, 2)).array.transpose(0, 2, 3, 1)


def mismatch(comm, out):
    """Rank 1 has one channel more: the same ValueError on both ranks, no hang."""
    x = numpy.ones((2, 1, 1, 3 + comm.rank), numpy.float32)
    g = numpy.ones(3 + comm.rank, numpy.float32)
    try:
        multinode.multi_node_batch_normalization(x, g, g * 0, comm)
    except ValueError as e:
        out['mismatch'] = numpy.array(str(e))


def train(comm, out):
    """TRAIN_STEPS steps on this rank's half of each global batch, model converted by
    multinode.create_mnbn_model: through ChainerMN's wrapper (its first update broadcasts
    rank 0's model and makes no step) and through multinode.TrainStep."""
    os.environ['CHAINER_TC_EMULATE'] = '0'
    half = common.TRAIN_BATCH // comm.size

    def mine(step):
        return tuple(a[comm.rank * half:(comm.rank + 1) * half]
                     for a in common.train_batch(step))

    for how in ('wrapper', 'trainstep'):
        model = multinode.create_mnbn_model(common.Net(), comm)
        opt = common.optimizer(model)
        lossfun = common.lossfun(model)
        if how == 'wrapper':
            opt = multinode.create_multi_node_optimizer(opt, comm)
            update = lambda x, t: opt.update(lossfun, x, t)  # noqa: E731
            update(*mine(0))            # the loss (BN statistics), then the broadcast: no step
        else:
            update = multinode.TrainStep(model, opt, comm, lossfun)
        exchanges = []                  # per step: the host exchanges of row counts made
        for s in range(common.TRAIN_STEPS):
            made = []
            with _counting(collectives, '_allgather_objects', made):
                update(*mine(s))
            exchanges.append(len(made))
        out['train-{}/exchanges'.format(how)] = numpy.array(exchanges)
        for k, v in common.state(model).items():
            out['train-{}/{}'.format(how, k)] = v
        if how == 'trainstep':
            out['train-trainstep/replays'] = numpy.array(update.replays)
            out['train-trainstep/eager'] = numpy.array(update.eager_steps)
        out['train-{}/types'.format(how)] = numpy.array(
            sorted('{}:{}'.format(p, type(link).__name__) for p, link in model.namedlinks()
                   if 'BatchNorm' in type(link).__name__))


def agreement(comm, out):
    """multinode.TrainStep where the ranks would step differently. (1) At PARTIAL_AT rank 0
    has one image less (a new signature on rank 0 only): that step runs eagerly on both ranks.
    (2) Rank 0 alone changes GainNet's gain: its next check drops its trace while rank 1 keeps
    replaying; both ranks then drop it and record it again together. The step's counters after
    each step, and the warnings, are written out."""
    os.environ['CHAINER_TC_EMULATE'] = '0'
    model = multinode.create_mnbn_model(common.Net(), comm)
    opt = common.optimizer(model)
    step = multinode.TrainStep(model, opt, comm, common.lossfun(model))
    modes = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        for s in range(common.AGREE_STEPS):
            images = common.images_at(s)
            step(*(common.shard(a, comm.rank, images) for a in common.agreed_batch(s)))
            modes.append((step.eager_steps, step.replays, step.checks, step.disagreements))
    for k, v in common.state(model).items():
        out['partial/' + k] = v
    out['partial/modes'] = numpy.array(modes)
    out['partial/warnings'] = numpy.array([str(w.message) for w in seen
                                           if 'multinode.TrainStep' in str(w.message)] or [''])
    # one more step, a reporter current on rank 1 only (another part of the signature)
    reporter = chainer.Reporter()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        with reporter.scope({}) if comm.rank == 1 else contextlib.nullcontext():
            step(*(common.shard(a, comm.rank, common.images_at(0))
                   for a in common.agreed_batch(0)))
    out['partial/reporter'] = numpy.array([str(w.message) for w in seen
                                           if 'multinode.TrainStep' in str(w.message)] or [''])

    model = multinode.create_mnbn_model(common.GainNet(), comm)
    step = multinode.TrainStep(model, common.optimizer(model), comm, common.lossfun(model),
                               check_every=common.GAIN_CHECK_EVERY)
    out['gain/modes'], out['gain/warnings'] = _steps(comm, step, common.AGREE_STEPS + 2,
                                                     _gain_halved(comm, model, common.GAIN_AT))


def _steps(comm, step, steps, before=lambda s: None):
    """``steps`` steps of ``step`` on this rank's half of each global batch, ``before(s)``
    ahead of step s: (the step's counters after each step, the TrainStep warnings)."""
    half = common.TRAIN_BATCH // comm.size
    modes = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        for s in range(steps):
            before(s)
            step(*(a[comm.rank * half:(comm.rank + 1) * half] for a in common.train_batch(s)))
            modes.append((step.eager_steps, step.replays, step.checks, step.disagreements))
    return numpy.array(modes), numpy.array([str(w.message) for w in seen
                                            if 'TrainStep' in str(w.message)] or [''])


def _gain_halved(comm, model, at):
    """Rank 0 alone sets GainNet's gain to 0.5 before step ``at``."""
    def before(s):
        if s == at and comm.rank == 0:
            model.gain = 0.5
    return before


def failures(comm, out):
    """What one rank finds when it builds a replay is every rank's. (1) Rank 0 alone changes
    GainNet's gain between the two recorded steps: its build fails (a value differs between
    them), rank 1's does not. (2) A stand-in for a GPU capture (the CPU has none) that fails
    on rank 0 halfway through its forward (at its second host exchange: out of memory, say),
    while rank 1's runs its whole forward. The steps' counters, the warnings and the state
    are written out."""
    os.environ['CHAINER_TC_EMULATE'] = '0'
    model = multinode.create_mnbn_model(common.GainNet(), comm)
    step = multinode.TrainStep(model, common.optimizer(model), comm, common.lossfun(model))
    out['build/modes'], out['build/warnings'] = _steps(
        comm, step, common.FAIL_STEPS, _gain_halved(comm, model, common.BUILD_AT))
    for k, v in common.state(model).items():
        out['build/' + k] = v

    model = multinode.create_mnbn_model(common.Net(), comm)
    step = multinode.TrainStep(model, common.optimizer(model), comm, common.lossfun(model))
    step._chainer_cudnn_routed = lambda inputs: contextlib.nullcontext()
    made, replayed = [], []
    with _standing_in_for_capture(comm, made, replayed):
        out['capture/modes'], out['capture/warnings'] = _steps(comm, step, common.FAIL_STEPS)
    out['capture/made'] = numpy.array(made)            # host exchanges made while capturing
    out['capture/replayed'] = numpy.array(replayed)    # exchanges replayed while capturing
    for k, v in common.state(model).items():
        out['capture/' + k] = v


@contextlib.contextmanager
def _standing_in_for_capture(comm, made, replayed):
    """multinode.TrainStep's GPU path on NumPy arrays: its build 'captures' with a stand-in
    that runs the forward as a capture runs it on the host (the data collectives enqueued on
    the stream, NCCL's way, so no host communication; no array changed: BatchNorm's running
    statistics are put back) and raises NotReplayable on rank 0 at its second host exchange.
    ``made`` gets the number of host exchanges made while capturing, ``replayed`` those
    answered from the recorded step."""
    from chainer_tc.static_graph import _capture
    from chainer_tc.static_graph import _program
    from chainer_tc.static_graph import step as step_module

    class Capture:
        def __init__(self, step, entry):
            saved = [(a, a.copy()) for _, _, a in step._persistents()]
            calls = []
            tape = collectives._tapes.current

            def exchange(comm_, value):
                if comm.rank == 0 and tape.next == 1:
                    raise _program.NotReplayable('out of memory (a test)')
                return type(tape).exchange(tape, comm_, value)

            with _counting(collectives, '_allgather_objects', calls), \
                    _patched(tape, 'exchange', exchange), \
                    _patched(collectives, 'allgather', _enqueued_allgather):
                try:
                    step._call_lossfun(entry.buffers)
                finally:
                    for a, copy in saved:
                        a[...] = copy
                    made.append(len(calls))
                    replayed.append(tape.next)

    with _patched(step_module, '_is_cupy', lambda arrays: True), \
            _patched(_capture, 'CapturedStep', Capture):
        yield


def _counting(owner, name, calls):
    """A context in which ``owner.name`` appends to ``calls`` at each call."""
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    return _patched(owner, name, counted)


def _enqueued_allgather(comm, array, backend_name):
    return numpy.stack([array] * comm.size)


@contextlib.contextmanager
def _patched(owner, name, value):
    """``owner.name`` is ``value`` within (an instance's own attribute is removed after)."""
    had, old = name in vars(owner), vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def main(outdir):
    comm = chainermn.create_communicator('naive')
    assert comm.size == common.RANKS
    out = {}
    for case in common.function_cases():
        function_case(comm, *case, out=out)
    chainermn_accuracy(comm, out)
    mismatch(comm, out)
    train(comm, out)
    agreement(comm, out)
    failures(comm, out)
    numpy.savez(os.path.join(outdir, 'rank{}.npz'.format(comm.rank)), **out)


if __name__ == '__main__':
    try:
        main(sys.argv[1])
    except BaseException:
        import traceback
        from mpi4py import MPI
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)         # the other rank may wait in a collective: end it too
