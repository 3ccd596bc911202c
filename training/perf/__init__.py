"""Performance checks that judge measured results against the project's targets."""
