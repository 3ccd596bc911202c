"""Looking at what a model does: validation image grids during training from precomputed
prompt embeddings (``validation``), and diffusers' ``SanaPipeline`` assembled from an export
and sampled offline (``sample``)."""
