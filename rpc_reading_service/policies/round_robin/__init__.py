"""``"round_robin"``: one item of each worker in turn (the default)."""
