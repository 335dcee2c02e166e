"""The target megakernel: all decoder layers of one decode / verify step as ONE Pallas TPU program.

`forward` has the signature and semantics of `specdec.models.transformer.forward` (stacked layout). What runs
where:

  plain JAX, before   embedding lookup, RoPE cos/sin tables, the new-token mask as an additive bias,
                      per-row scalars (lengths, KV tile counts, ...) for SMEM
  the kernel          every decoder layer: weights streamed HBM -> VMEM through a ring of banks
                      (schedule.py), QKV / RoPE / attention over the KV cache in tiles with an online
                      softmax / output projection / SwiGLU MLP, the new K/V rows DMA'd into the cache in
                      place (input_output_aliases), residual taps
  plain JAX, after    final RMSNorm, `logits_at` gather, lm_head (an XLA matmul is bandwidth-bound too;
                      moving it into the kernel is a later step), taps assembly

Inside the kernel (one grid-less pallas_call, `lax.fori_loop` over layers):

  prologue: start the DMAs of global weight tiles 0 .. NB-1; x = embeddings
  for l in layers:                      # the static event list of schedule.layer_events, per layer
      start KV tile 0 of this layer     # overlaps the QKV projection
      h = rmsnorm(x)
      wait tile / matmul pieces / refill the bank with tile g + NB ...
      attention:  RoPE q, k -> VMEM; wait layer l-1's cache writes (the staging buffer is reused);
                  per row b: stream the committed prefix [0, len_b) in kv_tile chunks (one [KVH, kv_tile, HD]
                  DMA per chunk: a contiguous [kv_tile, HD] slab per KV head of the [L, B, KVH, S, HD] cache),
                  double-buffered (tile j+1's DMA in flight while tile j computes), online softmax;
                  then the T new tokens from VMEM under the tree mask; start the DMAs writing the new
                  K/V rows to cache slots len_b .. len_b+T-1 (waited one layer later)
      ... o-proj / mlp_norm / gate-up / act / down pieces ...
      taps
  drain the last layer's cache writes

Interpret mode: on a machine without a TPU the kernel runs in Pallas' TPU interpreter (HBM, VMEM, SMEM,
DMAs and semaphores simulated on CPU). The choice is made at trace time from `interpret=` or the module
default (`set_interpret` / `interpret_mode`); the default picks compiled mode on TPU and
`default_interpret_params()` elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specdec.kernels import schedule as sch
from specdec.kernels.schedule import Dims, Plan
from specdec.models import transformer
from specdec.models.config import ModelConfig

NEG = -1e30  # finite "minus infinity": exp(NEG - NEG) = 1 instead of NaN for fully masked rows
PACKED_KEY = "megakernel"  # params[PACKED_KEY] holds the packed weights (see prepare_params)
BUGS = ("read_before_wait", "skip_cache_write_wait")  # deliberate bugs for the race-detector tests


# ----------------------------------------------------------------------------------------------------------
# Interpret mode and chip selection (static, read at trace time)
# ----------------------------------------------------------------------------------------------------------

def default_interpret_params() -> pltpu.InterpretParams:
    """Interpreter settings for CPU use: DMAs run when waited on (so ordering bugs show), scratch starts as NaN."""
    return pltpu.InterpretParams(dma_execution_mode="on_wait", uninitialized_memory="nan")


def race_check_params() -> pltpu.InterpretParams:
    """Interpreter settings with the race detector live. Slower; used by the tests.

    The detector's vector clocks are approximate: each DMA takes a random slot among `vector_clock_size` minus
    the cores, and two DMAs sharing a slot look ordered, which can hide a race (never invent one). At the default
    size DMA-vs-DMA races are missed; at 16 the tiny kernel's `skip_cache_write_wait` bug went unseen for 1 seed
    in 30 (a CI failure); at 64 for none in 150 (docs/MEGAKERNEL.md)."""
    return pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True, vector_clock_size=64,
                                 uninitialized_memory="nan")


_settings: dict[str, Any] = {"interpret": "auto", "chip": None}


def set_interpret(value: Any = "auto") -> None:
    """Module default for `interpret`: "auto" (compiled on TPU, `default_interpret_params()` elsewhere),
    False (compiled), or a `pltpu.InterpretParams`. Takes effect for functions traced afterwards."""
    _settings["interpret"] = value


@contextlib.contextmanager
def interpret_mode(value: Any = "auto", chip: str | None = None):
    """Temporarily set the module defaults: `with interpret_mode(race_check_params()): ...`."""
    old = dict(_settings)
    _settings["interpret"] = value
    if chip is not None:
        _settings["chip"] = chip
    try:
        yield
    finally:
        _settings.update(old)


def resolve_interpret(value: Any = None) -> Any:
    value = _settings["interpret"] if value is None else value
    if isinstance(value, str) and value == "auto":
        return False if jax.default_backend() == "tpu" else default_interpret_params()
    return value


def resolve_chip(chip: str | None = None) -> str:
    """The TPU generation to budget VMEM for: the argument, the module default, the detected TPU (an unknown
    kind gets v7x's 64 MiB, the tightest), or "v5e" off TPU."""
    chip = chip or _settings["chip"]
    if chip:
        return chip
    if jax.default_backend() == "tpu":
        kind = jax.devices()[0].device_kind.lower()
        for name, keys in (("v5e", ("v5 lite", "v5e")), ("v6e", ("v6",)), ("v7x", ("v7", "7x"))):
            if any(k in kind for k in keys):
                return name
        return "v7x"
    return "v5e"


# ----------------------------------------------------------------------------------------------------------
# Packing the weights (once, at load time)
# ----------------------------------------------------------------------------------------------------------

def pack_layers(layers: dict, cfg: ModelConfig, subtile_cols: int | None = None) -> dict:
    """Stacked per-layer weights -> the kernel's layout (schedule.py): {"w": [L, P_sub, H, subtile_cols],
    "attn_norm": [L, H], "mlp_norm": [L, H], optional "qkv_bias" [L, Q+2KV], "q_norm"/"k_norm" [L, HD]}."""
    subtile_cols = subtile_cols or sch.default_subtile_cols(cfg)
    L, H = cfg.num_layers, cfg.hidden_size
    mats = [jnp.swapaxes(layers[n], 1, 2) if n in sch.TRANSPOSED else layers[n] for n in sch.SEGMENTS]
    w = jnp.concatenate(mats, axis=2)  # [L, H, C]
    cols = w.shape[2]
    if cols % subtile_cols:
        raise ValueError(f"subtile_cols {subtile_cols} does not divide the {cols} packed columns")
    w = w.reshape(L, H, cols // subtile_cols, subtile_cols).transpose(0, 2, 1, 3)
    packed = {"w": w, "attn_norm": layers["attn_norm"], "mlp_norm": layers["mlp_norm"]}
    if cfg.attention_bias:
        packed["qkv_bias"] = jnp.concatenate([layers["bq"], layers["bk"], layers["bv"]], axis=1)
    if cfg.qk_norm:
        packed["q_norm"], packed["k_norm"] = layers["q_norm"], layers["k_norm"]
    return packed


def prepare_params(params: dict, cfg: ModelConfig, subtile_cols: int | None = None,
                   keep_layers: bool = False) -> dict:
    """Pack once for the megakernel (call when the target is built). Without it `forward` repacks the weights
    on every step, which on TPU is an extra pass over all weights. The stacked `layers` are dropped unless
    `keep_layers` (the scan reference needs them)."""
    params = transformer.stack_layers(params)
    out = {k: v for k, v in params.items() if k != "layers" or keep_layers}
    out[PACKED_KEY] = pack_layers(params["layers"], cfg, subtile_cols)
    return out


def packed_weights(params: dict, cfg: ModelConfig) -> dict:
    if PACKED_KEY in params:
        return params[PACKED_KEY]
    return pack_layers(transformer.stack_layers(params)["layers"], cfg)


# ----------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------

SMEM_INPUTS = ("lengths", "ntiles", "next_row", "tile_base", "write_start", "first_row", "tap_slot")


def _vmem_inputs(cfg: ModelConfig) -> tuple[str, ...]:
    names = ["x0", "cos", "sin", "bias", "attn_norm", "mlp_norm"]
    if cfg.attention_bias:
        names.append("qkv_bias")
    if cfg.qk_norm:
        names += ["q_norm", "k_norm"]
    return tuple(names)


def _mm(x, w):
    """x @ w with f32 accumulation (x cast to the weight dtype)."""
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _mm_nt(x, w):
    """x @ w.T with f32 accumulation: w is stored transposed ([out, in] -> rows contracted on columns)."""
    return lax.dot_general(x.astype(w.dtype), w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _rms(x, w, eps):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)


def _online_softmax(state, scores, vals):
    """One step of the online softmax: fold `scores` [rows, n] and `vals` [n, HD] into (max, sum, acc)."""
    m, lsum, acc = state
    m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
    alpha, p = jnp.exp(m - m_new), jnp.exp(scores - m_new)
    lsum = alpha * lsum + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + jnp.dot(p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
    return m_new, lsum, acc


def _start_all(copies):
    for c in copies:
        c.start()


def _wait_all(copies):
    for c in copies:
        c.wait()


@dataclasses.dataclass(frozen=True)
class _KernelRefs:
    """The kernel's refs by name. pallas_call passes them positionally: SMEM inputs, VMEM inputs, the three HBM
    inputs, the outputs, then the scratch buffers (in `megakernel_call`'s order)."""
    smem: dict[str, Any]  # SMEM_INPUTS -> ref
    vmem: dict[str, Any]  # _vmem_inputs(cfg) -> ref
    w_hbm: Any  # packed weights [L, P_sub, H, subtile_cols]
    x_ref: Any  # the residual stream [N, H] (an output, so it doubles as the accumulator)
    taps_ref: Any  # [num_taps, N, H], or None without taps
    k_hbm: Any  # the caches [L, B, KVH, S, HD]: the outputs, aliased to the cache inputs
    v_hbm: Any
    banks: Any  # scratch from here on
    bank_sem: Any
    h_scr: Any
    qkv_scr: Any
    qh_scr: Any
    attn_scr: Any
    g_scr: Any
    u_scr: Any
    kstage: Any
    vstage: Any
    kbuf: Any
    vbuf: Any
    kv_sem: Any
    w_sem: Any

    @classmethod
    def from_refs(cls, cfg: ModelConfig, dims: Dims, refs) -> _KernelRefs:
        vmem_names = _vmem_inputs(cfg)
        i = 0
        smem = dict(zip(SMEM_INPUTS, refs[i:i + len(SMEM_INPUTS)])); i += len(SMEM_INPUTS)
        vmem = dict(zip(vmem_names, refs[i:i + len(vmem_names)])); i += len(vmem_names)
        w_hbm = refs[i]; i += 3  # the cache inputs are aliased to the cache outputs: use the outputs
        n_out = 4 if dims.num_taps else 3
        x_ref = refs[i]
        taps_ref = refs[i + 1] if dims.num_taps else None
        k_hbm, v_hbm = refs[i + n_out - 2], refs[i + n_out - 1]; i += n_out
        return cls(smem, vmem, w_hbm, x_ref, taps_ref, k_hbm, v_hbm, *refs[i:])


class _Kernel:
    """The kernel body for static (cfg, plan, dims, bug) over one set of refs; `run` traces it. Each method is
    one part of the body: DMA descriptors, the ops of schedule.layer_events, a matmul piece, one layer."""

    def __init__(self, cfg: ModelConfig, plan: Plan, dims: Dims, bug: str | None, refs: _KernelRefs):
        self.cfg, self.plan, self.dims, self.bug, self.refs = cfg, plan, dims, bug, refs
        self.L, self.HD = cfg.num_layers, cfg.head_dim
        self.Q, self.KV, self.NH, self.KVH = cfg.q_size, cfg.kv_size, cfg.num_heads, cfg.num_kv_heads
        self.G = self.NH // self.KVH  # query heads per KV head
        self.B, self.T, self.Tp = dims.batch, dims.num_new, dims.rows_per_seq(cfg)
        self.TK = plan.kv_tile
        self.P, self.NB, self.K = plan.tiles_per_layer, plan.num_banks, plan.subtiles_per_tile
        self.eps, self.scale = cfg.rms_norm_eps, 1.0 / math.sqrt(self.HD)
        self.events = sch.layer_events(cfg, plan)
        self.qkv_offset = {"wq": 0, "wk": self.Q, "wv": self.Q + self.KV}

    # ---- DMA descriptors ----

    def weight_copy(self, layer, tile):
        """Tile `tile` (static) of layer `layer` -> its ring bank ((layer * P + tile) % NB)."""
        r = self.refs
        bank = (layer * self.P + tile) % self.NB
        return pltpu.make_async_copy(r.w_hbm.at[layer, pl.ds(tile * self.K, self.K)], r.banks.at[bank],
                                     r.bank_sem.at[bank])

    def kv_copies(self, layer, b, j, slot):
        """Cache positions [j*TK, (j+1)*TK) of row b, all KV heads ([KVH, TK, HD]) -> K/V tile slot `slot`."""
        r, TK = self.refs, self.TK
        rows = pl.ds(pl.multiple_of(j * TK, TK), TK)
        return (pltpu.make_async_copy(r.k_hbm.at[layer, b, :, rows], r.kbuf.at[slot], r.kv_sem.at[0, slot]),
                pltpu.make_async_copy(r.v_hbm.at[layer, b, :, rows], r.vbuf.at[slot], r.kv_sem.at[1, slot]))

    def write_copies(self, layer, b, start):
        """The T new K/V rows of row b (staging, VMEM) -> cache slots start .. start+T-1, all KV heads."""
        r = self.refs
        src = pl.ds(pl.multiple_of(b * self.Tp, self.Tp), self.T)
        dst = pl.ds(start, self.T)
        return (pltpu.make_async_copy(r.kstage.at[:, src], r.k_hbm.at[layer, b, :, dst], r.w_sem.at[0]),
                pltpu.make_async_copy(r.vstage.at[:, src], r.v_hbm.at[layer, b, :, dst], r.w_sem.at[0]))

    def wait_writes(self, num_layers=1):
        """Wait for `num_layers` layers' worth of cache writes (2 DMAs per row each). Every write has the same
        size and signals w_sem[0], so row 0's descriptors stand in for any row's."""
        def body(_, c):
            _wait_all(self.write_copies(0, 0, 0))
            return c
        lax.fori_loop(0, num_layers * self.B, body, 0)

    # ---- the ops of schedule.layer_events ----

    def op(self, name, l):
        """The barrier op `name` (an "op" event) at layer l."""
        if name in ("attn_norm", "mlp_norm"):
            self.rms_into_h(l, self.refs.vmem[name])
        elif name == "attention":
            self.attention(l)
        elif name == "act":
            self.act()
        elif name == "layer_end":
            self.layer_end(l)
        else:
            raise ValueError(f"unknown op {name!r}")

    def rms_into_h(self, l, norm_ref):
        self.refs.h_scr[...] = _rms(self.refs.x_ref[...], norm_ref[pl.ds(l, 1), :], self.eps)

    def attention(self, l):
        """RoPE'd q/k and v into VMEM, then per row: attention over the cache and the new tokens, cache write."""
        self.stage_qkv(l)

        def row(b, carry):
            self.attend_row(l, b)
            return carry

        # KV tile 0 of this layer was started at the top of the layer (see `run_layer`)
        lax.fori_loop(0, self.B, row, 0)

    def rope_head(self, l, qkv, col, cos, sin, norm):
        """The head at columns [col, col+HD) of qkv, (QK-normed,) RoPE'd: x*cos + swap_halves(x)*(-sin | sin)."""
        x = qkv[:, col:col + self.HD]
        if self.cfg.qk_norm:
            x = _rms(x, self.refs.vmem[norm][pl.ds(l, 1), :], self.eps)
        return x * cos + pltpu.roll(x, self.HD // 2, axis=1) * sin

    def stage_qkv(self, l):
        """qkv (+ bias) -> q heads [NH, N, HD] (RoPE'd, scaled) and the new K/V rows [KVH, N, HD] in staging."""
        r, cfg, HD, Q, KV = self.refs, self.cfg, self.HD, self.Q, self.KV
        qkv = r.qkv_scr[...]
        if cfg.attention_bias:
            qkv = qkv + r.vmem["qkv_bias"][pl.ds(l, 1), :].astype(jnp.float32)
        cos, sin = r.vmem["cos"][...], r.vmem["sin"][...]
        r.qh_scr[...] = jnp.stack([self.rope_head(l, qkv, qh * HD, cos, sin, "q_norm") * self.scale
                                   for qh in range(self.NH)])  # [NH, N, HD]
        # layer l-1's cache writes still read the staging buffers: wait just before overwriting them, so the
        # writes overlap the q heads' work
        if self.bug != "skip_cache_write_wait":
            @pl.when(l > 0)
            def _():
                self.wait_writes()
        # [KVH, N, HD], head-major like the cache, so each row's write is one [KVH, T, HD] DMA
        r.kstage[...] = jnp.stack([self.rope_head(l, qkv, Q + h * HD, cos, sin, "k_norm")
                                   for h in range(self.KVH)]).astype(r.kstage.dtype)
        r.vstage[...] = jnp.stack([qkv[:, Q + KV + h * HD:Q + KV + (h + 1) * HD]
                                   for h in range(self.KVH)]).astype(r.vstage.dtype)

    def attend_row(self, l, b):
        """Batch row b: its committed cache prefix in KV tiles, then its T new tokens under the tree mask, into
        attn_scr; then start the DMAs writing its new K/V rows to the cache (waited one layer later)."""
        r, s, G, Tp, HD = self.refs, self.refs.smem, self.G, self.Tp, self.HD
        nt, length, base, nxt = s["ntiles"][b], s["lengths"][b], s["tile_base"][b], s["next_row"][b]
        rows = pl.ds(pl.multiple_of(b * Tp, Tp), Tp)
        qs = r.qh_scr[:, rows, :]  # [NH, Tp, HD]
        # the G query heads sharing KV head h, stacked along rows: [G*Tp, HD]
        q = [qs[h * G:(h + 1) * G].reshape(G * Tp, HD) for h in range(self.KVH)]

        def tile(j, states):
            return self.attend_cache_tile(l, b, j, states, q, nt, length, base, nxt)

        init = (jnp.full((G * Tp, 1), NEG, jnp.float32), jnp.zeros((G * Tp, 1), jnp.float32),
                jnp.zeros((G * Tp, HD), jnp.float32))
        states = lax.fori_loop(0, nt, tile, (init,) * self.KVH)
        # the new tokens themselves, from VMEM, under the tree mask
        bias = r.vmem["bias"][rows, :]
        bias = jnp.concatenate([bias] * G, axis=0)
        kn, vn = r.kstage[:, rows], r.vstage[:, rows]  # [KVH, Tp, HD]
        for h in range(self.KVH):
            _, lsum, acc = _online_softmax(states[h], _mm_nt(q[h], kn[h]) + bias, vn[h])
            out = acc / lsum
            for g in range(G):
                r.attn_scr[rows, pl.ds((h * G + g) * HD, HD)] = out[g * Tp:(g + 1) * Tp]
        _start_all(self.write_copies(l, b, s["write_start"][b]))

    def attend_cache_tile(self, l, b, j, states, q, nt, length, base, nxt):
        """KV tile j of row b (of nt): prefetch the next tile (this row's, else the next row's first), wait for
        this one, fold its committed positions (< length) into each KV head's online-softmax state."""
        r, TK = self.refs, self.TK
        slot = (base + j) % 2  # running KV-tile index in this layer, mod 2

        @pl.when(j + 1 < nt)
        def _():
            _start_all(self.kv_copies(l, b, j + 1, 1 - slot))

        @pl.when((j + 1 == nt) & (nxt < self.B))
        def _():
            _start_all(self.kv_copies(l, nxt, 0, 1 - slot))
        _wait_all(self.kv_copies(l, b, j, slot))
        kt, vt = r.kbuf[slot], r.vbuf[slot]  # [KVH, TK, HD]
        pos = j * TK + lax.broadcasted_iota(jnp.int32, (1, TK), 1)
        out = []
        for h in range(self.KVH):
            scores = _mm_nt(q[h], kt[h])  # [G*Tp, TK]
            scores = jnp.where(pos < length, scores, NEG)  # only the committed prefix
            out.append(_online_softmax(states[h], scores, vt[h]))
        return tuple(out)

    def act(self):
        g = self.refs.g_scr[...]
        self.refs.g_scr[...] = g * jax.nn.sigmoid(g) * self.refs.u_scr[...]

    def layer_end(self, l):
        if self.dims.num_taps:
            slot = self.refs.smem["tap_slot"][l]

            @pl.when(slot >= 0)
            def _():
                self.refs.taps_ref[slot] = self.refs.x_ref[...]

    # ---- matmul pieces, one layer, the whole kernel ----

    def piece(self, ev, bank):
        """One matmul piece: columns [col, col+width) of sub-tile `sub` in `bank`, for segment `ev.seg`."""
        r = self.refs
        w = r.banks[bank, ev.sub, :, pl.ds(ev.col, ev.width)]  # [H, width]
        a, b = ev.seg_col, ev.seg_col + ev.width
        if ev.seg in sch.QKV_SEGMENTS:
            o = self.qkv_offset[ev.seg]
            r.qkv_scr[:, o + a:o + b] = _mm(r.h_scr[...], w)
        elif ev.seg == "w_gate":
            r.g_scr[:, a:b] = _mm(r.h_scr[...], w)
        elif ev.seg == "w_up":
            r.u_scr[:, a:b] = _mm(r.h_scr[...], w)
        elif ev.seg == "wo":
            r.x_ref[...] += _mm_nt(r.attn_scr[:, a:b], w)
        else:  # w_down
            r.x_ref[...] += _mm_nt(r.g_scr[:, a:b], w)

    def run_layer(self, l):
        """Layer l: start its first KV tile, then execute the static event list."""
        s = self.refs.smem

        @pl.when(s["first_row"][0] < self.B)  # KV tile 0 of this layer, overlapping the QKV matmuls
        def _():
            _start_all(self.kv_copies(l, s["first_row"][0], 0, 0))

        deferred = []  # (bug "read_before_wait") waits moved after the tile's compute
        for ev in self.events:
            if ev.kind == "op":
                self.op(ev.name, l)
            elif ev.kind == "wait":
                if self.bug == "read_before_wait":
                    deferred.append(ev.tile)
                else:
                    self.weight_copy(l, ev.tile).wait()
            elif ev.kind == "piece":
                self.piece(ev, (l * self.P + ev.tile) % self.NB)
            elif ev.kind == "start":
                while deferred:
                    self.weight_copy(l, deferred.pop()).wait()

                @pl.when(l + ev.ahead_layers < self.L)
                def _(ev=ev):
                    self.weight_copy(l + ev.ahead_layers, ev.ahead_tile).start()

    def run(self):
        """Prologue (first NB weight tiles in flight, x = embeddings), the layer loop, the last cache writes."""
        r = self.refs
        r.x_ref[...] = r.vmem["x0"][...]
        for layer, tile in sch.prologue_starts(self.cfg, self.plan):
            self.weight_copy(layer, tile).start()

        def layer(l, carry):
            self.run_layer(l)
            return carry

        lax.fori_loop(0, self.L, layer, 0)
        # the last layer's cache writes (all of them if the per-layer waits were skipped)
        self.wait_writes(self.L if self.bug == "skip_cache_write_wait" else 1)


def _build_kernel(cfg: ModelConfig, plan: Plan, dims: Dims, bug: str | None):
    """Returns the kernel body for static (cfg, plan, dims): names the refs and runs `_Kernel`."""
    def kernel(*refs):
        _Kernel(cfg, plan, dims, bug, _KernelRefs.from_refs(cfg, dims, refs)).run()

    return kernel


def megakernel_call(cfg: ModelConfig, plan: Plan, dims: Dims, *, interpret: Any, vmem_limit: int | None,
                    cache_dtype=None, bug: str | None = None):
    """The pallas_call for static (cfg, plan, dims). Arguments: SMEM scalars (SMEM_INPUTS order), VMEM inputs
    (_vmem_inputs order), packed weights, k cache, v cache. Returns (x, [taps], k cache, v cache)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}")
    H, HD, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    Q, KV, NH, KVH = cfg.q_size, cfg.kv_size, cfg.num_heads, cfg.num_kv_heads
    N, B, L, S = dims.rows(cfg), dims.batch, cfg.num_layers, dims.capacity
    wdt, cdt, f32 = cfg.jnp_dtype, jnp.dtype(cache_dtype or cfg.jnp_dtype), jnp.float32
    cache_shape = jax.ShapeDtypeStruct((L, *transformer.cache_shape(B, S, KVH, HD)), cdt)  # [L, B, KVH, S, HD]
    out_shape = [jax.ShapeDtypeStruct((N, H), f32)]
    out_specs = [pl.BlockSpec(memory_space=pltpu.VMEM)]
    if dims.num_taps:
        out_shape.append(jax.ShapeDtypeStruct((dims.num_taps, N, H), f32))
        out_specs.append(pl.BlockSpec(memory_space=pltpu.VMEM))
    out_shape += [cache_shape, cache_shape]
    out_specs += [pl.BlockSpec(memory_space=pl.ANY)] * 2
    n_smem, n_vmem = len(SMEM_INPUTS), len(_vmem_inputs(cfg))
    in_specs = ([pl.BlockSpec(memory_space=pltpu.SMEM)] * n_smem + [pl.BlockSpec(memory_space=pltpu.VMEM)] * n_vmem
                + [pl.BlockSpec(memory_space=pl.ANY)] * 3)
    first_cache = n_smem + n_vmem + 1
    scratch = [  # the order of _KernelRefs' scratch fields
        pltpu.VMEM((plan.num_banks, plan.subtiles_per_tile, H, plan.subtile_cols), wdt),  # weight banks
        pltpu.SemaphoreType.DMA((plan.num_banks,)),
        pltpu.VMEM((N, H), f32),  # h: normed activations
        pltpu.VMEM((N, Q + 2 * KV), f32),  # qkv
        pltpu.VMEM((NH, N, HD), f32),  # q heads (RoPE'd, scaled)
        pltpu.VMEM((N, Q), f32),  # attention output
        pltpu.VMEM((N, F), f32),  # gate, then silu(gate) * up
        pltpu.VMEM((N, F), f32),  # up
        pltpu.VMEM((KVH, N, HD), cdt),  # new K rows (staging for the cache write)
        pltpu.VMEM((KVH, N, HD), cdt),  # new V rows
        pltpu.VMEM((2, KVH, plan.kv_tile, HD), cdt),  # K tiles (double buffer)
        pltpu.VMEM((2, KVH, plan.kv_tile, HD), cdt),  # V tiles
        pltpu.SemaphoreType.DMA((2, 2)),  # [k/v, slot]
        pltpu.SemaphoreType.DMA((1,)),  # cache writes
    ]
    compiler_params = pltpu.CompilerParams(vmem_limit_bytes=vmem_limit) if vmem_limit else None
    return pl.pallas_call(
        _build_kernel(cfg, plan, dims, bug),
        out_shape=tuple(out_shape), in_specs=in_specs, out_specs=tuple(out_specs), scratch_shapes=scratch,
        input_output_aliases={first_cache: len(out_shape) - 2, first_cache + 1: len(out_shape) - 1},
        compiler_params=compiler_params, interpret=interpret, name="specdec_megakernel")


# ----------------------------------------------------------------------------------------------------------
# The step function
# ----------------------------------------------------------------------------------------------------------

def step_scalars(lengths: jax.Array, num_new: int, capacity: int, kv_tile: int,
                 tap_slot: np.ndarray) -> dict[str, jax.Array]:
    """Per-row scalars for SMEM: KV tiles to read (ceil(len / kv_tile)), the next row that has any, the running
    KV-tile index at each row's start (for the double-buffer slot), and where the new rows are written."""
    B = lengths.shape[0]
    ntiles = jnp.minimum((lengths + kv_tile - 1) // kv_tile, capacity // kv_tile)
    has = ntiles > 0
    idx = jnp.arange(B)
    # next_row[b] = smallest b' > b with tiles, else B
    later = has[None, :] & (idx[None, :] > idx[:, None])
    next_row = jnp.min(jnp.where(later, idx[None, :], B), axis=1).astype(jnp.int32)
    first_row = jnp.min(jnp.where(has, idx, B)).astype(jnp.int32)[None]
    tile_base = (jnp.cumsum(ntiles) - ntiles).astype(jnp.int32)
    # as dynamic_update_slice in the reference: a write that would run past the end is shifted back
    write_start = jnp.clip(lengths, 0, capacity - num_new).astype(jnp.int32)
    return dict(lengths=lengths.astype(jnp.int32), ntiles=ntiles.astype(jnp.int32), next_row=next_row,
                tile_base=tile_base, write_start=write_start, first_row=first_row,
                tap_slot=jnp.asarray(tap_slot, jnp.int32))


def plan_for(cfg: ModelConfig, packed: dict, dims: Dims, chip: str | None = None,
             plan: Plan | None = None) -> tuple[Plan, int]:
    """The plan (given, or chosen from the VMEM budget) and the vmem limit for it."""
    chip = resolve_chip(chip)
    subtile_cols = packed["w"].shape[-1]
    if plan is None:
        plan = sch.choose_plan(cfg, dims, chip, subtile_cols)
    elif plan.subtile_cols != subtile_cols:
        raise ValueError(f"plan.subtile_cols={plan.subtile_cols} but the weights are packed in {subtile_cols}")
    return plan, sch.vmem_limit_bytes(cfg, plan, dims, chip)


def forward(params: dict, cfg: ModelConfig, cache: transformer.KVCache, tokens: jax.Array,
            positions: jax.Array | None = None, tree_mask: jax.Array | None = None, *,
            taps: tuple[int, ...] = (), logits_at: jax.Array | None = None,
            interpret: Any = None, chip: str | None = None, plan: Plan | None = None,
            bug: str | None = None) -> transformer.StepOutput:
    """`transformer.forward` (stacked layout) through the megakernel. Extra keyword-only arguments (all static):
    interpret (None: module default; False: compiled; or a pltpu.InterpretParams), chip (TPU generation for
    the VMEM budget), plan (override the schedule), bug (tests only: inject a deliberate race)."""
    b, t = tokens.shape
    L = cfg.num_layers
    capacity = cache.capacity
    if any(not 0 <= l <= L for l in taps):
        raise ValueError(f"taps must lie in [0, {L}], got {taps}")
    kernel_taps = sorted({l for l in taps if l > 0})
    dims = Dims(batch=b, num_new=t, capacity=capacity, num_taps=len(kernel_taps))
    packed = packed_weights(params, cfg)
    plan, vmem_limit = plan_for(cfg, packed, dims, chip, plan)  # first: refuse before building any input
    Tp = dims.rows_per_seq(cfg)

    lengths = cache.lengths.astype(jnp.int32)
    if positions is None:
        positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if tree_mask is None:
        tree_mask = transformer.causal_mask(t)
    if tree_mask.ndim == 2:
        tree_mask = jnp.broadcast_to(tree_mask, (b, t, t))

    def pad_rows(a):  # [B, T, ...] -> [B*Tp, ...] with zero rows after each sequence's T tokens
        a = jnp.pad(a, [(0, 0), (0, Tp - t)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape((b * Tp,) + a.shape[2:])

    x = params["embed"][tokens].astype(cfg.jnp_dtype)
    cos, sin = transformer.rope_tables(cfg, positions)  # [B, T, HD/2]
    cos_full = jnp.concatenate([cos, cos], axis=-1)
    sin_signed = jnp.concatenate([-sin, sin], axis=-1)  # rotate_half(x) = swap_halves(x) * (-1 | +1)
    allowed = jnp.pad(tree_mask, [(0, 0), (0, Tp - t), (0, Tp - t)])  # padded rows/cols: masked out
    bias = jnp.where(allowed, 0.0, NEG).astype(jnp.float32)

    tap_slot = np.full((L,), -1, np.int32)
    for i, l in enumerate(kernel_taps):
        tap_slot[l - 1] = i
    scalars = step_scalars(lengths, t, capacity, plan.kv_tile, tap_slot)
    vmem_in = dict(x0=pad_rows(x.astype(jnp.float32)), cos=pad_rows(cos_full), sin=pad_rows(sin_signed),
                   bias=bias.reshape(b * Tp, Tp), attn_norm=packed["attn_norm"], mlp_norm=packed["mlp_norm"])
    for name in ("qkv_bias", "q_norm", "k_norm"):
        if name in packed:
            vmem_in[name] = packed[name]

    call = megakernel_call(cfg, plan, dims, interpret=resolve_interpret(interpret), vmem_limit=vmem_limit,
                           cache_dtype=cache.k.dtype, bug=bug)
    outs = call(*[scalars[n] for n in SMEM_INPUTS], *[vmem_in[n] for n in _vmem_inputs(cfg)],
                packed["w"], cache.k, cache.v)
    x_out, new_k, new_v = outs[0], outs[-2], outs[-1]

    def unpad(a):  # [B*Tp, H] -> [B, T, H] in the model dtype
        return a.reshape(b, Tp, -1)[:, :t].astype(cfg.jnp_dtype)

    tapped = {0: x} if 0 in taps else {}
    for i, l in enumerate(kernel_taps):
        tapped[l] = unpad(outs[1][i])
    hidden, logits = transformer.final_logits(params, cfg, unpad(x_out), logits_at)
    tap_stack = jnp.stack([tapped[l] for l in taps]) if taps else None
    new_cache = dataclasses.replace(cache, k=new_k, v=new_v)
    return transformer.StepOutput(logits=logits, hidden=hidden, taps=tap_stack, cache=new_cache)
