#!/usr/bin/env bash
# The device check (issue 20, part 5), on a CUDA machine, under 10 minutes: the Triton kernels'
# tests compiled on the GPU (not under the interpreter), each kernel against its torch reference
# run on the same GPU and the grid gate (torch.equal cold against resumed); then the model on the
# device (tests/test_device.py: bf16 weights and fp32 state on the GPU, greedy tokens against the
# CPU's, a resumed prefill against a cold one on the device) and the spill writer's capture-lock
# grants; one table of the results. Prints the table; exits non-zero if a test failed.
#   scripts/device_check.sh            (after scripts/install.sh --test)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "device_check.sh: no CUDA device; nothing to check" >&2
  exit 2
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
TRITON_INTERPRET=0 timeout 420 "$py" -m pytest -q -p no:cacheprovider \
  --junitxml="$out/kernels.xml" tests/kernels/test_kernel_devices.py \
  tests/kernels/test_triton_gdn.py tests/kernels/test_triton_conv.py \
  tests/kernels/test_triton_spill.py >"$out/kernels.log" 2>&1 || status=$?
tail -n 30 "$out/kernels.log"
timeout 150 "$py" -m pytest -q -p no:cacheprovider --junitxml="$out/device.xml" \
  tests/test_device.py tests/actors/test_spill_writer.py -k "device or cuda or grant" \
  >"$out/device.log" 2>&1 || status=$?
tail -n 30 "$out/device.log"
"$py" - "$out/kernels.xml" "$out/device.xml" <<'PY'
import collections, datetime, os, sys, xml.etree.ElementTree as ET
import torch
rows = collections.OrderedDict()
cases = [c for path in sys.argv[1:] if os.path.exists(path)
         for c in ET.parse(path).getroot().iter("testcase")]
for case in cases:
    name = case.get("classname", "").rsplit(".", 1)[-1]
    row = rows.setdefault(name, collections.Counter())
    kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    row[kind] += 1
    row["seconds"] += float(case.get("time", 0))
print(f"\ndevice check {datetime.date.today()} on {torch.cuda.get_device_name()} "
      f"(torch {torch.__version__})")
print(f"| {'check':30} | passed | failed | skipped | seconds |")
print(f"|{'-' * 32}|--------|--------|---------|---------|")
for name, r in rows.items():
    print(f"| {name:30} | {r['passed']:6} | {r['failure'] + r['error']:6} | "
          f"{r['skipped']:7} | {r['seconds']:7.1f} |")
PY
exit "$status"
