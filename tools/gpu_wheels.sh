#!/usr/bin/env bash
# Downloads, into .whl/, the wheels `maxmoe train` needs on the lent H200 that its image lacks
# (grain for the data pipeline, tensorboardX for the metric writers; /work/.library/device/KINDS.md lists what the image holds),
# for its Python 3.12. Run once here; then tools/gpu_check.sh installs them there when the call
# carries them: run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-dir)/info/exclude"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
mkdir -p .whl
for spec in grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
done
ls .whl
