"""Smoke test of benchmarks/ablation.py: its hidden ``--smoke`` setting runs one tiny configuration
per row (batch 1, two timed iterations, the tiny model's parameters for the optimizer rows, eight
generated images), in seconds. Checks the tables, the JSON keys and the chart; never a timing.
The only benchmark the tests run."""
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'benchmarks', 'ablation.py')
CONFIGS = ('fp32', 'fp16', '+DALI', '+NHWC/fused/batched', '+static graph')
CPU_CONFIGS = ('fp32', 'fp16', '+NHWC/fused/batched', '+static graph')


def test_ablation_smoke(tmp_path):
    out = tmp_path / 'results' / 'ablation.json'
    proc = subprocess.run([sys.executable, SCRIPT, '--quick', '--smoke', '--out', str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    text = proc.stdout

    # the tables
    for title in ('Host time per training iteration', 'Optimizer update', 'Input pipeline',
                  'Ablation (cumulative'):
        assert title in text, title
    summary = text[text.index('Ablation (cumulative'):]
    for c in CONFIGS:
        assert '\n' + c + ' ' in summary, c
    assert 'GPU rows: not measured' in summary

    # the JSON
    result = json.loads(out.read_text())
    for key in ('benchmark', 'command', 'machine', 'versions', 'config', 'figures', 'chart'):
        assert key in result, key
    assert result['benchmark'] == 'ablation'
    for key in ('chainer', 'cupy', 'numpy', 'dali'):
        assert key in result['versions'], key
    assert result['versions']['chainer'] == '7.8.1'
    assert result['config']['configurations'] == list(CONFIGS)
    figures = result['figures']
    for key in ('host_time', 'launches_counted', 'optimizer_update', 'input_pipeline', 'gpu',
                'summary'):
        assert key in figures, key
    assert figures['gpu'] is None and result['gpu_measured'] is False

    rows = {r['config']: r for r in figures['host_time']['rows']}
    assert sorted(rows) == sorted(CPU_CONFIGS)
    for r in rows.values():
        assert r['batch'] == 1 and r['ms_per_iter'] > 0
        for key in ('speedup_vs_fp32', 'speedup_vs_previous', 'function_nodes_per_iter',
                    'launches_estimated', 'host_launches_estimated', 'host_syncs_per_iter'):
            assert key in r, (r['config'], key)
    assert rows['fp32']['speedup_vs_fp32'] == 1.0
    assert rows['fp32']['function_nodes_per_iter'] > rows['+NHWC/fused/batched'][
        'function_nodes_per_iter'] > 0
    static = rows['+static graph']
    assert static['function_nodes_per_iter'] == 0 and static['replayed_ops_per_iter'] > 0
    assert static['replays'] > 0
    assert static['host_launches_estimated'] < static['launches_estimated']
    assert rows['fp16']['host_syncs_per_iter'] == rows['fp16']['params']

    counted = figures['launches_counted']
    assert counted['+NHWC/fused/batched']['launches_per_iter'] > 0
    assert counted['+static graph']['replayed']

    opt = figures['optimizer_update']
    assert [r['config'] for r in opt['rows']] == ['fp32', 'fp16', '+NHWC/fused/batched']
    assert all(r['ms_per_update'] > 0 and r['GB_per_s'] > 0 for r in opt['rows'])
    assert opt['rows'][2]['launches_source'] == 'counted (emulator)'

    pipe = figures['input_pipeline']
    assert pipe['dali_cpu_images_per_s'] > 0 and pipe['chainer_images_per_s'] > 0

    assert [r['config'] for r in figures['summary']] == list(CONFIGS)

    # the chart, next to the JSON
    png = out.with_suffix('.png')
    if importlib.util.find_spec('matplotlib') is None:
        assert result['chart'] is None and result['chart_error']
    else:
        assert result['chart'] == str(png)
        assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_gpu_table_says_when_chainers_baseline_had_no_cudnn():
    """On CuPy 14 (no cuDNN in CuPy) Chainer's links convolve by im2col: the table says so, so
    the fp32/fp16 rows are not read as the study's cuDNN baseline."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        spec = importlib.util.spec_from_file_location('ablation_under_test', SCRIPT)
        ablation = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ablation)
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    gpu = {'device': 'H100', 'model': 'ResNet-50', 'repeats': 3, 'iters': 10,
           'chainer_cudnn': True, 'chainer_tc_cudnn': '9.24.0',
           'rows': [{'config': 'fp32', 'input': 'synthetic', 'batch': 32, 'images_per_s': 100.0,
                     'speedup_vs_fp32': 1.0}]}
    assert 'without cuDNN' not in ablation.gpu_table(gpu)
    text = ablation.gpu_table(dict(gpu, chainer_cudnn=False))
    assert text.splitlines()[-1] == (
        "Chainer's own links ran without cuDNN here (CuPy has none): the fp32/fp16 rows "
        "convolve by im2col and matrix products, not the study's cuDNN baseline; chainer_tc "
        "used cuDNN 9.24.0")
