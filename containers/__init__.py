"""Training images: Dockerfiles and the build/push helper (``python -m containers.image``)."""
