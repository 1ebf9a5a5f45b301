"""tandem: an inference server for hybrid GDN + attention models with exact, layered caches."""

import os as _os

__version__ = "0.1.0"

# torch's CPU matmuls are MKL's, whose results may depend on the operands' memory alignment: on
# an AMD EPYC host the same weights mapped at other offsets of a file (a checkpoint with an MTP
# head beside them, another shard's layout) prefilled other bits, where the grid gate needs one
# prefill's bits wherever the weights lie. MKL's strict reproducible mode fixes them per
# instruction set whatever the alignment and thread count (measured: no slower on this
# machine's prefill shapes). Set before MKL's first call, unless the user chose a mode; a
# model's manifest names it (HybridModel.manifest), so a cache never mixes two modes.
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
