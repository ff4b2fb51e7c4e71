"""Loading never runs a pickle (issue 11, item 5): every place chainer_tc, its examples and its
benchmarks read an array file goes through a pickle-free loader, and the mean file of the DALI
pipelines is refused when it is not a plain .npy array. The loader itself is tested in
tests/test_serializers.py."""
import ast
import os

import numpy
import pytest

from chainer_tc.dali import normalisation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources():
    for top in ('chainer_tc', 'examples', 'benchmarks'):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith('.py'):
                    yield os.path.join(d, f)


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return '.'.join(reversed(parts))


def _unsafe_loads(path):
    """(line, what) of every call that may unpickle: numpy.load without allow_pickle=False,
    chainer's load_npz, pickle.load(s)."""
    tree = ast.parse(open(path).read(), path)
    chainer_serializers = set()     # local names bound to chainer.serializers
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == 'chainer':
            chainer_serializers |= {a.asname or a.name for a in node.names
                                    if a.name == 'serializers'}
        if isinstance(node, ast.ImportFrom) and node.module in ('chainer.serializers',
                                                                'chainer.serializers.npz'):
            chainer_serializers |= {'<direct>' for a in node.names if a.name == 'load_npz'}
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name in ('numpy.load', 'np.load'):
            safe = [k for k in node.keywords if k.arg == 'allow_pickle'
                    and isinstance(k.value, ast.Constant) and k.value.value is False]
            if not safe:
                bad.append((node.lineno, name + ' without allow_pickle=False'))
        elif name in ('pickle.load', 'pickle.loads', 'chainer.serializers.load_npz'):
            bad.append((node.lineno, name))
        elif name.endswith('.load_npz') and name.split('.')[0] in chainer_serializers:
            bad.append((node.lineno, name + " (chainer's, which unpickles)"))
        elif name == 'load_npz' and '<direct>' in chainer_serializers:
            bad.append((node.lineno, "chainer's load_npz"))
    return bad


def test_no_loader_in_chainer_tc_examples_or_benchmarks_unpickles():
    found = {os.path.relpath(p, ROOT): b for p in _sources() for b in [_unsafe_loads(p)] if b}
    assert found == {}, 'use chainer_tc.serializers (load_npz, read_npz) or allow_pickle=False'


def test_the_scan_finds_what_it_looks_for(tmp_path):
    p = tmp_path / 'bad.py'
    p.write_text('import numpy, pickle\nfrom chainer import serializers\n'
                 'numpy.load("a.npy")\nnumpy.load("b.npy", allow_pickle=False)\n'
                 'serializers.load_npz("m.npz", m)\npickle.loads(b"")\n')
    assert [line for line, _ in _unsafe_loads(str(p))] == [3, 5, 6]


def test_mean_file_that_is_an_npz_archive_is_refused(tmp_path):
    path = str(tmp_path / 'mean.npz')
    numpy.savez(path, mean=numpy.full((3, 4, 4), 100.0))
    with pytest.raises(ValueError, match=r"mean: the mean file '.*mean.npz' is an .npz archive "
                                         r"\(of mean\), not a .npy array"):
        normalisation.channel_mean(path)


def test_mean_file_with_an_object_array_is_refused_unread(tmp_path):
    path = str(tmp_path / 'mean.npy')

    class Boom(object):
        def __reduce__(self):
            return (os.system, ('touch {}'.format(tmp_path / 'ran'),))
    numpy.save(path, numpy.array([Boom()], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match='not a .npy array of numbers'):
        normalisation.channel_mean(path)
    assert not (tmp_path / 'ran').exists()
