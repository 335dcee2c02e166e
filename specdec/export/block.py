"""DFlash / DSpark drafters <-> the serving engines' layouts (vLLM / speculators, SGLang / z-lab DFlash).

What the peers load (docs/EXPORT.md cites the file behind each field):

* one set of tensor names for both formats (vLLM's `qwen3_dflash.py` / `qwen3_dspark.py` loaders and SGLang's
  `dflash.py` read z-lab's DFlash checkpoints): `layers.{i}.input_layernorm`, `layers.{i}.self_attn.{q,k,v,o}_proj`,
  `layers.{i}.self_attn.{q,k}_norm`, `layers.{i}.post_attention_layernorm`, `layers.{i}.mlp.{gate,up,down}_proj`,
  `fc`, `hidden_norm` (the context norm), `norm`; DSpark adds `markov_head.markov_w1` [V, r],
  `markov_head.markov_w2` [Vd, r] and `confidence_head.proj` (weight [1, H + r], bias [1]). Torch Linear weights
  are [out, in]: our kernels [in, out] transposed.
* the draft layers are Qwen3 layers: q_norm / k_norm are always applied, so a drafter without them is refused.
* the block layout: the peers' [anchor, MASK x (g-1)] block, slot j >= 1 predicting the token at its own
  position (speculators' `sample_from_anchor: false`, vLLM's `dspark_bonus_anchor`). A drafter trained in
  specdec's own layout (slot j predicts a + j + 1) would draft every token one position off there, so it is
  refused with the option to train with (`block_layout: peer`).
* layer numbering: vLLM's `aux_hidden_state_layer_ids` = our taps, SGLang's / z-lab's `target_layer_ids` = our
  taps - 1 (`eagle3.engine_layer_ids`).
* the vocabulary: vLLM shares the target's embedding and, with the full vocabulary, its lm_head; a reduced one
  ships `lm_head` [Vd, H], `d2t` offsets and `t2d`. SGLang's DFlash draft model has neither lm_head nor d2t (it
  always uses the target's head), so a reduced vocabulary is refused there; its Qwen3 DSpark model owns its
  `embed_tokens` / `lm_head`, which are written (the target's, which is what specdec's drafter uses).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specdec.export import eagle3 as E
from specdec.export.eagle3 import NotRepresentable

KINDS = ("dflash", "dspark")
SGLANG_ARCH = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
VLLM_ARCH = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator"}

# specdec draft-layer weight -> (peer name under layers.{i}., transposed?)
LAYER = {"attn_norm": ("input_layernorm", False), "wq": ("self_attn.q_proj", True),
         "wk": ("self_attn.k_proj", True), "wv": ("self_attn.v_proj", True), "wo": ("self_attn.o_proj", True),
         "q_norm": ("self_attn.q_norm", False), "k_norm": ("self_attn.k_norm", False),
         "mlp_norm": ("post_attention_layernorm", False), "w_gate": ("mlp.gate_proj", True),
         "w_up": ("mlp.up_proj", True), "w_down": ("mlp.down_proj", True)}
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
CONF_W, CONF_B = "confidence_head.proj.weight", "confidence_head.proj.bias"


def _t(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32).T)


def problems(kind: str, arch, target_cfg, fmt: str) -> list[str]:
    """Why `arch` cannot run in `fmt`'s engine as it was trained (empty: it can)."""
    out = []
    if arch.layout != "peer":
        out.append("it was trained in specdec's block layout (slot j predicts token a + j + 1); the engines run "
                   "the [anchor, mask x (g-1)] block where slot j predicts a + j, so every draft would be one "
                   "position off. Train with the drafter option `block_layout: peer` (train.drafter_options)")
    if not arch.cfg.qk_norm:
        out.append("its draft layers have no q/k norms; the engines' DFlash / DSpark layers are Qwen3 layers that "
                   "always apply a per-head RMSNorm to q and k, which cannot be set to the identity. Train with "
                   "the drafter option `qk_norm: true` (train.drafter_options)")
    if arch.cfg.attention_bias:
        out.append("its draft layers have q/k/v biases (the target's Qwen2 layout); the engines' layers would also "
                   "give o_proj a bias and specdec has none")
    if fmt == "sglang" and arch.draft_vocab:
        out.append(f"it drafts from a reduced vocabulary ({arch.draft_vocab} ids); SGLang's DFlash / DSpark draft "
                   "models have no d2t map (they project onto the whole target vocabulary). Export it for vLLM, or "
                   "train with `draft_vocab_size: 0`")
    return out


def to_peer(kind: str, arch, params: dict, buffers: dict, target_cfg, fmt: str, *, embed, head,
            num_draft_tokens: int, verifier: dict) -> tuple[dict, dict[str, np.ndarray], list[str]]:
    """(config.json dict, {tensor name: array}, notes) of a trained DFlash / DSpark drafter in `fmt`'s layout.

    `params`: the trained tree ({"backbone", DSpark: "markov", "conf"}), `buffers`: its saved arrays (d2t absolute
    ids, DSpark's confidence temperatures), `embed` [V, H] / `head` [H, V]: the target's embedding and output
    projection (which specdec's drafter shares). `notes`: what the peer format drops (for the model card)."""
    E._check_format(fmt)
    if kind not in KINDS:
        raise ValueError(f"unknown block drafter kind {kind!r}; kinds: {', '.join(KINDS)}")
    why = problems(kind, arch, target_cfg, fmt)
    if why:
        raise NotRepresentable(f"this {kind} drafter cannot be exported for {fmt}: " + "; ".join(why))
    ids = E.engine_layer_ids(arch.taps, target_cfg.num_layers, fmt, count=None)
    if not 1 <= num_draft_tokens <= arch.drafts:
        raise ValueError(f"num_draft_tokens must be in [1, {arch.drafts}] (block_size - 1), got {num_draft_tokens}")
    c, p = arch.cfg, params["backbone"]
    tensors: dict[str, np.ndarray] = {}
    for i in range(c.num_layers):
        for ours, (theirs, transpose) in LAYER.items():
            w = np.asarray(p["layers"][ours][i], np.float32)
            tensors[f"layers.{i}.{theirs}.weight"] = _t(w) if transpose else w
    tensors["fc.weight"] = E.fc_in_layer_order(_t(p["fc"]), arch.taps, target_cfg.hidden_size)
    tensors["hidden_norm.weight"] = np.asarray(p["ctx_norm"], np.float32)
    tensors["norm.weight"] = np.asarray(p["final_norm"], np.float32)

    vocab = target_cfg.vocab_size
    head = np.asarray(head, np.float32)  # [H, V]
    perm, kept = None, np.arange(vocab)
    if arch.draft_vocab:
        perm, maps = E.vocab_maps(buffers.get("d2t"), arch.draft_vocab, vocab)
        kept = np.asarray(buffers["d2t"], np.int64)[perm]
        tensors.update(maps)
        tensors["lm_head.weight"] = _t(head[:, kept])
    elif fmt == "sglang" and kind == "dspark":  # SGLang's Qwen3 DSpark model owns its vocabulary weights
        tensors["lm_head.weight"] = _t(head)
        tensors["embed_tokens.weight"] = np.asarray(embed, np.float32)
    notes = []
    if kind == "dspark":
        tensors[W1] = np.asarray(params["markov"]["w1"], np.float32)
        tensors[W2] = _t(np.asarray(params["markov"]["w2"], np.float32)[:, kept])
        tensors[CONF_W] = np.asarray(params["conf"]["w"], np.float32)[None, :]
        tensors[CONF_B] = np.asarray(params["conf"]["b"], np.float32).reshape(1)
        for name in ("conf_temperature", "conf_temperature_greedy"):
            temps = buffers.get(name)
            if temps is not None and not np.allclose(np.asarray(temps), 1.0):
                notes.append(f"`{name}` (per-draft confidence temperatures {np.round(np.asarray(temps), 3).tolist()}"
                             f", fitted by specdec's calibration) has no field in the peer format: the engines "
                             f"compute sigmoid(confidence_head.proj([h; e])) at temperature 1, so their "
                             f"confidences are the uncalibrated ones")

    layer = E.layer_config(c, target_cfg, "qwen3", num_layers=c.num_layers)
    draft_vocab = arch.draft_vocab or vocab
    dspark = {"markov_rank": arch.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
              "confidence_head_with_markov": True} if kind == "dspark" else {}
    if fmt == "vllm":
        config = {
            "architectures": [VLLM_ARCH[kind]], "speculators_model_type": kind,
            "speculators_config": {
                "algorithm": kind,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_draft_tokens)}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier["name_or_path"],
                             "architectures": list(verifier["architectures"])},
            },
            "transformer_layer_config": layer, "draft_vocab_size": draft_vocab,
            "target_hidden_size": target_cfg.hidden_size, "aux_hidden_state_layer_ids": ids,
            "block_size": arch.block_size, "mask_token_id": arch.mask_id,
            # the peer block (vLLM's speculators adapter turns this into dspark_bonus_anchor)
            "sample_from_anchor": False, **dspark,
        }
    else:
        config = {**layer, "architectures": [SGLANG_ARCH[kind]], "block_size": arch.block_size,
                  "num_target_layers": target_cfg.num_layers, "draft_vocab_size": draft_vocab,
                  "target_hidden_size": target_cfg.hidden_size,
                  "dflash_config": {"mask_token_id": arch.mask_id, "target_layer_ids": ids}}
        if kind == "dspark":  # SGLang's Qwen3 DSpark model reads these at the top level
            config.update(dspark, mask_token_id=arch.mask_id, target_layer_ids=ids, sample_from_anchor=False)
    return config, tensors, notes


# ---------------------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------------------

def detect(config: dict) -> tuple[str, str] | None:
    """(kind, format) of a DFlash / DSpark config.json, or None."""
    kind = config.get("speculators_model_type")
    if kind in KINDS:
        return kind, "vllm"
    for kind, arch in SGLANG_ARCH.items():
        if arch in (config.get("architectures") or []):
            return kind, "sglang"
    return None


def from_peer(config: dict, tensors: dict[str, np.ndarray]) -> dict:
    """A peer DFlash / DSpark checkpoint in the peer block layout as specdec's {"drafter", "config", "params",
    "buffers", "dims", "format"} (`from_peer` of eagle3.py for the same fields)."""
    found = detect(config)
    if found is None:
        raise ValueError("config.json is no DFlash / DSpark drafter (speculators_model_type dflash / dspark, or "
                         f"architectures {', '.join(SGLANG_ARCH.values())})")
    kind, fmt = found
    if fmt == "vllm":
        layer, ids = config.get("transformer_layer_config") or {}, config.get("aux_hidden_state_layer_ids")
        block_size, mask_id = config.get("block_size"), config.get("mask_token_id")
        anchor = config.get("sample_from_anchor", kind == "dspark")  # speculators' defaults per kind
    else:
        draft = config.get("dflash_config") or {}
        layer, ids = config, draft.get("target_layer_ids", config.get("target_layer_ids"))
        block_size, mask_id = config.get("block_size"), draft.get("mask_token_id", config.get("mask_token_id"))
        anchor = config.get("sample_from_anchor", False)
    bad = []
    if anchor:
        bad.append("sample_from_anchor is true (slot j predicts a + j + 1); specdec imports the [anchor, mask] "
                   "layout only")
    if layer.get("model_type", "qwen3") != "qwen3":
        bad.append(f"draft layers of model_type {layer.get('model_type')!r} (specdec reads Qwen3 layers)")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        bad.append("attention/MLP biases")
    if layer.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {layer.get('hidden_act')!r}")
    if layer.get("layer_types") or layer.get("is_causal") or (config.get("dflash_config") or {}).get("causal"):
        bad.append("causal or sliding-window draft layers (specdec's block attention is bidirectional)")
    if kind == "dspark" and config.get("markov_head_type", "vanilla") != "vanilla":
        bad.append(f"markov_head_type {config.get('markov_head_type')!r} (specdec's Markov head is the vanilla one)")
    if not ids or block_size is None or mask_id is None:
        bad.append("no target layer ids, block_size or mask_token_id written")
    if bad:
        raise NotRepresentable(f"this {kind} checkpoint is not representable in specdec: " + "; ".join(bad))

    dims = E.layer_dims(layer)
    hidden, vocab = dims["hidden_size"], dims["vocab_size"]
    n = int(layer["num_hidden_layers"])
    missing = [f"layers.{i}.{theirs}.weight" for i in range(n) for theirs, _ in LAYER.values()
               if f"layers.{i}.{theirs}.weight" not in tensors]
    missing += [k for k in ("fc.weight", "hidden_norm.weight", "norm.weight") if k not in tensors]
    if kind == "dspark":
        missing += [k for k in (W1, W2, CONF_W, CONF_B) if k not in tensors]
    if missing:
        raise ValueError(f"the checkpoint lacks tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    layers = {ours: np.stack([np.asarray(tensors[f"layers.{i}.{theirs}.weight"], np.float32).T if transpose
                              else np.asarray(tensors[f"layers.{i}.{theirs}.weight"], np.float32)
                              for i in range(n)])
              for ours, (theirs, transpose) in LAYER.items()}
    taps = E.taps_from_engine_ids(ids, fmt)
    fc = _t(tensors["fc.weight"])
    if fc.shape != (len(taps) * hidden, hidden):
        raise NotRepresentable(f"fc reads {fc.shape[0]} inputs, not {len(taps)} target layers x hidden {hidden}")
    params: dict[str, Any] = {"backbone": {"fc": fc, "ctx_norm": np.asarray(tensors["hidden_norm.weight"], np.float32),
                                           "layers": layers,
                                           "final_norm": np.asarray(tensors["norm.weight"], np.float32)}}

    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    buffers = {}
    if draft_vocab != vocab:
        if "d2t" not in tensors or "lm_head.weight" not in tensors:
            raise ValueError(f"draft_vocab_size {draft_vocab} < vocab_size {vocab} but the checkpoint has no d2t map "
                             "or lm_head")
        buffers["d2t"] = E.absolute_d2t(tensors, draft_vocab, vocab).astype(np.int32)
    if kind == "dspark":
        w2 = np.asarray(tensors[W2], np.float32)  # [Vd, r]
        full = np.zeros((w2.shape[1], vocab), np.float32)  # specdec keeps W2 over the whole vocabulary
        full[:, buffers["d2t"] if "d2t" in buffers else np.arange(vocab)] = w2.T
        params["markov"] = {"w1": np.asarray(tensors[W1], np.float32), "w2": full}
        params["conf"] = {"w": np.asarray(tensors[CONF_W], np.float32).reshape(-1),
                          "b": np.asarray(tensors[CONF_B], np.float32).reshape(())}
    settings = {"num_layers": n, "taps": taps, "block_size": int(block_size), "mask_token_id": int(mask_id),
                "intermediate_size": int(layer["intermediate_size"]),
                "draft_vocab_size": 0 if draft_vocab == vocab else draft_vocab, "block_layout": "peer",
                "qk_norm": True}
    if kind == "dspark":
        settings["markov_rank"] = int(config["markov_rank"])
    return {"drafter": kind, "config": settings, "params": params, "buffers": buffers, "dims": dims, "format": fmt,
            "head": tensors.get("lm_head.weight"), "embed": tensors.get("embed_tokens.weight")}
