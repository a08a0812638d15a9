"""ZeroMQ plumbing shared by ranks, relays and the watcher (no torch here)."""
