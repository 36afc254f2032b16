"""retrace.train."""
