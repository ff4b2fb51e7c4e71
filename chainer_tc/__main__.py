"""``python -m chainer_tc COMMAND``: the command-line tools.

    info [--json]              versions, GPUs, and which chainer_tc features can run here (and why not)
    kernels [--json]           compile kernels/*.cu with NVRTC 12 for sm_70/80/90: registers, spills
    sass FAMILY KERNEL         a kernel's SASS (nvdisasm) and its innermost loops: instructions,
                               global loads and stores, source lines ([--arch sm_90] [--json])
    check-gpu-stack            check the CUDA/cuDNN install without a GPU (what CI runs)
    dali-check ROOT [LIST]     scan an image data set (root + list file, or a class-per-directory
                               tree) and list every bad line and file; non-zero exit if any
"""
import sys

COMMANDS = {
    'info': ('chainer_tc.info', 'versions, GPUs, and which features can run here'),
    'kernels': ('chainer_tc.nvrtc_check', 'compile every kernel with NVRTC 12; registers, spills'),
    'sass': ('chainer_tc.sass', "a kernel's innermost loops in SASS: instructions, loads, stores"),
    'check-gpu-stack': ('chainer_tc.gpu_stack', 'check the CUDA/cuDNN install without a GPU'),
    'dali-check': ('chainer_tc.dali.check', 'scan an image data set for bad lines and files'),
}


def _usage():
    lines = ['usage: python -m chainer_tc COMMAND [ARGS]', '', 'commands:']
    lines += ['  {:<16} {}'.format(k, v[1]) for k, v in COMMANDS.items()]
    return '\n'.join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help', 'help'):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print('unknown command {!r}\n\n{}'.format(cmd, _usage()), file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(COMMANDS[cmd][0]).main(rest)


if __name__ == '__main__':
    sys.exit(main())
