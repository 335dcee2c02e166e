"""Drafter training: distillation data from the target, target features, one training loop, checkpoints.

    data.py        prompts (files, hub names, or written by the target itself) -> target responses, on disk
    features.py    the target's hidden-state taps and logits for a batch: online (default) or a disk cache
    tasks.py       the TrainTask protocol a trainable drafter implements (drafters/<name>.py), shared losses
                   and the teacher-forced acceptance metrics
    loop.py        AdamW + warmup-cosine + clipping, periodic eval, NaN guard, exact resume, tracking
    checkpoint.py  orbax training checkpoints (every N steps, keep K) and the exported drafter (config + params)

Nothing here imports `drafters/` or `experiments/`: drafters register their tasks with `tasks.register_task`,
and a tracker is passed in (the `specdec.tracking.Tracker` interface; W&B lives in experiments/).
"""
