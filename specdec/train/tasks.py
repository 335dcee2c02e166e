"""The training side of a drafter: the `TrainTask` protocol, its registry, and the losses/metrics all share.

A trainable drafter (drafters/eagle3.py, drafters/medusa.py, drafters/distilled_lm.py, drafters/dflash.py,
drafters/dspark.py) registers a task factory

    @register_task("eagle3")
    def make_task(target, **options) -> TrainTask

The loop (`specdec.train.loop.train`) calls, with B examples of T tokens per batch (the `TrainTask` protocol):
    params, buffers = task.init(key, token_counts)     trainable pytree; saved non-trainable arrays (d2t maps)
    frozen = task.frozen(target)                        arrays taken from the target (embedding, lm_head, ...)
    loss, metrics = task.loss(params, consts, batch, feats, key)   consts = {**frozen, **buffers}
    loss, ev = task.evaluate(params, consts, batch, feats, k)      the loss and, per slot and draft step, the
                                                         teacher-forced acceptance (DraftEval), in one pass
    task.config()                                        JSON: everything needed to rebuild the drafter
and two optional hooks, whose defaults a task inherits by subclassing `TrainTask`: `training_keys` (config keys
a continued run may change) and `calibrate` (buffers fitted on held-out data after training).
`batch` = {"tokens" int32 [B, T], "loss_mask" int8 [B, T] (1 on response tokens), "lengths" int32 [B]};
`feats` = TargetFeatures(taps [n_taps, B, T, H] in `task.taps` order, logits [B, T, V] or None).

One indexing convention for every drafter ("root slot"): slot j is a root position, as in the engine, where
x_j is the last committed token; the drafter's k-th token (k = 0, 1, ...) predicts x_{j+k+1}, and the target
distribution it is compared with is the target's logits at position j+k. `evaluate` returns, per slot and
step, the acceptance probability at temperature 1, alpha = sum_v min(p_d(v), p_t(v)), and whether the draft's
argmax equals the target's. The teacher-forced expected tau of a slot is 1 + sum_k prod_{i<=k} alpha_i
(docs/METHODS.md); a slot counts when all k labels x_{j+1..j+k} are response tokens inside the example.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple, Protocol

import jax
import jax.numpy as jnp

_TASKS: dict[str, Callable] = {}


def register_task(name: str):
    def deco(factory):
        _TASKS[name] = factory
        return factory
    return deco


def available_tasks() -> list[str]:
    return sorted(_TASKS)


def task_options(name: str) -> list[str]:
    """The options (train.drafter_options) of the registered task `name` (import `drafters` first so drafter
    modules register)."""
    if name not in _TASKS:
        raise ValueError(f"drafter {name!r} has no training task; trainable drafters: "
                         f"{', '.join(available_tasks()) or '(none registered: import drafters first)'}")
    import inspect

    return [p for p in inspect.signature(_TASKS[name]).parameters if p != "target"]


def make_task(name: str, target, options: dict | None = None):
    """The registered task `name` for `target` (import `drafters` first so drafter modules register)."""
    accepted = task_options(name)
    options = dict(options or {})
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"train.drafter_options: drafter {name!r} got unknown option(s) {', '.join(unknown)}; "
                         f"its options are: {', '.join(accepted) or '(none)'}")
    return _TASKS[name](target, **options)


class DraftEval(NamedTuple):
    alpha: jax.Array  # float32 [B, T, K] acceptance probability of step k from root slot j (temperature 1)
    match: jax.Array  # bool [B, T, K] draft argmax == target argmax


class TrainTask(Protocol):
    """The training side of a drafter, as the loop uses it (the module docstring gives the shapes).

    The task objects are hashable (frozen dataclasses): they are part of the compiled steps' static key."""

    name: str  # the drafter name (`drafters.register`), written to drafter.json
    taps: tuple[int, ...]  # target layers whose residual stream `feats.taps` holds, in this order
    needs_target_logits: bool  # `loss` reads feats.logits (evaluation always gets them)
    max_eval_steps: int | None  # draft steps `evaluate` can score at most (None: any number)

    def config(self) -> dict:
        """JSON: everything needed to rebuild the drafter (drafter.json)."""
        ...

    def init(self, key: jax.Array, token_counts) -> tuple[Any, dict]:
        """(trainable params, buffers) of a fresh drafter; token_counts [V]: response-token frequencies."""
        ...

    def frozen(self, target) -> dict:
        """Arrays taken from the target, not trained (embedding, lm_head, ...)."""
        ...

    def loss(self, params, consts: dict, batch: dict, feats, key: jax.Array) -> tuple[jax.Array, dict]:
        """(scalar loss, metrics to average) of one batch; consts = {**frozen, **buffers}."""
        ...

    def evaluate(self, params, consts: dict, batch: dict, feats, num_steps: int) -> tuple[jax.Array, DraftEval]:
        """The loss and the teacher-forced acceptance of `num_steps` draft steps from every root slot."""
        ...

    # -- optional hooks: the defaults below are what a task that subclasses TrainTask and defines none gets --
    training_keys: tuple[str, ...] = ()  # config keys that shape training only: `train.init_from` may change them

    def grow(self, params: dict, source_config: dict) -> dict | None:
        """`train.init_from` a drafter of this kind whose config differs only by fewer layers (`num_layers`): its
        params (NumPy, the source's shapes) grown to this task's depth, computing what the source computed; None:
        this drafter cannot be grown (the differing config is then an error)."""
        return None

    def calibrate(self, params, consts: dict, batches_and_feats: Iterable[tuple[dict, Any]]) -> dict | None:
        """Buffers fitted after training on the held-out (batch, feats) pairs (DSpark: its confidence
        temperatures), merged into the saved ones; None: nothing to fit (the pairs are then never computed)."""
        return None


# ---------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------

def shift(x: jax.Array, k: int, fill=0) -> jax.Array:
    """x[:, j + k] at position j along axis 1 (`fill` past the end)."""
    if k == 0:
        return x
    pad = jnp.full((x.shape[0], k) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)[:, : x.shape[1]]


def shift_dynamic(x: jax.Array, k: jax.Array, max_k: int, fill=0) -> jax.Array:
    """`shift` for a traced k in [0, max_k] (inside a scan)."""
    pad = jnp.full((x.shape[0], max_k) + x.shape[2:], fill, x.dtype)
    return jax.lax.dynamic_slice_in_dim(jnp.concatenate([x, pad], axis=1), k, x.shape[1], axis=1)


def label_valid(batch: dict, k, min_slot: int = 0, max_k: int | None = None) -> jax.Array:
    """bool [B, T]: from root slot j, the k-th draft's label x_{j+k+1} is a response token inside the example
    (and j >= min_slot). `k` may be traced if `max_k` bounds it."""
    mask = batch["loss_mask"].astype(bool)
    t = mask.shape[1]
    pos = jnp.arange(t)[None, :]
    shifted = shift(mask, k + 1, False) if max_k is None else shift_dynamic(mask, k + 1, max_k + 1, False)
    ok = shifted & (pos + k + 1 < batch["lengths"][:, None])
    return ok & (pos >= min_slot)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def soft_cross_entropy(logits: jax.Array, target_probs: jax.Array) -> jax.Array:
    """-sum_v p_t(v) log softmax(logits)(v), per position."""
    return -jnp.sum(target_probs * jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


def kl_divergence(target_logits: jax.Array, logits: jax.Array) -> jax.Array:
    """KL(p_t || p_d) per position (forward KL: the distillation loss)."""
    lt = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    ld = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(lt) * (lt - ld), axis=-1)


def hard_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]


def acceptance(draft_logits: jax.Array, target_logits: jax.Array, d2t: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(alpha, argmax match) of draft vs target at temperature 1. draft_logits [..., Vd]; with `d2t` [Vd] the
    draft covers only those target ids (p_d is 0 elsewhere)."""
    pd = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1)
    pt = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    d_top = jnp.argmax(draft_logits, axis=-1)
    if d2t is not None:
        pt = jnp.take(pt, d2t, axis=-1)
        d_top = d2t[d_top]
    alpha = jnp.sum(jnp.minimum(pd, pt), axis=-1)
    return alpha, d_top == jnp.argmax(target_logits, axis=-1)


def reduced_vocab(counts, size: int, always=()):
    """The `size` most frequent target ids (ties: lower id first, which for a BPE vocabulary favours the earlier,
    more frequent merges), always including `always` (EOS), sorted: the d2t map of a reduced draft vocabulary
    (FR-Spec; docs/METHODS.md)."""
    import numpy as np

    counts = np.asarray(counts)
    order = np.lexsort((np.arange(len(counts)), -counts))
    keep = [int(i) for i in always if 0 <= i < len(counts)]
    keep += [int(i) for i in order if int(i) not in keep][: size - len(keep)]
    return np.sort(np.asarray(keep, np.int32))


def to_draft_ids(labels: jax.Array, d2t: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Target ids -> (draft ids, in the draft vocabulary) for a d2t map [Vd] (out-of-vocabulary ids map to 0)."""
    t2d = jnp.full((vocab_size,), -1, jnp.int32).at[d2t].set(jnp.arange(d2t.shape[0], dtype=jnp.int32))
    ids = t2d[labels]
    return jnp.maximum(ids, 0), ids >= 0


def slot_valid(batch: dict, num_steps: int, min_slot: int = 1) -> jax.Array:
    """bool [B, T]: all `num_steps` labels of root slot j are valid (the slots the eval averages over)."""
    ok = label_valid(batch, num_steps - 1, min_slot)  # the last label valid => the earlier ones are inside too
    for k in range(num_steps - 1):
        ok = ok & label_valid(batch, k, min_slot)
    return ok


def expected_tau_sums(ev: DraftEval, valid: jax.Array) -> dict[str, jax.Array]:
    """Sums over valid slots (the loop divides by `slots`): expected tau (temperature 1), greedy tau (the
    accepted length if drafting and verification were both argmax), and per step the conditional acceptance
    (alpha) and the argmax agreement (`match`: at step 0, the first draft's greedy acceptance)."""
    v = valid.astype(jnp.float32)
    surv = jnp.cumprod(ev.alpha, axis=-1)  # prod_{i<=k} alpha_i
    match = ev.match.astype(jnp.float32)
    greedy = jnp.cumprod(match, axis=-1)
    return {"slots": jnp.sum(v), "tau": jnp.sum((1.0 + jnp.sum(surv, -1)) * v),
            "greedy_tau": jnp.sum((1.0 + jnp.sum(greedy, -1)) * v),
            "alpha": jnp.sum(ev.alpha * v[..., None], axis=(0, 1)),
            "match": jnp.sum(match * v[..., None], axis=(0, 1))}


def tree_size(tree: Any) -> int:
    return int(sum(x.size for x in jax.tree.leaves(tree)))
