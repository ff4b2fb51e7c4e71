"""chainer_tc.sass: nvdisasm's text parsed into instructions and innermost loops, on a synthetic
listing (exact) and on small kernels compiled here (NVRTC 12 + the nvidia-cuda-nvdisasm wheel of
the test extra; no GPU), and the `python -m chainer_tc sass` command."""
import json
import os
import subprocess
import sys

import pytest

from chainer_tc import sass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# nvdisasm -c -gi's shape: a section per kernel, line comments (the first of a group is the
# innermost location), labels, a loop with an if/else inside, the spin after EXIT
LISTING = '''
//--------------------- .text.other --------------------------
        /*0000*/                   EXIT ;
//--------------------- .text.k  --------------------------
.text.k:
	//## File "/src/kernels/k.cu", line 5 inlined at "/src/kernels/k.cu", line 9
	//## File "/src/kernels/k.cu", line 9
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
	//## File "/src/kernels/k.cu", line 10
        /*0010*/                   LDG.E.U16 R2, desc[UR4][R4.64] ;
        /*0020*/                   LDG.E.64 R6, desc[UR4][R8.64] ;
        /*0030*/               @P1 BRA `(.L_x_1) ;
        /*0040*/                   FADD R2, R2, R3 ;
        /*0050*/                   FADD R2, R2, R3 ;
        /*0060*/                   BRA `(.L_x_2) ;
.L_x_1:
	//## File "/src/kernels/k.cu", line 11
        /*0070*/                   FMUL R2, R2, R3 ;
.L_x_2:
        /*0080*/                   STG.E.128 desc[UR4][R4.64], R8 ;
        /*0090*/               @!P0 BRA `(.L_x_0) ;
        /*00a0*/                   EXIT ;
.L_x_3:
        /*00b0*/                   BRA `(.L_x_3);
//--------------------- SYMBOLS --------------------------
'''


def test_parse_instructions_labels_and_lines():
    ins, labels = sass.parse(LISTING, 'k')
    assert [i.address for i in ins] == list(range(0, 0xc0, 0x10))
    assert labels == {'.L_x_0': 1, '.L_x_1': 7, '.L_x_2': 8, '.L_x_3': 11}
    assert ins[0].line == 'k.cu:5'                 # the innermost of "5 inlined at 9"
    assert ins[1].opcode == 'LDG.E.U16' and ins[1].line == 'k.cu:10'
    assert ins[3].predicate == '@P1' and ins[9].predicate == '@!P0'
    assert ins[7].line == 'k.cu:11' and ins[8].line == 'k.cu:11'
    assert sass.functions(LISTING) == ['other', 'k']
    with pytest.raises(KeyError, match='no function missing.*other, k'):
        sass.parse(LISTING, 'missing')


def test_loops_range_paths_and_accesses():
    ins, labels = sass.parse(LISTING, 'k')
    (loop,) = sass.loops(ins, labels)           # the spin after EXIT is no loop
    assert (loop.start, loop.end, loop.instructions) == (0x10, 0x90, 9)
    # if: 3 + FMUL + STG + BRA = 6; else: 3 + 2 FADD + BRA + STG + BRA = 8
    assert (loop.shortest, loop.longest) == (6, 8)
    assert (loop.loads, loop.stores, loop.load_bytes, loop.store_bytes) == (2, 1, 10, 16)
    assert loop.lines == ['k.cu:10', 'k.cu:11']
    assert loop.opcodes == {'LDG': 2, 'BRA': 3, 'FADD': 2, 'FMUL': 1, 'STG': 1}


def test_nested_loops_report_the_innermost():
    text = '''//--------------------- .text.n --------------------------
.L_x_0:
        /*0000*/                   IADD3 R0, R0, 1, RZ ;
.L_x_1:
        /*0010*/                   IADD3 R1, R1, 1, RZ ;
        /*0020*/               @P0 BRA `(.L_x_1) ;
        /*0030*/               @P1 BRA `(.L_x_0) ;
        /*0040*/                   EXIT ;
'''
    ins, labels = sass.parse(text, 'n')
    assert [(lp.start, lp.end, lp.instructions) for lp in sass.loops(ins, labels)] == \
        [(0x10, 0x20, 2)]


@pytest.mark.parametrize('opcode, size', [('LDG.E', 4), ('LDG.E.U8', 1), ('LDG.E.S16', 2),
                                          ('LDG.E.64.CONSTANT', 8), ('STG.E.128', 16)])
def test_access_bytes(opcode, size):
    assert sass.access_bytes(opcode) == size


TOY = '''extern "C" __global__ void axpy(const float* x, float* y, float a, int n) {
#pragma unroll 1
  for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = a * x[i] + y[i];
}
template <typename T>
__global__ void twice(T* x, int n) {
  for (int j = 0; j < n; ++j) {
#pragma unroll 1
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[j * n + i] += x[i];
  }
}
template __global__ void twice<__half>(__half*, int);
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / 'kernels').mkdir()
    (tmp_path / 'kernels' / 'toy.cu').write_text('#include <cuda_fp16.h>\n' + TOY)
    monkeypatch.setenv('CHAINER_TC_KERNEL_DIR', str(tmp_path / 'kernels'))
    monkeypatch.setenv('CHAINER_TC_CACHE_DIR', str(tmp_path / 'cache'))
    return tmp_path


def test_find_nvdisasm():
    path = sass.find_nvdisasm()
    assert os.path.basename(path) == 'nvdisasm' and os.access(path, os.X_OK)


def test_missing_nvdisasm_names_the_wheel(monkeypatch):
    monkeypatch.setattr(sass.sysconfig, 'get_paths', lambda: {'purelib': '', 'platlib': ''})
    monkeypatch.setattr(sys, 'path', [])
    monkeypatch.setenv('PATH', '')
    with pytest.raises(FileNotFoundError, match='pip install nvidia-cuda-nvdisasm'):
        sass.find_nvdisasm()


def test_a_known_loop_body(toy):
    listing = sass.disassemble('toy', 'axpy')
    (loop,) = sass.loops(listing, listing.labels)
    # y[i] = a * x[i] + y[i], i += blockDim.x: two 4-byte loads, an FFMA, a store, the branch
    assert (loop.loads, loop.stores, loop.load_bytes, loop.store_bytes) == (2, 1, 8, 4)
    assert loop.opcodes['FFMA'] == 1 and loop.opcodes['BRA'] == 1
    assert 'FMUL' not in loop.opcodes                  # -ftz=true as CuPy: contracted to FFMA
    assert 6 <= loop.instructions <= 12 and loop.shortest == loop.longest == loop.instructions
    assert loop.lines == ['toy.cu:4']                  # the loop's line (line 1 is the #include)
    assert all(i.line is None for i in sass.disassemble('toy', 'axpy', lines=False))


def test_a_template_by_its_name_expression_innermost_only(toy):
    (loop,) = sass.kernel_loops('toy', 'twice<__half>')
    assert loop.loads == 2 and loop.stores == 1 and loop.load_bytes == 4
    assert loop.lines and all(line.startswith('toy.cu:') for line in loop.lines)


def test_arch_is_checked(toy):
    with pytest.raises(ValueError, match='sm_70, sm_80, sm_90'):
        sass.disassemble('toy', 'axpy', arch='sm_75')


def run(*args, **env):
    return subprocess.run([sys.executable, '-m', 'chainer_tc', 'sass', *args], cwd=ROOT,
                          capture_output=True, text=True, env=dict(os.environ, **env))


def test_command_table_and_json(toy):
    env = dict(CHAINER_TC_KERNEL_DIR=str(toy / 'kernels'), CHAINER_TC_CACHE_DIR=str(toy / 'cache'))
    p = run('toy', 'axpy', **env)
    assert p.returncode == 0, p.stderr
    assert 'axpy (toy.cu, sm_90):' in p.stdout and '1 innermost loop' in p.stdout
    assert 'toy.cu:4' in p.stdout
    p = run('toy', 'twice<__half>', '--arch', 'sm_80', '--json', **env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out['arch'] == 'sm_80' and len(out['loops']) == 1
    assert out['loops'][0]['loads'] == 2 and out['loops'][0]['load_bytes'] == 4


def test_command_unknown_kernel_exits_1(toy):
    p = run('toy', 'nope', CHAINER_TC_KERNEL_DIR=str(toy / 'kernels'),
            CHAINER_TC_CACHE_DIR=str(toy / 'cache'))
    assert p.returncode == 1 and 'no function nope' in p.stderr and 'axpy' in p.stderr


@pytest.mark.parametrize('family', ['optimizer', 'batchnorm', 'layout', 'pooling'])
def test_every_kernel_reaches_global_memory_with_global_accesses(family):
    """NVVM proves an address global from how it was made; when it cannot, the access becomes
    a generic LD/ST (an address-space check on each). The optimizer's gradient addresses come
    from integers: masking their flag bits with a mask chosen at run time made its gradient
    loads and stores generic (424 LD/ST on sm_90), the loops otherwise the same. Every kernel here reaches global
    memory through LDG/STG (and shared memory through LDS/STS) only."""
    from chainer_tc import kernels  # noqa: F401
    options = sass.compile_options(sass.family_defines(family), 'sm_90')
    text = sass._run_nvdisasm(sass._compile(family, (), options).binary)
    generic = {}
    for name in sass.functions(text):
        instructions, _ = sass.parse(text, name)
        ops = [i.opcode for i in instructions if i.opcode.split('.')[0] in ('LD', 'ST')]
        if ops:
            generic[name] = len(ops)
    assert generic == {}
