"""Checkpoint loading: GGUF files (llama.cpp) and Hugging Face-style directories (config.json + safetensors).

Both produce the same thing: a `ModelConfig`, float32 NumPy weights in the canonical stacked layout of
`specdec.models.transformer`, and a `Tokenizer` built from the checkpoint itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from specdec.models.config import ModelConfig
from specdec.models.registry import CorruptCheckpointError, ModelNotFoundError, UnsupportedModelError, resolve
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import layer_param_shapes

# ----------------------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------------------

GGUF_LAYER_NAMES = {  # llama.cpp tensor name -> our layer key
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
    "ffn_norm": "mlp_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
}
GGUF_SUPPORTED_ARCHS = ("llama",)


def unpermute_qk(w_out_in: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation so the usual rotate-half RoPE applies.

    llama.cpp's converter interleaves the two halves of each head's rows (for its interleaved-pair RoPE).
    Keeping those rows with rotate-half RoPE gives fluent-looking garbage, so every Q and K is restored here.
    """
    out_dim, in_dim = w_out_in.shape
    head_dim = out_dim // num_heads
    return (w_out_in.reshape(num_heads, head_dim // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim))


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_gguf(path: Path):
    import gguf

    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises a mix of ValueError / struct.error / IndexError
        raise CorruptCheckpointError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CorruptCheckpointError(f"{path}: truncated (tensor {t.name} ends past the end of the file)")
    return reader


def load_gguf(path: Path, dtype: str = "float32") -> tuple[ModelConfig, dict, Tokenizer]:
    from gguf.quants import dequantize

    reader = read_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_SUPPORTED_ARCHS)})")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    num_heads = int(meta("attention.head_count"))
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    hidden = int(meta("embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    tokenizer = Tokenizer.from_gguf(reader)
    head_dim = int(meta("rope.dimension_count", hidden // num_heads))
    cfg = ModelConfig(
        vocab_size=int(meta("vocab_size", tensors["token_embd.weight"].shape[-1])),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        dtype=dtype,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        pad_token_id=tokenizer.pad_token_id,
        name=str(_field(reader, "general.name", path.stem)),
    )

    def tensor(name: str) -> np.ndarray:
        if name not in tensors:
            raise CorruptCheckpointError(f"{path}: missing tensor {name!r}")
        t = tensors[name]
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModelError(
                f"{path}: tensor {name} uses quantization {t.tensor_type.name}, which cannot be dequantized "
                f"by the installed gguf package ({e})") from e
        return np.asarray(arr, dtype=np.float32)

    shapes = layer_param_shapes(cfg)
    layers = {key: np.empty((cfg.num_layers, *shape), np.float32) for key, shape in shapes.items()}
    for i in range(cfg.num_layers):
        for gguf_name, key in GGUF_LAYER_NAMES.items():
            if key not in shapes:
                continue
            w = tensor(f"blk.{i}.{gguf_name}.weight")  # [out, in] (or [n] for norms)
            if key == "wq":
                w = unpermute_qk(w, num_heads)
            elif key == "wk":
                w = unpermute_qk(w, num_kv_heads)
            if w.ndim == 2:
                w = w.T
            if w.shape != shapes[key]:
                raise CorruptCheckpointError(
                    f"{path}: blk.{i}.{gguf_name}.weight has shape {w.shape}, expected {shapes[key]}")
            layers[key][i] = w
    params = {"embed": tensor("token_embd.weight"), "final_norm": tensor("output_norm.weight"), "layers": layers}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = tensor("output.weight").T
    return cfg, params, tokenizer


# ----------------------------------------------------------------------------------------------------------
# Hugging Face-style directories
# ----------------------------------------------------------------------------------------------------------

HF_ARCHS = {
    # architecture name -> flags that differ from plain Llama
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}

HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "mlp_norm", "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
}

SAFETENSORS_WEIGHTS = "model.safetensors"  # transformers' names for a single file and a sharded checkpoint's index
SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_safetensors(path: Path, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """The tensors of one .safetensors file (only `names` when given), read by the `safetensors` library, in
    their stored dtypes (BF16 as ml_dtypes' bfloat16, which widens to float32 exactly)."""
    import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16", which safetensors' numpy reader asks for)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            stored = set(f.keys())
            missing = sorted(set(names) - stored) if names is not None else []
            if missing:
                raise CorruptCheckpointError(
                    f"{path}: {SAFETENSORS_INDEX} maps {len(missing)} tensor(s) to this shard that it does not hold "
                    f"(first: {missing[0]!r})")
            return {name: f.get_tensor(name) for name in (names if names is not None else sorted(stored))}
    except SafetensorError as e:  # the library's one error type: a short, truncated or foreign file
        raise CorruptCheckpointError(f"{path}: truncated or corrupt safetensors file ({e})") from None
    except TypeError as e:  # a dtype numpy cannot hold (e.g. float8 without ml_dtypes support)
        raise UnsupportedModelError(f"{path}: a tensor has a dtype specdec cannot read ({e})") from None


def read_safetensors_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face-style directory, chosen as transformers chooses: model.safetensors if
    present, else the shards that model.safetensors.index.json's `weight_map` (tensor name -> shard file)
    names, else the directory's single *.safetensors file."""
    if (path / SAFETENSORS_WEIGHTS).is_file():
        return read_safetensors(path / SAFETENSORS_WEIGHTS)
    index_file = path / SAFETENSORS_INDEX
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map tensor names to shard file names")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{index_file}: not a valid index ({type(e).__name__}: {e})") from None
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        absent = sorted(s for s in by_shard if not (path / s).is_file())
        if absent:
            raise CorruptCheckpointError(
                f"{path}: shard {absent[0]} is missing ({SAFETENSORS_INDEX} maps {len(by_shard[absent[0]])} "
                f"tensors to it; {len(absent)} of its {len(by_shard)} shards are absent)")
        tensors: dict[str, np.ndarray] = {}
        for shard, names in sorted(by_shard.items()):
            tensors.update(read_safetensors(path / shard, names))
        return tensors
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path}: no *.safetensors files")
    if len(files) > 1:  # shards without their index: which file holds what is not ours to guess
        raise CorruptCheckpointError(
            f"{path}: {len(files)} *.safetensors files ({', '.join(f.name for f in files[:3])}, ...) but no "
            f"{SAFETENSORS_WEIGHTS} and no {SAFETENSORS_INDEX} saying which tensors each shard holds")
    return read_safetensors(files[0])


def load_hf_dir(path: Path, dtype: str = "float32") -> tuple[ModelConfig, dict, Tokenizer]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path}: a model directory needs config.json (and *.safetensors)")
    hf = json.loads(config_file.read_text())
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in HF_ARCHS), None)
    if arch is None:
        raise UnsupportedModelError(
            f"{path}: architecture {archs or hf.get('model_type')!r} is not supported "
            f"(supported: {', '.join(HF_ARCHS)})")
    weights = read_safetensors_checkpoint(path)
    sharded = not (path / SAFETENSORS_WEIGHTS).is_file() and (path / SAFETENSORS_INDEX).is_file()

    tokenizer = Tokenizer.from_hf_dir(path)
    eos = hf.get("eos_token_id", tokenizer.eos_token_ids)
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    num_heads = hf["num_attention_heads"]
    flags = dict(HF_ARCHS[arch])
    if hf.get("attention_bias"):
        flags["attention_bias"] = True
    # transformers >= 5 writes `rope_parameters` (rope_theta + rope_type + scaling keys); older configs write
    # top-level `rope_theta` and `rope_scaling`.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_scaling = ({("rope_type" if k == "type" else k): v for k, v in rope.items() if k != "rope_theta"}
                    if rope.get("rope_type", rope.get("type", "default")) != "default" else None)
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
        dtype=dtype,
        bos_token_id=hf.get("bos_token_id", tokenizer.bos_token_id),
        eos_token_ids=eos or tokenizer.eos_token_ids,
        pad_token_id=hf.get("pad_token_id", tokenizer.pad_token_id),
        name=path.name,
        **flags,
    )
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        cfg = cfg.replace(tie_word_embeddings=True)  # some exports drop the duplicate head silently

    def take(name: str) -> np.ndarray:
        if name not in weights:
            where = f" (not in {SAFETENSORS_INDEX}'s weight_map)" if sharded else ""
            raise CorruptCheckpointError(f"{path}: missing tensor {name!r}{where}")
        return np.asarray(weights.pop(name), dtype=np.float32)

    shapes = layer_param_shapes(cfg)
    layers = {key: np.empty((cfg.num_layers, *shape), np.float32) for key, shape in shapes.items()}
    for i in range(cfg.num_layers):
        for hf_name, key in HF_LAYER_NAMES.items():
            if key not in shapes:
                continue
            w = take(f"model.layers.{i}.{hf_name}")
            w = w.T if w.ndim == 2 else w
            if w.shape != shapes[key]:
                raise CorruptCheckpointError(
                    f"{path}: model.layers.{i}.{hf_name} has shape {w.shape}, expected {shapes[key]}")
            layers[key][i] = w
    params = {"embed": take("model.embed_tokens.weight"), "final_norm": take("model.norm.weight"),
              "layers": layers}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = take("lm_head.weight").T
    return cfg, params, tokenizer


def load_checkpoint(name_or_path: str | os.PathLike, dtype: str = "float32"):
    """Registry name, .gguf file or HF-style directory -> (ModelConfig, NumPy params, Tokenizer)."""
    path = resolve(name_or_path)
    if path.is_dir():
        return load_hf_dir(path, dtype)
    if path.suffix == ".gguf":
        return load_gguf(path, dtype)
    if path.suffix == ".safetensors":
        return load_hf_dir(path.parent, dtype)
    raise UnsupportedModelError(
        f"{path}: unrecognised checkpoint (expected a .gguf file or a directory with config.json and "
        "*.safetensors)")
