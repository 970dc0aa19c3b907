"""Config of `experiments/train_tiny.py`: the bundled byte-level models on the stdlib corpus.

Launch (from the repo root; ``nice`` because the CPU is shared)::

    nice -n 5 .venv/bin/python -m experiments.train_tiny --config=experiments/configs/train_tiny.py:tiny
    nice -n 5 .venv/bin/python -m experiments.train_tiny --config=experiments/configs/train_tiny.py:tiny-draft
    .venv/bin/python -m experiments.train_tiny --config=experiments/configs/train_tiny.py:smoke

Variants: ``tiny`` (the serving model), ``tiny-draft`` (a smaller model with the same tokenizer, for
speculative decoding), ``smoke`` (a few steps of a toy model on a few files).
Override any field, e.g. ``--config.steps=100 --config.output_dir=/tmp/w``. Weights go to
``results/train_tiny/<UTC timestamp>/`` unless ``output_dir`` says otherwise; to replace the bundled
weights pass ``--config.output_dir=paged/models/weights``.
"""

import ml_collections

_MODELS = {
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, ffn_dim=704),
    "tiny-draft": dict(
        d_model=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, ffn_dim=384
    ),
    "smoke": dict(d_model=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, ffn_dim=128),
}


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
    if arg not in _MODELS:
        raise ValueError(f"unknown variant {arg!r}; known: {sorted(_MODELS)}")
    c = ml_collections.ConfigDict()
    c.name = arg
    c.model = ml_collections.ConfigDict(
        dict(
            vocab_size=258,  # ByteTokenizer: bytes 0..255, BOS 256, EOS 257
            rope_theta=10000.0,
            max_seq_len=2048,
            norm_eps=1e-5,
            dtype="float32",
            tie_embeddings=True,
            **_MODELS[arg],
        )
    )
    c.seed = 0
    c.seq_len = 256  # training window in tokens
    c.batch_size = 16
    c.steps = 400  # ~13 min on 2 idle CPU cores (~2k tokens/s)
    c.warmup_steps = 40
    c.learning_rate = 3e-3
    c.min_lr_ratio = 0.1  # cosine decays to learning_rate * min_lr_ratio
    c.weight_decay = 0.1  # on matrices only (ndim >= 2)
    c.b1 = 0.9
    c.b2 = 0.95
    c.grad_clip = 1.0
    c.log_every = 20
    c.eval_every = 100
    c.eval_windows = 64  # fixed, evenly spaced windows of the held-out stream
    c.max_train_files = 0  # 0 = all
    c.max_eval_files = 0
    c.store_dtype = "float16"  # npz storage; loading gives float32
    c.output_dir = ""  # default results/train_tiny/<UTC timestamp>/; bundled: paged/models/weights
    if arg == "tiny-draft":
        c.steps = 600  # ~8x cheaper per step than tiny
        c.warmup_steps = 60
        c.learning_rate = 4e-3
    if arg == "smoke":
        c.seq_len = 32
        c.batch_size = 2
        c.steps = 3
        c.warmup_steps = 1
        c.log_every = 1
        c.eval_every = 2
        c.eval_windows = 2
        c.max_train_files = 3
        c.max_eval_files = 1
    return c
