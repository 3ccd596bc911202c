"""Backends supply only what differs between accelerators: device, distribution,
precision and the step's synchronisation point. See base.Backend."""
