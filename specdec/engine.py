"""The speculative decoding loop.

One round, for every row of the batch at once:
  1. the drafter proposes N draft nodes (a chain or a tree) after the root, the last committed token;
  2. the target runs [root, nodes] in ONE step (tree ancestor mask, positions = cache length + depth);
  3. the verification policy accepts a path and adds a correction/bonus token;
  4. for trees, the cache is compacted so only the accepted path's K/V stay;
  5. accepted tokens are committed, stopping exactly at EOS and at max_new_tokens; the drafter updates.

A round whose draft the scheduler skips is a plain decode step: no drafter code runs. The loop records such
rounds (and the target's taps at their roots), and the drafter catches up on all of them in one batched
`update` before it drafts again (`Drafter.update`), so any drafter may be skipped for any number of rounds.

Drafters written in pure JAX run the whole generation as one compiled `lax.while_loop` (no host round trip
per round); others run a host-stepped loop around the same jitted verify step. Rows carry their own lengths:
acceptance is ragged, finished rows stop advancing (their lanes still compute: static shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec import trees
from specdec.costs import PROFILE_ROUNDS, ForcedWidths, forced, profile_rounds
from specdec.drafter import CATCH_UP, Draft, Drafter, PromptInfo, RoundContext, VerifyResult
from specdec.generate import (CAPACITY_BUCKET, NO_EOS, cache_capacity, check_fits, context_limit, pad_prompts,
                              prefill_distinct, row_limits)
from specdec.metrics import DecodeMetrics
from specdec.models import transformer
from specdec.models.transformer import KVCache
from specdec.sampling import GREEDY, SampleKey, SamplingParams, as_sample_key, sample, sample_key
from specdec.scheduler import FixedWidth, Scheduler
from specdec.sharding import to_host
from specdec.target import Target
from specdec.verify import Policy, get_policy
from specdec.verify.base import commit as commit_result


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopState:
    cache: KVCache
    seq: jax.Array  # int32 [B, C] committed tokens (prompt + generated)
    seq_len: jax.Array  # int32 [B]
    num_new: jax.Array  # int32 [B] generated tokens so far
    done: jax.Array  # bool [B]
    limit: jax.Array  # int32 [B] max new tokens per row (traced, so a 1-token warm-up compiles the same loop)
    drafter_state: Any
    # plain rounds run since the drafter's last update (int32 []), and the target's taps at their roots
    # ([n_taps, B, CATCH_UP, H]; None for a drafter without taps): what its next update catches up on
    pending: jax.Array
    pending_taps: Any
    key: SampleKey  # the run's seed and row ids; a round draws at its rows' positions (`round_key`)
    # metric counters
    rounds: jax.Array  # int32 [B] rounds in which the row was active
    accepted: jax.Array  # int32 [B] accepted draft tokens that were committed (see verify_and_commit)
    proposed: jax.Array  # int32 [B] valid draft tokens proposed
    position_proposed: jax.Array  # int32 [N] row-rounds with a valid draft node at position/depth j+1
    position_accepted: jax.Array  # int32 [N] row-rounds that accepted (and committed) position/depth j+1
    # int32 [N] row-rounds whose verdict on position j was observed: a candidate at depth j+1 below the
    # accepted path, and positions < j accepted (the denominator of P(j accepted | j proposed, j-1 accepted))
    position_eligible: jax.Array
    round_committed: jax.Array  # int32 [B, C] tokens committed in each of the row's rounds (its accept lengths)
    sched: Any = ()  # the scheduler's state (`Scheduler.init_state`)
    # int32 []: the loop returns once this many rows are done, so their rows can be refilled (`generate_refilled`);
    # None: once every row is
    stop_at: Any = None


def running(state: LoopState) -> jax.Array:
    """Whether the loop goes on: a row is still active and (refilling) fewer than `stop_at` rows are done."""
    go = ~jnp.all(state.done)
    return go if state.stop_at is None else go & (jnp.sum(state.done) < state.stop_at)


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Static settings of one compiled loop (hashable)."""

    cfg: Any
    forward: Any
    drafter: Drafter
    policy: Policy
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    scheduler: Scheduler = FixedWidth()  # how many draft nodes each round verifies (specdec/scheduler.py)
    # Draft-node counts the verify step may run, ascending and ending at N (`scheduler.bucket_widths`); () = always all N.
    verify_widths: tuple[int, ...] = ()


def write_tokens(seq: jax.Array, new: jax.Array, at: jax.Array) -> jax.Array:
    """Write new [B, W] into seq [B, C] at each row's own offset."""
    return jax.vmap(lambda s, n, i: jax.lax.dynamic_update_slice(s, n, (i,)))(seq, new.astype(seq.dtype), at)


def _context(state: LoopState) -> RoundContext:
    return RoundContext(seq=state.seq, seq_len=state.seq_len, done=state.done, cache=state.cache)


def round_key(state: LoopState) -> SampleKey:
    """The randomness of a round, keyed by position, never by the round: offset 0 is the position after the root
    (the first draft node, the target's token at the root), so a node at depth d draws at offset d - 1 and AR's
    token at a position is the target's sample there whatever the rounds around it were."""
    return state.key.at(state.seq_len)


def propose(spec: LoopSpec, dparams, state: LoopState, planned=None):
    """Step 1: the scheduler plans a verify width, the drafter drafts (or, where the scheduler may skip and the
    plan is width 0, does not), and the scheduler cuts the draft to the nodes to verify. `planned`: the plan for
    this state, when the host-stepped loop has already made it (`loop_status`)."""
    sub = round_key(state)
    drafter, scheduler = spec.drafter, spec.scheduler

    def run():
        return drafter.propose(dparams, state.drafter_state, _context(state), spec.sampling, sub)

    may_skip = scheduler.may_skip
    if not drafter.jittable:  # host-stepped loop: decide on the host, call the drafter only when it drafts
        planned = np.int32(int(_jit_plan(spec, state)) if planned is None else planned)
        drafted = not may_skip or spec.verify_widths[planned] > 0
        if drafted:
            draft, dstate = run()
        else:  # nothing proposed (a deterministic-looking empty draft: its probs are never read)
            batch = state.seq.shape[0]
            draft = Draft.chain(jnp.zeros((batch, drafter.num_draft_tokens), jnp.int32),
                                valid=jnp.zeros((batch, drafter.num_draft_tokens), bool))
            dstate = state.drafter_state
        state = dataclasses.replace(state, drafter_state=dstate)
        draft, sched = _jit_refine(spec, state, draft, planned, jnp.asarray(drafted))
        return draft, dataclasses.replace(state, sched=sched)
    planned = scheduler.plan(spec, state)
    if may_skip:
        shapes = jax.eval_shape(run)
        drafted = jnp.asarray(spec.verify_widths)[planned] > 0
        # the skip branch keeps the drafter's state (cast to the dtypes `propose` returns, as cond requires)
        kept = jax.tree.map(lambda s, x: jnp.asarray(x, s.dtype), shapes[1], state.drafter_state)
        draft, dstate = jax.lax.cond(drafted, run, lambda: (empty_draft(shapes[0]), kept))
    else:
        drafted = jnp.asarray(True)
        draft, dstate = run()
    state = dataclasses.replace(state, drafter_state=dstate)
    draft, sched = scheduler.refine(spec, state, draft, planned, drafted)
    return draft, dataclasses.replace(state, sched=sched)


def empty_draft(like: Draft) -> Draft:
    """A draft of `like`'s shapes that proposes nothing (a skipped draft): all nodes invalid."""
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
    n = like.tokens.shape[1]
    parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, like.tokens.shape)
    return dataclasses.replace(zeros, parents=parents, valid=jnp.zeros(like.tokens.shape, bool))


_jit_plan = jax.jit(lambda spec, state: spec.scheduler.plan(spec, state), static_argnames=("spec",))


@functools.partial(jax.jit, static_argnames=("spec",))
def loop_status(spec: LoopSpec, state: LoopState) -> tuple[jax.Array, jax.Array]:
    """(every row done, the scheduler's plan): what the host-stepped loop reads before each round, in one call and
    one transfer."""
    return jnp.all(state.done), spec.scheduler.plan(spec, state)


# The host-stepped loop refines outside a compiled loop; the jitted call returns only the draft and the
# scheduler's state, since one that returned the whole LoopState would copy the KV cache (~15 ms a round at batch 8).
_jit_refine = jax.jit(lambda spec, state, draft, planned, drafted: spec.scheduler.refine(
    spec, state, draft, planned, drafted), static_argnames=("spec",))


def target_verify(spec: LoopSpec, tparams, cache: KVCache, tokens, positions, mask, need, width: int | None = None,
                  judge=None):
    """The target's verify forward over [root, nodes]. With `spec.verify_widths`, only the first
    1 + W tokens run, W the smallest width >= `need` (the last valid node of any active row), chosen inside the
    compiled program by `lax.switch`; logits, taps and new K/V are zero-padded back to N + 1 positions (with a
    static `width` they keep their 1 + W positions).
    Nothing past W is valid, so no policy accepts (or samples a bonus from) the padding, and the padded K/V rows
    land past every row's committed length (the capacity has room for N + 1). A static `width` runs that
    narrow step directly.

    `judge(logits, nodes) -> VerifyResult` (optional) verifies inside each branch, on the logits [B, 1 + W, V]
    of the positions the branch computed (nodes = W), and returns (StepOutput without logits, the result padded
    to N nodes). The policy then never reads the padding: at batch 8 an argmax over the N + 1 = 7 padded
    positions cost a width-0 round ~14 ms more than a plain step.

    The cache stays out of the switch: a branch that wrote it would make XLA copy every layer's cache in and
    out of the conditional (300 cache-sized copies per round on SmolLM2). So the branches only read the cache
    (`forward(..., write_cache=False)`) and the new K/V rows are written once, after the switch. A backend
    whose step cannot defer its writes (the megakernel) runs the switch with the cache inside."""
    full = tokens.shape[1]
    if not spec.verify_widths:
        out = spec.forward(tparams, spec.cfg, cache, tokens, positions, mask, taps=spec.drafter.taps)
        return out if judge is None else (out._replace(logits=None), judge(out.logits, full - 1))
    deferred = width is None and getattr(spec.forward, "defers_cache_writes", False)

    def pad(x, axis):
        return None if x is None else jnp.pad(x, [(0, full - x.shape[axis]) if a == axis else (0, 0)
                                                  for a in range(x.ndim)])

    def branch(width, same_shapes=True):
        t = width + 1

        def run(cache):
            out = spec.forward(tparams, spec.cfg, cache, tokens[:, :t], positions[:, :t], mask[:, :t, :t],
                               taps=spec.drafter.taps, **({"write_cache": False} if deferred else {}))
            result = None
            if judge is not None:
                result = judge(out.logits, width).padded(full - 1)
                out = out._replace(logits=None)
            if same_shapes:  # the switch's branches must agree; a static width keeps its own 1 + W positions
                # (at batch 8 padding the logits to N + 1 positions wrote 11 MB of zeros per plain round)
                out = out._replace(logits=pad(out.logits, 1), hidden=pad(out.hidden, 1), taps=pad(out.taps, 2))
            if deferred:  # new K/V [(L,) B, t, KVH, HD] -> N + 1 rows; the cache itself is not returned
                out = out._replace(cache=None, new_kv=jax.tree.map(lambda x: pad(x, x.ndim - 3), out.new_kv))
            return out if judge is None else (out, result)
        return run

    if width is not None:
        return branch(width, same_shapes=False)(cache)
    index = jnp.searchsorted(jnp.asarray(spec.verify_widths, jnp.int32), need.astype(jnp.int32))
    out = jax.lax.switch(index, [branch(w) for w in spec.verify_widths], cache)
    step = out if judge is None else out[0]
    if deferred:
        step = step._replace(cache=transformer.write_new_rows(cache, step.new_kv), new_kv=None)
    return step if judge is None else (step, out[1])


def verify_step(spec: LoopSpec, tparams, state: LoopState, draft: Draft, width: int | None = None, judge=None):
    """Step 2: the target over [root, nodes] (tree mask, positions = cache length + depth), as narrow as the
    active rows' valid nodes allow. Returns (the target's StepOutput, depth [B, N+1]); with `judge` (see
    `target_verify`), ((StepOutput without logits, VerifyResult), depth)."""
    batch, num_nodes = draft.tokens.shape
    root = state.seq[jnp.arange(batch), state.seq_len - 1]
    tokens = jnp.concatenate([root[:, None], draft.tokens.astype(jnp.int32)], axis=1)
    mask, depth = trees.tree_attention(draft.parents, draft.valid)
    positions = state.cache.lengths[:, None] + depth
    node_index = jnp.arange(1, num_nodes + 1)[None, :]
    need = jnp.max(jnp.where(draft.valid & ~state.done[:, None], node_index, 0))
    return target_verify(spec, tparams, state.cache, tokens, positions, mask, need, width, judge), depth


def verify_and_commit(spec: LoopSpec, tparams, state: LoopState, draft: Draft, width: int | None = None):
    """Steps 2-5 minus the drafter update. Returns (state, VerifyResult, target taps). A static `width` runs
    that verify width without the bucket switch (the draft must have no valid node past it)."""
    batch, num_nodes = draft.tokens.shape
    sub = round_key(state)

    def judge(logits, nodes: int):
        """Step 3 on the logits of the root and the draft's first `nodes` nodes (no valid node lies past them)."""
        if nodes == 0:  # nothing to verify: the target's token is drawn from p at the root, as every policy does
            token = sample(sub, logits[:, 0], spec.sampling)
            none = jnp.zeros((batch,), jnp.int32)
            return commit_result(draft.tokens[:, :0], jnp.zeros((batch, 0), jnp.int32), none, token)
        return spec.policy.verify(draft.prefix(nodes), logits, spec.sampling, sub)

    (out, result), depth = verify_step(spec, tparams, state, draft, width, judge)
    cache = out.cache
    if spec.drafter.kind == "tree" and width != 0:
        cache = trees.compact_cache(cache, result.path, result.num_accepted)

    # Commit: accepted tokens + correction/bonus, cut after the first EOS and at max_new_tokens.
    commit = result.num_accepted + 1
    slot = jnp.arange(num_nodes + 1)[None, :]
    eos = jnp.asarray(spec.eos_ids or (NO_EOS,), jnp.int32)
    is_eos = jnp.isin(result.tokens, eos) & (slot < commit[:, None])
    hit_eos = jnp.any(is_eos, axis=1)
    commit = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, commit)
    commit = jnp.minimum(commit, state.limit - state.num_new)
    active = ~state.done
    commit = jnp.where(active, commit, 0)
    seq = write_tokens(state.seq, jnp.where(slot < commit[:, None], result.tokens, 0), state.seq_len)
    seq_len = state.seq_len + commit
    num_new = state.num_new + commit
    done = state.done | (active & hit_eos) | (num_new >= state.limit)
    # The new root (last committed token) is not in the target cache yet.
    cache = cache.with_lengths(jnp.where(active, seq_len - 1, state.cache.lengths))

    # Counters from what was COMMITTED. A round commits c = commit tokens; the last of them counts as the
    # round's target token and the c - 1 before it as accepted drafts. Without a cut c = a + 1 (a =
    # num_accepted) and the last token is the correction/bonus; when EOS or max_new_tokens cut inside the
    # accepted drafts (c <= a) the last committed token is a draft the target accepted there, and the c - 1
    # before it are the accepted drafts counted. So every active round adds exactly accepted + 1 tokens:
    # accepted + rounds + one prefill token per row == new tokens.
    a = result.num_accepted
    kept = jnp.where(active, jnp.minimum(a, commit - 1), 0)  # accepted drafts committed (and counted)
    node_depth = depth[:, 1:]
    levels = jnp.arange(1, num_nodes + 1)[None, :, None]
    has_level = trees.levels_present(draft.valid, depth)  # [B, N]
    state = dataclasses.replace(state, sched=spec.scheduler.observe(spec, state, draft, depth, result, active))
    took_level = slot[:, :num_nodes] < kept[:, None]
    # Position j's verdict is observed when positions < j were kept and j was either kept or rejected (j == a,
    # no cut), with a candidate at depth j+1 below the accepted node at depth j (the root for j = 0).
    parent_on_path = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), result.path[:, :-1]], axis=1)
    below_path = jnp.any(draft.valid[:, None, :] & (node_depth[:, None, :] == levels)
                         & (draft.parents[:, None, :] == parent_on_path[:, :, None]), axis=2)  # [B, N]
    j = slot[:, :num_nodes]
    observed = (j < kept[:, None]) | ((j == kept[:, None]) & (commit > a)[:, None])
    act = active[:, None].astype(jnp.int32)
    rows = jnp.arange(batch)
    state = dataclasses.replace(
        state, cache=cache, seq=seq, seq_len=seq_len, num_new=num_new, done=done,
        rounds=state.rounds + active.astype(jnp.int32),
        accepted=state.accepted + kept,
        proposed=state.proposed + jnp.where(active, jnp.sum(draft.valid, axis=1), 0).astype(jnp.int32),
        position_proposed=state.position_proposed + jnp.sum(has_level * act, axis=0),
        position_accepted=state.position_accepted + jnp.sum(took_level * act, axis=0),
        position_eligible=state.position_eligible + jnp.sum((below_path & observed) * act, axis=0),
        round_committed=state.round_committed.at[rows, state.rounds].set(
            jnp.where(active, commit, state.round_committed[rows, state.rounds])),
    )
    return state, result, out.taps


def update(spec: LoopSpec, dparams, state: LoopState, result: VerifyResult, taps):
    dstate = spec.drafter.update(dparams, state.drafter_state, _context(state), result, taps)
    return dataclasses.replace(state, drafter_state=dstate)


def plain_round(spec: LoopSpec, tparams, state: LoopState, shapes) -> LoopState:
    """A round at verify width 0 whose draft is skipped, run as a plain decode step: the same commit as any
    round (the policy samples the target's token from p at the root), but no draft, no bucket switch and no
    drafter code: the round is recorded (`record_plain_round`) for the drafter's next update. `shapes`: the
    drafter's draft, as `jax.eval_shape` of its propose gives it."""
    state = dataclasses.replace(state, sched=spec.scheduler.skipped(spec, state))
    state, _, taps = verify_and_commit(spec, tparams, state, empty_draft(shapes), width=0)
    return record_plain_round(state, taps)


def record_plain_round(state: LoopState, taps) -> LoopState:
    """Count a plain round for the drafter's next update, and keep the target's taps at its root (taps
    [n_taps, B, 1, H]) in the slot of its order in the run."""
    kept = state.pending_taps
    if kept is not None:
        kept = jax.lax.dynamic_update_index_in_dim(kept, taps[:, :, 0].astype(kept.dtype), state.pending, axis=2)
    return dataclasses.replace(state, pending=state.pending + 1, pending_taps=kept)


def plain_run_result(state: LoopState) -> VerifyResult:
    """The run of M = `state.pending` plain rounds as the VerifyResult of one chain round (`Drafter.update`): M - 1
    accepted drafts (path 0 .. M - 2) and a bonus, their tokens the M committed last. Rows that finished during
    the run committed fewer; their drafter state is never read again."""
    m = state.pending
    batch = state.seq.shape[0]
    slot = jnp.arange(CATCH_UP, dtype=jnp.int32)
    at = jnp.clip((state.seq_len - m)[:, None] + slot[None, :], 0, state.seq.shape[1] - 1)
    tokens = jnp.where(slot < m, jnp.take_along_axis(state.seq, at, axis=1), -1)
    path = jnp.broadcast_to(jnp.where(slot[:-1] < m - 1, slot[:-1], -1), (batch, CATCH_UP - 1))
    return VerifyResult(num_accepted=jnp.broadcast_to(m - 1, (batch,)).astype(jnp.int32), tokens=tokens, path=path)


def catch_up(spec: LoopSpec, dparams, state: LoopState) -> LoopState:
    """The drafter's one update for the plain rounds run since its last one (`Drafter.update`); a drafter that
    syncs from the context (`Drafter.syncs_from_context`) gets result=None and taps=None."""
    drafter = spec.drafter
    if drafter.syncs_from_context:
        dstate = drafter.update(dparams, state.drafter_state, _context(state), None, None)
    else:
        dstate = drafter.update(dparams, state.drafter_state, _context(state), plain_run_result(state),
                                state.pending_taps)
    return dataclasses.replace(state, drafter_state=dstate, pending=jnp.zeros_like(state.pending))


def plain_rounds(spec: LoopSpec, tparams, dparams, state: LoopState, shapes, catch_up_after: bool = True):
    """Plain decode rounds (`plain_round`) while the adaptive width would skip the draft: as cheap as AR's step
    (no conditional around the cache, no drafter code), with the rows' history still updated. The plan is made
    again before every round, as the loop around it would: a skipped round changes no history, but the rows'
    remaining tokens (the makespan objective) and the exploration clock move (the plan costs well under a
    microsecond). The drafter catches up (`catch_up`) once the run ends, and every CATCH_UP rounds within a
    longer one (its buffer of taps is full); `catch_up_after=False` (the host-stepped loop, whose drafter's
    update is Python): not at all, and the run is not cut: the caller catches up once after it."""
    more = lambda s: running(s) & (jnp.asarray(spec.verify_widths)[spec.scheduler.plan(spec, s)] == 0)  # noqa: E731
    if not catch_up_after:
        return jax.lax.while_loop(more, lambda s: plain_round(spec, tparams, s, shapes), state)

    def run(s):  # at most CATCH_UP plain rounds, then the drafter's update for them
        s = jax.lax.while_loop(lambda s: more(s) & (s.pending < CATCH_UP), lambda s: plain_round(spec, tparams, s,
                                                                                               shapes), s)
        return catch_up(spec, dparams, s)

    return jax.lax.while_loop(more, run, state)


def runs_bursts(spec: LoopSpec, drafter: Drafter) -> bool:
    """Whether the host-stepped loop runs width-0 rounds in compiled bursts (`host_plain_rounds`)."""
    return spec.scheduler.may_skip and not drafter.jittable and drafter.syncs_from_context


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def host_plain_rounds(spec: LoopSpec, tparams, state: LoopState) -> LoopState:
    """`plain_rounds` for the host-stepped loop of a drafter with Python state: a run of width-0 rounds is one
    compiled call instead of a host round trip (plan, propose, verify, update) per token; the caller then
    catches the drafter up (`catch_up`, outside the compiled call)."""
    batch, n = state.seq.shape[0], spec.drafter.num_draft_tokens
    shapes = Draft.chain(jnp.zeros((batch, n), jnp.int32), valid=jnp.zeros((batch, n), bool))
    return plain_rounds(spec, tparams, None, state, shapes, catch_up_after=False)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def compiled_loop(spec: LoopSpec, tparams, dparams, state: LoopState) -> LoopState:
    def body(state):
        draft, state = propose(spec, dparams, state)
        state, result, taps = verify_and_commit(spec, tparams, state, draft)
        state = update(spec, dparams, state, result, taps)
        if spec.scheduler.may_skip:
            # while the adaptive width would skip the draft, run plain decode steps in a loop of their own
            shapes = jax.eval_shape(lambda: spec.drafter.propose(dparams, state.drafter_state, _context(state),
                                                                 spec.sampling, round_key(state))[0])
            state = plain_rounds(spec, tparams, dparams, state, shapes)
        return state

    return jax.lax.while_loop(running, body, state)


# verify and update donate the state they return (else XLA copies the KV cache into the output); propose does not,
# since analyses (specdec.testing) draft again from the same state.
_jit_propose = jax.jit(propose, static_argnames=("spec",))
_jit_verify = jax.jit(verify_and_commit, static_argnames=("spec",), donate_argnames=("state",))
_jit_update = jax.jit(update, static_argnames=("spec",), donate_argnames=("state",))


# The cache is donated: returned inside the state without it, XLA copied every layer's cache (two caches alive at
# once, 3.1 GB at batch 64 with 528 slots; `memory_analysis` of this program).
@functools.partial(jax.jit, static_argnames=("spec", "capacity"), donate_argnames=("cache",))
def _initial_state(spec: LoopSpec, tokens, lengths, first_logits, cache, key, limit, *, capacity: int):
    batch = tokens.shape[0]
    key = as_sample_key(key, batch)
    first = sample(key.at(lengths), first_logits, spec.sampling)  # the token at position `lengths`, as AR's
    seq = jnp.zeros((batch, capacity), jnp.int32).at[:, : tokens.shape[1]].set(tokens)
    seq = seq.at[jnp.arange(batch), lengths].set(first)
    eos = jnp.asarray(spec.eos_ids or (NO_EOS,), jnp.int32)
    limit = jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (batch,))
    done = jnp.isin(first, eos) | (limit <= 1)
    n = spec.drafter.num_draft_tokens
    zeros = jnp.zeros((batch,), jnp.int32)
    taps = spec.drafter.taps
    pending_taps = None if not taps or spec.drafter.syncs_from_context else jnp.zeros(
        (len(taps), batch, CATCH_UP, spec.cfg.hidden_size), spec.cfg.jnp_dtype)
    return first, LoopState(cache=cache, seq=seq, seq_len=lengths + 1, num_new=zeros + 1, done=done,
                            limit=limit, drafter_state=None, pending=jnp.zeros((), jnp.int32),
                            pending_taps=pending_taps, key=key, rounds=zeros, accepted=zeros, proposed=zeros,
                            position_proposed=jnp.zeros((n,), jnp.int32),
                            position_accepted=jnp.zeros((n,), jnp.int32),
                            position_eligible=jnp.zeros((n,), jnp.int32),
                            round_committed=jnp.zeros((batch, capacity), jnp.int32))


@dataclasses.dataclass
class SpecOutput:
    tokens: list[list[int]]  # new tokens per row (the prefill token first; EOS included if it stopped there)
    metrics: DecodeMetrics
    # per row, in round order: tokens committed in each of its rounds (accepted drafts + 1, as counted in
    # `metrics`); len = the row's rounds, sum = its new tokens - 1 (the prefill token)
    accept_lengths: list[list[int]] = dataclasses.field(default_factory=list)


def loop_setup(target: Target, drafter: Drafter, prompts, policy, max_new_tokens, sampling: SamplingParams,
               max_seq_len, scheduler, verify_buckets, capacity_bucket: int = CAPACITY_BUCKET):
    """What a speculative decoding call starts from: (the LoopSpec, the padded prompts [B, T], their lengths [B],
    each row's limit of new tokens [B], the cache capacity, rounded up to `capacity_bucket`). The policy and the
    scheduler (default `FixedWidth`) are checked against the drafter; a scheduler that measures its round costs in
    the loop is wrapped in `ForcedWidths`, so they are timed in the very program that runs."""
    pol = get_policy(policy) if isinstance(policy, str) else policy
    if drafter.kind == "tree" and not pol.supports_trees:
        raise ValueError(f"policy {pol.name!r} verifies chains only, but drafter {drafter.name!r} proposes trees; "
                         "use greedy_tree, multidraft_tree or typical")
    scheduler = FixedWidth() if scheduler is None else scheduler
    if scheduler.needs_confidence:
        if drafter.kind != "chain" or not drafter.has_confidence:
            raise ValueError(f"scheduler {scheduler.kind!r} needs a chain drafter with draft confidences "
                             f"(dflash, dspark); drafter {drafter.name!r} has none")
    if capacity_bucket < 1:
        raise ValueError(f"capacity_bucket must be >= 1, got {capacity_bucket}")
    prompts = [list(p) for p in prompts]
    max_new, limits = row_limits(max_new_tokens, len(prompts))
    n = drafter.num_draft_tokens
    check_fits([len(p) for p in prompts], max_new, context_limit(target, max_seq_len), extra=n + 1)
    if scheduler.measured_in_loop:
        scheduler = ForcedWidths(scheduler)
    spec = LoopSpec(cfg=target.cfg, forward=target.forward, drafter=drafter, policy=pol, sampling=sampling,
                    eos_ids=tuple(target.eos_token_ids), scheduler=scheduler,
                    verify_widths=scheduler.verify_widths(n, verify_buckets))
    pad = target.cfg.pad_token_id if target.cfg.pad_token_id is not None else 0
    tokens, lengths = pad_prompts(prompts, pad)
    return spec, tokens, lengths, limits, cache_capacity(lengths, max_new, extra=n + 1, bucket=capacity_bucket)


def speculative_generate(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *,
                         policy: str | Policy = "greedy_chain", max_new_tokens: int | Sequence[int] = 64,
                         sampling: SamplingParams = GREEDY, seed: int = 0, compiled: bool | None = None,
                         max_seq_len: int | None = None, warmup: bool = False, scheduler=None,
                         verify_buckets=None, on_round=None, capacity_bucket: int = CAPACITY_BUCKET) -> SpecOutput:
    """Speculative decoding of a batch of token-id prompts with any drafter and verification policy: a policy
    name (with its default options) or a `specdec.verify.Policy` (`get_policy("typical", epsilon=0.05)`), up to
    `max_new_tokens` new tokens per prompt (one limit, or one per prompt).

    `scheduler` (specdec/scheduler.py; default `FixedWidth`: verify every drafted token) decides each round how
    many draft nodes the target verifies: `ThresholdSchedule` / `PrefixSchedule` per row from the drafter's
    `draft_confidence`, `AdaptiveWidth` the width that pays on this machine (0 = skip the draft). `verify_buckets`
    ("auto" or draft-node counts, see `bucket_widths`) lets a round whose rows all verify few nodes (a short
    schedule, an n-gram miss) run a narrower target step; None runs all N + 1 positions every round (the
    adaptive width always runs the buckets, "auto" unless given, plus width 0).

    `on_round(draft, confidence, result, active)` (host-stepped loop only) is called after every round with the
    verified draft, the drafter's `draft_confidence` (None without one), the VerifyResult and the rows that were
    active: per-round data for analyses such as confidence calibration.

    `warmup=True` first runs the same compiled programs for one round (untimed), so the reported times
    exclude compilation.

    `capacity_bucket`: the KV cache's slots are rounded up to a multiple of this (`specdec.generate.cache_capacity`;
    the default CAPACITY_BUCKET lets prompts of many lengths share one compiled loop). Attention reads every slot,
    so a caller decoding one short shape many times may pass a smaller one: the exact distribution check
    (`specdec.testing.sampled_joint`, 8000 rows of 20 tokens) runs 48 slots instead of 272.
    """
    compiled = drafter.jittable if compiled is None else compiled
    if compiled and on_round is not None:
        raise ValueError("on_round needs the host-stepped loop: pass compiled=False")
    if compiled and not drafter.jittable:
        raise ValueError(f"drafter {drafter.name!r} keeps Python state and cannot run in the compiled loop")
    forcing = scheduler is not None and scheduler.measured_in_loop  # its round costs are timed in this loop
    spec, tokens, lengths, limits, capacity = loop_setup(target, drafter, prompts, policy, max_new_tokens, sampling,
                                                         max_seq_len, scheduler, verify_buckets, capacity_bucket)
    scheduler, widths, n = spec.scheduler, spec.verify_widths, drafter.num_draft_tokens

    probe = LoopProbe(spec, target, tokens, lengths, capacity, compiled)
    measured = scheduler.prepare(probe)
    del probe  # and its prefilled random prompts (a cache the size of the run's)

    def fresh_state():  # a fresh state per run: the compiled loop donates its buffers
        return scheduler.init_state(len(tokens), n, drafter.evidence_classes, measured)

    if warmup:  # the same compiled programs, run for 2 tokens from one prefill
        # Where the width can be forced, every verify width once (and a draft that verifies nothing, and the width-0
        # loop or burst): a path first taken in the timed run compiles there (a host-side drafter's burst of plain
        # rounds, compiled mid-run, cost suffix decoding 2.4x on MT-Bench).
        paths = [(k, k) for k in range(len(widths))] + [(len(widths) - 1, 0)] if forcing else [None]
        ready = prefilled(spec, target, drafter, target.init_cache(len(tokens), capacity), tokens, lengths, capacity,
                          seed)
        for path in paths:
            state = fresh_state() if path is None else forced(fresh_state(), *path)
            _decode(spec, target, drafter, ready.state(2, state), lengths, compiled)
        del ready
    return _run(spec, target, drafter, tokens, lengths, capacity, limits, seed, compiled, on_round,
                sched_state=fresh_state())


def generate_refilled(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *, batch_size: int,
                      refill_rows: int = 1, policy: str | Policy = "greedy_chain",
                      max_new_tokens: int | Sequence[int] = 64, sampling: SamplingParams = GREEDY, seed: int = 0,
                      max_seq_len: int | None = None, scheduler=None, verify_buckets=None,
                      warmup: bool = False) -> SpecOutput:
    """Speculative decoding of more prompts than rows: `batch_size` rows run the compiled loop, which returns to the
    host once `refill_rows` of them are done (`LoopState.stop_at`); the host then prefills the next prompts into
    those rows and the loop goes on. A row that finished thus does not idle until the batch's longest row ends.

    A refilled row starts exactly as that prompt would in a batch of its own: its K/V, tokens, counters, key
    (`SampleKey.rows` = the prompt's index, so sampled text is the prompt's whatever row it lands in), drafter
    state and scheduler history are those of a fresh start (`Prefilled.state` on the inserted prompts), written
    over the row's slice of every leaf that has a batch axis; what all rows share (the scheduler's measured costs
    and calibration, the position counters) carries on. The batch axis of each leaf is read off the state's
    shapes at two batch sizes, so any drafter's state is refilled without knowing its layout. Greedy output equals
    AR's per prompt; the outputs come back in prompt order. Drafters with Python state (`jittable = False`) are
    refused: their per-row state lives outside the loop's arrays. `scheduler.objective: throughput` values a round
    by the tokens it commits over the rows, the objective of a batch that refills its rows.

    The metrics' decode time is the time inside the compiled loop; their prefill time is all the rest of the run:
    the prefills of the first batch and of every refill, and the host's reading of the finished rows at each return
    (what a smaller `refill_rows` pays more often). `warmup=True` first runs every program of the run on the
    first prompts for 2 tokens each (untimed), so neither time includes compilation."""
    if not drafter.jittable:
        raise ValueError(f"generate_refilled refills rows of the compiled loop; drafter {drafter.name!r} keeps "
                         "Python state per row (use speculative_generate)")
    if batch_size < 1 or not 1 <= refill_rows <= batch_size:
        raise ValueError(f"batch_size must be >= 1 and refill_rows in [1, batch_size], got {batch_size} and "
                         f"{refill_rows}")
    # one prompt width and one cache capacity for every insert
    spec, all_tokens, all_lengths, limits, capacity = loop_setup(target, drafter, prompts, policy, max_new_tokens,
                                                                 sampling, max_seq_len, scheduler, verify_buckets)
    scheduler, n = spec.scheduler, drafter.num_draft_tokens
    num_prompts = len(all_lengths)
    batch = min(batch_size, num_prompts)
    measured = scheduler.prepare(LoopProbe(spec, target, all_tokens[:batch], all_lengths[:batch], capacity, True))

    def fresh(index, row_limits):  # the started state of prompts `index` (padded with copies of the last)
        ready = prefilled(spec, target, drafter, target.init_cache(len(index), capacity), all_tokens[index],
                          all_lengths[index], capacity, seed, rows=index)
        sched = scheduler.init_state(len(index), n, drafter.evidence_classes, measured)
        return ready.state(row_limits[index], sched, last_use=True)

    shapes = [jax.eval_shape(lambda: dataclasses.replace(fresh(np.zeros(r, np.int64), limits), stop_at=jnp.int32(0)))
              for r in (refill_rows, refill_rows + 1)]
    axes = _batch_axes(*shapes)

    def run(count: int, row_limits):
        """Decodes prompts 0..count-1 (count >= batch) with `row_limits` new tokens each. Returns (per prompt:
        tokens, accept lengths, accepted, proposed; loop iterations; seconds in the loop; seconds outside it:
        the prefills and the host's reading of finished rows; the final state)."""
        t_start = time.perf_counter()
        state = dataclasses.replace(fresh(np.arange(batch), row_limits), stop_at=jnp.asarray(refill_rows, jnp.int32))
        holder = list(range(batch))  # the prompt each row holds (-1: none)
        queue, steps, rows_out, decode_s = batch, 0, {}, 0.0
        while True:
            jax.block_until_ready(state)  # the prefills (and the drafter's init) are the host's part, not the loop's
            rounds_before = np.asarray(state.rounds)
            t0 = time.perf_counter()
            state = compiled_loop(spec, target.params, drafter.params, state)
            jax.block_until_ready(state)
            decode_s += time.perf_counter() - t0
            seq, seq_len, done, rounds, committed = map(to_host, (state.seq, state.seq_len, state.done,
                                                                  state.rounds, state.round_committed))
            steps += int(np.max(rounds - rounds_before))  # the row finishing last ran every iteration
            accepted, proposed = to_host(state.accepted), to_host(state.proposed)
            free = []
            for row, held in enumerate(holder):
                if held >= 0 and done[row]:
                    rows_out[held] = (seq[row, all_lengths[held]: seq_len[row]].tolist(),
                                      committed[row, : rounds[row]].tolist(), int(accepted[row]), int(proposed[row]))
                    holder[row] = -1
                if holder[row] < 0:
                    free.append(row)
            if queue >= count:
                if all(h < 0 for h in holder):
                    break
                state = dataclasses.replace(state, stop_at=jnp.asarray(batch, jnp.int32))  # drain
                continue
            while free and queue < count:
                take = list(range(queue, min(queue + refill_rows, queue + len(free), count)))
                index = np.asarray(take + [take[-1]] * (refill_rows - len(take)))
                slots = np.asarray(free[:len(take)] + [batch] * (refill_rows - len(take)), np.int32)  # batch: dropped
                state = _insert(axes, state, fresh(index, row_limits), jnp.asarray(slots))
                for row, i in zip(free, take):
                    holder[row] = i
                free, queue = free[len(take):], queue + len(take)
        return rows_out, steps, decode_s, time.perf_counter() - t_start - decode_s, state

    if warmup:  # every program the run calls, the prompts decoded for 2 tokens: the first batch's prefill, the
        # loop and an insert of refill_rows prompts; then, rows dropped, an insert of each smaller count (more rows
        # done at once than a multiple of refill_rows, or the queue's end): its padding copies are prefilled once
        # (`prefill_distinct`), a program per count of distinct prompts
        *_, state = run(min(num_prompts, batch + refill_rows), np.minimum(limits, 2))
        for k in range(1, refill_rows if num_prompts > batch else 1):
            index = np.minimum(np.arange(refill_rows), k - 1)
            state = _insert(axes, state, fresh(index, limits), jnp.full(refill_rows, batch, jnp.int32))
        jax.block_until_ready(state)
        del state
    rows_out, steps, decode_s, prefill_s, state = run(num_prompts, limits)

    order = range(num_prompts)
    tokens = [rows_out[i][0] for i in order]
    accept_lengths = [rows_out[i][1] for i in order]
    pos_proposed, pos_accepted, pos_eligible = map(to_host, (state.position_proposed, state.position_accepted,
                                                             state.position_eligible))
    metrics = DecodeMetrics(
        new_tokens=sum(map(len, tokens)), rounds=sum(map(len, accept_lengths)),
        accepted_draft_tokens=sum(rows_out[i][2] for i in order), proposed_draft_tokens=sum(rows_out[i][3]
                                                                                            for i in order),
        prefill_seconds=prefill_s, decode_seconds=decode_s, position_proposed=pos_proposed.tolist(),
        position_accepted=pos_accepted.tolist(), position_eligible=pos_eligible.tolist(), batch_size=num_prompts,
        row_steps=batch * steps)
    for name, value in spec.scheduler.metrics(spec, state.sched).items():
        setattr(metrics, name, value)
    return SpecOutput(tokens=tokens, metrics=metrics, accept_lengths=accept_lengths)


def _batch_axes(small, bigger):
    """Per leaf of a state's shapes at two batch sizes (`jax.eval_shape`), the axis that grows with the batch, or
    None for a leaf all rows share (a hashable tuple in leaf order)."""
    def axis(a, b):
        grown = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        return grown[0] if grown else None
    return tuple(axis(a, b) for a, b in zip(jax.tree.leaves(small), jax.tree.leaves(bigger)))


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnames=("state",))
def _insert(axes, state: LoopState, fresh: LoopState, slots) -> LoopState:
    """`state` with rows `slots` [R] (a slot past the batch is dropped) taken from `fresh`, a started state of R
    rows: every leaf with a batch axis (`axes`); the leaves all rows share stay `state`'s. `stop_at` is kept."""
    leaves, tree = jax.tree.flatten(state)
    new = jax.tree.leaves(dataclasses.replace(fresh, stop_at=state.stop_at))

    def put(big, small, axis):
        if axis is None:
            return big
        return big.at[(slice(None),) * axis + (slots,)].set(small.astype(big.dtype), mode="drop")
    return jax.tree.unflatten(tree, [put(b, s, a) for b, s, a in zip(leaves, new, axes)])


@dataclasses.dataclass(frozen=True)
class LoopProbe:
    """The loop a scheduler is about to run in, for what it must measure first (`Scheduler.prepare`): this very
    loop, on random prompts of the same shapes, with the verify width forced (`specdec.costs.ForcedWidths`)."""

    spec: LoopSpec
    target: Target
    tokens: Any  # the padded prompts' shape (the random prompts take it)
    lengths: Any
    capacity: int
    compiled: bool
    # the loop lengths of the forced runs so far (the first one compiles); not part of the probe's identity
    runs: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def drafter(self) -> Drafter:
        return self.spec.drafter

    @property
    def batch(self) -> int:
        return len(self.tokens)

    def random_prompts(self) -> np.ndarray:
        vocab, eos = self.target.cfg.vocab_size, list(self.spec.eos_ids)
        fake = np.random.default_rng(0).integers(0, vocab, size=np.shape(self.tokens)).astype(np.int32)
        return np.where(np.isin(fake, eos), (fake + 1) % vocab, fake)

    def run_forced(self, plan: int, refine: int, measured) -> float:
        """Seconds per loop iteration with the plan and refine decisions forced to those indices into the verify
        widths, every draft node up to the width verified. Every run starts from the probe's one prefill of its
        random prompts (`prefilled`); the first run of the probe (2 tokens) compiles the loop. Width 0 runs
        PROFILE_ROUNDS = CATCH_UP plain rounds, so its time holds one catch-up per CATCH_UP of them, as a long run
        of skips does; a drafted width is timed over `profile_rounds` iterations, sized by a first short run to
        span about PROFILE_SECONDS (fewer where rounds are slow: self-speculation's, or any at batch 32). The
        loop's scheduler is a `specdec.costs.ForcedWidths`. `measured`: what the wrapped scheduler's `init_state`
        takes (any value of the right shapes: its decisions are overridden)."""
        scheduler = self.spec.scheduler
        if not isinstance(scheduler, ForcedWidths):
            raise TypeError("run_forced needs a loop whose scheduler is wrapped in ForcedWidths "
                            "(schedulers with measured_in_loop are)")
        def run(rounds: int) -> float:
            state = scheduler.init_state(self.batch, self.drafter.num_draft_tokens, self.drafter.evidence_classes,
                                         measured)  # fresh: the loop donates its state
            with self.drafter.profiling():
                out = _decode(self.spec, self.target, self.drafter,
                              self.prefilled.state(rounds, forced(state, plan, refine)), self.lengths, self.compiled)
            self.runs.append(rounds)
            return out.metrics.decode_seconds / max(max(map(len, out.accept_lengths)), 1)  # per loop iteration

        if not self.runs:
            run(2)  # compiles the loop
        if self.spec.verify_widths[plan] == 0:
            return run(PROFILE_ROUNDS + 1)
        return run(profile_rounds(run(2)) + 1)

    @functools.cached_property
    def prefilled(self) -> Prefilled:
        """The random prompts prefilled once, for every forced run and the draft timing."""
        return prefilled(self.spec, self.target, self.drafter, self.target.init_cache(self.batch, self.capacity),
                         self.random_prompts(), self.lengths, self.capacity, 0)

    def draft_seconds(self, calls: int = 4 * PROFILE_ROUNDS, repeats: int = 3) -> float:
        """Seconds one `propose` of a pure-JAX drafter takes, timed alone in a compiled loop of up to `calls` drafts
        from the prefilled random prompts (the committed length moves by one token per call, so nothing is hoisted
        out of the loop; fewer calls for a slow draft, `profile_rounds`, timed by a first run of one call that also
        compiles the loop); the median of `repeats` runs. The alternative, a drafted round that verifies nothing minus
        a plain one, is the difference of two loop timings whose noise (~1-2 ms here) exceeds prompt lookup's
        whole draft (~1 us): one such profile measured n-gram's draft at 14% of a round, so the adaptive width
        stopped treating it as free (`free_draft`), and the quickstart's rewrite prompt fell from 2.13x to 1.35x
        AR in replay."""
        spec, drafter = self.spec, self.drafter
        state = self.prefilled.state(PROFILE_ROUNDS)

        @jax.jit
        def drafts(n, dparams, dstate, seq, seq_len, done, cache, key):
            def one(i, total):
                ctx = RoundContext(seq=seq, seq_len=jnp.maximum(seq_len - i % 8, 1), done=done, cache=cache)
                draft, _ = drafter.propose(dparams, dstate, ctx, spec.sampling, key.at(ctx.seq_len))
                return total + jnp.sum(draft.tokens) + jnp.sum(draft.valid)
            return jax.lax.fori_loop(0, n, one, jnp.int32(0))

        args = (drafter.params, state.drafter_state, state.seq, state.seq_len, state.done, state.cache, state.key)

        def timed(n: int) -> float:
            t0 = time.perf_counter()
            jax.block_until_ready(drafts(jnp.int32(n), *args))
            return (time.perf_counter() - t0) / n

        timed(1)  # compile
        calls = profile_rounds(timed(1), most=calls)
        return float(np.median([timed(calls) for _ in range(repeats)]))


def start(spec: LoopSpec, target: Target, drafter: Drafter, cache: KVCache, tokens, lengths, capacity: int,
          limit, seed: int, sched_state=None) -> LoopState:
    """Prefill the padded prompts into `cache`, sample each row's first token, initialise the drafter: the
    state the loop starts from."""
    return prefilled(spec, target, drafter, cache, tokens, lengths, capacity, seed).state(limit, sched_state,
                                                                                          last_use=True)


@dataclasses.dataclass
class Prefilled:
    """A batch whose prompts the target has prefilled, that several loop runs may start from (`state`): the
    warm-up's paths and the round-cost profile's forced widths. At batch 32 on 2 CPU cores a prefill of 256-token
    prompts takes ~28 CPU-seconds, a loop iteration ~1: one prefill per run (31 of them in one adaptive call: 24
    for the profile, 5 for the warm-up) cost ~15 minutes before the first timed token."""

    spec: LoopSpec
    drafter: Drafter
    loop: LoopState  # the target's side of the started loop (no drafter or scheduler state)
    prompt: PromptInfo
    capacity: int

    def state(self, limit, sched_state=None, *, last_use: bool = False) -> LoopState:
        """A fresh loop state (its own buffers: the compiled loop donates them) with each row's `limit` of new
        tokens, the drafter initialised on the prompts afresh (a host-side drafter's Python state included) and
        `sched_state`. `last_use`: the state takes this batch's buffers instead of copies (a Prefilled started
        once, `start`), so no second cache is allocated beside the first (1.56 GB at batch 64 with 528 slots);
        the Prefilled must not start another run."""
        state, prompt = (self.loop, self.prompt) if last_use else jax.tree.map(_copy, (self.loop, self.prompt))
        batch = state.seq.shape[0]
        limit = jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (batch,))
        eos = jnp.asarray(self.spec.eos_ids or (NO_EOS,), jnp.int32)
        done = jnp.isin(prompt.first_token, eos) | (limit <= 1)  # as `_initial_state` sets it
        return dataclasses.replace(state, limit=limit, done=done, sched=sched_state,
                                   drafter_state=self.drafter.init(self.drafter.params, prompt, self.capacity))


def _copy(x):
    return jnp.copy(x) if isinstance(x, jax.Array) else x


def prefilled(spec: LoopSpec, target: Target, drafter: Drafter, cache: KVCache, tokens, lengths, capacity: int,
              seed: int, rows=None) -> Prefilled:
    """Prefill the padded prompts into `cache` and sample each row's first token (`Prefilled`). `rows`: each
    prompt's index in the caller's list, which keys its samples (`SampleKey.rows`; default 0..B-1)."""
    logits, taps, cache = prefill_distinct(target.params, cache, tokens, lengths, forward=target.forward,
                                           cfg=target.cfg, taps=drafter.taps)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    key = sample_key(seed, len(tokens))
    if rows is not None:
        key = dataclasses.replace(key, rows=jnp.asarray(rows, jnp.int32))
    # the limit is replaced by `Prefilled.state`; any value compiles the same program (it is traced)
    first, state = _initial_state(spec, tokens, lengths, logits, cache, key, 2, capacity=capacity)
    prompt = PromptInfo(tokens=tokens, lengths=lengths, taps=taps, first_token=first)
    return Prefilled(spec, drafter, state, prompt, capacity)


def _run(spec, target, drafter, tokens, lengths, capacity, limit, seed, compiled, on_round=None,
         sched_state=None) -> SpecOutput:
    cache = target.init_cache(len(tokens), capacity)
    t0 = time.perf_counter()
    state = start(spec, target, drafter, cache, tokens, lengths, capacity, limit, seed, sched_state)
    jax.block_until_ready(state)
    return _decode(spec, target, drafter, state, lengths, compiled, on_round, prefill_seconds=time.perf_counter() - t0)


def _decode(spec, target, drafter, state: LoopState, lengths, compiled, on_round=None,
            prefill_seconds: float = 0.0) -> SpecOutput:
    """Runs the loop from a started `state` to the end; the decode time counts from here. The state is waited for
    first: a state just copied from a `Prefilled` (the round-cost profile's and the warm-up's runs) is still being
    copied (asynchronous dispatch), and the profile timed that copy as loop time."""
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    draft_s = verify_s = None
    callback_s = 0.0
    if compiled:
        state = compiled_loop(spec, target.params, drafter.params, state)
        jax.block_until_ready(state)
    else:
        draft_s = verify_s = 0.0
        update_fn = _jit_update if drafter.jittable else update
        # a host-side drafter that syncs from the context skips whole runs of width-0 rounds in one call
        bursts = runs_bursts(spec, drafter) and on_round is None
        while True:
            finished, planned = jax.device_get(loop_status(spec, state))
            if finished:
                break
            if bursts and planned == 0:
                ta = time.perf_counter()
                state = host_plain_rounds(spec, target.params, state)
                jax.block_until_ready(state)
                tb = time.perf_counter()
                state = catch_up(spec, drafter.params, state)  # its update syncs from the context
                verify_s += tb - ta
                draft_s += time.perf_counter() - tb
                continue
            ta = time.perf_counter()
            if drafter.jittable:
                draft, state = _jit_propose(spec, drafter.params, state)
            else:
                draft, state = propose(spec, drafter.params, state, planned)
            jax.block_until_ready(draft)
            tb = time.perf_counter()
            active = ~state.done if on_round is not None else None  # read before verify donates the state
            state, result, taps = _jit_verify(spec, target.params, state, draft)
            jax.block_until_ready(result)
            tc = time.perf_counter()
            if on_round is not None:  # the caller's analysis: billed to neither draft nor verify time
                conf = drafter.draft_confidence(state.drafter_state) if drafter.has_confidence else None
                on_round(draft, conf, result, active)
            td = time.perf_counter()
            state = update_fn(spec, drafter.params, state, result, taps)
            draft_s += (tb - ta) + (time.perf_counter() - td)
            verify_s += tc - tb
            callback_s += td - tc
    t2 = time.perf_counter() - callback_s

    # to_host: on several hosts a row-sharded array is gathered first (np.asarray refuses non-local arrays)
    seq, seq_len, rounds, accepted, proposed, pos_proposed, pos_accepted, pos_eligible, committed = map(to_host, (
        state.seq, state.seq_len, state.rounds, state.accepted, state.proposed, state.position_proposed,
        state.position_accepted, state.position_eligible, state.round_committed))
    batch = len(seq)
    rows = [seq[i, lengths[i]: seq_len[i]].tolist() for i in range(batch)]
    metrics = DecodeMetrics(
        new_tokens=int(np.sum(seq_len - lengths)), rounds=int(np.sum(rounds)),
        accepted_draft_tokens=int(np.sum(accepted)), proposed_draft_tokens=int(np.sum(proposed)),
        prefill_seconds=prefill_seconds, decode_seconds=t2 - t1, draft_seconds=draft_s, verify_seconds=verify_s,
        position_proposed=pos_proposed.tolist(), position_accepted=pos_accepted.tolist(),
        position_eligible=pos_eligible.tolist(), batch_size=batch,
        row_steps=batch * int(np.max(rounds, initial=0)))  # the row finishing last is active every iteration
    for name, value in spec.scheduler.metrics(spec, state.sched).items():  # e.g. the adaptive width's choices
        setattr(metrics, name, value)
    accept_lengths = [committed[i, : rounds[i]].tolist() for i in range(batch)]
    return SpecOutput(tokens=rows, metrics=metrics, accept_lengths=accept_lengths)
