"""cost() against a measurement (issue 14, part 5): the workspace the governor admits for a
prefill is at least what the prefill's chunk really holds above what was held before it (its
own rows aside), at a context long enough for the attention's mask to count, and not so loose
that it sheds caches for nothing. The prefill runs in a fresh process with malloc's thresholds
fixed, so that a freed temporary goes back to the OS at once and RSS follows the live bytes."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import ctypes, json, sys
import torch
sys.path.insert(0, sys.argv[1])
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
libc.mallopt(-1, 64 << 10)  # M_TRIM_THRESHOLD
torch.set_num_threads(2)
from tandem.engine import Engine
from tandem.models.hybrid import HybridConfig, HybridModel
from tandem.models.tiny import TINY_CONFIG, _weights

config = dict(TINY_CONFIG, vocab_size=1024, hidden_size=512, intermediate_size=2048,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
              num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=8,
              linear_num_value_heads=8)
weights = {k.removeprefix("model."): v for k, v in _weights(config).items()}
model = HybridModel(HybridConfig.from_dict(config), weights)

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out

context, chunk = int(sys.argv[2]), 1024
engine = Engine(model, window=context, prefix_chunk=chunk)
ids = torch.randint(0, 1024, (context,), generator=torch.Generator().manual_seed(0)).tolist()
# The rows under the last chunk stand in place unwritten (zero pages): its memory is the same.
engine.resume_at(context - chunk, ids)
engine.prefill(ids[:context - chunk + 8])  # warm: the first call's one-off allocations
engine.resume_at(context - chunk)
entry = status()
open("/proc/self/clear_refs", "w").write("5")
engine.prefill(ids)
now = status()
peak = now["VmHWM"] - entry["VmRSS"] - (now["RssFile"] - entry["RssFile"])
rows = engine.cost().row_nbytes * chunk
print(json.dumps({"measured": peak - rows, "cost": engine.cost().workspace_nbytes(context)}))
"""


def measure(context: int) -> dict:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(root), str(context)], check=True,
                         capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_workspace_cost_bounds_what_a_prefill_chunk_holds_and_is_not_loose():
    for context in (2048, 16384):
        got = measure(context)
        assert got["measured"] > 0, got
        assert got["measured"] <= got["cost"], (context, got)
        # The floor (32 MiB and a logits slice) aside, within 3x of what was held.
        assert got["cost"] <= 3 * got["measured"] + (40 << 20), (context, got)
