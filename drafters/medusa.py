"""Medusa: K extra heads on the target's last hidden state, drafting a chain (top-1 per head) or a static tree.

Network (Flax linen, `MedusaNet`): head k (k = 1..K) = ResBlock(s) `x + SiLU(W x + b)` (W zero-initialised,
so every head starts as the target's own next-token head) then a projection to the vocabulary, initialised
from the target's lm_head (`shared_head: true` instead reuses the frozen target lm_head: no vocabulary-sized
weights per head, cheaper on CPU). At hidden position t (the final-normed last hidden state that predicts
x_{t+1}), head k predicts x_{t+k+1}. Loss: cross-entropy on the target-generated tokens, head weights 0.8^(k-1),
over labels that are response tokens.

Where the hidden state comes from: the drafter requests tap L (`taps = (L,)`, the residual stream after the
last block, before the final norm) from the target's prefill and verify steps and applies the target's final
norm itself. After a round with m accepted drafts, the state is the hidden state at the last accepted position
(index 0 = the root when m = 0, else path[m-1] + 1 of the verify step's [root, nodes]); it predicted the new
root (the bonus token), so head k predicts the k-th token after the root. In the one indexing convention of
`specdec.train.tasks` (root slot j), the heads read the hidden state at j-1.

Inference: chain = head k's top-1 (greedy) or a sample from it (with its distribution: lossless rejection
sampling, since head k's draft does not depend on earlier drafts) for k = 1..N; static tree = `tree_paths`
(Medusa "choices"), node [r1, ..., rd] = the rank-rd candidate of head d: at temperature 0 head d's rd-th most
likely token (deterministic: probs None), above it head d's rd-th draw without replacement with the target's
noise at the node's position (the coupled draw first, each draw carrying q less the earlier ones), for
greedy_tree, multidraft_tree, the invariant policies or typical acceptance.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from drafters import register
from specdec import trees
from specdec.drafter import Draft, Drafter, PromptInfo, RoundContext
from specdec.models import transformer
from specdec.sampling import probabilities, sample_with_probs
from specdec.train import tasks as T
from specdec.train.checkpoint import load_trained

NAME = "medusa"


@dataclasses.dataclass(frozen=True)
class MedusaArch:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int = 1  # ResBlocks per head
    shared_head: bool = False  # True: the frozen target lm_head projects every head

    def to_config(self) -> dict:
        return {"num_heads": self.num_heads, "num_layers": self.num_layers, "shared_head": self.shared_head}


class MedusaNet(nn.Module):
    arch: MedusaArch

    @nn.compact
    def __call__(self, h, head=None):
        """h [..., H] final-normed hidden states -> logits [..., K, V]; `head` [H, V] when shared."""
        a = self.arch
        h = h.astype(jnp.float32)
        outs = []
        for k in range(a.num_heads):
            x = h
            for r in range(a.num_layers):
                x = x + jax.nn.silu(nn.Dense(a.hidden_size, kernel_init=nn.initializers.zeros,
                                             name=f"head{k}_res{r}")(x))
            if a.shared_head:
                outs.append(jnp.einsum("...h,hv->...v", x, head.astype(jnp.float32)))
            else:
                outs.append(nn.Dense(a.vocab_size, use_bias=False, name=f"head{k}_proj")(x))
        return jnp.stack(outs, axis=-2)


def head_logits(arch: MedusaArch, params, consts, last: jax.Array) -> jax.Array:
    """Heads on the target's residual stream after the last block `last` [..., H] (final norm applied here)."""
    h = transformer.rms_norm(last.astype(jnp.float32), consts["final_norm"], consts["eps"])
    return MedusaNet(arch).apply({"params": params}, h, consts.get("head"))


@dataclasses.dataclass(frozen=True)
class MedusaTask(T.TrainTask):
    arch: MedusaArch
    num_layers_target: int
    head_weight: float = 0.8
    target: Any = dataclasses.field(default=None, compare=False, repr=False)

    name = NAME
    needs_target_logits = False  # CE on the target's own tokens; the eval still compares with its logits
    training_keys = ("head_weight",)  # may change in a continued run (train.init_from)

    @property
    def taps(self) -> tuple[int, ...]:
        return (self.num_layers_target,)

    @property
    def max_eval_steps(self) -> int:
        return self.arch.num_heads

    def config(self) -> dict:
        return {**self.arch.to_config(), "head_weight": self.head_weight}

    def init(self, key, token_counts):
        consts = self.frozen(self.target)
        h = jnp.zeros((1, self.arch.hidden_size), jnp.float32)
        params = MedusaNet(self.arch).init(key, h, consts.get("head"))["params"]
        params = jax.tree.map(jnp.asarray, params)
        if not self.arch.shared_head:
            head = jnp.asarray(self.target.output_projection(), jnp.float32)
            for k in range(self.arch.num_heads):
                params[f"head{k}_proj"] = {"kernel": head}
        return params, {}

    def frozen(self, target) -> dict:
        out = {"final_norm": target.params["final_norm"], "eps": jnp.float32(target.cfg.rms_norm_eps)}
        if self.arch.shared_head:
            out["head"] = target.output_projection()
        return out

    def _loss(self, logits, batch):
        total, weights, metrics = 0.0, 0.0, {}
        for k in range(self.arch.num_heads):  # head k+1 at hidden t predicts x_{t+k+2}
            labels = T.shift(batch["tokens"], k + 2)
            valid = T.label_valid(batch, k + 1)
            lk = T.masked_mean(T.hard_cross_entropy(logits[:, :, k], labels), valid)
            w = self.head_weight ** k
            total, weights = total + w * lk, weights + w
            metrics[f"loss_head{k + 1}"] = lk
            metrics[f"acc_head{k + 1}"] = T.masked_mean(jnp.argmax(logits[:, :, k], -1) == labels, valid)
        return total / weights, metrics

    def loss(self, params, consts, batch, feats, key):
        return self._loss(head_logits(self.arch, params, consts, feats.taps[0]), batch)

    def evaluate(self, params, consts, batch, feats, num_steps: int):
        logits = head_logits(self.arch, params, consts, feats.taps[0])  # [B, T, K, V]
        alpha, match = [], []
        for k in range(num_steps):  # at hidden t, head k+1 vs the target at t+k+1; root slot j = t+1
            a, m = T.acceptance(logits[:, :, k], T.shift(feats.logits, k + 1))
            alpha.append(jnp.concatenate([jnp.zeros_like(a[:, :1]), a[:, :-1]], 1))
            match.append(jnp.concatenate([jnp.zeros_like(m[:, :1]), m[:, :-1]], 1))
        return self._loss(logits, batch)[0], T.DraftEval(jnp.stack(alpha, -1), jnp.stack(match, -1))


@T.register_task(NAME)
def make_task(target, num_heads: int = 4, num_layers: int = 1, shared_head: bool = False,
              head_weight: float = 0.8) -> MedusaTask:
    if num_heads < 1 or num_layers < 0:
        raise ValueError(f"medusa needs num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
    arch = MedusaArch(target.cfg.hidden_size, target.cfg.vocab_size, num_heads, num_layers, bool(shared_head))
    return MedusaTask(arch=arch, num_layers_target=target.cfg.num_layers, head_weight=float(head_weight),
                      target=target)


# ---------------------------------------------------------------------------------------------------------
# Inference
# ---------------------------------------------------------------------------------------------------------

class MedusaDrafter(Drafter):
    kind = "chain"
    jittable = True

    def __init__(self, arch: MedusaArch, params, num_draft_tokens: int, target_layers: int, name: str = NAME):
        if num_draft_tokens > arch.num_heads:
            raise ValueError(f"medusa has {arch.num_heads} heads, so it drafts at most {arch.num_heads} tokens; "
                             f"got num_draft_tokens={num_draft_tokens}")
        self.arch, self.num_draft_tokens, self.name = arch, num_draft_tokens, name
        self.taps = (target_layers,)  # the residual stream after the last block (final norm applied here)
        self.params = params  # {"params": heads, "final_norm", "eps"[, "head"]}

    @classmethod
    def from_trained(cls, arch, trained, target, num_draft_tokens, tree_paths=None):
        params = {"params": jax.tree.map(jnp.asarray, trained), "final_norm": target.params["final_norm"],
                  "eps": jnp.float32(target.cfg.rms_norm_eps)}
        if arch.shared_head:
            params["head"] = target.output_projection()
        if tree_paths:
            return MedusaTreeDrafter(arch, params, trees.tree_from_paths(tree_paths), target.cfg.num_layers)
        return cls(arch, params, num_draft_tokens, target.cfg.num_layers)

    def heads(self, params, last):
        """Head logits [B, K, V] from the residual stream `last` [B, H] at the last committed target position."""
        return head_logits(self.arch, params["params"], params, last)

    def init(self, params, prompt: PromptInfo, capacity: int):
        return jnp.take_along_axis(prompt.taps[0], (prompt.lengths - 1)[:, None, None], axis=1)[:, 0]

    def propose(self, params, last, ctx: RoundContext, sampling, key):
        logits = self.heads(params, last)[:, : self.num_draft_tokens]  # [B, N, V]
        if sampling.greedy:
            return Draft.chain(jnp.argmax(logits, -1).astype(jnp.int32)), last
        # head j drafts the token at offset j, with the target's noise there (each head's draft is independent of
        # the earlier ones)
        tokens, probs = sample_with_probs(key, logits, sampling, jnp.arange(logits.shape[1], dtype=jnp.int32))
        return Draft.chain(tokens, probs=probs), last

    def update(self, params, last, ctx: RoundContext, result, taps):
        m = result.num_accepted
        idx = jnp.where(m > 0, jnp.take_along_axis(result.path, jnp.maximum(m - 1, 0)[:, None], 1)[:, 0] + 1, 0)
        return jnp.take_along_axis(taps[0], idx[:, None, None], axis=1)[:, 0]

    def describe(self):
        return {**super().describe(), "heads": self.arch.num_heads}


class MedusaTreeDrafter(MedusaDrafter):
    """Medusa with a static tree: node [r1, ..., rd] is the rank-rd candidate of head d (its rd-th most likely
    token at temperature 0, its rd-th draw without replacement above it)."""

    kind = "tree"

    def __init__(self, arch: MedusaArch, params, tree: trees.StaticTree, target_layers: int, name: str = NAME):
        if tree.max_depth > arch.num_heads:
            raise ValueError(f"tree depth {tree.max_depth} exceeds the {arch.num_heads} medusa heads")
        super().__init__(arch, params, min(tree.num_nodes, arch.num_heads), target_layers, name=name)
        self.num_draft_tokens = tree.num_nodes
        self.tree = tree

    def propose(self, params, last, ctx: RoundContext, sampling, key):
        tree = self.tree
        topk = max(tree.topk_per_depth)
        logits = self.heads(params, last)[:, : tree.max_depth]  # [B, D, V]
        depth, rank = jnp.asarray(tree.depth - 1), jnp.asarray(tree.rank)
        parents = tree.batched_parents(logits.shape[0])
        if sampling.greedy:
            _, cand = jax.lax.top_k(logits, topk)  # [B, D, topk]
            return Draft.tree(cand[:, depth, rank], parents), last
        # Head d's candidates are drawn without replacement from its q with the target's noise at offset d - 1, in
        # draw order; head d's q does not read the path, so every node of depth d - 1 has the same children.
        q = probabilities(logits, sampling)
        offsets = jnp.broadcast_to(jnp.arange(tree.max_depth, dtype=jnp.int32), q.shape[:2])
        ids, laws, drawn = trees.draw_children(q, topk, trees.draft_noise(key, offsets, q.shape[-1]))
        own = drawn[:, depth, rank]  # [B, N] q had a token left for the node's rank
        valid = []
        for i, parent in enumerate(tree.parents):  # a node exists if its parent does (parents come first)
            valid.append(own[:, i] if parent < 0 else own[:, i] & valid[parent])
        return Draft.tree(ids[:, depth, rank], parents, probs=laws[:, depth, rank], valid=jnp.stack(valid, 1)), last

    def describe(self):
        return {**super().describe(), "tree_nodes": self.tree.num_nodes}


def arch_from_checkpoint(target, config: dict) -> MedusaArch:
    return MedusaArch(target.cfg.hidden_size, target.cfg.vocab_size, int(config["num_heads"]),
                      int(config.get("num_layers", 1)), bool(config.get("shared_head", False)))


@register(NAME)
def make_medusa(target, num_draft_tokens: int, path: str = "", tree_paths: Sequence[Sequence[int]] | None = None):
    """A trained Medusa drafter (`path`: its training run or exported directory). With `tree_paths`
    (Medusa choices, e.g. [[0], [1], [0, 0]]) it drafts that static tree and the tree's node count is the
    draft size (num_draft_tokens is then ignored)."""
    info = load_trained(path, NAME, target, "medusa")
    arch = arch_from_checkpoint(target, info["config"])
    return MedusaDrafter.from_trained(arch, info["params"], target, num_draft_tokens, tree_paths)
