"""retrace.export."""
