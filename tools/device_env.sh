# Sourced at the start of a device command (tools/device_kit.sh made .devkit/suite): the Vulkan loader (prepare.sh's
# enter.sh), the validation layer, the Python packages, Node.js with naga-wasm, the SPIR-V built on the developer's
# machine, llama.cpp's Vulkan build (.devkit/peers, for benchmarks/model_peers.py) and the serve extra's wheels
# (.devkit/serve: fastapi, uvicorn, httpx and what they import, for pagedvk serve's tests). Each part is set up only where
# it was carried: the carry holds 64 MiB, so the suite's run carries all of .devkit but peers/, and the peers'
# benchmark .devkit/{enter.sh,deb,whl,suite/whl,suite/spv.tar.xz,peers}.
source .devkit/enter.sh
for f in .devkit/suite/deb/*.deb; do [ -f "$f" ] && dpkg -x "$f" /; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .devkit/suite/whl/*.whl $(ls .devkit/peers/*.whl .devkit/serve/*.whl 2>/dev/null)
mkdir -p /tmp/site/bin
[ -f .devkit/suite/cmeel.tar.xz ] && tar -C /tmp/site -xJf .devkit/suite/cmeel.tar.xz
[ -f .devkit/suite/node.xz ] && xz -dc .devkit/suite/node.xz > /tmp/site/bin/node && chmod +x /tmp/site/bin/node
[ -f .devkit/suite/naga_wasm.tar.xz ] && tar -xJf .devkit/suite/naga_wasm.tar.xz   # node_modules/naga-wasm
mkdir -p pagedvk/spv && tar -C pagedvk/spv -xJf .devkit/suite/spv.tar.xz
export PYTHONPATH=/tmp/site:$PWD   # cmeel.prefix on sys.path: build_shaders.matrix_tools finds glslang 13 there
export PATH=/tmp/site/bin:$PATH
