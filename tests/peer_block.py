"""An independent PyTorch DFlash / DSpark drafter that reads an exported directory the way the serving engines do.

Written from the peers' published code, not from specdec's drafter: z-lab DFlash `dflash/model.py`
(`DFlashDraftModel`, `Qwen3DFlashAttention`, `dflash_generate`: the block, its positions, which outputs are
drafts, `extract_context_feature`'s layer offset), vLLM `model_executor/models/qwen3_dflash.py` (tensor names,
d2t offsets in `compute_logits`, the shared target embedding / lm_head when the checkpoint has none) and
`model_executor/models/qwen3_dspark.py` (`DSparkMarkovHead`: markov_w1 [V, r] over target ids, markov_w2 [Vd, r];
`DSparkConfidenceHead` on [h; e]), vLLM `transformers_utils/configs/speculators/algos.py` (`update_dflash`: aux ids
for capture, target_layer_ids = aux - 1) and SGLang `srt/speculative/dflash_utils.py` (target_layer_ids name the
layer whose output is read). What it does, in the peers' terms:

* context: the target's hidden states at the configured layers, concatenated in layer order, through `fc` and
  `hidden_norm`, for the positions strictly before the anchor (the tokens already verified).
* block: [anchor, mask x (g - 1)] at positions anchor_pos + j, embedded with the target's embedding.
* each layer (Qwen3): residual; input_layernorm; q = q_norm(q_proj(h)); k = k_norm(k_proj of [context ; h]),
  v = v_proj of [context ; h]; neox RoPE (queries at the block positions, keys at context + block positions);
  non-causal attention; o_proj; residual; post_attention_layernorm; SwiGLU MLP; residual. Then `norm`.
* drafts: the outputs at block slots 1..k (slot j predicts the token at anchor_pos + j); logits = lm_head (the
  checkpoint's, else the target's); DSpark adds markov_w2 @ markov_w1[previous token] left to right (the first
  previous token is the anchor), each drafted id mapped to the target vocabulary (draft + d2t[draft]) before it
  becomes the next previous token; confidence = sigmoid(confidence_head.proj([h ; markov_w1[previous]])).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.peer_eagle3 import rms, rotate_neox


class PeerBlockDrafter:
    def __init__(self, export_dir: str | Path, embed: torch.Tensor, lm_head: torch.Tensor):
        """`embed` [V, H] and `lm_head` [V, H]: the target's, which the engines share with a draft that has none."""
        export_dir = Path(export_dir)
        config = json.loads((export_dir / "config.json").read_text())
        if config.get("speculators_model_type") in ("dflash", "dspark"):
            self.engine, self.kind = "vllm", config["speculators_model_type"]
            layer = config["transformer_layer_config"]
            # update_dflash: eagle_aux_hidden_state_layer_ids = aux ids (captured at the input of layer id)
            self.capture = sorted(config["aux_hidden_state_layer_ids"])
            self.mask_id = config["mask_token_id"]
            assert config["sample_from_anchor"] is False  # the [anchor, mask] block read below
        else:
            self.engine = "sglang"
            self.kind = {"DFlashDraftModel": "dflash", "DSparkDraftModel": "dspark"}[config["architectures"][0]]
            layer = config
            # target_layer_ids name the layer whose output is read: hidden_states[id + 1]
            self.capture = sorted(i + 1 for i in config["dflash_config"]["target_layer_ids"])
            self.mask_id = config["dflash_config"]["mask_token_id"]
        assert layer["model_type"] == "qwen3" and layer.get("rope_scaling") is None
        assert not layer.get("attention_bias") and not layer.get("layer_types")  # full, non-causal attention
        self.block_size = config["block_size"]
        self.layers = layer["num_hidden_layers"]
        self.heads, self.kv_heads, self.head_dim = (layer["num_attention_heads"], layer["num_key_value_heads"],
                                                    layer["head_dim"])
        self.eps, self.theta = layer["rms_norm_eps"], layer["rope_theta"]
        self.vocab = layer["vocab_size"]
        w = load_file(str(export_dir / "model.safetensors"))
        self.w = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in w.items()}
        self.embed = self.w.get("embed_tokens.weight", embed.to(torch.float64))
        self.lm_head = self.w.get("lm_head.weight", lm_head.to(torch.float64))
        draft_vocab = self.lm_head.shape[0]
        d2t = self.w.get("d2t")
        self.targets = torch.arange(draft_vocab) + (d2t if d2t is not None else 0)

    def _attention(self, i: int, h: torch.Tensor, ctx: torch.Tensor, q_pos, k_pos) -> torch.Tensor:
        w, p = self.w, f"layers.{i}.self_attn."
        g, c = h.shape[0], ctx.shape[0]
        q = rms((h @ w[p + "q_proj.weight"].T).view(g, self.heads, self.head_dim), w[p + "q_norm.weight"], self.eps)
        kv_in = torch.cat([ctx, h])
        k = (kv_in @ w[p + "k_proj.weight"].T).view(c + g, self.kv_heads, self.head_dim)
        k = rms(k, w[p + "k_norm.weight"], self.eps)
        v = (kv_in @ w[p + "v_proj.weight"].T).view(c + g, self.kv_heads, self.head_dim)
        q, k = rotate_neox(q, q_pos, self.theta), rotate_neox(k, k_pos, self.theta)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(self.head_dim)  # no mask: non-causal
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(g, -1)
        return out @ w[p + "o_proj.weight"].T

    def block_hidden(self, anchor: int, hidden_states: list[torch.Tensor]) -> torch.Tensor:
        """The normed outputs [g, H] of the block anchored after the context `hidden_states` (the target's
        hidden_states of all L + 1 layers over the verified tokens, [T, H] each)."""
        w = self.w
        aux = torch.cat([hidden_states[i].to(torch.float64) for i in self.capture], dim=-1)
        ctx = rms(aux @ w["fc.weight"].T, w["hidden_norm.weight"], self.eps)
        c = ctx.shape[0]
        ids = torch.tensor([anchor] + [self.mask_id] * (self.block_size - 1))
        q_pos = torch.arange(c, c + self.block_size)  # the anchor sits right after the context
        k_pos = torch.arange(c + self.block_size)
        x = self.embed[ids]
        for i in range(self.layers):
            p = f"layers.{i}."
            x = x + self._attention(i, rms(x, w[p + "input_layernorm.weight"], self.eps), ctx, q_pos, k_pos)
            h = rms(x, w[p + "post_attention_layernorm.weight"], self.eps)
            mlp = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + mlp @ w[p + "mlp.down_proj.weight"].T
        return rms(x, w["norm.weight"], self.eps)

    def propose(self, anchor: int, hidden_states: list[torch.Tensor], k: int):
        """Greedy drafts: (k target ids, full-vocabulary logits [k, V] (-inf off the draft vocabulary),
        DSpark's per-draft confidences [k] or None)."""
        h = self.block_hidden(anchor, hidden_states)[1:1 + k]  # slot j >= 1 predicts anchor_pos + j
        base = h @ self.lm_head.T
        drafted, rows, conf = [], [], []
        prev = anchor
        for j in range(k):
            logits = base[j]
            if self.kind == "dspark":
                e = self.w["markov_head.markov_w1.weight"][prev]
                logits = logits + self.w["markov_head.markov_w2.weight"] @ e
                z = torch.cat([h[j], e]) @ self.w["confidence_head.proj.weight"][0] + \
                    self.w["confidence_head.proj.bias"][0]
                conf.append(torch.sigmoid(z))
            prev = int(self.targets[int(logits.argmax())])
            drafted.append(prev)
            full = torch.full((self.vocab,), float("-inf"), dtype=logits.dtype)
            full[self.targets] = logits
            rows.append(full)
        return drafted, torch.stack(rows), (torch.stack(conf) if conf else None)
