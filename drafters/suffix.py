"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): a training-free tree drafter over suffix indexes.

Two indexes are kept, both depth-limited suffix tries with occurrence counts (`SuffixIndex`):
- a per-request index over each row's prompt + output so far, extended incrementally with the tokens the
  target commits (it is rebuilt for every `speculative_generate` call);
- a global index over earlier finished outputs: whenever a row finishes, its output (EOS included) is added.
  The global index lives in the drafter object and persists across `speculative_generate` calls, which is
  what makes suffix decoding pay off on repeated / agentic / templated requests.

Each round, for each row, the longest suffix of the committed sequence (at most `max_match` tokens) that
occurred earlier WITH a continuation is located in each index. Below that match node the trie holds every
continuation seen after the matched pattern, with counts; the drafter grows a speculation tree best-first
by cumulative score = product along the path of count(child) / count(parent continued), keeps at most
`num_draft_tokens` nodes, stops at depth `max_depth`, and never adds a node whose cumulative score is below
`min_score`. So the draft size adapts to the match: a long, always-repeated pattern yields a deep chain,
an ambiguous one a few shallow alternatives or nothing. Of the two candidate trees (per-request, global),
the one with the larger expected accepted length (sum of node scores) is proposed.

The data structure, and why it is exact: a suffix trie truncated at depth D = max_match + max_depth. Each
appended token extends the (at most D) trie nodes of the sequence's current suffixes by one child (O(D)
dict operations per token), so node(s).count = number of occurrences of the string s (of length <= D) and
node(s).cont = number of those occurrences followed by another token. Any pattern of length m <= max_match
thus has its exact continuation counts down to depth max_depth, the same statistics a (depth-limited)
suffix tree gives. The per-request match needs no walk: the nodes of the current suffixes are exactly the
"active" nodes kept for appending. The probability uses `cont` (not `count`) as the denominator because the
pattern's latest occurrence - the one we are matching from - has no continuation yet.

Frequencies rank tokens; they are not a distribution the tokens were sampled from, so the Draft carries
probs=None (q one-hot): greedy_tree is exact greedy decoding, multidraft_tree is lossless at any
temperature (siblings hold distinct tokens). Typical acceptance works too (lossy).

Host-side drafter (`jittable = False`): the engine runs its host-stepped loop. The per-request state lives
in the drafter object (the engine state gets `()`), so one drafter object must not serve two
`speculative_generate` calls at the same time. The global index is unbounded; call `clear_global()` to
drop it (benchmarks do, between configurations, so earlier runs of the same prompts cannot leak in).
Cost: building a 2k-token prompt index is a few tens of ms once per request; a propose call is tens of
microseconds per row (see tests/test_suffix.py).
"""

from __future__ import annotations

import contextlib

import heapq
from typing import Iterable, Sequence

import jax
import numpy as np

from drafters import register
from specdec.drafter import MATCH_CLASS_STARTS, Draft, Drafter, PromptInfo, RoundContext, match_length_class


# Finished outputs shorter than this are not added to the global corpus. They carry almost no statistics,
# and it keeps the engine's warm-up (`speculative_generate(..., warmup=True)` first decodes 2 tokens of the
# SAME prompts with this drafter) from planting the start of each answer in the corpus before the timed run.
MIN_DOCUMENT_TOKENS = 3


class _Node:
    __slots__ = ("count", "cont", "children")

    def __init__(self):
        self.count = 0  # occurrences of this node's string
        self.cont = 0  # occurrences followed by one more token (= sum of the children's counts)
        self.children: dict[int, _Node] | None = None


class SuffixIndex:
    """A suffix trie truncated at `depth`, with occurrence counts, built incrementally.

    A document is appended token by token through a *stream*: the list of trie nodes of the document's
    current suffixes (stream[k] = node of its last k + 1 tokens). Several documents can share one index (the
    global corpus): patterns never span two documents.
    """

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"SuffixIndex depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.num_tokens = 0
        self.num_nodes = 1
        self.num_documents = 0

    def extend(self, stream: list, tokens: Iterable[int]) -> list:
        """Append `tokens` to the document whose suffix nodes are `stream`; returns the new stream."""
        root, depth = self.root, self.depth
        for t in tokens:
            t = int(t)
            new = []
            for parent in [root] + stream[: depth - 1]:
                children = parent.children
                if children is None:
                    children = parent.children = {}
                child = children.get(t)
                if child is None:
                    child = children[t] = _Node()
                    self.num_nodes += 1
                child.count += 1
                parent.cont += 1
                new.append(child)
            root.count += 1
            stream = new
            self.num_tokens += 1
        return stream

    def add_document(self, tokens: Sequence[int]) -> None:
        """Index a whole document (e.g. a finished response)."""
        self.extend([], tokens)
        self.num_documents += 1

    def find(self, pattern: Sequence[int]) -> _Node | None:
        node = self.root
        for t in pattern:
            if node.children is None:
                return None
            node = node.children.get(int(t))
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int], max_match: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (<= max_match tokens) that occurred with a
        continuation, and its length; (None, 0) if even the last token never continued."""
        for m in range(min(max_match, len(context), self.depth - 1), 0, -1):
            node = self.find(context[len(context) - m:])
            if node is not None and node.cont > 0:
                return node, m
        return None, 0


def stream_match(stream: list, max_match: int) -> tuple[_Node | None, int]:
    """Longest-match for a document being indexed: its suffix nodes are already at hand in `stream`."""
    for m in range(min(max_match, len(stream)), 0, -1):
        if stream[m - 1].cont > 0:
            return stream[m - 1], m
    return None, 0


def grow_tree(node: _Node, budget: int, max_depth: int, min_score: float):
    """Best-first speculation tree below match node `node`.

    Returns (tokens, parents, scores) lists of at most `budget` nodes in non-increasing score order, which is
    topological (a child never outscores its parent, and a parent is pushed before its children). A child's
    score is its parent's times count(child) / cont(parent); nodes below `min_score` or deeper than
    `max_depth` are never added.
    """
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    heap: list = []
    tick = 0

    def push_children(trie_node: _Node, index: int, score: float, depth: int):
        nonlocal tick
        if depth >= max_depth or trie_node.cont == 0:
            return
        threshold = min_score * trie_node.cont / score  # child.count needed to reach min_score
        scale = score / trie_node.cont
        for tok, child in trie_node.children.items():
            if child.count >= threshold:
                heapq.heappush(heap, (-child.count * scale, tick, tok, child, index, depth + 1))
                tick += 1

    push_children(node, -1, 1.0, 0)
    while heap and len(tokens) < budget:
        neg, _, tok, child, parent, depth = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        scores.append(-neg)
        push_children(child, len(tokens) - 1, -neg, depth)
    return tokens, parents, scores


class _Row:
    __slots__ = ("index", "stream", "known", "prompt_len", "finished")

    def __init__(self, depth: int, prompt: Sequence[int]):
        self.index = SuffixIndex(depth)
        self.stream = self.index.extend([], prompt)
        self.known = len(prompt)  # tokens of the row already indexed
        self.prompt_len = len(prompt)
        self.finished = False


class SuffixDrafter(Drafter):
    name = "suffix"
    kind = "tree"
    jittable = False
    syncs_from_context = True  # update (and propose) catch up on the committed sequence: ctx is all they read
    deterministic = True  # counts rank the tokens; nothing is sampled (probs=None)
    evidence_classes = len(MATCH_CLASS_STARTS)  # the evidence: the chosen tree's match length, as a class
    ordered_tree = True  # best-first: nodes in non-increasing score order, parents first (grow_tree)

    def __init__(self, num_draft_tokens: int, max_match: int = 8, max_depth: int | None = 8,
                 min_score: float = 0.1, use_global: bool = True, max_spec_factor: float | None = None,
                 max_spec_offset: float = 0.0):
        max_depth = num_draft_tokens if max_depth is None else max_depth
        if max_match < 1 or max_depth < 1:
            raise ValueError(f"suffix drafter needs max_match >= 1 and max_depth >= 1, got {max_match}, {max_depth}")
        if not 0.0 <= min_score <= 1.0:
            raise ValueError(f"suffix drafter min_score must be in [0, 1], got {min_score}")
        if max_spec_factor is not None and max_spec_factor <= 0:
            raise ValueError(f"suffix drafter max_spec_factor must be > 0 (or None: no cap), got {max_spec_factor}")
        # The paper's adaptive speculation: a tree below a pattern matched over m tokens holds at most
        # max_spec_factor * m + max_spec_offset nodes (ArcticInference / vLLM default factor 1.0): a one-token
        # match is weak evidence, so it drafts one node, where a long repeated pattern drafts the whole budget.
        # None: every tree may use the whole budget.
        self.max_spec_factor = None if max_spec_factor is None else float(max_spec_factor)
        self.max_spec_offset = float(max_spec_offset)
        self.num_draft_tokens = num_draft_tokens
        self.max_match, self.max_depth = int(max_match), int(max_depth)
        self.min_score, self.use_global = float(min_score), bool(use_global)
        self._learning = True  # False while the engine times throwaway rounds (`profiling`)
        self.global_index = SuffixIndex(self.max_match + self.max_depth)
        self._rows: list[_Row] = []
        self.last_scores: np.ndarray | None = None  # [B, N] cumulative scores of the last draft (0 = invalid)
        self.last_source: list[str] = []  # per row: "request", "global" or "none"

    # --- corpus management ------------------------------------------------------------------------------
    def clear_global(self) -> None:
        """Forget every earlier output."""
        self.global_index = SuffixIndex(self.max_match + self.max_depth)

    def observe(self, tokens: Sequence[int]) -> None:
        """Add a document (e.g. a response from a log) to the global corpus."""
        if len(tokens):
            self.global_index.add_document([int(t) for t in tokens])

    # --- protocol -----------------------------------------------------------------------------------------
    def init(self, params, prompt: PromptInfo, capacity: int):
        tokens, lengths = np.asarray(prompt.tokens), np.asarray(prompt.lengths)
        depth = self.max_match + self.max_depth
        self._rows = [_Row(depth, tokens[b, : lengths[b]].tolist()) for b in range(tokens.shape[0])]
        return ()

    def _sync(self, seq: np.ndarray, seq_len: np.ndarray) -> None:
        for b, row in enumerate(self._rows):
            n = int(seq_len[b])
            if n > row.known:
                row.stream = row.index.extend(row.stream, seq[b, row.known: n].tolist())
                row.known = n

    def budget(self, match_length: int) -> int:
        """Tree nodes a pattern matched over `match_length` tokens may draft (`max_spec_factor`)."""
        if self.max_spec_factor is None:
            return self.num_draft_tokens
        cap = int(self.max_spec_factor * match_length + self.max_spec_offset)
        return max(0, min(self.num_draft_tokens, cap))

    def draft_row(self, row: _Row, context: Sequence[int]):
        """(tokens, parents, scores, source, match length) for one row whose committed sequence ends with
        `context`."""
        best = ([], [], [], "none", 0)
        best_value = 0.0
        node, length = stream_match(row.stream, self.max_match)
        if node is not None:
            t, p, s = grow_tree(node, self.budget(length), self.max_depth, self.min_score)
            best, best_value = (t, p, s, "request", length), sum(s)
        if self.use_global and self.global_index.num_tokens:
            node, length = self.global_index.match(context, self.max_match)
            if node is not None:
                t, p, s = grow_tree(node, self.budget(length), self.max_depth, self.min_score)
                if sum(s) > best_value:
                    best = (t, p, s, "global", length)
        return best

    def propose(self, params, state, ctx: RoundContext, sampling, key):
        seq, seq_len, done = np.asarray(ctx.seq), np.asarray(ctx.seq_len), np.asarray(ctx.done)
        self._sync(seq, seq_len)
        batch, n = seq.shape[0], self.num_draft_tokens
        tokens = np.zeros((batch, n), np.int32)
        parents = np.full((batch, n), -1, np.int32)
        valid = np.zeros((batch, n), bool)
        scores = np.zeros((batch, n), np.float32)
        matched = np.zeros((batch,), np.int32)
        self.last_source = []
        for b, row in enumerate(self._rows):
            if done[b]:
                self.last_source.append("none")
                continue
            end = int(seq_len[b])
            context = seq[b, max(0, end - self.max_match): end].tolist()
            t, p, s, source, matched[b] = self.draft_row(row, context)
            k = len(t)
            tokens[b, :k], parents[b, :k], scores[b, :k], valid[b, :k] = t, p, s, True
            self.last_source.append(source)
        self.last_scores = scores
        evidence = match_length_class(np.where(valid.any(axis=1), matched, 0))
        # one transfer for the whole draft: a device op per array costs ~0.1-0.5 ms a round on this path
        tokens, parents, valid, evidence = jax.device_put((tokens, parents, valid, evidence))
        return Draft(tokens=tokens, parents=parents, probs=None, valid=valid, evidence=evidence), state

    def update(self, params, state, ctx: RoundContext, result, taps):
        seq, seq_len, done = np.asarray(ctx.seq), np.asarray(ctx.seq_len), np.asarray(ctx.done)
        self._sync(seq, seq_len)
        for b, row in enumerate(self._rows):
            if done[b] and not row.finished:
                row.finished = True
                output = seq[b, row.prompt_len: int(seq_len[b])].tolist()
                if self.use_global and self._learning and len(output) >= MIN_DOCUMENT_TOKENS:
                    self.observe(output)
        return state

    @contextlib.contextmanager
    def profiling(self):
        self._learning = False
        try:
            yield
        finally:
            self._learning = True

    def describe(self):
        return {**super().describe(), "max_match": self.max_match, "max_depth": self.max_depth,
                "min_score": self.min_score, "use_global": self.use_global,
                **({"max_spec_factor": self.max_spec_factor, "max_spec_offset": self.max_spec_offset}
                   if self.max_spec_factor is not None else {})}


@register("suffix")
def make(target, num_draft_tokens: int, max_match: int = 8, max_depth: int | None = 8, min_score: float = 0.1,
         use_global: bool = True, max_spec_factor: float | None = None, max_spec_offset: float = 0.0):
    return SuffixDrafter(num_draft_tokens, max_match=max_match, max_depth=max_depth, min_score=min_score,
                         use_global=use_global, max_spec_factor=max_spec_factor, max_spec_offset=max_spec_offset)
