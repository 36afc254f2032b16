"""retrace.plugins."""
