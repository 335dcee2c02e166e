"""A distilled draft LM: a small causal LM of the target's family trained with KL to the target's logits.

By default it starts as the target's first `num_layers` blocks + its final norm + embedding/lm_head
(self-speculation's model, `drafters/draft_lm.py: self_spec`) and is then trained, all weights, to match the
target's next-token distribution on the target's own responses: loss = KL(p_target || p_draft) at every
position whose next token is a response token. `init: random` trains the same shape from random weights.

The model is the target's own functional transformer (`specdec.models.transformer.forward`, the target's
parameter layout), not a separate module, so what is trained is exactly what `DraftLMDrafter` runs: at
inference the checkpoint loads as a `drafters.draft_lm.DraftLMDrafter` (or `DraftLMTreeDrafter` with
tree_top_k / tree_depth).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from drafters import register
from drafters.draft_lm import DraftLMDrafter, DraftLMTreeDrafter
from specdec.models import transformer
from specdec.models.config import ModelConfig
from specdec.train import tasks as T
from specdec.train.checkpoint import load_trained

NAME = "distilled_lm"


def model_config_to_dict(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    d["rope_scaling"] = [list(kv) for kv in cfg.rope_scaling] if cfg.rope_scaling else None
    return d


def model_config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"]) if d.get("rope_scaling") else None
    return ModelConfig(**d)


def draft_logits(dcfg: ModelConfig, params, tokens: jax.Array) -> jax.Array:
    """Logits [B, T, V] of the draft model over whole sequences (an empty cache of length T)."""
    b, t = tokens.shape
    cache = transformer.init_cache(dcfg, b, t)
    return transformer.forward(transformer.unstack_layers(params), dcfg, cache, tokens).logits


@dataclasses.dataclass(frozen=True)
class DistilledLMTask(T.TrainTask):
    dcfg: ModelConfig
    init_from: str = "target"
    target: Any = dataclasses.field(default=None, compare=False, repr=False)

    name = NAME
    taps = ()
    needs_target_logits = True
    max_eval_steps = None

    def config(self) -> dict:
        return {"model": model_config_to_dict(self.dcfg), "init": self.init_from}

    def init(self, key, token_counts):
        if self.init_from == "target":
            tp = transformer.stack_layers(self.target.params)  # the standard layout, whatever the backend's
            params = {k: v for k, v in tp.items() if k != "layers"}
            params["layers"] = {k: v[: self.dcfg.num_layers] for k, v in tp["layers"].items()}
        else:
            params = transformer.init_params(self.dcfg, key)
        return jax.tree.map(lambda a: jnp.array(a, jnp.float32), params), {}

    def frozen(self, target) -> dict:
        return {}

    def _loss(self, logits, feats, batch):
        valid = T.label_valid(batch, 0)  # position p is compared with the target at p (label x_{p+1})
        kl = T.masked_mean(T.kl_divergence(feats.logits, logits), valid)
        acc = T.masked_mean(jnp.argmax(logits, -1) == jnp.argmax(feats.logits, -1), valid)
        return kl, {"kl": kl, "top1_agreement": acc}

    def loss(self, params, consts, batch, feats, key):
        return self._loss(draft_logits(self.dcfg, params, batch["tokens"]), feats, batch)

    def evaluate(self, params, consts, batch, feats, num_steps: int):
        logits = draft_logits(self.dcfg, params, batch["tokens"])
        a, m = T.acceptance(logits, feats.logits)  # per position; step k from root slot j is position j+k
        ev = T.DraftEval(jnp.stack([T.shift(a, k) for k in range(num_steps)], -1),
                         jnp.stack([T.shift(m, k, False) for k in range(num_steps)], -1))
        return self._loss(logits, feats, batch)[0], ev


@T.register_task(NAME)
def make_task(target, num_layers: int = 4, init: str = "target") -> DistilledLMTask:
    tl = target.cfg.num_layers
    if init not in ("target", "random"):
        raise ValueError(f"distilled_lm init must be 'target' or 'random', got {init!r}")
    if not 1 <= num_layers <= tl:
        raise ValueError(f"distilled_lm num_layers must be in [1, {tl}], got {num_layers}")
    dcfg = target.cfg.replace(num_layers=num_layers, dtype="float32", name=f"distilled[{target.cfg.name}:{num_layers}]")
    return DistilledLMTask(dcfg=dcfg, init_from=init, target=target)


@register(NAME)
def make_distilled_lm(target, num_draft_tokens: int, path: str = "", tree_top_k: int = 0, tree_depth: int = 0):
    """A trained distilled draft LM (`path`: its training run or exported directory), run as DraftLMDrafter."""
    info = load_trained(path, NAME, target, "draft_lm")
    dcfg = model_config_from_dict(info["config"]["model"])
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), info["params"])
    if tree_top_k or tree_depth:
        return DraftLMTreeDrafter(dcfg, params, num_draft_tokens, tree_top_k, tree_depth, name=NAME)
    return DraftLMDrafter(dcfg, params, num_draft_tokens, name=NAME)
