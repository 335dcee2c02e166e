"""EAGLE-3 drafters <-> the serving engines' checkpoint layouts (vLLM / speculators, SGLang / SpecForge).

What the peers load (docs/EXPORT.md cites the file behind each field):

* weights: `fc.weight` [H, 3H], `<layer>.{input_layernorm, hidden_norm, post_attention_layernorm}.weight`,
  `<layer>.self_attn.{q,k,v,o}_proj.weight`, `<layer>.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
  `lm_head.weight` [Vd, H], where <layer> is `layers.0` for vLLM (speculators' own module names; vLLM also maps
  `midlayer.` onto them) and `midlayer` for SGLang (its LlamaForCausalLMEagle3 has only that name); `d2t` int64
  [Vd] as OFFSETS (target id = draft id + d2t[draft id]) and `t2d` bool [V] (the identity map for the full
  vocabulary). Torch Linear weights are [out, in]: our Dense kernels [in, out] transposed. No `embed_tokens`:
  both engines then share the target's embedding, which is what specdec's drafter uses (the frozen target
  embedding).
* the draft vocabulary in ascending target-id order (speculators builds t2d as a mask and slices the verifier's
  lm_head with it, so draft id i is the i-th kept target id); specdec's d2t is sorted already, and the export
  permutes lm_head rows with it if one is not.
* aux hidden-state layer ids: specdec tap l = the residual stream after block l (Hugging Face hidden_states[l]).
  vLLM captures `hidden_states + residual` before decoder layer id, i.e. its id l = our tap l; SGLang captures
  before layer id + 1, i.e. its id = our tap - 1. Both concatenate the captures in layer order, so fc's input
  blocks are in ascending tap order (the export reorders fc's columns when the run listed taps otherwise).

Refused, with the reason (`NotRepresentable`): other than 3 taps (both engines size fc as 3 x hidden), repeated
taps, tap 0 (the embeddings: both engines add a residual that does not exist before layer 0) and tap L (the
last block's output is never captured).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

FORMATS = ("vllm", "sglang")
SGLANG_ARCH = "LlamaForCausalLMEagle3"
N_AUX = 3  # vLLM llama_eagle3.py and SGLang llama_eagle3.py both build fc with target_hidden_size * 3 inputs

# specdec Eagle3Net parameter -> peer tensor name. Dense kernels are transposed, norm scales copied.
DENSE = {"wq": "midlayer.self_attn.q_proj", "wk": "midlayer.self_attn.k_proj", "wv": "midlayer.self_attn.v_proj",
         "wo": "midlayer.self_attn.o_proj", "w_gate": "midlayer.mlp.gate_proj", "w_up": "midlayer.mlp.up_proj",
         "w_down": "midlayer.mlp.down_proj", "fc": "fc", "lm_head": "lm_head"}
NORMS = {"input_norm": "midlayer.input_layernorm", "hidden_norm": "midlayer.hidden_norm",
         "mlp_norm": "midlayer.post_attention_layernorm", "norm": "norm"}


LAYER_PREFIX = {"vllm": "layers.0.", "sglang": "midlayer."}


def _rename(tensors: dict, src: str, dst: str) -> dict:
    return {dst + k[len(src):] if k.startswith(src) else k: v for k, v in tensors.items()}


class NotRepresentable(ValueError):
    """A drafter (or a peer checkpoint) that the other side's architecture cannot express exactly."""


# ---------------------------------------------------------------------------------------------------------
# Tap numbering
# ---------------------------------------------------------------------------------------------------------

def engine_layer_ids(taps, num_layers: int, fmt: str, count: int | None = N_AUX) -> list[int]:
    """Our taps (ascending) in the engine's aux-layer numbering, or NotRepresentable saying why not. `count`:
    the number of taps the engine's fc reads (EAGLE-3: 3; None: any, as DFlash / DSpark). The same numbering
    holds for DFlash / DSpark: vLLM's aux ids capture the input of layer id (= our tap), SGLang's / z-lab's
    `target_layer_ids` name the layer whose output is read (= our tap - 1)."""
    _check_format(fmt)
    taps = [int(t) for t in taps]
    if count is not None and len(taps) != count:
        raise NotRepresentable(f"EAGLE-3 in vLLM and SGLang reads exactly {count} target layers (fc has "
                               f"3 x hidden inputs); this drafter taps {len(taps)}: {taps}")
    if len(set(taps)) != len(taps):
        raise NotRepresentable(f"taps {taps} repeat a layer; the engines capture each layer once, so fc would "
                               "get fewer inputs than it was trained on")
    bad = sorted(t for t in taps if not 1 <= t <= num_layers - 1)
    if bad:
        why = []
        if 0 in bad:
            why.append("tap 0 is the embedding output, where vLLM and SGLang add a residual that does not exist yet")
        if num_layers in bad:
            why.append(f"tap {num_layers} is the last block's output, which they never capture")
        raise NotRepresentable(f"taps {bad} cannot be captured by the engines (usable: 1..{num_layers - 1} for this "
                               f"{num_layers}-layer target): " + "; ".join(why))
    ordered = sorted(taps)
    return ordered if fmt == "vllm" else [t - 1 for t in ordered]


def taps_from_engine_ids(ids, fmt: str) -> list[int]:
    _check_format(fmt)
    ids = sorted(int(i) for i in ids)  # the engines concatenate captures in layer order whatever the list order
    return ids if fmt == "vllm" else [i + 1 for i in ids]


def fc_in_layer_order(fc_weight: np.ndarray, taps, hidden: int) -> np.ndarray:
    """fc.weight [H, n x H] with its input blocks in ascending tap order: the engines concatenate the captured
    layers in layer order whatever order the config lists them in."""
    order = np.argsort(np.asarray(taps), kind="stable")
    return np.ascontiguousarray(np.concatenate([fc_weight[:, i * hidden:(i + 1) * hidden] for i in order], axis=1))


def vocab_maps(d2t, draft_vocab: int, vocab: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(perm, {"d2t": int64 offsets [Vd], "t2d": bool [V]}) of specdec's reduced vocabulary `d2t` (absolute
    target ids): the peers keep the draft vocabulary in ascending target-id order, so a draft-vocabulary axis
    (lm_head rows, DSpark's markov_w2 rows) is written permuted by `perm` (the identity for specdec's sorted
    maps), and store offsets: target id = draft id + d2t[draft id]."""
    if d2t is None:
        raise ValueError(f"the drafter has draft_vocab_size {draft_vocab} but no d2t buffer")
    d2t = np.asarray(d2t, np.int64)
    if d2t.shape != (draft_vocab,) or d2t.min() < 0 or d2t.max() >= vocab or len(np.unique(d2t)) != len(d2t):
        raise ValueError(f"d2t must hold {draft_vocab} distinct target ids in [0, {vocab}); got shape "
                         f"{d2t.shape}, range [{d2t.min()}, {d2t.max()}], {len(np.unique(d2t))} distinct")
    perm = np.argsort(d2t, kind="stable")
    kept = d2t[perm]
    t2d = np.zeros((vocab,), bool)
    t2d[kept] = True
    return perm, {"d2t": kept - np.arange(len(kept), dtype=np.int64), "t2d": t2d}


def absolute_d2t(tensors: dict, draft_vocab: int, vocab: int) -> np.ndarray:
    """A peer checkpoint's d2t offsets (checked against its t2d when present) as specdec's absolute ids [Vd]."""
    offsets = np.asarray(tensors["d2t"], np.int64)
    if offsets.shape != (draft_vocab,):
        raise ValueError(f"d2t has shape {offsets.shape}, expected ({draft_vocab},)")
    d2t = np.arange(draft_vocab, dtype=np.int64) + offsets  # offsets -> specdec's absolute target ids
    if d2t.min() < 0 or d2t.max() >= vocab or len(np.unique(d2t)) != draft_vocab:
        raise ValueError(f"d2t offsets map to ids outside [0, {vocab}) or to repeated ids")
    if "t2d" in tensors:
        t2d = np.asarray(tensors["t2d"]).astype(bool)
        if t2d.shape != (vocab,) or int(t2d.sum()) != draft_vocab or not t2d[d2t].all():
            raise ValueError("t2d does not mark exactly the target ids of d2t")
    return d2t


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; formats: {', '.join(FORMATS)}")


# ---------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------

def to_peer(arch, params: dict, buffers: dict, target_cfg, fmt: str, *, num_draft_tokens: int = 3,
            verifier: dict | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json dict, {tensor name: array}) of a trained EAGLE-3 drafter in `fmt`'s layout.

    `arch` is the drafter's `Eagle3Arch`, `params` its trained weights (Eagle3Net tree), `buffers` its saved
    arrays (`d2t`: absolute target ids), `target_cfg` the target's ModelConfig. `verifier`: {"name_or_path",
    "architectures"} of the target for the speculators config."""
    c = arch.cfg
    ids = engine_layer_ids(arch.taps, target_cfg.num_layers, fmt)
    if c.hidden_size != target_cfg.hidden_size:
        raise NotRepresentable(f"draft hidden size {c.hidden_size} != target's {target_cfg.hidden_size}: the engines "
                               "share the target's embedding with the drafter, which needs equal widths")
    tensors: dict[str, np.ndarray] = {}
    for ours, theirs in DENSE.items():
        tensors[f"{theirs}.weight"] = np.ascontiguousarray(np.asarray(params[ours]["kernel"], np.float32).T)
    for ours, theirs in NORMS.items():
        tensors[f"{theirs}.weight"] = np.asarray(params[ours]["scale"], np.float32)

    tensors["fc.weight"] = fc_in_layer_order(tensors["fc.weight"], arch.taps, target_cfg.hidden_size)

    vocab = target_cfg.vocab_size
    if arch.draft_vocab:
        perm, maps = vocab_maps(buffers.get("d2t"), arch.draft_vocab, vocab)
        tensors["lm_head.weight"] = np.ascontiguousarray(tensors["lm_head.weight"][perm])
        tensors.update(maps)
    else:
        # The identity map for a full vocabulary: SGLang's EAGLE worker (older releases) calls .to() on the
        # hot-token map without a None check, and speculators accepts and ignores identity maps.
        tensors["d2t"] = np.zeros((vocab,), np.int64)
        tensors["t2d"] = np.ones((vocab,), bool)
    draft_vocab = arch.draft_vocab or vocab
    tensors = _rename(tensors, "midlayer.", LAYER_PREFIX[fmt])
    # the draft layer is a plain Llama block whatever the target family
    layer = layer_config(c, target_cfg, "llama", num_layers=1)
    if fmt == "vllm":
        verifier = verifier or {"name_or_path": target_cfg.name, "architectures": []}
        verifier = {"name_or_path": verifier["name_or_path"], "architectures": list(verifier["architectures"])}
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_draft_tokens)}],
                "default_proposal_method": "greedy",
                "verifier": verifier,
            },
            "transformer_layer_config": layer, "draft_vocab_size": draft_vocab,
            # vLLM's speculators adapter defaults norm_before_residual to True; ours keeps the residual pre-norm
            "norm_before_residual": False, "norm_before_fc": False,
            "target_hidden_size": target_cfg.hidden_size, "eagle_aux_hidden_state_layer_ids": ids,
        }
    else:
        config = {**layer, "architectures": [SGLANG_ARCH], "draft_vocab_size": draft_vocab,
                  "target_hidden_size": target_cfg.hidden_size,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
    return config, tensors


def layer_config(c, target_cfg, model_type: str, num_layers: int) -> dict:
    """The Hugging Face config of the draft layers (widths `c`, a ModelConfig): `transformer_layer_config` for
    speculators, the top level for SGLang. `model_type` "llama" (EAGLE-3's layer) or "qwen3" (DFlash / DSpark:
    q/k norms)."""
    eos = list(target_cfg.eos_token_ids)
    return {
        "model_type": model_type,
        "architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen3ForCausalLM"],
        "vocab_size": target_cfg.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": int(num_layers), "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": target_cfg.max_position_embeddings,
        "rope_theta": c.rope_theta, "rope_scaling": dict(c.rope_scaling) if c.rope_scaling is not None else None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": target_cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": target_cfg.pad_token_id, "torch_dtype": "float32",
    }


def layer_dims(layer: dict) -> dict:
    """The target widths a peer checkpoint's draft layers were built for (`target_dims`'s keys)."""
    rope = layer.get("rope_scaling")
    hidden = int(layer["hidden_size"])
    return {"hidden_size": hidden, "vocab_size": int(layer["vocab_size"]),
            "num_heads": int(layer["num_attention_heads"]),
            "num_kv_heads": int(layer.get("num_key_value_heads", layer["num_attention_heads"])),
            "head_dim": int(layer.get("head_dim") or hidden // int(layer["num_attention_heads"])),
            "rope_theta": float(layer.get("rope_theta", 10000.0)), "rms_norm_eps": float(layer["rms_norm_eps"]),
            "rope_scaling": json.loads(json.dumps(rope)) if rope else None}


# ---------------------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------------------

def detect_format(config: dict) -> str | None:
    """"vllm" (speculators layout), "sglang", or None for a config.json that is no EAGLE-3 drafter."""
    if config.get("speculators_model_type") == "eagle3":
        return "vllm"
    if SGLANG_ARCH in (config.get("architectures") or []):
        return "sglang"
    return None


def from_peer(config: dict, tensors: dict[str, np.ndarray]) -> dict:
    """A peer EAGLE-3 checkpoint as specdec's {"config", "params", "buffers", "dims"}: the drafter settings
    (`make_eagle3`'s checkpoint config), the Eagle3Net weights, d2t as absolute ids, and the widths the target
    must have (`dims`, checked against the target when the drafter is built)."""
    fmt = detect_format(config)
    if fmt is None:
        raise ValueError("config.json is neither a speculators EAGLE-3 config (speculators_model_type: eagle3) nor "
                         f"an SGLang one (architectures: [{SGLANG_ARCH}])")
    if fmt == "vllm":
        layer = config.get("transformer_layer_config") or {}
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        # vLLM's own default when unset is True (vllm/transformers_utils/configs/speculators/algos.py)
        nbr = config.get("norm_before_residual", True)
        extras = {k: config.get(k, False) for k in ("norm_before_fc", "fc_norm", "norm_output")}
    else:
        layer = config
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        nbr, extras = False, {}  # SGLang's midlayer always keeps the residual before hidden_norm
    problems = []
    if nbr:
        problems.append("norm_before_residual is true (specdec's draft layer adds the un-normalised feature)")
    problems += [f"{k} is true (specdec has no such norm)" for k, v in extras.items() if v]
    if layer.get("model_type", "llama") != "llama":
        problems.append(f"transformer_layer_config.model_type {layer.get('model_type')!r} (specdec's draft layer "
                        "is a Llama block: no q/k norms, no biases)")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        problems.append(f"{layer.get('num_hidden_layers')} draft layers (specdec's EAGLE-3 has one)")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        problems.append("attention/MLP biases (specdec's draft layer has none)")
    if layer.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {layer.get('hidden_act')!r} (specdec uses silu)")
    hidden = int(layer["hidden_size"])
    if int(config.get("target_hidden_size") or hidden) != hidden:
        problems.append(f"target_hidden_size {config.get('target_hidden_size')} != hidden_size {hidden}")
    if not ids:
        problems.append("no eagle_aux_hidden_state_layer_ids (the engine would pick its default layers; "
                        "specdec needs them written down)")
    if problems:
        raise NotRepresentable("this EAGLE-3 checkpoint is not representable in specdec: " + "; ".join(problems))

    tensors = _rename(tensors, LAYER_PREFIX["vllm"], LAYER_PREFIX["sglang"])  # either name set, as vLLM accepts
    missing = [f"{n}.weight" for n in [*DENSE.values(), *NORMS.values()] if f"{n}.weight" not in tensors]
    if missing:
        raise ValueError(f"the checkpoint lacks tensors {missing}")
    params: dict[str, Any] = {}
    for ours, theirs in DENSE.items():
        params[ours] = {"kernel": np.ascontiguousarray(np.asarray(tensors[f"{theirs}.weight"], np.float32).T)}
    for ours, theirs in NORMS.items():
        params[ours] = {"scale": np.asarray(tensors[f"{theirs}.weight"], np.float32)}
    n_in = params["fc"]["kernel"].shape[0]
    if n_in != N_AUX * hidden:
        raise NotRepresentable(f"fc has {n_in} inputs, not {N_AUX} x hidden ({N_AUX * hidden})")
    taps = taps_from_engine_ids(ids, fmt)
    if len(taps) != N_AUX:
        raise NotRepresentable(f"{len(taps)} aux layer ids {ids}; fc reads {N_AUX}")

    vocab = int(layer["vocab_size"])
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    if params["lm_head"]["kernel"].shape[1] != draft_vocab:
        raise ValueError(f"lm_head has {params['lm_head']['kernel'].shape[1]} rows, draft_vocab_size is {draft_vocab}")
    buffers = {}
    if draft_vocab == vocab and "d2t" in tensors and np.any(np.asarray(tensors["d2t"]) != 0):
        raise NotRepresentable("a full-vocabulary d2t that permutes the vocabulary (specdec's full-vocabulary "
                               "drafters use the identity)")
    if "d2t" in tensors and draft_vocab != vocab:
        buffers["d2t"] = absolute_d2t(tensors, draft_vocab, vocab).astype(np.int32)
    elif draft_vocab != vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab} < vocab_size {vocab} but the checkpoint has no d2t map")

    dims = layer_dims(layer)
    settings = {"taps": taps, "draft_vocab_size": 0 if draft_vocab == vocab else draft_vocab,
                "intermediate_size": int(layer["intermediate_size"])}
    return {"config": settings, "params": params, "buffers": buffers, "dims": dims, "format": fmt,
            "embed": tensors.get("embed_tokens.weight")}


def target_dims(cfg) -> dict:
    """The target widths an imported drafter was built for (`from_peer`'s `dims`)."""
    return {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rope_theta": float(cfg.rope_theta),
            "rms_norm_eps": float(cfg.rms_norm_eps),
            "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling is not None else None}
