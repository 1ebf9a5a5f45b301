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
#   - the server on the device through its HTTP API (scripts/serve_check.py): /health names the
#     device, a chat and its next turn answer 200, the second resumed from the first's rows;
#   - scripts/bench_engine.py on the device: prefill tok/s at 1k/8k/32k and decode tok/s, tandem
#     against transformers on the same checkpoint in the same run (flash-linear-attention where
#     installed), decode against the bound (the weights' bytes over the device's read rate).
# Prints the table; exits 1 if a test failed, 2 without a CUDA device.
#   bash scripts/device_check.sh            (after bash scripts/install.sh --test)
#   MODEL=/path/to/checkpoint bash scripts/device_check.sh    (the bench on a real checkpoint)
# On a lent machine with no .venv (its image holds torch, triton and transformers, and reaches no
# index), python3 runs it, and the wheels of scripts/device_wheels.sh, carried in .whl/, are
# installed into a scratch folder first where tandem's own needs are missing. Where $OUT is set,
# the table and each group's log are written there too.
#   DEVICE_CHECK_CPU=1 bash scripts/device_check.sh   (rehearsed on a CPU: test_device_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."
# Every step's limit is cut to what is left of DEVICE_CHECK_SECONDS (540: the table prints inside
# a lent machine's 10-minute command, whatever hangs), and a step with nothing left is skipped.
t0=$(date +%s)
budget=${DEVICE_CHECK_SECONDS:-540}
within() {  # within SECONDS: SECONDS, or what is left of the budget if less (at least 1, as
  local left=$(( t0 + budget - $(date +%s) - 10 ))  # timeout 0 would mean no limit at all)
  [ "$left" -lt 1 ] && left=1
  echo $(( $1 < left ? $1 : left ))
}
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if compgen -G ".whl/*.whl" >/dev/null \
    && ! "$py" -c "import msgspec, structlog, zstandard, llguidance" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$out/site" \
    .whl/*.whl
  export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # tandem from this checkout, installed or not
"$py" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'triton', triton.__version__, 'transformers', \
transformers.__version__)" || true
device=cuda interpret=0 bench_args=()
if [ "${DEVICE_CHECK_CPU:-0}" = 1 ]; then
  # a rehearsal of this script on a CPU: the same steps, the GPU tests skipping, the Triton
  # tests under the interpreter, a short bench on the CPU; the table is the one a GPU prints
  device=cpu interpret=1 bench_args=(--lengths 1024 --decode-tokens 16)
elif ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "device_check.sh: no CUDA device; nothing to check (DEVICE_CHECK_CPU=1 rehearses it)" >&2
  exit 2
fi
status=0
run() {  # run NAME SECONDS pytest-args...: one group of tests, its junit XML for the table
  local name=$1 limit
  limit=$(within "$2")
  shift 2
  if [ "$limit" -lt 5 ]; then
    echo "device_check.sh: $name skipped, out of time" | tee "$out/$name.log"
    status=1
    return
  fi
  TRITON_INTERPRET=$interpret timeout "$limit" "$py" -m pytest -q -p no:cacheprovider \
    --junitxml="$out/$name.xml" "$@" >"$out/$name.log" 2>&1 || status=1
  tail -n 15 "$out/$name.log"
}
run kernels 240 tests/kernels/test_kernel_devices.py tests/kernels/test_triton_gdn.py \
  tests/kernels/test_triton_conv.py tests/kernels/test_triton_spill.py
run device 60 tests/test_device.py tests/actors/test_spill_writer.py -k "device or cuda or grant"
run oracle 60 tests/models/test_oracle_device.py
run graphs 60 tests/models/test_graphs.py tests/actors/test_capture_graphs.py -k "cuda"
run fp8 30 tests/models/test_fp8.py
# the server on the device, through its HTTP API: a chat and its next turn, resumed in place
limit=$(within 150)
timeout "$limit" "$py" scripts/serve_check.py --device "$device" --up-seconds $(( limit * 2 / 3 )) \
  --json "$out/serve.json" >"$out/serve.log" 2>&1 || status=1
tail -n 5 "$out/serve.log"
# the bench last, in what is left
limit=$(within 600)
timeout "$limit" "$py" scripts/bench_engine.py --model "${MODEL:-tiny}" --device "$device" \
  "${bench_args[@]}" --json "$out/bench.json" >"$out/bench.log" 2>&1 \
  || { status=1; tail -n 20 "$out/bench.log"; }
tail -n 8 "$out/bench.log"
( "$py" - "$out" <<'PY'
import collections, datetime, json, os, sys, xml.etree.ElementTree as ET
import torch
out = sys.argv[1]
where = torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU (a rehearsal)"
print(f"\ndevice check {datetime.date.today()} on {where} "
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
serve = os.path.join(out, "serve.json")
if os.path.exists(serve):
    s = json.load(open(serve))
    second = (s["turns"][1]["cache"] or {}) if len(s["turns"]) > 1 else {}
    cell = (f"{second.get('tier')} {second.get('source')}, {second.get('cached')} cached"
            if s["ok"] else str(s.get("error"))[:30])  # the second turn's resume
    label = f"serve on {s.get('device')} ({s.get('dtype')})"
    print(f"| {label:34} | {int(s['ok']):6} | {int(not s['ok']):6} | {0:7} | {cell:>30} |")
else:
    print(f"| {'serve: did not finish':34} | {'':>6} | {'':>6} | {'':>7} | {'':>30} |")
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
          + (f"({b['read_rate_bytes_s'] / 1e9:.0f} GB/s)" if b["read_rate_bytes_s"]
             else "(not measured here)"))
else:
    print("| bench: did not finish (see above)  |        |        |         |"
          f"{'':32}|")
PY
) | tee "$out/table.txt"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  # four files at most (a lent machine sends back eight): the table, the logs in one, the JSON
  cp "$out/table.txt" "$OUT"/
  for log in "$out"/*.log; do echo "== $(basename "$log")"; cat "$log"; done >"$OUT/logs.txt"
  for j in bench serve; do if [ -f "$out/$j.json" ]; then cp "$out/$j.json" "$OUT"/; fi; done
fi
exit "$status"
