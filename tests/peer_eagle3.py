"""An independent PyTorch EAGLE-3 drafter that reads an exported directory the way the serving engines do.

Written from the engines' published code, not from specdec's drafter: vLLM `model_executor/models/llama_eagle3.py`
(the draft layer, `compute_logits` with d2t offsets), vLLM `model_executor/models/llama.py` and SGLang
`srt/models/llama.py` (which hidden states the aux layer ids capture), SGLang `srt/models/llama_eagle3.py`
(its `eagle_config` ids, hot-token map). What it does, in the engines' terms:

* aux capture: vLLM id i = the residual stream entering decoder layer i = hidden_states[i]; SGLang captures at
  layer id + 1, so its id i = hidden_states[i + 1]. Captures are concatenated in layer order, then `fc`.
* draft layer (norm_before_residual false): residual = hidden; x = cat(input_layernorm(embed), hidden_norm(hidden));
  attention (q/k/v from 2H, neox RoPE, GQA, causal over the draft KV cache); residual += o_proj(attn);
  post_attention_layernorm, SwiGLU MLP; the model returns norm(h + residual) for logits and the pre-norm sum
  as the next step's hidden.
* positions: the proposer feeds token x_{p+1} with the target's hidden state at p at position p (the input ids
  shifted left by one), so the draft runs one position earlier than specdec's convention; RoPE is relative.
* logits: lm_head over the draft vocabulary, scattered to target ids draft + d2t[draft]; -inf elsewhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D] rotated at `positions` [T] (rotate-half / neox layout, as Llama's get_rope)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class PeerEagle3:
    def __init__(self, export_dir: str | Path, embed: torch.Tensor):
        export_dir = Path(export_dir)
        config = json.loads((export_dir / "config.json").read_text())
        if config.get("speculators_model_type") == "eagle3":
            self.engine = "vllm"
            layer = config["transformer_layer_config"]
            ids = config["eagle_aux_hidden_state_layer_ids"]
            assert config["norm_before_residual"] is False  # vLLM's adapter would default it to True
        else:
            assert config["architectures"] == ["LlamaForCausalLMEagle3"]
            assert config["tie_word_embeddings"] is False  # True would make SGLang's lm_head the embedding
            self.engine = "sglang"
            layer = config
            ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert layer.get("rope_scaling") is None, "this reference implements plain RoPE only"
        assert not layer.get("attention_bias") and layer["num_hidden_layers"] == 1
        self.capture = sorted(ids) if self.engine == "vllm" else sorted(i + 1 for i in ids)
        # vLLM's loader maps `midlayer.` onto its `layers.0.` modules; SGLang's has only `midlayer.` names
        weights = load_file(str(export_dir / "model.safetensors"))
        if self.engine == "vllm":
            weights = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}
        else:
            assert not any(k.startswith("layers.") for k in weights), "SGLang would skip layers.* weights"
        self.w = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in weights.items()}
        self.layer = "layers.0." if self.engine == "vllm" else "midlayer."
        self.embed = embed.to(torch.float64)
        self.vocab = int(layer["vocab_size"])
        self.draft_vocab = int(config["draft_vocab_size"])
        self.heads, self.kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
        self.head_dim = layer["head_dim"]
        self.eps, self.theta = layer["rms_norm_eps"], layer["rope_theta"]
        d2t = self.w.get("d2t")
        if self.engine == "sglang" and d2t is not None:
            self.targets = d2t + torch.arange(d2t.shape[0])  # SGLang's hot_token_id
        else:
            self.targets = torch.arange(self.draft_vocab) + (d2t if d2t is not None else 0)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []

    def fuse(self, hidden_states: list[torch.Tensor]) -> torch.Tensor:
        """`combine_hidden_states` on the target's hidden_states (all L+1 of them, [T, H] each)."""
        aux = torch.cat([hidden_states[i].to(torch.float64) for i in self.capture], dim=-1)
        return aux @ self.w["fc.weight"].T

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor):
        """The draft model on new tokens (appended to its KV cache). Returns (full-vocab logits, pre-norm hidden)."""
        w, m = self.w, self.layer
        emb = rms(self.embed[input_ids], w[m + "input_layernorm.weight"], self.eps)
        residual = hidden
        x = torch.cat([emb, rms(hidden, w[m + "hidden_norm.weight"], self.eps)], dim=-1)
        t = x.shape[0]
        q = (x @ w[m + "self_attn.q_proj.weight"].T).view(t, self.heads, self.head_dim)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).view(t, self.kv_heads, self.head_dim)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(t, self.kv_heads, self.head_dim)
        q, k = rotate_neox(q, positions, self.theta), rotate_neox(k, positions, self.theta)
        self.k_cache.append(k)
        self.v_cache.append(v)
        keys, values = torch.cat(self.k_cache), torch.cat(self.v_cache)
        rep = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        past = keys.shape[0] - t
        scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(self.head_dim)
        causal = torch.arange(keys.shape[0])[None, :] <= (past + torch.arange(t))[:, None]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        attn = torch.einsum("hts,shd->thd", scores.softmax(-1), values).reshape(t, -1)
        h = attn @ w[m + "self_attn.o_proj.weight"].T
        residual = residual + h
        n = rms(residual, w[m + "post_attention_layernorm.weight"], self.eps)
        mlp = (torch.nn.functional.silu(n @ w[m + "mlp.gate_proj.weight"].T) * (n @ w[m + "mlp.up_proj.weight"].T))
        out = mlp @ w[m + "mlp.down_proj.weight"].T
        prenorm = out + residual
        draft_logits = rms(prenorm, w["norm.weight"], self.eps) @ w["lm_head.weight"].T
        full = torch.full((t, self.vocab), float("-inf"), dtype=draft_logits.dtype)
        full[:, self.targets] = draft_logits
        return full, prenorm

    def propose(self, tokens: list[int], root: int, hidden_states: list[torch.Tensor], k: int):
        """Chain drafting as the engine's proposer does it after the target's prefill of `tokens` (root = the
        token the target sampled): k greedy draft tokens and their full-vocabulary logits [k, V]."""
        self.k_cache, self.v_cache = [], []
        g = self.fuse(hidden_states)  # [P, H]
        p = len(tokens)
        ids = torch.tensor(tokens[1:] + [root])  # shifted left by one: x_{i+1} with the hidden state at i
        logits, prenorm = self.step(ids, torch.arange(p), g)
        out, drafted = [logits[-1]], [int(logits[-1].argmax())]
        hidden = prenorm[-1:]
        for i in range(1, k):
            logits, hidden = self.step(torch.tensor([drafted[-1]]), torch.tensor([p - 1 + i]), hidden)
            out.append(logits[0])
            drafted.append(int(logits[0].argmax()))
        return drafted, torch.stack(out)
