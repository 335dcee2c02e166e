"""DSpark: the DFlash block drafter (drafters/dflash.py) plus a cheap sequential "Markov" head and a confidence
head, so drafts are sampled position by position with exact draft probabilities and every draft position comes
with an estimate of how likely the target is to accept it (used by `specdec.scheduling` to decide, per request
and under load, how many draft tokens to verify).

Heads on top of the backbone's normed hidden h_j of draft j (draft j predicts x_{a+j+1}; x_a is the anchor; draft
j is block slot j, or slot j + 1 in the peer `block_layout`, dflash.py):
    e_j     = W1[x_{a+j}]                               the previous token's rank-r embedding (x_a: the anchor)
    logits_j = U_j + W2 e_j                             U_j = lm_head(h_j), the DFlash logits; W2 [r, V]
    c_j     = sigmoid((w . [h_j ; e_j] + b) / tau_j)    confidence; tau_j from calibration (1 before it)
At inference x_{a+j} for j >= 1 is the DRAFTED token, so the slots are sampled left to right (a lax.scan over
the block): each q_j is exactly the distribution x_{a+j+1} was drawn from, and rejection sampling applies.
With W2 = 0 the logits are U_j exactly: DSpark equals DFlash (tests/test_dspark.py checks it token for token).
c_j depends on x_{a+j}, never on the token it scores, and the prefix survival a_j = prod_{i<=j} c_i is what
the schedulers read (`draft_confidence`).

Training (teacher-forced: e_j from the true previous token): per slot
    0.1 CE(logits_j, x_{a+j+1}) + 0.9 ||p_d - p_t||_1 + 1.0 BCE(c_j, 1 - 0.5 ||p_d - p_t||_1 detached),
p_t the target's distribution at position a+j (temperature 1), with DFlash's anchors, masks and exp(-j/4) slot
weights. `calibrate` then fits one temperature per slot on held-out data, left to right, each minimising the
expected calibration error of the prefix survival a_j against the teacher-forced prod_{i<=j} alpha_i
(alpha = sum min(p_d, p_t)) with the earlier slots' temperatures fixed (sequential temperature scaling).
Acceptance means different things at different sampling temperatures, so it fits two sets: `conf_temperature`
against alpha (sampled verification at temperature 1) and `conf_temperature_greedy` against the argmax
agreement of draft and target (greedy verification: accepted iff the argmaxes agree). Drafting picks the set of
the temperature in use: greedy at T = 0, the T = 1 fit at any T > 0 (the nearest calibrated case; acceptance at
other temperatures is not fitted).
With a reduced draft vocabulary (`draft_vocab_size`, see dflash.py) U_j and W2 keep only the d2t columns, p_d is
0 elsewhere, so the L1 term counts the target mass outside the draft vocabulary too and 1 - 0.5 L1 is still
exactly the expected acceptance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from drafters import dflash, register
from drafters.dflash import BlockArch, DFlashDrafter, DFlashTask
from specdec.drafter import draft_probs_to_target, draft_to_target
from specdec.export.registry import register_architecture
from specdec.sampling import sample_with_probs
from specdec.train import tasks as T
from specdec.train.checkpoint import load_trained, register_draft_vocab_axes

NAME = "dspark"
TEMPERATURE_GRID = np.exp(np.linspace(np.log(0.1), np.log(10.0), 61))


def init_heads(arch: BlockArch, key) -> dict:
    c = arch.cfg
    rng = dflash.numpy_rng(key)
    # W1 is a unit-scale embedding table and W2 starts at 0: training starts exactly at DFlash, and W2's first
    # gradients are not scaled down by a small W1 (the bilinear product would otherwise be slow to leave 0).
    return {"markov": {"w1": jnp.asarray(rng.standard_normal((c.vocab_size, arch.markov_rank)), jnp.float32),
                       "w2": jnp.zeros((arch.markov_rank, c.vocab_size), jnp.float32)},
            "conf": {"w": jnp.asarray(0.02 * rng.standard_normal(c.hidden_size + arch.markov_rank), jnp.float32),
                     "b": jnp.zeros((), jnp.float32)}}


def markov_bias(heads: dict, prev: jax.Array, d2t: jax.Array | None = None):
    """(B_j = W2 W1[prev] [..., V] (W2's columns d2t only, when given: [..., Vd]), e = W1[prev] [..., r]).
    `prev` is a target id: W1 covers the whole vocabulary, whatever the draft vocabulary."""
    e = heads["markov"]["w1"][prev]
    w2 = heads["markov"]["w2"] if d2t is None else jnp.take(heads["markov"]["w2"], d2t, axis=1)
    return jnp.einsum("...r,rv->...v", e, w2, preferred_element_type=jnp.float32), e


def confidence_logit(heads: dict, hidden: jax.Array, e: jax.Array) -> jax.Array:
    return jnp.concatenate([hidden, e], axis=-1) @ heads["conf"]["w"] + heads["conf"]["b"]


def ece(pred: np.ndarray, label: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error with soft labels: sum over equal-width bins of |mean pred - mean label| * share."""
    idx = np.minimum((pred * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total += abs(pred[sel].mean() - label[sel].mean()) * sel.mean()
    return float(total)


def sequential_temperatures(z: np.ndarray, alpha: np.ndarray, grid=TEMPERATURE_GRID) -> np.ndarray:
    """z, alpha [M, G] confidence logits and teacher-forced acceptance of M valid blocks -> temperatures [G]:
    slot by slot, the grid value minimising the ECE of a_j = a_{j-1} sigmoid(z_j / tau) against
    prod_{i<=j} alpha_i, with the earlier slots' temperatures fixed."""
    m, g = z.shape
    temps = np.ones(g)
    survive = np.ones(m)
    label = np.cumprod(alpha, axis=1)
    for j in range(g):
        scores = [ece(survive / (1 + np.exp(-z[:, j] / t)), label[:, j]) for t in grid]
        temps[j] = grid[int(np.argmin(scores))]
        survive = survive / (1 + np.exp(-z[:, j] / temps[j]))
    return temps


def confidence_temperatures(params: dict, sampling, drafts: int) -> jax.Array:
    """The per-slot confidence temperatures calibrated for `sampling`: the greedy fit at temperature 0, the
    temperature-1 fit otherwise (a checkpoint calibrated before the greedy fit existed: its one fit; none: 1)."""
    sampled = params.get("conf_temperature", jnp.ones((drafts,), jnp.float32))
    return params.get("conf_temperature_greedy", sampled) if sampling.greedy else sampled


@dataclasses.dataclass(frozen=True)
class DSparkTask(DFlashTask):
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    bce_weight: float = 1.0
    calibration_anchors: int = 64

    name = NAME
    needs_target_logits = True
    # may change in a continued run (train.init_from)
    training_keys = DFlashTask.training_keys + ("ce_weight", "l1_weight", "bce_weight")

    def config(self) -> dict:
        return {**super().config(), "markov_rank": self.arch.markov_rank, "ce_weight": self.ce_weight,
                "l1_weight": self.l1_weight, "bce_weight": self.bce_weight}

    def init(self, key, token_counts: np.ndarray):
        k_backbone, k_heads = jax.random.split(key)
        params, buffers = super().init(k_backbone, token_counts)
        buffers["conf_temperature"] = jnp.ones((self.arch.drafts,), jnp.float32)
        buffers["conf_temperature_greedy"] = jnp.ones((self.arch.drafts,), jnp.float32)
        return {**params, **init_heads(self.arch, k_heads)}, buffers

    def slot_logits(self, params, consts, hidden, prev):
        bias, _ = markov_bias(params, prev, consts.get("d2t"))
        return super().slot_logits(params, consts, hidden, prev) + bias

    def slot_loss(self, params, consts, hidden, prev, labels, target_logits):
        d2t = consts.get("d2t")
        bias, e = markov_bias(params, prev, d2t)
        logits = super().slot_logits(params, consts, hidden, prev) + bias
        pd = jax.nn.softmax(logits, axis=-1)
        pt = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
        ce, hit = self.label_ce(consts, logits, labels)
        if d2t is None:
            l1 = jnp.sum(jnp.abs(pd - pt), axis=-1)
        else:  # p_d is 0 off the draft vocabulary: there |p_d - p_t| is the target mass it leaves out
            pt_in = jnp.take(pt, d2t, axis=-1)
            l1 = jnp.sum(jnp.abs(pd - pt_in), axis=-1) + (1.0 - jnp.sum(pt_in, axis=-1))
        y = jax.lax.stop_gradient(1.0 - 0.5 * l1)  # = sum min(p_d, p_t), the expected acceptance
        z = confidence_logit(params, hidden, e)
        bce = jax.nn.softplus(z) - y * z  # binary cross-entropy with a soft label, from the logit
        loss = self.ce_weight * ce + self.l1_weight * l1 + self.bce_weight * bce
        return loss, {"ce": ce, "l1": l1, "bce": bce, "conf": jax.nn.sigmoid(z), "expected_accept": y,
                      "acc": hit.astype(jnp.float32)}

    def calibration_stats(self, params, consts, batch, feats):
        """Confidence logits z, teacher-forced alpha (temperature-1 acceptance), argmax agreement (greedy
        acceptance) and validity [B, N, G] at a fixed set of anchors."""
        anchors, anchor_ok = dflash.sample_anchors(batch, self.calibration_anchors, jax.random.PRNGKey(0))
        _, ok = dflash.block_labels(batch, anchors, anchor_ok, self.arch.drafts)
        hidden, prev = self.forward(params, consts, batch["tokens"], feats.taps, anchors)
        bias, e = markov_bias(params, prev, consts.get("d2t"))
        logits = super().slot_logits(params, consts, hidden, prev) + bias
        alpha, match = T.acceptance(logits, self._target_at(feats, anchors), consts.get("d2t"))
        return confidence_logit(params, hidden, e), alpha, match.astype(jnp.float32), ok

    def calibrate(self, params, consts, batches_and_feats) -> dict:
        """Buffers with the fitted per-slot temperatures for sampled (`conf_temperature`) and greedy
        (`conf_temperature_greedy`) verification, from held-out (batch, feats) pairs."""
        stats = jax.jit(self.calibration_stats)
        zs, alphas, matches = [], [], []
        for batch, feats in batches_and_feats:
            z, alpha, match, ok = jax.device_get(stats(params, consts, batch, feats))
            full = np.asarray(ok).all(axis=-1)  # blocks whose every label is a response token
            zs.append(np.asarray(z)[full])
            alphas.append(np.asarray(alpha)[full])
            matches.append(np.asarray(match)[full])
        z, alpha, match = np.concatenate(zs), np.concatenate(alphas), np.concatenate(matches)
        if len(z) == 0:
            ones = jnp.ones((self.arch.drafts,), jnp.float32)
            return {"conf_temperature": ones, "conf_temperature_greedy": ones}
        return {"conf_temperature": jnp.asarray(sequential_temperatures(z, alpha), jnp.float32),
                "conf_temperature_greedy": jnp.asarray(sequential_temperatures(z, match), jnp.float32)}


@T.register_task(NAME)
def make_task(target, num_layers: int = 2, taps: list | None = None, block_size: int = 7,
              mask_token_id: int = -1, intermediate_size: int | None = None, num_anchors: int = 16,
              position_decay: float = 4.0, markov_rank: int = 64, ce_weight: float = 0.1, l1_weight: float = 0.9,
              bce_weight: float = 1.0, draft_vocab_size: int = 0, block_layout: str = "specdec",
              qk_norm: bool | None = None) -> DSparkTask:
    """`block_layout: peer` and `qk_norm: true` train the drafter vLLM / SGLang can run (docs/EXPORT.md)."""
    if markov_rank < 1:
        raise ValueError(f"dspark: markov_rank must be >= 1 (use dflash for no Markov head), got {markov_rank}")
    if num_anchors < 1 or position_decay <= 0:
        raise ValueError(f"dspark: num_anchors must be >= 1 and position_decay > 0, got {num_anchors}, "
                         f"{position_decay}")
    arch = dflash.build_arch(target, num_layers, taps, block_size, mask_token_id, intermediate_size, markov_rank,
                             draft_vocab_size, block_layout, qk_norm)
    return DSparkTask(arch=arch, num_anchors=int(num_anchors), position_decay=float(position_decay),
                      ce_weight=float(ce_weight), l1_weight=float(l1_weight), bce_weight=float(bce_weight),
                      target=target)


class DSparkDrafter(DFlashDrafter):
    """DFlash's block forward, then the slots sampled left to right through the Markov head."""

    def __init__(self, arch: BlockArch, params, num_draft_tokens: int, name: str = NAME, tree_top_k: int = 0,
                 tree_depth: int = 0, tree_accept: float = dflash.TREE_ACCEPT,
                 tree_sampling: str = dflash.TREE_SAMPLING):
        if arch.markov_rank < 1:
            raise ValueError("dspark needs a Markov head (markov_rank >= 1)")
        super().__init__(arch, params, num_draft_tokens, name=name, tree_top_k=tree_top_k, tree_depth=tree_depth,
                         tree_accept=tree_accept, tree_sampling=tree_sampling)

    # W2's columns are target ids, of which drafting reads the draft vocabulary's (cut once, at load); W1's rows
    # are the previous token's id, and the root before each block can be any target token: W1 is read whole
    draft_vocab_axes = {"markov/w2": 1}

    def next_logits(self, params, u, prev):
        return u + markov_bias(params["params"], prev)[0]  # W2 cut to the draft vocabulary at load

    def draw(self, params, hidden, root, sampling, key):
        k = self.num_draft_tokens
        d2t, vocab = params.get("d2t"), self.arch.cfg.vocab_size
        heads = params["params"]
        u = self.head_logits(params, hidden)[:, :k]  # [B, k, Vd]
        temps = confidence_temperatures(params, sampling, self.arch.drafts)[:k]

        def step(prev, inp):  # slot j: the token at offset j, drawn with the target's noise there from its q
            u_j, h_j, j, temp_j = inp
            bias, e = markov_bias(heads, prev)  # W2 cut to the draft vocabulary at load (`from_trained`)
            ids, q = sample_with_probs(key, u_j + bias, sampling, j, ids=d2t)
            tok = draft_to_target(ids, d2t)
            q = jnp.zeros((), jnp.float32) if q is None else draft_probs_to_target(q, d2t, vocab)
            c = jax.nn.sigmoid(confidence_logit(heads, h_j, e) / temp_j)
            return tok, (tok, q, c)

        xs = (jnp.swapaxes(u, 0, 1), jnp.swapaxes(hidden[:, :k], 0, 1), jnp.arange(k, dtype=jnp.int32), temps)
        _, (tokens, probs, conf) = jax.lax.scan(step, root, xs)
        probs = None if sampling.greedy else jnp.swapaxes(probs, 0, 1)
        return jnp.swapaxes(tokens, 0, 1), probs, jnp.cumprod(jnp.swapaxes(conf, 0, 1), axis=-1)


# a DFlash BlockArch (its Markov rank from the config): what `specdec export` rebuilds the drafter with
register_architecture(NAME)(dflash.arch_from_checkpoint)
register_draft_vocab_axes(NAME, DSparkDrafter.draft_vocab_axes)  # what the inference format cuts


@register(NAME)
def make_dspark(target, num_draft_tokens: int, path: str = "", tree_top_k: int = 0, tree_depth: int = 0,
                tree_accept: float = dflash.TREE_ACCEPT, tree_sampling: str = dflash.TREE_SAMPLING):
    """A trained DSpark drafter: `path` = its training run directory (or an exported drafter directory).
    `tree_top_k` / `tree_depth` > 0: draft a token tree of `num_draft_tokens` nodes, the Markov head
    conditioning each node's children on its token (`DFlashDrafter.propose_tree` at temperature 0; above it
    sampled, `DFlashDrafter.sample_tree`, unless `tree_accept` is 0; `tree_sampling: dynamic`:
    `DFlashDrafter.sampled_children`)."""
    info = load_trained(path, NAME, target, "dspark")
    arch = dflash.arch_from_checkpoint(target, info["config"])
    return DSparkDrafter.from_trained(arch, info["params"], info["buffers"], target, num_draft_tokens,
                                      tree_top_k, tree_depth, tree_accept, tree_sampling,
                                      cut=tuple(info["draft_vocab_cut"]))
