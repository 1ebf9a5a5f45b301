#!/usr/bin/env bash
# The device check (issue 20, part 5), on a CUDA machine, under 10 minutes, in one table:
#   - the Triton kernels' tests compiled on the GPU (not under the interpreter), each kernel
#     against its torch reference on the same GPU, and the grid gate (torch.equal cold against
#     resumed);
#   - the model on the device (tests/test_device.py: bf16 weights and fp32 state on the GPU,
#     greedy tokens against the CPU's, a resumed prefill against a cold one on the device) and
#     the spill writer's capture-lock grants;
#   - the transformers oracle on the GPU (tests/models/test_oracle_device.py: logits and greedy
#     tokens, eager and through CUDA graphs), the graphs' replays against eager steps
#     (tests/models/test_graphs.py) and the capture race (tests/actors/test_capture_graphs.py:
#     captures under a writer copying back to back); native FP8 (tests/models/test_fp8.py);
#   - scripts/bench_engine.py on the device: prefill tok/s at 1k/8k/32k and decode tok/s, tandem
#     against transformers on the same checkpoint in the same run (flash-linear-attention where
#     installed), decode against the bound (the weights' bytes over the device's read rate).
# Prints the table; exits 1 if a test failed, 2 without a CUDA device.
#   bash scripts/device_check.sh            (after bash scripts/install.sh --test)
#   MODEL=/path/to/checkpoint bash scripts/device_check.sh    (the bench on a real checkpoint)
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
started=$(date +%s)
run() {  # run NAME SECONDS pytest-args...: one group of tests, its junit XML for the table
  local name=$1 limit=$2
  shift 2
  TRITON_INTERPRET=0 timeout "$limit" "$py" -m pytest -q -p no:cacheprovider \
    --junitxml="$out/$name.xml" "$@" >"$out/$name.log" 2>&1 || status=1
  tail -n 15 "$out/$name.log"
}
run kernels 240 tests/kernels/test_kernel_devices.py tests/kernels/test_triton_gdn.py \
  tests/kernels/test_triton_conv.py tests/kernels/test_triton_spill.py
run device 60 tests/test_device.py tests/actors/test_spill_writer.py -k "device or cuda or grant"
run oracle 60 tests/models/test_oracle_device.py
run graphs 60 tests/models/test_graphs.py tests/actors/test_capture_graphs.py -k "cuda"
run fp8 30 tests/models/test_fp8.py
# the bench last, in what is left of the 10 minutes (at least 2)
left=$(( 570 - ($(date +%s) - started) ))
[ "$left" -lt 120 ] && left=120
timeout "$left" "$py" scripts/bench_engine.py --model "${MODEL:-tiny}" --device cuda \
  --json "$out/bench.json" >"$out/bench.log" 2>&1 || { status=1; tail -n 20 "$out/bench.log"; }
tail -n 8 "$out/bench.log"
"$py" - "$out" <<'PY'
import collections, datetime, json, os, sys, xml.etree.ElementTree as ET
import torch
out = sys.argv[1]
print(f"\ndevice check {datetime.date.today()} on {torch.cuda.get_device_name()} "
      f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
print(f"| {'check':34} | {'passed':>6} | {'failed':>6} | {'skipped':>7} | {'seconds / tok/s':>30} |")
print(f"|{'-' * 36}|--------|--------|---------|{'-' * 32}|")
for group in ("kernels", "device", "oracle", "graphs", "fp8"):
    path = os.path.join(out, f"{group}.xml")
    if not os.path.exists(path):
        print(f"| {group + ': did not run':34} | {'':>6} | {'':>6} | {'':>7} | {'':>30} |")
        continue
    rows = collections.OrderedDict()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").rsplit(".", 1)[-1]
        row = rows.setdefault(name, collections.Counter())
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        row[kind] += 1
        row["seconds"] += float(case.get("time", 0))
    for name, r in rows.items():
        print(f"| {name:34} | {r['passed']:6} | {r['failure'] + r['error']:6} | "
              f"{r['skipped']:7} | {r['seconds']:30.1f} |")
bench = os.path.join(out, "bench.json")
if os.path.exists(bench):
    b = json.load(open(bench))
    against = "transformers+fla" if b["fla"] else "transformers"
    for r in b["rows"]:
        theirs = r["transformers_tok_s"]
        cell = (f"{r['tandem_tok_s']:.0f} vs {theirs:.0f} = {r['ratio']:.2f}x" if theirs
                else f"{r['tandem_tok_s']:.0f}")
        if "bound_tok_s" in r:
            cell += f", {r['of_bound']:.2f} of {r['bound_tok_s']}"
        label = f"bench {b['model']} {r['row']}"
        print(f"| {label:34} | {'':>6} | {'':>6} | {'':>7} | {cell:>30} |")
    print(f"bench: tandem against {against} on {b['model']} ({b['dtype']}, graphs "
          f"{'on' if b['graphs'] else 'off'}); decode's bound is the weights "
          f"({b['weights_nbytes'] / 2**30:.2f} GiB) over the device's read rate "
          f"({(b['read_rate_bytes_s'] or 0) / 1e9:.0f} GB/s)")
else:
    print("| bench: did not finish (see above)  |        |        |         |"
          f"{'':32}|")
PY
exit "$status"
