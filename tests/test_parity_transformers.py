"""Parity with an independent implementation: transformers (PyTorch, float32).

1. The real target: transformers loads the SAME GGUF (dequantized by its own code, its own Q/K handling) and
   must agree with ours on logits (relative L2 < 1e-4, argmax 100%), on 64-token greedy continuations, on
   tokenizer ids and on the rendered chat template.
2. The Hugging Face-directory loader: tiny random Llama (tied / untied, llama3 RoPE scaling), Qwen2 (q/k/v
   bias) and Qwen3 (qk-norm, explicit head_dim) models saved by transformers as safetensors, loaded by
   `specdec.models.loading.load_checkpoint`, must compute the same logits; a bfloat16 export loads too.

Needs the parity extra (`pip install -e '.[parity]'`); skipped with a reason otherwise.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -e '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers (pip install -e '.[parity]')")

from specdec.generate import generate  # noqa: E402
from specdec.models import registry  # noqa: E402
from specdec.models.loading import load_checkpoint  # noqa: E402
from specdec.sampling import GREEDY  # noqa: E402
from specdec.target import Target  # noqa: E402

pytestmark = pytest.mark.parity

REL_L2_TOL = 1e-4
NEW_TOKENS = 64

# Three chat prompts of different kinds: explanation, code, and a multi-turn chat with its own system prompt.
CHATS = [
    [{"role": "user", "content": "Explain step by step how photosynthesis turns sunlight into sugar."}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number, with a "
                                 "docstring and comments."}],
    [{"role": "system", "content": "You are a patient teacher who answers with concrete examples."},
     {"role": "user", "content": "What is 12 times 7?"},
     {"role": "assistant", "content": "12 times 7 is 84."},
     {"role": "user", "content": "Now tell me a short story about a robot who learns to paint."}],
]

TOKENIZER_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Digits: 0 12 345 6789 3.14159 1,000,000 2026-11-30 0x1F",
    "Unicode: café naïve façade — Straße, 日本語のテキスト, Привет мир, emoji 🚀🎉👍🏽, ∑∫√∞",
    "def fib(n: int) -> int:\n    \"\"\"Return F(n).\"\"\"\n\tif n < 2:\n        return n  # base case\n"
    "    return fib(n - 1) + fib(n - 2)\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "   leading spaces,  double  spaces\n\n\nand newlines\r\n trailing   ",
    "<|endoftext|>special<|im_start|> in the middle<|im_end|>!",
]

TEMPLATE_CASES = [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi there"}], True),
    (CHATS[2], True),
    (CHATS[2] + [{"role": "assistant", "content": "Once upon a time..."}], False),
]


def rel_l2(ours: np.ndarray, theirs: np.ndarray) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "stacked"))
def _full_logits(params, tokens, *, forward, cfg, stacked):
    """Logits at every position of right-padded token rows [B, T] in one forward (one compile per shape)."""
    from specdec.models.transformer import init_cache

    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1], stacked=stacked)
    return forward(params, cfg, cache, tokens).logits


def full_logits(target: Target, rows: list[list[int]]) -> list[np.ndarray]:
    width = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r  # right padding never influences earlier positions (causal)
    logits = np.asarray(_full_logits(target.params, jnp.asarray(tokens), forward=target.forward, cfg=target.cfg,
                                     stacked=target.backend.stacked))
    return [logits[i, : len(r)] for i, r in enumerate(rows)]


# ----------------------------------------------------------------------------------------------------------
# 1. The real model: same GGUF in transformers
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def torch_one_thread():
    """One torch thread: on a shared 2-core machine two threads spin against other jobs (5x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return registry.fetch(registry.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def chat_prompts(real_target):
    return [real_target.tokenizer.encode(real_target.tokenizer.apply_chat_template(m)) for m in CHATS]


@pytest.fixture(scope="module")
def hf_continuations(hf_model, chat_prompts, real_target):
    """transformers' greedy continuations (EOS included if it stopped there, as ours are)."""
    eos = list(real_target.eos_token_ids)
    outs = []
    with torch.no_grad():
        for ids in chat_prompts:
            inp = torch.tensor([ids])
            out = hf_model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, num_beams=1,
                                    max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=eos[0],
                                    temperature=None, top_p=None, top_k=None)
            outs.append(out[0, len(ids):].tolist())
    return outs


def test_config_matches_transformers(real_target, hf_model):
    ours, theirs = real_target.cfg, hf_model.config
    assert ours.vocab_size == theirs.vocab_size
    assert ours.hidden_size == theirs.hidden_size
    assert ours.intermediate_size == theirs.intermediate_size
    assert ours.num_layers == theirs.num_hidden_layers
    assert ours.num_heads == theirs.num_attention_heads
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert real_target.cfg.eos_token_ids == (hf_model.generation_config.eos_token_id,)


def test_logits_match_transformers(real_target, hf_model, chat_prompts, hf_continuations):
    """Logits at every position of prompt + continuation (>= 64 positions each) agree with transformers."""
    rows = [p + c for p, c in zip(chat_prompts, hf_continuations)]
    ours = full_logits(real_target, rows)
    for i, (row, mine) in enumerate(zip(rows, ours)):
        assert len(row) >= 64, f"prompt {i}: only {len(row)} positions"
        with torch.no_grad():
            theirs = hf_model(torch.tensor([row])).logits[0].float().numpy()
        assert mine.shape == theirs.shape
        err = rel_l2(mine, theirs)
        per_pos = np.linalg.norm(mine - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)
        agree = (mine.argmax(-1) == theirs.argmax(-1))
        assert err < REL_L2_TOL, f"prompt {i}: relative L2 error {err:.2e} (worst position {per_pos.max():.2e})"
        assert agree.all(), f"prompt {i}: argmax differs at positions {np.flatnonzero(~agree).tolist()}"


def test_greedy_continuations_match_transformers(real_target, chat_prompts, hf_continuations):
    ours = generate(real_target, chat_prompts, NEW_TOKENS, GREEDY).tokens  # one batch, different lengths
    tok = real_target.tokenizer
    for i, (mine, theirs) in enumerate(zip(ours, hf_continuations)):
        assert mine == theirs, (f"prompt {i} diverges at token "
                                f"{next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)}:\n"
                                f"ours:   {tok.decode(mine)!r}\ntheirs: {tok.decode(theirs)!r}")
    # the prompts were chosen to run the full length: the comparison covers 64 tokens, not a short answer
    assert sum(len(t) == NEW_TOKENS for t in ours) >= 2, [len(t) for t in ours]


@pytest.mark.parametrize("text", TOKENIZER_TEXTS)
def test_tokenizer_ids_match_transformers(real_target, hf_tokenizer, text):
    ours = real_target.tokenizer.encode(text)
    theirs = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ours == theirs
    assert real_target.tokenizer.decode(ours, skip_special_tokens=False) == \
        hf_tokenizer.decode(theirs, skip_special_tokens=False)


def test_tokenizer_round_trip(real_target):
    tok = real_target.tokenizer
    for text in TOKENIZER_TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("messages,add_generation_prompt", TEMPLATE_CASES)
def test_chat_template_matches_transformers(real_target, hf_tokenizer, messages, add_generation_prompt):
    ours = real_target.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


# ----------------------------------------------------------------------------------------------------------
# 2. Hugging Face-style directories written by transformers
# ----------------------------------------------------------------------------------------------------------

VOCAB = 320
SEQ = 48
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}  # small, so scaling matters within SEQ positions
CORPUS = ("The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them "
          "in one pass of the target model. def add(a, b): return a + b  # 0123456789 ") * 20
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_hf_tokenizer():
    """A byte-level BPE with exactly VOCAB entries, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    assert tok.get_vocab_size() == VOCAB
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", chat_template=CHAT_TEMPLATE)


COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

HF_CASES = {
    "llama-tied-llama3rope": ("LlamaConfig", "LlamaForCausalLM",
                              dict(tie_word_embeddings=True, rope_theta=50000.0, rope_scaling=LLAMA3_ROPE)),
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=20000.0)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3-qknorm-headdim": ("Qwen3Config", "Qwen3ForCausalLM",
                             dict(tie_word_embeddings=False, head_dim=32, rope_theta=1000000.0)),
}


def build_hf_model(case: str, seed: int = 0):
    config_cls, model_cls, extra = HF_CASES[case]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # random everything (norms and biases too, so their loading is really checked)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


def save_hf_dir(model, tokenizer, path: Path, dtype=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (model.to(dtype) if dtype is not None else model).save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


def token_rows(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, SEQ).tolist(), rng.integers(0, VOCAB, SEQ - 11).tolist()]


def hf_logits(model, rows) -> list[np.ndarray]:
    with torch.no_grad():
        return [model(torch.tensor([r])).logits[0].float().numpy() for r in rows]


def assert_logits_match(target: Target, model, rows, tol=REL_L2_TOL, check_argmax=True):
    for i, (mine, theirs) in enumerate(zip(full_logits(target, rows), hf_logits(model, rows))):
        err = rel_l2(mine, theirs)
        assert err < tol, f"row {i}: relative L2 error {err:.2e} >= {tol:.0e}"
        if check_argmax:
            assert (mine.argmax(-1) == theirs.argmax(-1)).all(), f"row {i}: argmax differs"


def safetensors_dtypes(path: Path) -> set[str]:
    from safetensors import safe_open

    dtypes = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="numpy") as fh:
            dtypes |= {fh.get_slice(name).get_dtype() for name in fh.keys()}
    return dtypes


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_dir_logits_match_transformers(case, tmp_path, tiny_hf_tokenizer):
    model = build_hf_model(case)
    path = save_hf_dir(model, tiny_hf_tokenizer, tmp_path / case)
    cfg, params, tokenizer = load_checkpoint(path)
    hf = model.config
    assert cfg.vocab_size == VOCAB and tokenizer.vocab_size == VOCAB
    assert cfg.num_layers == 2 and cfg.num_kv_heads == 2
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert ("lm_head" in params) == (not hf.tie_word_embeddings)
    assert cfg.attention_bias == case.startswith("qwen2")
    assert cfg.qk_norm == case.startswith("qwen3")
    assert cfg.rope_theta == HF_CASES[case][2]["rope_theta"]
    assert (cfg.rope_scaling is not None) == ("rope_scaling" in HF_CASES[case][2])
    target = Target.from_params(cfg, params, tokenizer)
    assert_logits_match(target, model, token_rows())


def test_hf_dir_legacy_rope_keys(tmp_path, tiny_hf_tokenizer):
    """Configs written before transformers 5 carry top-level rope_theta / rope_scaling ({"type": ...}): same result."""
    model = build_hf_model("llama-tied-llama3rope")
    path = save_hf_dir(model, tiny_hf_tokenizer, tmp_path / "legacy")
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {}
    config["rope_theta"] = rope.pop("rope_theta", 50000.0)
    rope = dict(rope or LLAMA3_ROPE)
    rope["type"] = rope.pop("rope_type")  # the oldest spelling of the key
    config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config))
    cfg, params, tokenizer = load_checkpoint(path)
    assert cfg.rope_theta == 50000.0 and dict(cfg.rope_scaling)["rope_type"] == "llama3"
    assert_logits_match(Target.from_params(cfg, params, tokenizer), model, token_rows())


def test_hf_dir_tokenizer_matches_transformers(tmp_path, tiny_hf_tokenizer):
    path = save_hf_dir(build_hf_model("llama-untied"), tiny_hf_tokenizer, tmp_path / "tok")
    _, _, ours = load_checkpoint(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    for text in ["The quick brown fox.", "def add(a, b): return a + b  # 42", "<s>user\nhé 🚀</s>"]:
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert (ours.bos_token_id, ours.eos_token_ids) == (theirs.bos_token_id, (theirs.eos_token_id,))
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=True)


def test_hf_dir_bfloat16(tmp_path, tiny_hf_tokenizer):
    """A bfloat16 export loads (widened exactly to float32) and computes the bf16-rounded model's function."""
    model = build_hf_model("llama-untied", seed=1)
    reference_fp32 = hf_logits(model, token_rows())
    path = save_hf_dir(model, tiny_hf_tokenizer, tmp_path / "bf16", dtype=torch.bfloat16)
    assert safetensors_dtypes(path) == {"BF16"}
    cfg, params, tokenizer = load_checkpoint(path)
    assert cfg.dtype == "float32" and params["embed"].dtype == np.float32
    target = Target.from_params(cfg, params, tokenizer)
    # exact widening: equals transformers running the same bf16 weights in float32
    # (reloaded rather than `model.float()`: `.to(bfloat16)` also rounds the RoPE inv_freq buffer)
    widened = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert_logits_match(target, widened, token_rows())
    # and close to the original float32 model, within bfloat16 rounding of the weights
    for mine, ref in zip(full_logits(target, token_rows()), reference_fp32):
        assert rel_l2(mine, ref) < 2e-2
