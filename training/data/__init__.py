"""Feature shards: the precomputed latents + caption embeddings the loop trains on.

Layout of a feature directory (local/FSx path or ``s3://`` prefix)::

    index.json                 shapes, dtype, per-shard sample count / bytes / sha256, and
                               text_conditioning (CHI, N, tokenizer, text encoder: see
                               training/data/text_features.py TextConditioning)
    null_caption.safetensors   {"text": [N, D] bf16, "mask": [N]}: the empty caption's full
                               encoding, for CFG dropout (Sana's token_drop swaps it in whole)
                               and the negative prompt of validation images; older
                               directories hold {"text": [n, D]}, its real rows only
    validation_prompts.safetensors  {"0000": [n, D] bf16, ...}: index.json validation.prompts,
                               encoded like the captions (optional; training/evaluation/validation.py)
    shard-00000.tar ...        one member per sample: ``<key>.safetensors`` holding
                               "latents" [C,H,W] bf16 (UNscaled) and "text" [n_real, D] bf16

Buckets (training/data/buckets.py): a directory precomputed with aspect-ratio buckets has
``buckets`` in index.json ({name: {latent_shape, samples}}, in a fixed order) and each shard
entry lists its members' buckets as ``[[name, count], ...]`` runs (members are stored
grouped by bucket). ``latent_shape`` is then the most populous bucket's. Without
``buckets`` (square mode, older directories) every sample has ``latent_shape``.

Why this shape: the text encoder (Gemma-2-2B) and the VAE cost more per sample than a
600M training step, so they run once (training/data/precompute.py). Embeddings keep only their
real tokens (a 20-token caption stores 20 rows, not 300): about 6x fewer bytes on S3/FSx;
padding and the attention mask are recreated in collate to ``max_text_tokens`` so every
batch has the same static shape (XLA compiles one graph; ``drop_last`` for the same reason).

Order: one global permutation per epoch from ``(seed, epoch)``; step ``s`` of an epoch
takes ``perm[s*G:(s+1)*G]`` with ``G = batch_size * world_size`` and rank ``r`` the
``r``-th slice of ``batch_size`` of it, so ranks are disjoint and the global batch is the
same for any world size. With buckets, every batch is one bucket: each bucket has its own
permutation and the epoch's sequence of buckets is shuffled, all from ``(seed, epoch)``
alone, so every rank runs the same bucket at each step (buckets.plan_epoch). Buckets with
fewer samples than ``G`` are dropped with one warning. The position (epoch, step) is the
loader's whole state.
Random access into the tars goes through mmap and member offsets read from the tar
headers, so a shuffled read is a page-cache copy, not a tar scan.

Modules: ``shards`` (writing), ``index`` (index.json), ``buckets`` (tables, order),
``decode`` (mmap reads, buffer pool), ``loader`` (FeatureLoader), ``bench`` (CLI); for
precompute: ``raw_input`` (listing the raw pairs), ``raw_samples`` (one pair -> pixels +
caption, or a named skip), ``feature_settings`` (one feature set per directory),
``feature_output`` (the directory being written).
"""
