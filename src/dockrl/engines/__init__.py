"""Pure torch, no Ray: the work a worker does (train, rollout, reshard)."""
