#!/usr/bin/env bash
# Downloads, into .whl/, the wheels a lent GPU's image lacks (/work/.library/device/KINDS.md
# lists what it holds: jax 0.11.2 with its CUDA 13 plugin, flax, optax, orbax, no tokamax), for
# its Python 3.12, without their dependencies (--no-deps): only what `import tokamax` and
# `maxmoe train` import. Run once here; tools/gpu_check.sh installs them there when the call
# carries them: run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540).
# - tokamax 0.0.17 (kernels/tokamax_ops.py) and what its import pulls in: einshape, pydantic
#   (+ pydantic-core, annotated-types, typing-inspection), qwix, immutabledict, and xprof
#   (tokamax/_src/benchmarking.py imports xprof.cli.tools at module level; 32 MB, the largest)
#   with fire and termcolor. Their versions are the ones the .[cuda] venv resolved here.
# - grain, array_record, portpicker (the data pipeline), tensorboardX, crc32c (checkpoints).
# All together about 41 MB, under the 64 MiB a call may carry with the checkout (~4 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-dir)/info/exclude"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
mkdir -p .whl
for spec in tokamax==0.0.17 einshape==1.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 qwix==0.1.8 immutabledict==4.3.1 \
    xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 \
    grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5 crc32c==2.9.post0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl "$spec" 2>&1 | grep -v "^WARNING" || true
done
ls .whl
du -ch .whl/*.whl | tail -n 1
