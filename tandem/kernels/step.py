"""A whole decode step in one native call (csrc/step.c), for a model the native kernels take whole.

HybridModel.forward_batch's layer-by-layer step on the native kernels makes some fifty ctypes
calls a token on `tiny` (a norm, a projection, the GDN middle or attention, a projection, a norm,
gate_up, silu, down, a layer), each with its tensors, views and checks: about 1.1 ms of a 15.6 ms
token on two EPYC cores (1.3 of 10.4 on the Xeon before), where the head's 254 MB are read at the
machine's rate. step.c runs the same kernels on the same operands in the same order, so its
logits, states, tails and rows are that step's bits (tests/kernels/test_native_step.py holds
it), and one call replaces them all: the plan (every layer's weights, gains, offsets and
constants) is packed once a model, a step passes its rows' addresses and positions.
``scripts/bench_decode.py`` prints the two side by side (1.22x to 1.36x on `tiny`).

It takes a model whose decode is all fp32 on the native kernels and of the shapes it knows: a
Qwen3.5 text stack (GDN and gated attention layers, dense MLPs, no attention bias) with its
projections fused (HybridModel._fuse_projections) and its GDN layers native (decode.GdnLayer).
Any other (a MoE layer, Qwen3-Next's interleaved in_proj, bf16, a GPU) keeps the layer path.
"""

from __future__ import annotations

import ctypes
import math

import torch

from tandem.kernels import decode as decode_ops
from tandem.kernels import screen as screen_kernel
from tandem.kernels.native import fits as native_fits
from tandem.kernels.native import function as native_function

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float

_enabled = True


def set_enabled(on: bool) -> None:
    """Whether forward_batch takes the whole-step call where a model fits it (on by default;
    off, the layer-by-layer native step runs: the same bits, for tests and benchmarks)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


class _Proj(ctypes.Structure):
    _fields_ = [("w", _P * 4), ("n", _L * 4), ("parts", _L), ("width", _L)]  # struct step_proj


class _Layer(ctypes.Structure):
    _fields_ = [("kind", _L), ("slot", _L), ("in_norm", _P), ("post_norm", _P), ("in_", _Proj),
                ("off", _L * 4), ("w_out", _P), ("k_out", _L), ("gate_up", _Proj),
                ("w_down", _P), ("ff", _L), ("gdn", _P), ("nh", _L), ("nkv", _L), ("hd", _L),
                ("rd", _L), ("q_gain", _P), ("k_gain", _P), ("scale", _F)]  # struct step_layer


def _proj(model, key: str, keep: list) -> _Proj | None:
    """A fused projection's matrices as step.c's: the one fused matrix, else its parts (kept
    alive in ``keep``)."""
    names, sizes, fused = model._fused[key]
    mats = [fused] if fused is not None else [model.w[n] for n in names]
    if not (1 <= len(mats) <= 4 and _fp32_runs(*mats)):
        return None
    keep.extend(mats)
    return _Proj((_P * 4)(*(m.data_ptr() for m in mats)), (_L * 4)(*(m.shape[0] for m in mats)),
                 len(mats), sum(sizes))


class _Model(ctypes.Structure):
    _fields_ = [("layers", _L), ("D", _L), ("vocab", _L), ("layer", ctypes.POINTER(_Layer)),
                ("final_norm", _P), ("head", _P), ("eps", _F), ("width", _L), ("middle", _L),
                ("conv_slot", _L), ("state_slot", _L), ("head_q", _P), ("head_scale", _P),
                ("head_radius", _P), ("head_rq", _P), ("head_wmax", _F),
                ("head_file", screen_kernel._FileC)]  # step.c's struct step_model


def _fp32_runs(*tensors: torch.Tensor | None) -> bool:
    return all(t is not None and t.dtype == torch.float32 and t.device.type == "cpu"
               and t.is_contiguous() for t in tensors)


class NativeStep:
    """A model's decode step as one native call; ``build`` says whether the model is one it
    takes. The tensors the plan points into are the model's own (kept alive by it)."""

    def __init__(self, model, layers: list[_Layer], keep: list, width: int, middle: int):
        c = model.config
        self._layers = (_Layer * len(layers))(*layers)
        self._keep = keep  # what the plan points into: the projections, the GDN layers' structs
        head = model.w["lm_head.weight"]
        self.vocab = head.shape[0]
        # the shapes a sequence's sections must have to be read by slot
        self._sections = {
            "gdn.conv": (len(model.gdn_layers), c.conv_dim, c.linear_conv_kernel_dim - 1),
            "gdn.S": (len(model.gdn_layers), c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)}
        conv_slot, state_slot = (math.prod(shape[1:]) for shape in self._sections.values())
        self._model = _Model(len(layers), c.hidden_size, self.vocab,
                             ctypes.cast(self._layers, ctypes.POINTER(_Layer)),
                             model._gain["norm.weight"].data_ptr(), head.data_ptr(),
                             model._eps_value, width, middle, conv_slot, state_slot)
        self._model.head_file = screen_kernel._FileC(-1, 0)  # no screen yet: no file
        self._ref = ctypes.byref(self._model)
        self._kv = (len(model.attn_layers), c.num_key_value_heads, c.head_dim)
        self.screen = None  # set_screen's

    def set_screen(self, screen) -> None:
        """The head's screen (tandem.kernels.screen.HeadScreen, kept alive here), or None: a
        row asked for its greedy token alone (``choose``) then gets it from the screen."""
        self.screen = screen
        m = self._model
        if screen is None:
            m.head_q = m.head_scale = m.head_radius = m.head_rq = None
            m.head_wmax = 0.0
            m.head_file = screen_kernel._FileC(-1, 0)
        else:
            m.head_q, m.head_scale = screen.q.data_ptr(), screen.scale.data_ptr()
            m.head_radius, m.head_rq = screen.radius.data_ptr(), screen.rq.data_ptr()
            m.head_wmax = screen.wmax
            m.head_file = screen.file.c if screen.file is not None else screen_kernel._FileC(-1, 0)

    @classmethod
    def build(cls, model) -> "NativeStep | None":
        """The plan for ``model`` (a HybridModel), or None where it is not all the kernels'."""
        c = model.config
        if not (decode_ops.block() == 1 and model.device.type == "cpu"
                and model.dtype == torch.float32 and model.state_dtype == torch.float32
                and c.model_type != "qwen3_next" and not c.attention_bias
                and c.head_dim <= 1024 and c.rotary_dim % 2 == 0
                and not any(c.is_moe_layer(i) for i in range(len(c.layer_types)))):
            return None
        w, gain = model.w, model._gain
        if not native_fits(torch.empty(1, c.hidden_size), w["lm_head.weight"]):
            return None
        layers, keep, width, middle = [], [], 0, 0
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            gdn = kind == "linear_attention"
            key = p + ("linear_attn.in_proj" if gdn else "self_attn.kqv")
            _, sizes, _ = model._fused[key]
            proj_in, gate_up = _proj(model, key, keep), _proj(model, p + "mlp.gate_up", keep)
            out = w[p + ("linear_attn.out_proj.weight" if gdn else "self_attn.o_proj.weight")]
            down = w[p + "mlp.down_proj.weight"]
            norms = (gain[p + "input_layernorm.weight"],
                     gain[p + "post_attention_layernorm.weight"])
            ff = down.shape[1]
            if (proj_in is None or gate_up is None or gate_up.width != 2 * ff
                    or not _fp32_runs(out, down, *norms)):
                return None
            offsets = [0, 0, 0, 0]
            for j in range(1, len(sizes)):
                offsets[j] = offsets[j - 1] + sizes[j - 1]
            layer = _Layer(kind=0 if gdn else 1, slot=model._slot[i], in_norm=norms[0].data_ptr(),
                           post_norm=norms[1].data_ptr(), in_=proj_in, off=(_L * 4)(*offsets),
                           w_out=out.data_ptr(), k_out=out.shape[1], gate_up=gate_up,
                           w_down=down.data_ptr(), ff=ff)
            if gdn:
                native = model._gdn_native(i)
                if native is None or len(sizes) != 4:
                    return None
                keep.append(native)
                layer.gdn = native.address
            else:
                a = p + "self_attn."
                q_gain, k_gain = gain[a + "q_norm.weight"], gain[a + "k_norm.weight"]
                if len(sizes) != 3 or not _fp32_runs(q_gain, k_gain):
                    return None
                layer.nh, layer.nkv, layer.hd = (c.num_attention_heads, c.num_key_value_heads,
                                                 c.head_dim)
                layer.rd, layer.scale = c.rotary_dim, c.head_dim ** -0.5
                layer.q_gain, layer.k_gain = q_gain.data_ptr(), k_gain.data_ptr()
            layers.append(layer)
            width = max(width, proj_in.width, gate_up.width)
            middle = max(middle, out.shape[1], ff)
        return cls(model, layers, keep, width, middle)

    def fits(self, states) -> bool:
        """Whether every sequence's sections and rows are the shapes and layout the plan reads
        by slot (contiguous fp32 CPU runs; a sequence's key and value rows of one window)."""
        for s in states:
            for name, shape in self._sections.items():
                t = s.sections.get(name)
                if t is None or tuple(t.shape) != shape or not _fp32_runs(t):
                    return False
            k, v = s.views["K"].tensor, s.views["V"].tensor
            if not (_fp32_runs(k, v) and k.shape == v.shape and k.dim() == 4
                    and (k.shape[0], k.shape[1], k.shape[3]) == self._kv):
                return False
        return True

    def __call__(self, x: torch.Tensor, states, positions: list[int], cos: torch.Tensor,
                 sin: torch.Tensor, choose: list[bool] | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, list[int]]:
        """The step's logits [R, vocab] fp32 for embedding rows x [R, D] (rows contiguous), row
        r of sequence ``states[r]`` at ``positions[r]``, its rotary cos and sin [R, rd] (sin's
        first half negated, as HybridModel._step_rope gives them); each sequence's tails,
        states and rows are advanced in place (``fits`` first).

        With ``choose`` (and a screen): also each row's greedy token where choose[r] asks for
        it alone, -1 for a row whose logits were written; a chosen row's logits are not
        written (their memory is left as it was)."""
        seqs = []
        for s in states:  # positions inside the windows: forward_batch refuses the rest
            conv, recur = s.sections["gdn.conv"].data_ptr(), s.sections["gdn.S"].data_ptr()
            seqs += (conv, conv, recur, recur, *_kv(s))
        return self._run(x, seqs, positions, [], cos, sin, choose)

    def ragged(self, x: torch.Tensor, states, ragged, positions: list[int], cos: torch.Tensor,
               sin: torch.Tensor, choose: list[bool | None] | None = None,
               h_out: torch.Tensor | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, list[int]]:
        """A ragged step's logits [R, vocab] fp32 (HybridModel.forward_ragged): row r of
        ``ragged.rows`` (sequence b, its row t) at ``positions[r]``; a decode row advances its
        sequence's sections in place, a verify row reads the state its row t - 1 left (its
        sequence's at t = 0) and writes ``ragged.work[b]``'s row t, the sections in place left
        as they were; every row's key and value rows written. The GDN middle runs in
        ``ragged.waves`` as the layer path's run_native does; ``fits`` first, for the states
        and the work copies alike. ``choose`` as ``__call__``'s, a row of ``ragged.rows``
        each, and None there: that row gets no head at all (its logits row left as it was, its
        token -3). ``h_out`` [R, D] fp32 contiguous: every row's final normed hidden row, what
        the head reads."""
        seqs = []
        for b, t in ragged.rows:
            s, work = states[b], ragged.work[b]
            ends = []
            for name in ("gdn.conv", "gdn.S"):
                here = s.sections[name].data_ptr()
                if work is None:  # a decode: read and written in place
                    ends += (here, here)
                else:
                    ends += (here if t == 0 else work[name][t - 1].data_ptr(),
                             work[name][t].data_ptr())
            seqs += (*ends, *_kv(s))
        return self._run(x, seqs, positions, [wave for wave, _ in ragged.waves], cos, sin,
                         choose, h_out)

    def _run(self, x: torch.Tensor, seqs: list[int], positions: list[int],
             waves: list[list[int]], cos: torch.Tensor, sin: torch.Tensor,
             choose: list[bool | None] | None = None, h_out: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, list[int]]:
        """tandem_step_f32 over rows ``seqs`` (8 addresses and strides a row, step.c), the GDN
        middle wave by wave (no waves: one call over every row); with ``choose``, also the
        rows' tokens (``__call__``)."""
        rows = x.shape[0]
        order = [r for wave in waves for r in wave]
        at = [0]
        for wave in waves:
            at.append(at[-1] + len(wave))
        logits = torch.empty(rows, self.vocab, dtype=torch.float32)
        tokens = None if choose is None else (_L * rows)(
            *(-3 if c is None else -2 if c else -1 for c in choose))
        if h_out is not None and not (h_out.dtype == torch.float32 and h_out.is_contiguous()
                                      and tuple(h_out.shape) == (rows, x.shape[1])):
            raise ValueError("h_out must be [rows, D] fp32 contiguous")
        status = native_function("tandem_step_f32")(
            self._ref, rows, x.data_ptr(), x.stride(0), (_L * len(seqs))(*seqs),
            (_L * rows)(*positions), (_L * len(order))(*order), (_L * len(at))(*at),
            len(waves), cos.data_ptr(), sin.data_ptr(), logits.data_ptr(), tokens,
            torch.get_num_threads(), None if h_out is None else h_out.data_ptr())
        if status != 0:
            raise MemoryError("the native step could not allocate its buffers")
        return logits if tokens is None else (logits, list(tokens))


def _kv(state) -> tuple[int, int, int, int]:
    """A sequence's key and value rows and their strides (a layer slot, a head), in floats."""
    k = state.views["K"].tensor
    return k.data_ptr(), state.views["V"].tensor.data_ptr(), k.stride(0), k.stride(1)
