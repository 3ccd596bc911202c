"""Looking at what a model does: diffusers' ``SanaPipeline`` assembled from what training produces
(an exported transformer, the DC-AE and Gemma-2 the features were made with) and sampled
(``sample``)."""
