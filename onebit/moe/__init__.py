"""MoE routing: traces, cache-policy simulation (and, later, routing prediction)."""
