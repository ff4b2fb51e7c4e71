# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install chainer_tc, train ResNet-50 on a small real image set on
#               the CPU with every technique on (examples/imagenet/demo.py, a few minutes)
#   make test   create .venv, install the test extras, run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q
PYTEST_ARGS ?=

.PHONY: demo smoke test check-gpu-stack kernels info clean

# The virtual environment, with the build tools Chainer 7.8.1's sdist needs: its setup.py imports
# pkg_resources, which setuptools>=70 no longer ships, so it is built without isolation against
# setuptools<70 (a user never sees the pkg_resources error).
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip 'setuptools<70' wheel

$(VENV)/.chainer: | $(BIN)/python
	$(PIP) install 'numpy>=1.22,<2'
	$(PIP) install --no-build-isolation 'chainer==7.8.1'
	touch $@

# One stamp per extras set; re-installed when setup.py changes.
$(VENV)/.installed-%: setup.py | $(VENV)/.chainer
	$(PIP) install --no-build-isolation -e '.[$(subst +,$(comma),$*)]'
	touch $@

comma := ,
NO_EXTRAS := $(VENV)/.installed-base

$(NO_EXTRAS): setup.py | $(VENV)/.chainer
	$(PIP) install --no-build-isolation -e .
	touch $@

# The example's demo: data from scikit-learn's sample photographs (no download), the log and
# plots in result/demo; it ends with 'demo passed: ...' or fails.
demo: $(VENV)/.installed-gpu+demo
	$(BIN)/python examples/imagenet/demo.py --out result/demo

# Seconds: what can run here, one kernel through the emulator, a few NHWC training steps.
smoke: $(VENV)/.installed-gpu
	$(BIN)/python examples/smoke.py

CUDNN9 := $(VENV)/cudnn9
CUDNN9_WHEEL := nvidia-cudnn-cu13==9.24.0.43

test: $(VENV)/.installed-gpu+test $(CUDNN9)/.done
	CHAINER_TC_TEST_CUDNN9=$(CUDNN9)/nvidia/cudnn $(BIN)/python -m pytest tests $(PYTEST_ARGS)

# cuDNN 9 beside the gpu extra's 8.9, for the tests only: tests/test_cuda_cudnn.py checks
# chainer_tc's cuDNN binding against cuDNN 9's headers and runs its host-only calls (descriptors,
# messages; no GPU needed) on cuDNN 9's libraries, in a process of their own. Of the wheel only
# the headers and the four libraries those calls load are kept (about 175 MB of 553).
$(CUDNN9)/.done: | $(BIN)/python
	rm -rf $(CUDNN9)
	$(PIP) download --no-deps --only-binary=:all: -d $(CUDNN9)/wheel '$(CUDNN9_WHEEL)'
	$(BIN)/python -c "import glob, re, zipfile; z = zipfile.ZipFile(glob.glob('$(CUDNN9)/wheel/*.whl')[0]); z.extractall('$(CUDNN9)', [n for n in z.namelist() if re.fullmatch(r'nvidia/cudnn/(include/.*_v9[.]h|lib/libcudnn(_ops|_cnn|_graph)?[.]so[.]9)', n)])"
	rm -rf $(CUDNN9)/wheel
	touch $@

# The GPU install story, proved without a GPU: cuDNN 8.9 loads, the entry points resolve,
# Chainer sees cuDNN.
check-gpu-stack: $(VENV)/.installed-gpu
	$(BIN)/python -m chainer_tc check-gpu-stack

kernels: $(VENV)/.installed-gpu
	$(BIN)/python -m chainer_tc kernels

info: $(VENV)/.installed-gpu
	$(BIN)/python -m chainer_tc info

clean:
	rm -rf $(VENV) build *.egg-info
