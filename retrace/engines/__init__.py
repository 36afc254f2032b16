"""retrace.engines."""
