"""`make demo` runs examples/smoke.py; it must pass end to end on a CPU-only machine."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_demo_passes():
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'examples', 'smoke.py')],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert 'bit-identical to NumPy: True' in p.stdout
    assert 'smoke job passed' in p.stdout
