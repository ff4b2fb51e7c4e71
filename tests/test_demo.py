"""`make demo` runs examples/imagenet/demo.py (ResNet-50 learns the demo's real images with every
technique on); `make smoke` runs examples/smoke.py. Both must pass on a CPU-only machine."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_passes(tmp_path):
    """The demo script itself, shortened (12 epochs at width/16 and 48x48 instead of 20 at
    width/8 and 64x64; float16 and every technique as in `make demo`): about 25 s here."""
    out = tmp_path / 'demo'
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'examples', 'imagenet', 'demo.py'),
                        '--epochs', '12', '--width', '16', '--insize', '48', '--out', str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith('demo passed: training loss '), last
    assert 'validation accuracy' in last and '(chance 0.17)' in last
    assert 'Techniques: --nhwc --fused-bn --batched-update --static-graph --pad-channels 4 ' \
           '--loss-scale dynamic --dali' in p.stdout
    assert 'Dtype: float16' in p.stdout and 'Input: DALI, CPU pipeline' in p.stdout
    assert 'this epoch' in p.stdout                 # the progress bar
    for name in ('log', 'loss.png', 'accuracy.png', 'snapshot_iter_144', 'model_iter_144'):
        assert (out / name).is_file(), name
    with open(str(out / 'log')) as f:
        assert len(json.load(f)) == 12


def test_demo_fails_when_it_does_not_learn(tmp_path):
    """The verdict: a log whose loss did not fall, or whose accuracy is near chance, fails."""
    sys.path.insert(0, os.path.join(ROOT, 'examples', 'imagenet'))
    import demo
    log = tmp_path / 'log'
    cases = [((2.0, 0.5, 0.9), True), ((2.0, 1.8, 0.9), False), ((2.0, 0.5, 0.2), False)]
    for (first, last, accuracy), passed in cases:
        log.write_text(json.dumps([{'main/loss': first},
                                   {'main/loss': last, 'validation/main/accuracy': accuracy}]))
        ok, line = demo.verdict(str(log), 6)
        assert ok is passed, line
        assert line.startswith('demo passed' if passed else 'demo FAILED')


def test_smoke_job_passes():
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'examples', 'smoke.py')],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert 'bit-identical to NumPy: True' in p.stdout
    assert 'smoke job passed' in p.stdout
