"""Every kernel of kernels/, emulated on awkward shapes with the race detector on and under three
schedules (forward, reverse, random): the project's own kernels must not be reported, must agree
between schedules, must write every output, and match NumPy where a reference is given.

Some cases launch fewer blocks than the work needs, as the kernels' contracts allow, so that their
grid-stride and tile loops run more than once (the mutation tool relies on them:
python -m chainer_tc.testing.mutate).
"""
import os

import numpy
import pytest

from chainer_tc.testing import emulator
from chainer_tc.testing import kernel_cases

CASES = kernel_cases.cases(big=False)


@pytest.fixture(scope='module')
def backend():
    return kernel_cases.EmulatorBackend()


def checks():
    """Race detector and three schedules, unless the environment says otherwise (the mutation
    tool's --memcheck-only sets CHAINER_TC_EMULATOR_RACECHECK=0)."""
    if 'CHAINER_TC_EMULATOR_RACECHECK' in os.environ:
        return emulator.checking()
    return emulator.checking(race=True, schedules=['forward', 'reverse', 'random:3'])


@pytest.mark.parametrize('case', CASES, ids=['{}-{}'.format(c.family, c.name) for c in CASES])
def test_kernel_case(case, backend):
    with checks():
        out, _ = kernel_cases.run(case, backend)
    for name, value in out.items():
        if value.dtype.kind == 'f':
            assert not numpy.isnan(value).any(), '{}: elements left unwritten (NaN)'.format(name)
        else:
            assert not (value == -1).all() or value.size == 0, '{}: not written'.format(name)
    if case.reference is not None:
        for name, (expected, rtol, atol) in case.reference(case.arrays).items():
            numpy.testing.assert_allclose(out[name].astype(numpy.float64),
                                          numpy.asarray(expected, numpy.float64),
                                          rtol=rtol, atol=atol, err_msg=name)


def test_every_kernel_has_a_case():
    from chainer_tc import kernels
    launched = {(c.family, k.split('<')[0]) for c in CASES for k in c.kernel_names()}
    for family in kernels.families():
        code = kernels.source(family)
        names = set(emulator.entry_points(code))
        names |= {n.split('<')[0] for c in CASES if c.family == family for n in c.name_expressions}
        missing = sorted(n for n in names if (family, n) not in launched)
        assert not missing, 'kernels/{}.cu: no case launches {}'.format(family, missing)
