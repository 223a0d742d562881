"""``"first_ready"``: each worker's shard, delivered in arrival order."""
