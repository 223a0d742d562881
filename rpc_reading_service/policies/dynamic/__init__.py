"""``"dynamic"``: chunks leased on demand, delivered resequenced."""
