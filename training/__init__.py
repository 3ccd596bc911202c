"""Sana training package: one loop, one objective, two backends (GPU and Trainium)."""
