"""Running code in a fresh interpreter, as a user's process starts: without LD_LIBRARY_PATH
(chainer_tc must find the pip-installed CUDA libraries itself), without the switch that turns
their preloading off, and without inherited warning filters; the repository first on the path."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLEARED = ('LD_LIBRARY_PATH', 'CHAINER_TC_NO_PRELOAD', 'PYTHONWARNINGS')


def run_python(code, **extra_env):
    """Run ``code`` with ``python -c`` in the repository, the environment cleared as above and
    updated with ``extra_env``; return the CompletedProcess (text output captured)."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env['PYTHONPATH'] = REPO
    env.update(extra_env)
    return subprocess.run([sys.executable, '-c', code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
