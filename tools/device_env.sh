# Sourced at the start of a device command (tools/device_kit.sh made .devkit/suite): the Vulkan loader (prepare.sh's
# enter.sh), the validation layer, the Python packages, Node.js with naga-wasm, and the SPIR-V built on the
# developer's machine.
source .devkit/enter.sh
for f in .devkit/suite/deb/*.deb; do dpkg -x "$f" /; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .devkit/suite/whl/*.whl
mkdir -p /tmp/site/bin && tar -C /tmp/site -xJf .devkit/suite/cmeel.tar.xz
xz -dc .devkit/suite/node.xz > /tmp/site/bin/node && chmod +x /tmp/site/bin/node
tar -xJf .devkit/suite/naga_wasm.tar.xz   # node_modules/naga-wasm, where build_shaders.py looks for it
mkdir -p pagedvk/spv && tar -C pagedvk/spv -xJf .devkit/suite/spv.tar.xz
export PYTHONPATH=/tmp/site:$PWD   # cmeel.prefix on sys.path: build_shaders.matrix_tools finds glslang 13 there
export PATH=/tmp/site/bin:$PATH
