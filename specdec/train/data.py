"""Distillation data: prompts -> the target's own responses, stored as a `datasets` dataset on disk.

    prompts = load_prompt_records("../shared/data/prompts/train_prompts.jsonl", limit=300)
    # or: prompts = self_generated_prompts(target, 200, sampling, seed=0)   (no data needed at all)
    summary = build_distill_data(target, prompts, "data/smollm2", sampling=SamplingParams(0.7), ...)
    data = load_distill_data("data/smollm2")                    # -> DistillData (numpy, in memory)

Prompt sources (`load_prompt_records`): a .jsonl / .json / .csv file (the prompt is `field`, or the first of
prompt / instruction (+ input) / question / text / turns[0]), or a Hugging Face `datasets` name; with the hub
unreachable (HF_DATASETS_OFFLINE, no network) that fails at once with a `DataError` naming the dataset.
`self_generated_prompts` lets the (instruct) target write the user turns itself: it is given only the chat
template's user prefix (`<|im_start|>system ... <|im_start|>user\n` for ChatML) and samples until it ends the
turn. A target without a tokenizer (the random test models) gets prompts as UTF-8 byte ids.

Responses come from the compiled AR decoding of `specdec.generate` (its prefill + decode loop, with one prompt
width and cache size for the whole run so that a single program serves every batch), sampling settings from
the config. One example = prompt ids + response ids (EOS included when the target stopped), with `loss_mask` 1
over the response only. Storage: `<out>/shards/shard_NNNNN/` (each a `save_to_disk` dataset, written to a
temporary name and renamed when complete) plus `<out>/manifest.json` (settings and the prompt fingerprint). A
rerun with the same settings skips finished shards, so an interrupted run resumes; other settings are an error.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from specdec.generate import ContinuousStats, continuous_shapes, generate_continuous
from specdec.models.tokenizer import ByteCodec
from specdec.records import DataError, chat_list, first_user, last_assistant, load_records, record_text, sample_order
from specdec.sampling import SamplingParams

SELF_PROMPTS = "self"  # data.datasets name meaning "the target writes the prompts"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# How responses are sampled: "continuous" = per-prompt keys (data made by the earlier per-batch-key generator
# has no such entry, so resuming it with this code is refused instead of mixing two samplers in one data set)
GENERATOR = "continuous"


@dataclasses.dataclass
class PromptRecord:
    id: str
    source: str
    text: str | None = None  # the user message (chat-templated when the target has a template)
    tokens: list[int] | None = None  # or ready token ids (used as they are)
    response: str | None = None  # a given answer: teacher-forced, no generation (None: the target answers)


RESPONSE_FIELDS = ("response", "answer", "output", "completion", "code", "canonical_solution")
GSM8K_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations "<<48/2=24>>"


def record_response(record: dict, field: str, where: str) -> str:
    """The given answer of a record: `field` ("auto": the first of RESPONSE_FIELDS that holds text, or the
    last assistant turn of a chat `messages` list). GSM8K's calculator annotations are removed (no model writes
    them), the rest is kept verbatim."""
    if field == "auto":
        messages = chat_list(record)
        if messages is not None:
            return last_assistant(messages, where)
        field = next((f for f in RESPONSE_FIELDS if isinstance(record.get(f), str) and record[f].strip()), None)
        if field is None:
            raise DataError(f"{where}: no response field (looked for {', '.join(RESPONSE_FIELDS)} and messages; "
                            f"fields: {sorted(record)}); set `response_field`")
    if field not in record:
        raise DataError(f"{where}: response field {field!r} not found; the records have fields {sorted(record)}")
    text = str(record[field])
    if field == "answer" and "\n#### " in text:  # GSM8K
        text = GSM8K_CALCULATOR.sub("", text)
    return text


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def contamination_filter(paths: Sequence[str], n: int = 13) -> Callable[[str], bool]:
    """A predicate that is True for a text sharing a word n-gram (13, as GPT-3's decontamination) with any
    prompt of the evaluation files `paths` (their prompts and, where present, reference answers)."""
    grams: set[tuple[str, ...]] = set()
    for name in paths:
        records, where, _ = load_records(name, None, default_split="test")
        for i, record in enumerate(records):
            for key in ("turns", "prompt", "question", "text", "canonical_solution", "answer", "code"):
                value = record.get(key)
                for part in value if isinstance(value, list) else [value]:
                    if isinstance(part, str):
                        grams |= word_ngrams(part, n)
    return lambda text: not grams.isdisjoint(word_ngrams(text, n))


# ---------------------------------------------------------------------------------------------------------
# Prompt sources
# ---------------------------------------------------------------------------------------------------------

def load_prompt_records(name: str, *, split: str | None = None, field: str | None = None,
                        limit: int | None = None, sample_seed: int | None = None, skip: int = 0,
                        response_field: str | None = None, exclude_ids: Sequence[int] = (),
                        contaminated: Callable[[str], bool] | None = None,
                        sources: Sequence[str] = ()) -> list[PromptRecord]:
    """Prompts from a local file (by suffix) or a `datasets` hub name ("owner/name[:config]"); with
    `sample_seed`, a seeded random `limit` of them (ids keep the records' file positions); `skip` leaves out the
    first records of that order (a later sample that repeats none of an earlier one).

    With `response_field` (a field name, or "auto": see `record_response`) each record also carries its given
    answer, and the data built from it is teacher-forced. Records whose `id` / `task_id` / `question_id` is in
    `exclude_ids` (e.g. MBPP's test split, task ids 11-510) or whose prompt `contaminated` flags are skipped;
    with `sources`, so are the records whose `source` field (the file's label where a record has none) is not
    one of them (in the sample's order, so `limit` counts the records kept)."""
    if name == SELF_PROMPTS:
        raise DataError(f"{SELF_PROMPTS!r} prompts are written by the target: use self_generated_prompts")
    records, where, label = load_records(name, split, default_split="train")
    excluded = {str(i) for i in exclude_ids}
    out = []
    for i, record in sample_order(records, sample_seed, skip, sources=sources, label=label, where=where):
        if limit is not None and len(out) >= limit:
            break
        rid = next((str(record[k]) for k in ("id", "question_id", "task_id") if k in record), f"{label}-{i}")
        if rid in excluded:
            continue
        at = f"{where} record {i}"
        messages = chat_list(record)
        if field is None and messages is not None:
            text = first_user(messages, at)
        else:
            text = record_text(record, field, at)
        if contaminated is not None and contaminated(text):
            continue
        response = record_response(record, response_field, at) if response_field else None
        out.append(PromptRecord(id=rid, source=str(record.get("source", label)), text=text, response=response))
    if not out:
        raise DataError(f"{where}: no prompts")
    return out


def user_turn_prefix(tokenizer) -> str:
    """The chat template rendered up to where the user's message begins (system prompt included)."""
    marker = "\x00SPECDEC_USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False)
    if marker not in text:
        raise DataError("the chat template does not render the user message; cannot find its user prefix")
    return text.split(marker)[0]


def encode_prompt(target, record: PromptRecord, chat_template: bool) -> list[int]:
    if record.tokens is not None:
        return list(record.tokens)
    tok = target.tokenizer
    if tok is None:  # random test models: UTF-8 bytes as ids, as everywhere else (specdec.models.tokenizer)
        ids = ByteCodec().encode(record.text)
        if max(ids, default=0) >= target.cfg.vocab_size:
            raise DataError(f"target has no tokenizer and vocabulary {target.cfg.vocab_size} < 256: cannot "
                            "byte-encode text prompts")
        return ids
    if chat_template and tok.chat_template:
        return tok.encode_chat(record.text)
    return tok.encode(record.text)


def self_generated_prompts(target, num_prompts: int, *, sampling: SamplingParams, seed: int = 0, skip: int = 0,
                           max_new_tokens: int = 96, batch_size: int = 8, progress: bool = False,
                           cache_path: str | os.PathLike | None = None,
                           contaminated: Callable[[str], bool] | None = None) -> list[PromptRecord]:
    """User turns written by the target itself from the chat template's user prefix (no data needed; the
    Magpie recipe: an instruct model asked for nothing writes the kind of request it was tuned to answer).

    Turn i (i = skip .. skip + num_prompts - 1) is sampled with its own key (`generate_continuous`'s prompt
    seed i under `seed`) until the target ends the turn (EOS) or `max_new_tokens`, so with one seed `skip: N`
    gives the turns after the first N, as it does for a prompt file. Kept are the turns that end at EOS, hold
    text and no special token (a turn that runs on into "<|im_start|>assistant ..." wrote its own answer), are
    not repeats, and pass `contaminated` (a text -> bool filter, e.g. `contamination_filter`); fewer than
    `num_prompts` may come back. Ids are "self-<seed>-<i>". Without a chat template the prefix is the BOS
    token, the prompt is kept as token ids and a turn cut at `max_new_tokens` is kept too (there is no turn
    structure to check). With `cache_path` (a .jsonl) the turns are stored there before decontamination and
    reused by later calls with the same settings, so a resumed `specdec data` sees the very same prompts."""
    from specdec.generate import continuous_shapes, generate_continuous

    settings = {"num_prompts": num_prompts, "skip": skip, "sampling": dataclasses.asdict(sampling), "seed": seed,
                "max_new_tokens": max_new_tokens, "batch_size": batch_size, "target": target.cfg.name,
                "kept": "turns ended at EOS, no special tokens, no repeats"}
    if cache_path is not None and Path(cache_path).is_file():
        lines = Path(cache_path).read_text().splitlines()
        if lines and json.loads(lines[0]) == {"settings": settings}:
            return _decontaminated([PromptRecord(**json.loads(line)) for line in lines[1:]], contaminated)

    if sampling.greedy:
        raise DataError("self-generated prompts need sampling (temperature > 0): greedy decoding writes the same "
                        "user turn every time")
    tok = target.tokenizer
    chat = tok is not None and bool(tok.chat_template)
    if chat:
        prefix = tok.encode(user_turn_prefix(tok))
    else:
        bos = target.cfg.bos_token_id
        prefix = [bos if bos is not None else 1]
    eos = set(target.eos_token_ids)
    shapes = continuous_shapes(target, [len(prefix)], max_new_tokens, batch_size)
    indices = list(range(skip, skip + num_prompts))
    turns: dict[int, list[int]] = {}
    bar = _progress(num_prompts, "self-generated prompts", progress)
    for j, row in generate_continuous(target, [prefix] * num_prompts, indices, shapes, sampling, seed):
        turns[indices[j]] = row
        bar.update(1)
    bar.close()

    out: list[PromptRecord] = []
    seen: set[str] = set()
    dropped = collections.Counter()
    for i in indices:
        row = turns[i]
        body = [t for t in row if t not in eos]
        rid = f"self-{seed}-{i}"
        if not chat:
            if body:
                out.append(PromptRecord(id=rid, source=SELF_PROMPTS, tokens=prefix + body))
            continue
        text = tok.decode(body).strip()
        if not row or row[-1] not in eos:
            dropped["cut at max_new_tokens"] += 1
        elif not text:
            dropped["empty"] += 1
        elif tok.decode(body, skip_special_tokens=False).strip() != text:
            dropped["special tokens inside"] += 1
        elif text in seen:
            dropped["repeats"] += 1
        else:
            seen.add(text)
            out.append(PromptRecord(id=rid, source=SELF_PROMPTS, text=text))
    if dropped:
        print(f"self-generated prompts: kept {len(out)} of {num_prompts}; dropped "
              + ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())), flush=True)
    if cache_path is not None:
        Path(cache_path).parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"settings": settings})] + [json.dumps(dataclasses.asdict(r)) for r in out]
        Path(cache_path).write_text("\n".join(lines) + "\n")
    return _decontaminated(out, contaminated)


def _decontaminated(prompts: list[PromptRecord], contaminated: Callable[[str], bool] | None) -> list[PromptRecord]:
    """`prompts` less those `contaminated` flags (applied after the cache, so the filter can change)."""
    if contaminated is None:
        return prompts
    kept = [p for p in prompts if p.text is None or not contaminated(p.text)]
    if len(kept) < len(prompts):
        print(f"self-generated prompts: {len(prompts) - len(kept)} dropped by decontamination", flush=True)
    return kept


# ---------------------------------------------------------------------------------------------------------
# Responses from the target
# ---------------------------------------------------------------------------------------------------------

def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, unit="prompt", dynamic_ncols=True)


def _fingerprint(items: Sequence[Any]) -> str:
    return hashlib.sha256(json.dumps(items, separators=(",", ":")).encode()).hexdigest()[:16]


def _shard_dir(out: Path, i: int) -> Path:
    return out / "shards" / f"shard_{i:05d}"


def encode_response(target, record: PromptRecord, prompt_ids: list[int], chat_template: bool) -> list[int]:
    """Token ids of a given answer as the target would have written them after `prompt_ids`: with a chat
    template, the template's own rendering of the assistant turn up to and including its end token (so the
    response ends with EOS like a finished generation); otherwise the text's ids followed by the first EOS."""
    tok = target.tokenizer
    eos = target.eos_token_ids
    if tok is None:
        ids = list(record.response.encode("utf-8"))
        return ids + list(eos[:1])
    if chat_template and tok.chat_template and record.tokens is None:
        full = tok.encode(tok.apply_chat_template([{"role": "user", "content": record.text},
                                                   {"role": "assistant", "content": record.response}],
                                                  add_generation_prompt=False))
        if full[:len(prompt_ids)] == prompt_ids:
            rest = full[len(prompt_ids):]
            end = next((i for i, t in enumerate(rest) if t in eos), None)
            if end is not None:
                return rest[:end + 1]
    return tok.encode(record.response) + list(eos[:1])


def build_distill_data(target, prompts: Sequence[PromptRecord], out_dir: str | os.PathLike, *,
                       sampling: SamplingParams, seed: int = 0, max_new_tokens: int = 256, batch_size: int = 8,
                       shard_size: int = 64, chat_template: bool = True, max_prompt_len: int | None = None,
                       max_total_len: int | None = None, insert_rows: int = 8, max_seconds: float | None = None,
                       progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Store distillation examples for `prompts` under `out_dir` (resumable).

    A prompt with a given `response` is teacher-forced: its answer is tokenized (`encode_response`) and cut so
    that prompt + response fit `max_total_len` tokens (None: at most `max_new_tokens` response tokens); the
    others are answered by the target (sampled with `sampling`, up to `max_new_tokens`). Both kinds mix in one
    data set, shard by shard. Prompts longer than `max_prompt_len` tokens are skipped (counted in the summary).

    Generation is continuous batching (`specdec.generate.generate_continuous`): `batch_size` decode rows, refilled
    `insert_rows` prompts at a time as rows finish, streaming across shard boundaries; a shard is written as soon
    as its last row ends. Prompt g of the run (its index among the usable prompts) is sampled with its own key
    fold_in(PRNGKey(seed), g), so a response does not depend on which prompts shared its batch and a resumed
    run produces exactly the shards a single run would. With `max_seconds` the call stops at the first shard
    written after that many seconds (the rest is left for a rerun; `complete` is False). Returns the summary
    (prompts, examples, tokens, per-source counts, time, generation throughput and batch utilisation), also
    written to `<out>/summary.json`.
    """
    datasets = _datasets()
    import pyarrow as pa

    t0 = time.perf_counter()
    out = Path(out_dir)
    encoded, skipped = [], 0  # (record, prompt ids, given response ids or None)
    for record in prompts:
        ids = encode_prompt(target, record, chat_template)
        if not ids or (max_prompt_len is not None and len(ids) > max_prompt_len):
            skipped += 1
            continue
        response = None
        if record.response is not None:
            room = max_new_tokens if max_total_len is None else max_total_len - len(ids)
            response = encode_response(target, record, ids, chat_template)[:max(room, 0)]
            if not response:
                skipped += 1
                continue
        encoded.append((record, ids, response))
    if not encoded:
        raise DataError(f"no usable prompts ({skipped} longer than max_prompt_len={max_prompt_len})")
    generated = [ids for _, ids, resp in encoded if resp is None]
    manifest = {
        "format": FORMAT_VERSION, "target": target.cfg.name, "vocab_size": target.cfg.vocab_size,
        "sampling": dataclasses.asdict(sampling), "seed": seed, "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "shard_size": shard_size, "chat_template": chat_template,
        "generator": GENERATOR,
        "num_prompts": len(encoded),
        "prompts_sha": _fingerprint([ids if resp is None else [ids, resp] for _, ids, resp in encoded]),
    }
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    if manifest_path.exists():
        stored = json.loads(manifest_path.read_text())
        diff = sorted(k for k in set(stored) | set(manifest) if stored.get(k) != manifest.get(k))
        if diff:
            raise DataError(f"{out} holds distillation data made with other settings (differs in: "
                            f"{', '.join(diff)}); use another train.data_dir or delete it")
    else:
        manifest_path.write_text(json.dumps(manifest, indent=2))

    num_shards = -(-len(encoded) // shard_size)
    done = [i for i in range(num_shards) if _shard_dir(out, i).is_dir()]
    bar = _progress(len(encoded), "examples", progress)
    bar.update(sum(min(shard_size, len(encoded) - i * shard_size) for i in done))
    if done:
        log(f"resuming: {len(done)}/{num_shards} shards already in {out / 'shards'}")
    features = datasets.Features({
        "id": datasets.Value("string"), "source": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")), "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "prompt_len": datasets.Value("int32"), "stopped": datasets.Value("bool"),
        "teacher_forced": datasets.Value("bool"),
    })
    eos = set(target.eos_token_ids)

    def write_shard(s: int, rows: dict[int, list[int]]) -> None:
        items = encoded[s * shard_size:(s + 1) * shard_size]
        records = {k: [] for k in features}
        for i, (record, ids, given) in enumerate(items):
            resp = rows[i]
            records["id"].append(record.id)
            records["source"].append(record.source)
            records["input_ids"].append(ids + resp)
            records["loss_mask"].append([0] * len(ids) + [1] * len(resp))
            records["prompt_len"].append(len(ids))
            records["stopped"].append(bool(resp) and resp[-1] in eos)
            records["teacher_forced"].append(given is not None)
        final = _shard_dir(out, s)
        tmp = final.with_name(final.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # one bar (ours) is enough
        try:
            # Built from an Arrow table with a fingerprint of our own: `Dataset.from_dict` hashes the features
            # with dill to make one, which fails with some datasets / pyarrow pairs (a TPU image's index).
            table = datasets.table.InMemoryTable(pa.Table.from_pydict(records, schema=features.arrow_schema))
            fingerprint = hashlib.sha256("\n".join(records["id"]).encode()).hexdigest()[:16]
            datasets.Dataset(table, info=datasets.DatasetInfo(features=features),
                             fingerprint=fingerprint).save_to_disk(str(tmp))
        finally:
            if bars:
                datasets.enable_progress_bars()
        os.replace(tmp, final)  # a killed run never leaves a half shard under the final name

    # Shard s keeps its finished rows (given responses at once, generated ones as they come) in rows[s] and is
    # written the moment its last generated row ends, while the generator goes on with the next shards' prompts.
    rows: dict[int, dict[int, list[int]]] = {}
    waiting: dict[int, int] = {}  # shard -> generated rows still to come
    todo = []  # (shard, row in shard, prompt ids, index in `encoded`: the prompt's seed)
    for s in range(num_shards):
        if s in done:
            continue
        items = encoded[s * shard_size:(s + 1) * shard_size]
        rows[s] = {i: resp for i, (_, _, resp) in enumerate(items) if resp is not None}
        bar.update(len(rows[s]))
        answer = [i for i, (_, _, resp) in enumerate(items) if resp is None]
        waiting[s] = len(answer)
        todo += [(s, i, items[i][1], s * shard_size + i) for i in answer]
        if not answer:
            write_shard(s, rows.pop(s))
    stats = ContinuousStats()
    shapes = None
    if todo:
        # Shapes from all the run's generated prompts (not just those left), so a resumed run compiles the
        # same programs as an uninterrupted one.
        shapes = continuous_shapes(target, [len(ids) for ids in generated], max_new_tokens, batch_size,
                                   insert_rows)
        stream = generate_continuous(target, [ids for _, _, ids, _ in todo], [g for *_, g in todo], shapes,
                                     sampling, seed, stats)
        for j, response in stream:
            s, i = todo[j][0], todo[j][1]
            rows[s][i] = response
            waiting[s] -= 1
            bar.update(1)
            if waiting[s] == 0:
                write_shard(s, rows.pop(s))
                if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                    log(f"\nmax_seconds={max_seconds} reached after shard {s}: stopping; a rerun goes on with the rest")
                    break
    bar.close()

    data = load_distill_data(out)
    finished = sum(_shard_dir(out, i).is_dir() for i in range(num_shards))
    summary = {
        "data_dir": str(out), "prompts": len(encoded), "skipped_prompts": skipped, "examples": len(data),
        "complete": finished == num_shards, "shards": f"{finished}/{num_shards}",
        "prompt_tokens": int(sum(data.prompt_lens)), "response_tokens": int(sum(m.sum() for m in data.loss_mask)),
        "teacher_forced_examples": int(sum(data.teacher_forced)),
        "stopped_at_eos": float(np.mean(data.stopped)) if len(data) else 0.0,
        "sources": data.source_counts(),
        "seconds": round(time.perf_counter() - t0, 2),
        "new_tokens_this_run": stats.new_tokens,
        "generate_seconds": round(stats.seconds, 2),
        # response tokens produced / wall seconds of generation (compilation and host refills included)
        "generate_tokens_per_second": round(stats.tokens_per_second, 1) if stats.seconds else None,
        # fraction of decode row-steps that produced a kept token (rows idle while waiting for a refill)
        "batch_utilisation": round(stats.utilisation, 3) if stats.decode_row_steps else None,
        "decode_batch": batch_size, "insert_rows": shapes.insert_rows if shapes else None,
        "decode_chunks": stats.chunks,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def generate_fixed(target, prompts: Sequence[Sequence[int]], width: int, capacity: int, max_new_tokens: int,
                   sampling: SamplingParams, seed: int, limit: int | None = None) -> list[list[int]]:
    """`specdec.generate.generate` with a fixed prompt width and cache capacity (its compiled prefill and
    decode loop, so every batch reuses one program). New tokens per row, EOS included. The static-batch path
    (each batch runs until its longest row ends) that `build_distill_data` used before continuous batching;
    kept as the baseline of benchmarks/bench_data_gen.py. `limit` < max_new_tokens stops early (warm-up)."""
    import jax
    import jax.numpy as jnp

    from specdec.generate import decode_loop, prefill

    pad = target.cfg.pad_token_id if target.cfg.pad_token_id is not None else 0
    tokens = np.full((len(prompts), width), pad, np.int32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    cache = target.init_cache(len(prompts), capacity)
    logits, _, cache = prefill(target.params, cache, jnp.asarray(tokens), jnp.asarray(lengths),
                               forward=target.forward, cfg=target.cfg)
    result = decode_loop(target.params, cache, logits, jax.random.PRNGKey(seed), jnp.int32(limit or max_new_tokens),
                         forward=target.forward, cfg=target.cfg, sampling=sampling,
                         max_new_tokens=max_new_tokens, eos_ids=tuple(target.eos_token_ids))
    out, counts = np.asarray(result[0]), np.asarray(result[1])  # (tokens, counts[, cache])
    return [out[i, : counts[i]].tolist() for i in range(len(prompts))]


# ---------------------------------------------------------------------------------------------------------
# Loading for training
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class DistillData:
    """Examples in memory: ragged token ids and loss masks (numpy), plus ids."""

    ids: list[str]
    input_ids: list[np.ndarray]
    loss_mask: list[np.ndarray]
    prompt_lens: list[int]
    stopped: list[bool]
    manifest: dict
    sources: list[str] | None = None  # where each example's prompt came from
    teacher_forced: list[bool] | None = None  # the response was given (True) or generated by the target

    def __post_init__(self):
        n = len(self.ids)
        self.sources = self.sources if self.sources is not None else ["?"] * n
        self.teacher_forced = self.teacher_forced if self.teacher_forced is not None else [False] * n

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, idx: Sequence[int]) -> "DistillData":
        return DistillData([self.ids[i] for i in idx], [self.input_ids[i] for i in idx],
                           [self.loss_mask[i] for i in idx], [self.prompt_lens[i] for i in idx],
                           [self.stopped[i] for i in idx], self.manifest, [self.sources[i] for i in idx],
                           [self.teacher_forced[i] for i in idx])

    def source_counts(self) -> dict[str, dict[str, int]]:
        """Per source: examples, response tokens, and how many of them were teacher-forced."""
        out: dict[str, dict[str, int]] = {}
        for src, mask, forced in zip(self.sources, self.loss_mask, self.teacher_forced):
            c = out.setdefault(src, {"examples": 0, "response_tokens": 0, "teacher_forced": 0})
            c["examples"] += 1
            c["response_tokens"] += int(mask.sum())
            c["teacher_forced"] += int(forced)
        return dict(sorted(out.items()))

    def split_indices(self, num_eval: int) -> tuple[np.ndarray, np.ndarray]:
        """(train, held-out) example indices: the `num_eval` examples whose id hashes lowest are held out
        (stable under appending data and independent of order)."""
        n = len(self)
        if num_eval <= 0:
            return np.arange(n), np.arange(0)
        if num_eval >= n:
            raise DataError(f"train.eval_examples={num_eval} leaves no training data ({n} examples)")
        rank = sorted(range(n), key=lambda i: hashlib.sha1(self.ids[i].encode()).hexdigest())
        held = np.zeros(n, bool)
        held[rank[:num_eval]] = True
        return np.flatnonzero(~held), np.flatnonzero(held)

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token occurs in the responses (for reduced draft vocabularies)."""
        counts = np.zeros(vocab_size, np.int64)
        for ids, mask in zip(self.input_ids, self.loss_mask):
            counts += np.bincount(ids[mask > 0], minlength=vocab_size)[:vocab_size]
        return counts

    def padded(self, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
        """Fixed-shape arrays: tokens int32 [N, seq_len] (right-padded / truncated), loss_mask int8 [N, seq_len]
        and lengths int32 [N]."""
        n = len(self)
        tokens = np.full((n, seq_len), pad_id, np.int32)
        mask = np.zeros((n, seq_len), np.int8)
        lengths = np.zeros((n,), np.int32)
        for i, (ids, m) in enumerate(zip(self.input_ids, self.loss_mask)):
            k = min(len(ids), seq_len)
            tokens[i, :k], mask[i, :k], lengths[i] = ids[:k], m[:k], k
        return {"tokens": tokens, "loss_mask": mask, "lengths": lengths}


def check_same_target(parts: Sequence[tuple[str, DistillData]], doing: str) -> None:
    """Data sets (name, data) that are used together must come from the same target: the manifests' target and
    vocabulary agree, else a DataError names the two sets and the key (`doing`: what was to be done with them)."""
    (first_name, first), rest = parts[0], parts[1:]
    for name, data in rest:
        for key in ("target", "vocab_size"):
            if data.manifest.get(key) != first.manifest.get(key):
                raise DataError(f"cannot {doing} {first_name} and {name} together: their {key} differs "
                                f"({first.manifest.get(key)!r} vs {data.manifest.get(key)!r})")


def pool_distill_data(parts: Sequence[tuple[str, DistillData]]) -> DistillData:
    """Several data sets (name, data) as one: examples concatenated in order. They must come from the same target
    (`check_same_target`); the pool keeps the first manifest, plus `pooled_from` (the names)."""
    check_same_target(parts, "train on")
    first, rest = parts[0][1], parts[1:]
    if not rest:
        return first
    cat = lambda attr: [x for _, d in parts for x in getattr(d, attr)]  # noqa: E731
    return DistillData(cat("ids"), cat("input_ids"), cat("loss_mask"), cat("prompt_lens"), cat("stopped"),
                       {**first.manifest, "pooled_from": [name for name, _ in parts]}, cat("sources"),
                       cat("teacher_forced"))


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("distillation data is stored with the `datasets` package, which the base install leaves "
                        "out: pip install -e '.[train]'") from None
    return datasets


def load_distill_data(path: str | os.PathLike, skip_shards: int = 0) -> DistillData:
    """The finished shards of `path` in order, less the first `skip_shards` (already trained on)."""
    datasets = _datasets()

    out = Path(path)
    if not (out / MANIFEST).is_file():
        raise DataError(f"no distillation data in {out} (no {MANIFEST}); build it first with "
                        "`specdec data <config.yaml>`")
    shards = sorted(p for p in (out / "shards").glob("shard_*") if not p.name.endswith(".partial"))
    if not shards:
        raise DataError(f"{out} has no finished shards yet; run `specdec data <config.yaml>` (it resumes)")
    if skip_shards >= len(shards):
        raise DataError(f"train.skip_shards={skip_shards} leaves no data: {out} has {len(shards)} finished shards")
    shards = shards[skip_shards:]
    ds = datasets.concatenate_datasets([datasets.load_from_disk(str(p)) for p in shards])
    cols = ds.to_dict()
    return DistillData(ids=cols["id"], input_ids=[np.asarray(x, np.int32) for x in cols["input_ids"]],
                       loss_mask=[np.asarray(x, np.int8) for x in cols["loss_mask"]],
                       prompt_lens=list(cols["prompt_len"]), stopped=list(cols["stopped"]),
                       manifest=json.loads((out / MANIFEST).read_text()), sources=list(cols["source"]),
                       teacher_forced=list(cols.get("teacher_forced", [False] * len(cols["id"]))))
